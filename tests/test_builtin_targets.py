"""Correct allocators pass: the harness raises no false alarm."""

import gc
import weakref

import attrs
import pytest

from state_machines.harness.lockstep import TENSOR_CENSUS_PAGES
from state_machines.runs.runner import fuzz
from state_machines.targets.catalogue import clean_configs


@pytest.mark.parametrize("config", list(clean_configs()), ids=lambda c: c.label())
def test_builtin_target_passes_the_ci_budget(config):
    """A built-in target runs its whole ci budget with no failure."""
    outcome = fuzz(config)
    assert outcome.ok, [f"{t.invariant}: {t.detail}\n{t.program()}" for t in outcome.failures]
    assert outcome.record.examples >= 100


@pytest.mark.parametrize("config", list(clean_configs()), ids=lambda c: c.label())
def test_a_made_states_runs_answers_as_why_not_does_for_every_step(config):
    """``runs()`` keeps its answers once a state is made; each, asked twice, is ``why_not(step) is None``."""
    from state_machines.harness import build
    from state_machines.runs.trace import RULES

    state = build(config)
    for _ in range(2):
        assert {r: state.runs(r) for r in RULES} == {r: state.why_not(r) is None for r in RULES}


# Every built-in target, and at a pool its fast paths read (tensor
# censuses, twins and their memo) the families that have them.
_TEARDOWN_CONFIGS = [*clean_configs(), *(attrs.evolve(c, size=2 * TENSOR_CENSUS_PAGES * c.page_size) for c in clean_configs()
                                          if c.target in ("builtin:unified-swa", "builtin:unified-mamba", "builtin:mamba", "builtin:multi-ended"))]


@pytest.mark.parametrize("config", _TEARDOWN_CONFIGS, ids=lambda c: c.label() + (f" size={c.size}" if c.size else ""))
def test_a_clean_examples_state_goes_when_its_teardown_returns(config, monkeypatch):
    """No cyclic collection is needed to free a clean example's state.  A
    state the machine kept, or one in a reference cycle, would wait for the
    collector, which reads every entry of its model's maps and sets: at
    16,384 slots a Mamba run spent 3 ms a collection on about 7 dead models."""
    from bench.baseline import random_fuzz
    from state_machines.harness import machines

    teardown = machines.FreeGroupMachine.teardown
    alive = []

    def watched(self):
        state = weakref.ref(self.state)
        teardown(self)
        alive.append(state() is not None)

    monkeypatch.setattr(machines.FreeGroupMachine, "teardown", watched)
    gc.disable()
    try:
        assert random_fuzz(config, seed=0, max_examples=5).ok
    finally:
        gc.enable()
    assert alive and not any(alive)
