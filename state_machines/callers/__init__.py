"""The real caller (``--caller``): sglang's own prefix cache, request pool
and scheduler helpers drive its allocator, in lockstep with a census of who
holds every page (``reference_model.caller``).

- ``adapters.py``: one adapter per API generation of the request and the
  scheduler helpers, chosen by probing the release;
- ``placement.py``: where the release's scheduler opens free groups
  (``--groups release|all|none``);
- ``release.py``: the release's modules, its cache and the stand-ins it forces;
- ``lockstep.py``: the steps (``arrive``, ``prefill``, ``decode``,
  ``evict_tokens``, ``retract``, ``abort``, and ``slide_windows`` on an SWA
  cache) and the census;
- ``machine.py``: the Hypothesis rules that draw them.

Importing this package registers the ``caller`` family, which
``state_machines.harness.build`` uses for a configuration whose ``caller``
is not ``harness``.  A printed trace of a caller run runs again after
``from state_machines.callers import build``.
"""

from state_machines.callers.lockstep import CallerLockstep
from state_machines.callers.machine import CallerMachine
from state_machines.harness.family import FAMILIES, Family, build, register

if "caller" not in FAMILIES:
    register(Family("caller", CallerLockstep, CallerMachine, lambda allocator: False,
                    "sglang's own prefix cache and scheduler helpers drive the allocator (--caller)"))

__all__ = ["CallerLockstep", "CallerMachine", "build"]
