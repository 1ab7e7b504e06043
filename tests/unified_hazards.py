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

from reference_model.unified_hybrid import Demand
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


def swa_tail(path: str, kind: str) -> str:
    """PD decode's preallocation of 9 tokens with a 1-token SWA tail (page
    size 4): three new virtual pages, the last bound on the SWA side; the
    SWA v2p of each new page, then the checks' verdict."""
    state = build(Config(target=f"sglang:{kind}", page_size=4, sglang_path=path))
    req = state.admit()
    state.extend_swa_tail(req, 9, 1)
    pages = state.model.requests[req.rid].own
    v2p = state.allocator.swa_attn_allocator.virtual_to_physical.tolist()
    bound = "".join("b" if v2p[p] != -1 else "-" for p in pages)
    return f"{bound} {_judged(state)}"


def swa_tail_told_all_bound(path: str, kind: str) -> str:
    """The same preallocation, with the model told every new page has an
    SWA side (a binding the allocator did not make): the checks' verdict."""
    state = build(Config(target=f"sglang:{kind}", page_size=4, sglang_path=path))
    req = state.admit()
    state.extend_swa_tail(req, 9, 1)
    pages = state.model.requests[req.rid].own
    unbound = [p for p in pages if not state.swa.live(p)]
    state.swa.take(unbound, unbound)
    return _judged(state)


def composite_decode(path: str, kind: str) -> str:
    """A request of 4 tokens decodes one token (a new page at page size 4)
    through the composite's own alloc_decode: the pages it holds on each
    side, then the checks' verdict."""
    state = build(Config(target=f"sglang:{kind}", page_size=4, sglang_path=path))
    req = state.alloc(4)
    state.decode([req])
    pages = state.model.requests[req.rid].own
    swa = state.allocator.swa_attn_allocator.virtual_to_physical.tolist()
    return f"{len(pages)} full, {sum(swa[p] != -1 for p in pages)} swa {_judged(state)}"


def swa_only_demand(path: str, kind: str) -> str:
    """On a 16-token pool at page size 4: the composite's own
    ``can_reserve(0, 16)`` (four SWA pages, no full page), the arena
    model's answer (four SWA pages need four virtual ids), then the
    ``reserve`` step of that demand judged."""
    state = build(Config(target=f"sglang:{kind}", page_size=4, size=16, sglang_path=path))
    said = bool(state.allocator.can_reserve(0, 16))
    arena = Demand(0, 4, 0, 0, len(state.universe)).fits(state.arena)
    try:
        state.reserve(0, 4, 0, 0, False)
    except InvariantViolation as failure:
        return f"can_reserve {said}, arena {arena}, caught {failure.invariant}"
    return f"can_reserve {said}, arena {arena}, {_judged(state)}"


def swa_tail_priced_as_full(path: str, kind: str) -> str:
    """On a 16-token pool at page size 4: a preallocation of 11 tokens with
    a 3-token SWA tail (three full pages, one SWA page); what the composite
    returns, then the checks' verdict."""
    state = build(Config(target=f"sglang:{kind}", page_size=4, size=16, sglang_path=path))
    req = state.admit()
    state.extend_swa_tail(req, 11, 3)
    return f"{'None' if not state.model.requests[req.rid].own else 'allocated'} {_judged(state)}"


HAZARDS = {f.__name__: f for f in (swa_tail_priced_as_full, swa_only_demand, double_free, segment_freed_twice_in_group, group_begin_while_open,
                                    slot_free_of_minus_one, swa_tail, swa_tail_told_all_bound, composite_decode)}

if __name__ == "__main__":
    name, path, kind = sys.argv[1:4]
    print(HAZARDS[name](path, kind))
