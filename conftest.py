"""Hypothesis profiles for the test suite, chosen with --hypothesis-profile.

Registered at import, before Hypothesis's pytest plugin loads the one named
on the command line (`make test` names `ci`).
"""

import signal

import pytest
from hypothesis import HealthCheck, settings

import state_machines  # noqa: F401  (sets torch's import-time environment first)

# The Ctrl-C tests send SIGINT to the commands they start.  A suite started
# in the background by a non-interactive shell (`make test &`, a CI runner's
# `setsid ... &`) inherits SIGINT ignored, and every process it starts would
# ignore it too (an ignored signal stays ignored across exec): Python's own
# handler, which a child's exec resets to the default, puts it back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# ci: the gate.  Derandomized, so a run is the same on every machine and every
# rerun; no example database, so a clean clone behaves like CI.
settings.register_profile(
    "ci",
    max_examples=200,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow],
)
# dev: quicker local iterations, random seeds, failures remembered.
settings.register_profile("dev", max_examples=100, deadline=None)
# long: a local soak of the same tests.
settings.register_profile("long", max_examples=2000, deadline=None)


@pytest.fixture(autouse=True)
def no_example_database():
    """Every test runs without an example database, whatever the profile: a
    stale local ``.hypothesis/`` folder would otherwise replay an earlier
    run's failures into it (``fuzz`` replays the walk's saved failures
    first, which moves where ``minimize`` starts).  A test that needs a
    database passes its own."""
    before = settings.default
    settings.register_profile("no-database", settings(before, database=None))
    settings.load_profile("no-database")
    yield
    settings.register_profile("before-no-database", before)
    settings.load_profile("before-no-database")
