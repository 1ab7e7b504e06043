"""The hazards issue 12 read in sglang's unified allocators, each driven by
hand on a real release (run in a fresh process: ``python -m
tests.unified_hazards NAME SGLANG_PATH``; it prints one outcome line).

Each calls the allocator as no sglang caller does (the callers' contracts
exclude it; see the tests in ``test_unified_mamba.py``), then lets the
harness's checks judge the state: what they say is the outcome.
"""

from __future__ import annotations

import sys

import torch

from state_machines.config import Config
from state_machines.harness import build
from state_machines.harness.lockstep import InvariantViolation


def _judged(state) -> str:
    """The first invariant the state breaks now, or "clean"."""
    try:
        state.check()
    except InvariantViolation as failure:
        return f"caught {failure.invariant}"
    return "clean"


def _raised(fn) -> str | None:
    try:
        fn()
    except AssertionError as e:
        return "raised AssertionError: " + " ".join(str(e).split())[:80]
    return None


def double_free(path: str, kind: str) -> str:
    """Free a finished request's page a second time, outside any group."""
    state = build(Config(target=f"sglang:{kind}", page_size=4, sglang_path=path))
    req = state.alloc(4)
    slots = state.rows[state._row_of(req)[0], :4].clone()
    state.finish(req)
    return _raised(lambda: state.allocator.free(slots)) or _judged(state)


def segment_freed_twice_in_group(path: str, kind: str) -> str:
    """In one free group, two ``free_segment`` calls of the same page."""
    state = build(Config(target=f"sglang:{kind}", page_size=4, sglang_path=path))
    req = state.alloc(4)
    slots = state.rows[state._row_of(req)[0], :4].clone()
    a = state.allocator
    a.free_group_begin()
    a.free_segment(slots, start_pos=0)
    a.free_segment(slots, start_pos=0)
    outcome = _raised(a.free_group_end)
    # The model's view: the request's page freed once.
    state.model.finish(req.rid) if hasattr(state.model, "finish") else None
    return outcome or _judged(state)


def group_begin_while_open(path: str, kind: str) -> str:
    """``alloc_group_begin`` of the Mamba slots while a group is open."""
    state = build(Config(target=f"sglang:{kind}", page_size=4, sglang_path=path))
    slots = state.allocator.mamba_slots
    free_before = len(state._mamba_census())
    slots.alloc_group_begin(2)
    slots.alloc_group_begin(1)
    slots.alloc_group_end()
    lost = free_before - len(state._mamba_census())
    return f"{lost} slot(s) neither free nor handed out"


def slot_free_of_minus_one(path: str, kind: str) -> str:
    """``free(tensor([-1]))`` on the Mamba slots (an empty ping-pong entry)."""
    state = build(Config(target=f"sglang:{kind}", page_size=4, sglang_path=path))
    mea = state.allocator.mamba_allocator
    outcome = _raised(lambda: state.allocator.mamba_slots.free(torch.tensor([-1], dtype=torch.int64)))
    if outcome:
        return outcome
    bad = [v for v in mea.free_virtual_ids.tolist() if v < 0]
    return f"free ids now hold {bad}" if bad else _judged(state)


HAZARDS = {f.__name__: f for f in (double_free, segment_freed_twice_in_group, group_begin_while_open,
                                    slot_free_of_minus_one)}

if __name__ == "__main__":
    name, path, kind = sys.argv[1:4]
    print(HAZARDS[name](path, kind))
