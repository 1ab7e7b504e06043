"""Every mutant is caught, with a trace that replays to the same failure."""

import attrs
import pytest

from state_machines.runner import fuzz, replay
from state_machines.trace import Trace
from tests.catalogue import mutant_configs


@pytest.mark.parametrize("config", list(mutant_configs()), ids=lambda c: f"{c.target}-{c.mutant}")
def test_mutant_is_caught_and_its_trace_replays(config, tmp_path):
    """The ci budget finds the mutant; the shrunk trace fails again on
    replay (read back from disk), at its last step, on the same invariant,
    and passes on the target without the mutant."""
    outcome = fuzz(config)
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
        assert replay(loaded, attrs.evolve(config, mutant=None)) is None
