"""HypoFuzz targets: each built-in configuration's state machine as a pytest
``TestCase`` that ``hypothesis fuzz`` (``make hypofuzz``) can collect.

Not named ``test_*``, so ``make test`` skips it.  Environment:
``KV_LOCKSTEP_TARGET`` / ``KV_LOCKSTEP_PAGE_SIZE`` fuzz one target instead of
the built-ins; ``KV_LOCKSTEP_DB`` (a directory or ``redis://HOST:PORT``) is
the example database that fuzzing processes and machines share.
"""

import os

from hypothesis import settings

from state_machines.config import Config
from state_machines.harness import machine_for
from state_machines.runs.runner import fuzz_settings
from state_machines.targets.catalogue import clean_configs


def _configs():
    target = os.environ.get("KV_LOCKSTEP_TARGET")
    if not target:
        return list(clean_configs())
    page_size = int(os.environ.get("KV_LOCKSTEP_PAGE_SIZE", "1"))
    return [Config(target=target, page_size=page_size, need_sort=ns) for ns in (False, True)]


if os.environ.get("KV_LOCKSTEP_DB"):
    from state_machines.runs.options import open_database

    _database = open_database(os.environ["KV_LOCKSTEP_DB"])
else:
    _database = settings.default.database

for _config in _configs():
    _machine = machine_for(_config)
    _machine.TestCase.settings = fuzz_settings(database=_database, derandomize=False)
    globals()["Test" + _machine.__name__] = _machine.TestCase
