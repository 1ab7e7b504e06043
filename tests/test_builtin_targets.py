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
