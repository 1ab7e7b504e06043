"""Each invariant the harness checks after every step catches a bug on its
own, so switching one off (or emptying its body) fails this suite."""

import pytest

import reference_model
from state_machines.harness import InvariantViolation, Step, build
from state_machines.harness import lockstep as harness_lockstep
from state_machines.runs.trace import run_steps

# invariant -> (configuration, steps), a bug it alone is enough to catch.
BUGS = {
    # Aliasing: the queue holds a view of row 0, the row is zeroed, end frees slot 0.
    "free_sets_agree": (
        dict(target="builtin:token", mutant="alias"),
        [Step("begin", {}), Step("alloc", {"n": 1}, "req_0"), Step("finish", {"req": "req_0"}),
         Step("overwrite_row", {"row": 0}), Step("end", {})],
    ),
    # Flag drift: the second end frees the queued slot again.
    "no_page_freed_twice": (
        dict(target="builtin:token", mutant="flag-drift"),
        [Step("alloc", {"n": 1}, "req_0"), Step("begin", {}), Step("finish", {"req": "req_0"}),
         Step("end", {}), Step("end", {})],
    ),
    # A leak: free_segment ending mid-page keeps the trailing page.
    "eviction_accounting_balances": (
        dict(target="builtin:paged", mutant="segment-drops-tail", page_size=4),
        [Step("alloc", {"n": 8}, "req_0"), Step("free_segment", {"req": "req_0", "start": 0, "n": 7})],
    ),
}


@pytest.mark.parametrize("name", sorted(BUGS))
def test_the_invariant_alone_catches_its_bug(name, monkeypatch):
    """With only this invariant checked, its bug's steps fail under its name."""
    by_name = {p.__name__: p for p in reference_model.CHECKS}
    assert name in by_name, f"{name} is no longer among the checks run after every step"
    monkeypatch.setattr(harness_lockstep, "CHECKS", (by_name[name],))
    overrides, steps = BUGS[name]
    state = build(**overrides)
    with pytest.raises(InvariantViolation) as caught:
        run_steps(state, steps)
        state.teardown()
    assert caught.value.invariant == name
