"""Every mutant is caught, with a trace that replays to the same failure."""

import attrs
import pytest

from state_machines.runs.runner import fuzz, fuzz_settings, replay
from state_machines.runs.trace import Trace
from state_machines.targets.catalogue import mutant_configs


@pytest.mark.parametrize("config", list(mutant_configs()), ids=lambda c: f"{c.target}-{c.mutant}")
def test_mutant_is_caught_and_its_trace_replays(config, tmp_path):
    """The ci budget finds the mutant; its trace fails again on replay (read
    back from disk), at its last step, on the same invariant, and passes on
    the target without the mutant.  (Unshrunk, to keep the suite quick;
    test_shrinking_yields_a_short_trace covers shrinking.)"""
    outcome = fuzz(config, shrink=False)
    assert not outcome.ok, f"{config.label()} was not caught"
    for trace in outcome.failures:
        path = tmp_path / "trace.json"
        path.write_text(trace.to_json())
        loaded = Trace.load(path)
        assert loaded == trace
        again = replay(loaded)
        assert again is not None, f"trace did not fail on replay:\n{trace.program()}"
        assert (again.invariant, again.detail) == (trace.invariant, trace.detail)
        assert len(again.steps) == len(trace.steps)
        # On the pool the run drew (the trace's own), without the mutant.
        assert replay(loaded, attrs.evolve(loaded.config, mutant=None)) is None


# One mutant per bug class: aliasing of free()'s queue, of free_segment's,
# a repeated end, and a leak; with the longest trace each may shrink to.
SHRINK_CASES = {
    ("builtin:token", "alias"): 6,
    ("builtin:paged", "reps-alias"): 10,
    ("builtin:token", "flag-drift"): 8,
    ("builtin:paged", "segment-drops-tail"): 6,
}


@pytest.mark.parametrize("config", [c for c in mutant_configs() if (c.target, c.mutant) in SHRINK_CASES],
                         ids=lambda c: f"{c.target}-{c.mutant}")
def test_shrinking_yields_a_short_trace(config):
    """Shrinking cuts a failure to a few steps, ending at the failing one, and it still fails."""
    outcome = fuzz(config)
    assert not outcome.ok
    shortest = min(outcome.failures, key=lambda t: len(t.steps))
    assert len(shortest.steps) <= SHRINK_CASES[(config.target, config.mutant)], shortest.program()
    assert replay(shortest) is not None


def test_a_test_runs_without_an_example_database():
    """Whatever the profile, a test's fuzz runs see no on-disk example database
    (conftest), so a stale ``.hypothesis/`` cannot change what it shrinks."""
    from hypothesis import settings

    assert settings.default.database is None
    assert fuzz_settings().database is None
