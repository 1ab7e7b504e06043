"""The page-interleave family: owner classes, rotation bases, and the
caller's contract (allocation through alloc_extend only, page-aligned)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference_model import page_interleave as pi
from reference_model.model import OwnershipModel
from state_machines.config import Config
from state_machines.harness import FAMILIES, Step, build
from state_machines.runs.trace import TraceError, run_steps
from state_machines.targets import TargetError

N = 3


def _state(**overrides):
    return build(Config(target="builtin:page-interleave", page_size=4, **overrides))


def _classes(pages):
    return [p % N for p in pages]


def test_the_builtin_twin_runs_on_the_page_interleave_family():
    """builtin:page-interleave names its family, and the registry drives it there."""
    assert type(_state()) is FAMILIES["page_interleave"].lockstep


def test_page_size_1_is_refused():
    """Its caller sends page size 1 to alloc(), which the class lacks: bad input, not a run."""
    with pytest.raises(TargetError, match="page size 2 or more"):
        build(Config(target="builtin:page-interleave", page_size=1))


def test_decode_is_disabled_with_the_probes_reason():
    """alloc_decode raises NotImplementedError (prefill only): decode is disabled, saying so."""
    assert "NotImplementedError" in _state().why_not("decode")


def test_extend_runs_the_probe_sending_rotation_bases():
    """The probe calls alloc_extend as the caller does, with bases: extend is not disabled."""
    assert _state().runs("extend")


def test_a_new_chains_pages_cycle_through_the_classes():
    """Four new pages of one request are of classes b, b+1, b+2, b."""
    state = _state()
    req = state.alloc(n=16)
    got = _classes(state.model.requests[req.rid].own)
    assert got == [(got[0] + j) % N for j in range(4)]


def test_a_continuing_request_keeps_its_chains_phase():
    """A second alloc of the same request continues the cycle where its row left it."""
    state = _state()
    req = state.alloc(n=8)
    state.alloc(n=8, req=req)
    got = _classes(state.model.requests[req.rid].own)
    assert got == [(got[0] + j) % N for j in range(4)]


def test_a_class_short_returns_none_though_the_pool_has_pages_enough():
    """Two pages free in classes 1 and 2 cannot serve a chain whose next class is 0: None, no failure."""
    state = _state(size=8)
    req_0 = state.alloc(n=8)
    state.alloc(n=8)
    assert pi.class_free_counts(state.model, N) == [0, 1, 1]
    assert state.alloc(n=8, req=req_0) is None
    assert len(state.model.requests[req_0.rid].own) == 2


def test_a_load_back_cycles_from_its_start_class():
    """alloc_cyclic(start=2, 3 pages) hands out pages of classes 2, 0, 1, held by a new request."""
    state = _state()
    req = state.load_back(n=12, start=2)
    assert _classes(state.model.requests[req.rid].own) == [2, 0, 1]


def test_load_back_is_disabled_without_alloc_cyclic():
    """A page-interleaved allocator without alloc_cyclic (sglang 0.5.20, 0.5.22) does not run load_back, saying why."""
    state = _state()
    state.allocator.alloc_cyclic = None
    assert "no alloc_cyclic" in state.why_not("load_back")


def test_an_extend_ending_mid_page_stops_the_request_growing():
    """After an extend ends mid-page the request is no longer extendable."""
    state = _state()
    req = state.admit()
    state.extend(reqs=[req], tokens=[5])
    assert req not in state.extendable()


def test_replay_refuses_growing_a_request_that_ends_mid_page():
    """A trace extending a request whose last extend ended mid-page is refused, not blamed on the allocator."""
    steps = (Step("admit", {}, "req_0"), Step("extend", {"reqs": ["req_0"], "tokens": [1]}),
             Step("extend", {"reqs": ["req_0"], "tokens": [1]}))
    with pytest.raises(TraceError, match="ends mid-page"):
        run_steps(_state(), steps)


# -- the model's predicates --


def test_class_counts_split_a_run_cyclically():
    """Five pages from class 2 of three: classes 2, 0, 1, 2, 0."""
    assert pi.class_counts(2, 5, 3) == [2, 1, 2]


def test_chain_base_puts_the_last_page_at_its_position():
    """A chain of 3 pages ending on page 7 (class 1 of 3) has base (1 - 2) % 3 = 2."""
    assert pi.chain_base(7, 3, 3) == 2


def test_a_page_in_another_class_list_is_named():
    """Page 4 (class 1) in class 0's list fails free_pages_in_own_class."""
    assert "class 0's free list holds pages [4]" in pi.free_pages_in_own_class([[3, 4], [], []], 3)


def test_available_size_is_the_min_class_floor():
    """Class counts [1, 3, 2] at page 4 of 3 classes: 3 * 4 * 1 = 12, not the aggregate 24."""
    assert pi.interleave_available_size_agrees(12, [1, 3, 2], 4, 3) is None
    assert pi.interleave_available_size_agrees(24, [1, 3, 2], 4, 3) is not None


def test_an_unresolved_base_fails_rotation_bases_resolved():
    """A None left in place of a new chain's base is named."""
    assert "rotation base None" in pi.rotation_bases_resolved("alloc_extend(...)", [None], [None], 3)


def test_none_is_due_exactly_when_a_class_is_short():
    """None with every class able to supply fails; None with class 0 short holds."""
    assert pi.none_iff_class_short("x", True, [1, 0, 0], [1, 1, 1]) is not None
    assert pi.none_iff_class_short("x", True, [1, 0, 0], [0, 5, 5]) is None


def test_class_free_counts_read_the_model_free_set():
    """Free pages 3, 4, 6 of three classes: [2, 1, 0]."""
    assert pi.class_free_counts(OwnershipModel.from_census([3, 4, 6]), 3) == [2, 1, 0]


@given(st.sets(st.integers(0, 200), min_size=1), st.sets(st.integers(0, 200)), st.integers(1, 5))
def test_class_free_counts_from_the_codes_are_the_free_set_s(pages, held, shard_size):
    """Counted off the model's per-id kind codes, as off its free set."""
    model = OwnershipModel.from_census(sorted(pages))
    if held & pages:
        model.new_request(row=0, pages=sorted(held & pages))
    want = [sum(1 for p in model.free if p % shard_size == c) for c in range(shard_size)]
    assert model.owner.codes is not None and pi.class_free_counts(model, shard_size) == want
