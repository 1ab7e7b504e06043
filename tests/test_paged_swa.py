"""Paged SWA: allocation through alloc_extend / alloc_decode /
alloc_extend_swa_tail above page size 1, the mapping checked per page, and
the in-group remap (``set_full_to_swa_mapping``)."""

import pytest

from reference_model import invariants
from state_machines.harness import InvariantViolation, build


def tombstone_then_remap(state):
    """A request's page goes to the cache; inside a group the cache drops
    its SWA side (queued) and loads it back onto a fresh SWA page."""
    req = state.alloc(n=state.page_size)
    entry = state.rematch(req=req, dup=0)
    state.finish(req=req)
    state.begin()
    state.evict_swa(entry=entry)
    state.remap(entry=entry)
    state.end()


def test_remap_in_a_group_runs_clean_on_the_builtin_swa():
    """Re-pointing a tombstoned entry at a fresh SWA page inside a group keeps both pools and the mapping in step."""
    tombstone_then_remap(build(target="builtin:swa", page_size=4))


def test_a_queued_free_swa_resolved_at_end_frees_the_replacement():
    """A release that reads the mapping at free_group_end() frees the remapped page and leaks the original."""
    with pytest.raises(InvariantViolation) as caught:
        tombstone_then_remap(build(target="builtin:swa", mutant="end-resolves-swa", page_size=4))
    assert caught.value.invariant == "swa_free_sets_agree"
    assert [s.rule for s in caught.value.steps][-3:] == ["evict_swa", "remap", "end"]


def test_unmapping_per_token_is_caught_by_a_segment_slide():
    """free_swa_segment that unmaps only the page representatives leaves the page's other slots mapped."""
    state = build(target="builtin:swa", mutant="unmap-per-token", page_size=4)
    req = state.alloc(n=8)
    with pytest.raises(InvariantViolation) as caught:
        state.slide(req=req, pages=1, segment=True)
    assert caught.value.invariant == "swa_mapping_consistent"


def test_extend_swa_tail_maps_the_pages_before_the_tail_to_nothing():
    """alloc_extend_swa_tail of 9 tokens with a 1-token tail: two full pages without an SWA side, one with."""
    state = build(target="builtin:swa", page_size=4)
    req = state.admit()
    state.extend_swa_tail(req=req, tokens=9, tail=1)
    pages = state.model.requests[req.rid].own
    assert [state.swa.live(p) for p in pages] == [False, False, True]


def test_a_partly_used_page_maps_only_its_used_slots():
    """After an extend of 5 tokens the second page maps one slot; a decode maps the next."""
    state = build(target="builtin:swa", page_size=4)
    req = state.admit()
    state.extend(reqs=[req], tokens=[5])
    last = state.model.requests[req.rid].own[-1]
    assert state.swa.filled_slots(last, 4) == 1
    state.decode(reqs=[req])
    assert state.swa.filled_slots(last, 4) == 2


def test_a_window_never_slides_past_a_partly_used_last_page():
    """The newest token's page stays in the window: only the full pages before it can slide."""
    state = build(target="builtin:swa", page_size=4)
    req = state.admit()
    state.extend(reqs=[req], tokens=[9])
    assert state.live_own(req) == 2


def test_new_pages_mapped_rejects_a_stale_slot_past_the_used_ones():
    """A new page whose unused slot still maps somewhere is named, with both sides."""
    problem = invariants.swa_new_pages_mapped("extend", [3], [[8, 9, 5]], [2], 3)
    assert problem == "extend mapped full page 3's slots to SWA slots [8, 9, 5] / 2 slots onto one SWA page, the rest onto nothing"


def test_decode_on_a_short_pool_is_not_drawn_above_page_size_1():
    """The scheduler retracts before a decode the pools cannot take, so the SWA harness never sends one."""
    state = build(target="builtin:swa", page_size=4, size=8)
    req = state.alloc(n=8)
    assert not state.decode_fits([req])
