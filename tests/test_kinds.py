"""The pure-SWA, HiSparse and Mamba families: each drives its allocators,
models what they add, and refuses what their callers never do."""

import pytest

from reference_model.mamba import MambaModel
from state_machines.config import Config
from state_machines.harness import FAMILIES, InvariantViolation, Step, build
from state_machines.runs.trace import TraceError, run_steps
from state_machines.targets import TargetError


@pytest.mark.parametrize("target, family", [
    ("builtin:pure-swa", "pure_swa"), ("builtin:hisparse", "hisparse"), ("builtin:mamba", "mamba"),
])
def test_each_new_builtin_runs_on_its_own_family(target, family):
    """A built-in twin names its family, and the registry drives it there."""
    assert type(build(target=target)) is FAMILIES[family].lockstep


# -- pure-SWA --


def test_a_slide_outside_a_group_frees_the_window_pages_at_once():
    """free_swa of a request's oldest pages frees them; the row keeps them, past its own pages' reach."""
    state = build(target="builtin:pure-swa")
    req = state.alloc(n=3)
    first_two = state.model.requests[req.rid].own[:2]
    state.slide(req=req, pages=2)
    assert set(first_two) <= state.model.free_pages
    assert state.model.requests[req.rid].prefix == first_two


def test_a_slide_inside_a_group_is_queued_until_end():
    """Inside a free group the slid pages are queued, and free at end()."""
    state = build(target="builtin:pure-swa")
    req = state.alloc(n=2)
    state.begin()
    state.slide(req=req, pages=1)
    slid = state.model.requests[req.rid].prefix
    assert state.model.ledger.queued_pages() == slid
    state.end()
    assert set(slid) <= state.model.free_pages


def test_finishing_a_slid_request_frees_each_page_once():
    """free_full of the slid span releases nothing, free() the rest: the whole pool is free again."""
    state = build(target="builtin:pure-swa")
    req = state.alloc(n=3)
    state.slide(req=req, pages=1)
    state.finish(req=req)
    assert state.model.free_pages == set(state.model.owner)


def test_finishing_a_slid_request_in_segments_frees_each_page_once():
    """free_full_segments of the slid span releases nothing, free_segments the rest: the whole pool is free again."""
    state = build(target="builtin:pure-swa")
    req = state.alloc(n=3)
    state.slide(req=req, pages=1)
    state.finish_segments(req=req, cut=1)
    assert state.model.free_pages == set(state.model.owner)


def test_finishing_in_segments_catches_a_free_full_that_releases_the_slid_span():
    """A free_full_segment that frees (the free-full-releases mutant) gives the slid page back twice."""
    state = build(target="builtin:pure-swa", mutant="free-full-releases")
    req = state.alloc(n=3)
    state.slide(req=req, pages=1)
    with pytest.raises(InvariantViolation):
        state.finish_segments(req=req, cut=0)


def test_a_request_whose_window_slid_is_not_rematched_on_replay():
    """Replay refuses a rematch the pure-SWA machine never draws."""
    steps = (Step("alloc", {"n": 2}, "req_0"), Step("slide", {"req": "req_0", "pages": 1}), Step("rematch", {"req": "req_0", "dup": 0}))
    with pytest.raises(TraceError, match="window slid"):
        _replay(Config(target="builtin:pure-swa"), steps)


# -- HiSparse --


def _hisparse():
    return build(target="builtin:hisparse", page_size=4)


def test_a_device_buffer_keeps_the_rows_first_device_pages_and_frees_the_rest():
    """alloc_device_buffer of two mapped pages into one page's buffer keeps the first peer, frees the second."""
    state = _hisparse()
    req = state.alloc(n=8)
    peers = [state.device.mapping[p] for p in state.model.requests[req.rid].own]
    state.device_buffer(req=req, n=4)
    assert state.device.buffers[req.rid] == peers[:1]
    assert peers[1] in state.device.free_pages
    assert not state.device.mapping


def test_a_device_buffer_makes_up_a_shortfall_with_fresh_pages():
    """A buffer larger than the row's device pages takes fresh ones after them."""
    state = _hisparse()
    req = state.alloc(n=4)
    peer = state.device.mapping[state.model.requests[req.rid].own[0]]
    state.device_buffer(req=req, n=12)
    buffer = state.device.buffers[req.rid]
    assert buffer[0] == peer and len(buffer) == 3


def test_finishing_a_buffered_request_frees_its_buffer_and_its_logical_pages():
    """free_hisparse_indices of the buffer, then free() of the row: both pools are whole again."""
    state = _hisparse()
    req = state.alloc(n=8)
    state.device_buffer(req=req, n=12)
    state.finish(req=req)
    assert state.device.free_pages == set(state.device.universe)
    assert state.model.free_pages == set(state.model.owner)


def test_free_hisparse_frees_the_device_pages_and_keeps_the_logical_ones():
    """An aborted staging request loses its device pages only."""
    state = _hisparse()
    req = state.alloc(n=8)
    own = list(state.model.requests[req.rid].own)
    state.free_hisparse(req=req)
    assert state.device.free_pages == set(state.device.universe)
    assert state.model.requests[req.rid].own == own


def test_a_hisparse_request_decodes_only_once_it_holds_a_device_buffer():
    """A request still staging (no device buffer) is not decodable; once its buffer is made it is."""
    state = _hisparse()
    req = state.alloc(n=4)
    assert state.decodable() == []
    state.device_buffer(req=req, n=4)
    assert state.decodable() == [req]


def test_a_page_size_1_decode_maps_each_new_page_to_a_device_page():
    """At page size 1 the caller sends decode to alloc(), which maps the new slot to a device slot."""
    state = build(target="builtin:hisparse")
    req = state.alloc(n=1)
    state.decode(reqs=[req])
    new = state.model.requests[req.rid].own[-1]
    assert new in state.device.mapping


# -- Mamba --


def test_alloc_1_inside_a_group_hands_out_a_reserved_slot():
    """After alloc_group_begin(2), alloc(1) draws one of the two reserved slots."""
    state = build(target="builtin:mamba")
    state.alloc_group_begin(n=2)
    reserved = list(state.model.reserved)
    req = state.alloc(n=1)
    assert state.model.requests[req.rid].own[0] in reserved
    assert len(state.model.reserved) == 1


def test_alloc_group_end_returns_the_undrawn_slots():
    """Of three reserved slots, the two no alloc drew are free after the end."""
    state = build(target="builtin:mamba")
    state.alloc_group_begin(n=3)
    state.alloc(n=1)
    state.alloc_group_end()
    assert state.model.num_free == state.model.capacity - 1


def test_a_group_larger_than_the_free_list_reserves_nothing():
    """alloc_group_begin(n) with fewer than n free slots takes none."""
    state = build(target="builtin:mamba", size=3)
    state.alloc_group_begin(n=4)
    assert state.model.reserved == []


def test_a_drawn_reserved_slot_is_counted_allocated_once():
    """The model counts a reserved slot allocated when reserved, not again when drawn."""
    model = MambaModel.from_census([1, 2, 3])
    model.group_begin([1, 2])
    model.new_request(0, [1])
    assert model.ledger.expected_free == 1
    assert model.violations() == []


def test_replay_refuses_a_nested_alloc_group_begin():
    """Allocation groups do not nest: sglang's only caller closes each first."""
    steps = (Step("alloc_group_begin", {"n": 1}), Step("alloc_group_begin", {"n": 1}))
    with pytest.raises(TraceError, match="already open"):
        _replay(Config(target="builtin:mamba"), steps)


def test_replay_refuses_a_free_group_step_on_mamba():
    """A Mamba slot allocator has no free groups: a trace's begin is refused, not run."""
    with pytest.raises(TraceError, match="rule 'begin' does not exist"):
        _replay(Config(target="builtin:mamba"), (Step("begin", {}),))


def test_mamba_takes_page_size_1_only():
    """Slots are not pages: any other page size is bad input."""
    with pytest.raises(TargetError, match="takes page size 1, not 4"):
        build(target="builtin:mamba", page_size=4)


def _replay(config, steps):
    run_steps(build(config), steps)


# -- empty frees --


def test_an_swa_pool_takes_an_empty_span_through_each_of_its_six_frees():
    """free, free_segment and the SWA and full halves of each, of an empty view, release nothing on either pool."""
    state = build(target="builtin:swa", page_size=4)
    req = state.alloc(n=8)
    assert state.empty_free_methods() == ["free", "free_segment", "free_swa", "free_swa_segment", "free_full", "free_full_segment"]
    before = (set(state.model.free_pages), set(state.swa.free_pages))
    for how in range(6):
        state.free_empty_span(req=req, how=how)
    assert (set(state.model.free_pages), set(state.swa.free_pages)) == before


def test_a_unified_pool_draws_no_empty_span_free_of_the_core():
    """The unified families have their own empty free (free_nothing): the core's is never drawn there."""
    assert build(target="builtin:unified-swa").empty_frees == ()
