"""The hand-written shortest traces the bench compares shrinking against."""

import pytest

from bench.known_shortest import KNOWN
from bench.targets import unavailable
from state_machines.runner import replay


def _runnable(config):
    """Skip, saying why, where the configuration cannot be built here."""
    if (reason := unavailable(config)) is not None:
        pytest.skip(reason)


def _marks(known):
    return [pytest.mark.sglang] if known.config.target.startswith("sglang:") else []


@pytest.mark.parametrize("known", [pytest.param(k, marks=_marks(k), id=k.name) for k in KNOWN])
def test_known_shortest_trace_fails_on_its_bug(known):
    """The hand-written trace fails at its last step, on the invariant it names."""
    _runnable(known.config)
    violation = replay(known.trace())
    assert violation is not None, f"{known.name}: the known trace passed:\n{known.trace().program()}"
    assert violation.invariant == known.invariant, violation.detail
    assert len(violation.steps) == len(known.steps), "the trace fails before its last step"


@pytest.mark.parametrize(
    "known, fixed",
    [pytest.param(k, f, marks=_marks(k), id=f"{k.name}-on-{f.label()}") for k in KNOWN for f in k.fixed],
)
def test_known_shortest_trace_passes_on_the_fixed_target(known, fixed):
    """The same steps run clean on a target without the bug."""
    _runnable(fixed)
    assert replay(known.trace(), fixed) is None
