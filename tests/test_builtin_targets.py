"""Correct allocators pass: the harness raises no false alarm."""

import pytest

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
