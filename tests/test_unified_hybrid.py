"""The unified hybrid SWA family: full and SWA sub-pools in one byte arena,
over virtual page ids (``harness/unified_hybrid.py``)."""

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from allocators.unified_swa import UnifiedSWAAllocator
from reference_model.unified_hybrid import (
    Arena,
    Demand,
    SubPool,
    least_reclaim,
    unified_compacted,
    unified_extend_demand_agrees,
    unified_max_new_agrees,
    unified_page_table_bijective,
    unified_read_path_agrees,
)
from state_machines.harness import FAMILIES, build
from state_machines.harness.lockstep import InvariantViolation, ids
from state_machines.harness.unified_hybrid import _TreeStandIn
from tests.test_sglang import REPO, release_dir

FULL = SubPool("full pool", first=1, end=11, page_bytes=16, grows="up")
SWA = SubPool("swa pool", first=2, end=22, page_bytes=8, grows="down")


def test_the_builtin_twin_runs_on_the_unified_swa_family():
    """builtin:unified-swa names its family, and the registry drives it there."""
    assert type(build(target="builtin:unified-swa")) is FAMILIES["unified_swa"].lockstep


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_slide_tombstones_the_swa_side_and_keeps_the_full_side(page_size):
    """free_swa of a request's oldest page sets its SWA v2p to -1; its full v2p stays bound."""
    state = build(target="builtin:unified-swa", page_size=page_size)
    req = state.alloc(n=2 * page_size)
    first = state.model.requests[req.rid].own[0]
    state.slide(req=req, pages=1)
    a = state.allocator
    assert ids(a.swa_attn_allocator.virtual_to_physical)[first] == -1
    assert ids(a.full_attn_allocator.virtual_to_physical)[first] > 0


def test_bytes_a_slide_frees_serve_the_next_alloc():
    """With the arena full, an alloc is short; after a slide of two pages (8 bytes a slot each) one more page fits."""
    state = build(target="builtin:unified-swa")
    req = state.alloc(n=6)
    assert state.alloc(n=1) is None
    state.slide(req=req, pages=2)
    assert state.alloc(n=1) is not None


def test_a_tombstoned_page_is_recovered_once_when_its_request_finishes():
    """After a slide and the finish, every virtual page is free on both sides again."""
    state = build(target="builtin:unified-swa", page_size=4)
    req = state.alloc(n=12)
    state.slide(req=req, pages=2)
    state.finish(req=req)
    assert state.model.free_pages == set(state.universe)
    assert state.swa.free_pages == set(state.universe)


def test_a_full_only_free_in_a_group_waits_for_end():
    """An evicted entry whose window slid goes to free_full: queued inside a group, freed at end()."""
    state = build(target="builtin:unified-swa", page_size=4)
    req = state.alloc(n=4)
    entry = state.rematch(req=req, dup=0)
    state.finish(req=req)
    state.evict_swa(entry=entry)
    state.begin()
    page = state.model.cache[entry.eid].pages[0]
    state.evict(entry=entry)
    assert page not in ids(state.allocator.full_attn_allocator.free_virtual_ids)
    state.end()
    assert page in ids(state.allocator.full_attn_allocator.free_virtual_ids)


def test_a_queued_full_free_that_end_drops_is_caught():
    """The full-queue-not-flushed mutant leaks a free_full queued in a group: free_sets_agree at end()."""
    state = build(target="builtin:unified-swa", mutant="full-queue-not-flushed", page_size=4)
    req = state.alloc(n=4)
    entry = state.rematch(req=req, dup=0)
    state.finish(req=req)
    state.evict_swa(entry=entry)
    state.begin()
    state.evict(entry=entry)
    with pytest.raises(InvariantViolation, match="free_sets_agree"):
        state.end()


def test_a_free_that_sends_a_tombstone_to_the_swa_side_is_caught():
    """The no-tombstone-filter mutant shrinks the SWA band for a page it never held: swa_compacted."""
    state = build(target="builtin:unified-swa", mutant="no-tombstone-filter", page_size=4)
    req = state.alloc(n=8)
    state.slide(req=req, pages=1)
    with pytest.raises(InvariantViolation, match="swa_compacted"):
        state.free(req=req, n=8)


def test_a_slide_that_leaves_the_binding_is_caught():
    """The slide-keeps-binding mutant frees the SWA page but keeps v2p on it: the SWA census disagrees."""
    state = build(target="builtin:unified-swa", mutant="slide-keeps-binding")
    req = state.alloc(n=2)
    with pytest.raises(InvariantViolation, match="swa_free_sets_agree"):
        state.slide(req=req, pages=1)


def test_a_segment_queued_as_a_row_view_is_caught():
    """The segment-queues-view mutant frees what the row holds at end(), not what was queued."""
    state = build(target="builtin:unified-swa", mutant="segment-queues-view", page_size=4)
    state.begin()
    req = state.alloc(n=4)
    state.free_segment(req=req, start=0, n=4)
    state.overwrite_row(row=0)
    with pytest.raises(InvariantViolation):
        state.end()


def test_page_tables_that_are_not_inverse_are_named():
    """v2p maps virtual 1 to physical 1, but p2v[1] names virtual 2: the predicate says so."""
    v2p = [0, 1, -1, -1] + [-1] * 8
    p2v = [0, 2] + [-1] * 10
    problem = unified_page_table_bijective(FULL, v2p, p2v, {1}, {1, 2, 3})
    assert problem and "p2v[v2p[v]] != v" in problem


def test_a_hole_inside_the_band_is_not_compacted():
    """Two live full pages at physical 1 and 3 leave a hole: eager compaction wants 1 and 2."""
    assert "compacted to [1, 2]" in unified_compacted(FULL, [1, 3], 2, 1)


def test_the_arena_counts_each_sides_bytes():
    """160 bytes hold 6 pages of both sides (24 bytes a pair) but not 7; 10 full pages alone."""
    arena = Arena(low=FULL, high=SWA)
    assert arena.fits(6, 6) and not arena.fits(7, 7) and arena.fits(10, 0)


@given(st.integers(1, 12), st.integers(1, 12), st.integers(0, 40), st.integers(0, 40), st.integers(0, 14),
       st.integers(0, 14), st.booleans())
def test_the_arenas_room_is_the_most_pages_that_still_fit(low_pages, high_pages, low_bytes, high_bytes, low_live,
                                                        high_live, low):
    """``Arena.room``, in closed form, is what counting up ``fits`` one page
    at a time finds (a page of no bytes: the index range alone)."""
    arena = Arena(low=SubPool("low", 1, 1 + low_pages, low_bytes, "up"),
                  high=SubPool("high", 2, 2 + high_pages, high_bytes, "down"))
    counted = 0
    if arena.fits(low_live, high_live):
        while arena.fits(low_live + (counted + 1) * low, high_live + (counted + 1) * (not low)):
            counted += 1
    assert arena.room(low_live, high_live, low=low) == counted


# -- admission and the read paths --


def test_bytes_a_slide_frees_let_admission_say_yes():
    """With the arena full, can_reserve of one more page is no; after a slide of two pages it is yes (judged by the arena)."""
    state = build(target="builtin:unified-swa")
    req = state.alloc(n=6)
    assert not state.allocator.can_reserve(1, 1)
    state.slide(req=req, pages=2)
    state.reserve(full=1, swa=1, evict_full=0, evict_swa=0, prefer_swa=False)
    assert state.allocator.can_reserve(1, 1)


def test_the_least_reclaim_evicts_swa_first_unless_told_otherwise():
    """Full arena (6+6 pages, 144 of 160 bytes): one more pair (24 bytes) needs 8 bytes back: one full page
    when all full pages may go first, one SWA page when the full side is spared (prefer_swa)."""
    arena = Arena(low=FULL, high=SWA)
    demand = Demand(1, 1, live_full=6, live_swa=6, universe=10, evict_full=3, evict_swa=3)
    assert least_reclaim(arena, demand, prefer_swa=False) == (1, 0)
    assert least_reclaim(arena, demand, prefer_swa=True) == (0, 1)


def test_no_reclaim_plan_when_eviction_cannot_make_room():
    """A demand past the virtual ids fits after no eviction: least_reclaim says None."""
    arena = Arena(low=FULL, high=SWA)
    assert least_reclaim(arena, Demand(11, 0, live_full=0, live_swa=0, universe=10), prefer_swa=False) is None


def test_admission_that_ignores_the_swa_side_is_caught():
    """The admission-ignores-swa mutant says yes to 4 more SWA pages (32 bytes) where 16 are left."""
    state = build(target="builtin:unified-swa", mutant="admission-ignores-swa")
    state.alloc(n=6)
    with pytest.raises(InvariantViolation, match="reclaim_plan_agrees"):
        state.reserve(full=0, swa=4, evict_full=0, evict_swa=0, prefer_swa=False)


def test_a_tombstone_read_through_the_last_page_is_caught():
    """The tombstone-read-wraps mutant reads a slid page's SWA KV from the arena's last page: swa_read_path_agrees."""
    state = build(target="builtin:unified-swa", mutant="tombstone-read-wraps", page_size=4)
    req = state.alloc(n=8)
    with pytest.raises(InvariantViolation, match="swa_read_path_agrees"):
        state.slide(req=req, pages=1)


def test_making_room_answers_as_the_arena_does():
    """With the arena full, reclaim_for_prealloc names a shortfall for one more page pair; after a slide of two, None."""
    state = build(target="builtin:unified-swa")
    req = state.alloc(n=6)
    state.make_room(full=1, swa=1)
    assert state.allocator.reclaim_for_prealloc(_TreeStandIn(0, 0), 1, 1) is not None
    state.slide(req=req, pages=2)
    state.make_room(full=1, swa=1)
    assert state.allocator.reclaim_for_prealloc(_TreeStandIn(0, 0), 1, 1) is None


def test_making_room_the_arena_cannot_hold_is_caught():
    """The admission-ignores-swa mutant says it made room for 4 SWA pages where 16 bytes are left: admission_agrees."""
    state = build(target="builtin:unified-swa", mutant="admission-ignores-swa")
    state.alloc(n=6)
    with pytest.raises(InvariantViolation, match="admission_agrees"):
        state.make_room(full=0, swa=4)


def test_an_extend_asks_for_the_pages_it_starts():
    """From 5 to 9 tokens at page size 4 an extend starts one page (4 tokens), not 2 (the pages of 4 new tokens)."""
    assert unified_extend_demand_agrees("x", 4, 5, 9, 4) is None
    assert "= 8 tokens / 4" in unified_extend_demand_agrees("x", 8, 5, 9, 4)


def test_max_new_tokens_must_stop_where_the_next_does_not_fit():
    """Counts 0..2 fit, 3 does not: 2 is the answer, 1 is not (2 fits too), and nothing fitting wants None."""
    fitting = [True, True, True, False, False, False]
    assert unified_max_new_agrees("m", 2, 4, fitting) is None
    assert "fitting counts [0, 1, 2]" in unified_max_new_agrees("m", 1, 4, fitting)
    assert unified_max_new_agrees("m", None, 4, [False] * 6) is None


def test_a_dead_token_must_read_the_sink():
    """Virtual page 2 is not live, yet its token reads physical slot 5: the predicate names it."""
    problem = unified_read_path_agrees("swa", [2], [5], [0, 3, -1], {1}, 1)
    assert problem and "token 2 -> 5 (want 0)" in problem


# -- the unified Mamba pool --


def test_the_unified_mamba_twin_runs_on_its_own_family():
    """builtin:unified-mamba names the unified_mamba family, and the registry drives it there."""
    assert type(build(target="builtin:unified-mamba")) is FAMILIES["unified_mamba"].lockstep


def test_mamba_slots_take_bytes_the_full_side_would_use():
    """At page size 1 the arena's 144 bytes hold 9 full pages; two Mamba slots (32 bytes each) leave room for 5."""
    state = build(target="builtin:unified-mamba")
    state.mamba_alloc(n=2)
    assert state.alloc(n=6) is None
    assert state.alloc(n=5) is not None


def test_an_allocation_group_hands_out_its_reserve_then_returns_the_rest():
    """alloc_group_begin(2), one alloc(1) from it, end: one slot held, the other free again."""
    state = build(target="builtin:unified-mamba")
    state.mamba_group_begin(n=2)
    state.mamba_alloc(n=1)
    state.mamba_group_end()
    assert len(state.mamba_universe) - state.mamba.num_free == 1


def test_a_group_end_that_keeps_the_undrawn_slots_is_caught():
    """The group-end-keeps-leftovers mutant leaks the reserve: mamba_free_sets_agree at end."""
    state = build(target="builtin:unified-mamba", mutant="group-end-keeps-leftovers")
    state.mamba_group_begin(n=1)
    with pytest.raises(InvariantViolation, match="mamba_free_sets_agree"):
        state.mamba_group_end()


def test_segment_representatives_that_end_drops_are_caught():
    """The reps-not-flushed mutant leaks a free_segment queued in a group: free_sets_agree at end."""
    state = build(target="builtin:unified-mamba", mutant="reps-not-flushed", page_size=4)
    req = state.alloc(n=4)
    state.begin()
    state.free_segment(req=req, start=0, n=4)
    with pytest.raises(InvariantViolation, match="free_sets_agree"):
        state.end()


def test_a_full_side_that_ignores_the_mamba_bytes_is_caught():
    """The bytes-not-shared mutant hands out full pages the Mamba slots' bytes leave no room for."""
    state = build(target="builtin:unified-mamba", mutant="bytes-not-shared")
    state.mamba_alloc(n=2)
    with pytest.raises(InvariantViolation, match="alloc_none_iff_short"):
        state.alloc(n=6)


# -- sglang's unified pools (a release per process; skipped without it) --

UNIFIED_KINDS = "unified-swa,unified-mamba,unified-mamba-swa"


@pytest.fixture(scope="module")
def rows_0_5_23(tmp_path_factory):
    from tests.test_sglang import gate

    return gate("0.5.23", tmp_path_factory.mktemp("traces"), UNIFIED_KINDS)


@pytest.mark.sglang
@pytest.mark.parametrize("kind", UNIFIED_KINDS.split(","))
def test_0_5_23_runs_each_unified_kind_clean(rows_0_5_23, kind):
    """0.5.23's unified SWA, Mamba and Mamba-SWA composites pass the gate's budget at page size 4."""
    assert rows_0_5_23[kind]["result"] == "pass", rows_0_5_23[kind]


def composite_hazard(name: str, kind: str) -> str:
    from tests.test_unified_mamba import hazard

    return hazard(name, kind)


@pytest.mark.sglang
@pytest.mark.parametrize("kind", ["unified-swa", "unified-mamba-swa"])
def test_0_5_23_a_swa_tail_preallocation_binds_only_the_tail(kind):
    """extend_swa_tail of 9 tokens, tail 1, at page size 4: of three new virtual pages only the last has an SWA side, as the model says."""
    assert composite_hazard("swa_tail", kind) == "--b clean"


@pytest.mark.sglang
@pytest.mark.parametrize("kind", ["unified-swa", "unified-mamba-swa"])
def test_0_5_23_a_model_that_binds_the_whole_preallocation_is_caught(kind):
    """Told that all three new pages have an SWA side, the SWA census check disagrees with the allocator."""
    assert composite_hazard("swa_tail_told_all_bound", kind) == "caught swa_free_sets_agree"


@pytest.mark.sglang
@pytest.mark.parametrize("kind", ["unified-swa", "unified-mamba-swa"])
def test_0_5_23_the_composite_decodes_at_page_size_four_on_cpu(kind):
    """With the full side's kernels on CPU, alloc_decode of a page-aligned request binds one new page on both sides."""
    assert composite_hazard("composite_decode", kind) == "2 full, 2 swa clean"


@pytest.mark.sglang
def test_0_5_23_the_float_chain_says_yes_to_swa_pages_no_virtual_id_backs():
    """At 16 tokens, page size 4, Mamba-SWA's can_reserve(0, 16) is True where the arena (three virtual ids) says no; reserve asks no such demand, so nothing is judged."""
    assert composite_hazard("swa_only_demand", "unified-mamba-swa") == "can_reserve True, arena False, clean"


@pytest.mark.sglang
def test_0_5_20_prices_a_swa_tail_at_the_full_sides_pages_and_that_refusal_is_no_failure():
    """At 16 tokens, page size 4, 11 tokens with a 3-token tail: 0.5.20 refuses (both sides priced at three pages, its documented policy), 0.5.23 allocates; both check out."""
    import os
    import subprocess
    import sys

    from tests.test_sglang import REPO, release_dir

    outcomes = []
    for version in ("0.5.20", "0.5.23"):
        run = subprocess.run([sys.executable, "-m", "tests.unified_hazards", "swa_tail_priced_as_full",
                              str(release_dir(version)), "unified-swa"], cwd=REPO, capture_output=True, text=True,
                             timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert run.returncode == 0, run.stderr[-3000:]
        outcomes.append(run.stdout.strip().splitlines()[-1])
    assert outcomes == ["None clean", "allocated clean"]


@pytest.mark.sglang
def test_0_5_20_crashes_sorting_frees_under_pd_and_0_5_22_does_not(tmp_path):
    """A finding: with need_sort (PD disaggregation), 0.5.20's alloc_extend short of virtual ids calls the base's
    merge_and_sort_free, whose release_pages the unified pool never sets (TypeError, base.py:136); 0.5.22 dropped the call."""
    import json
    import os
    import subprocess
    import sys

    from tests.test_sglang import REPO, release_dir

    config = {"target": "sglang:unified-mamba-swa", "page_size": 4, "need_sort": True, "size": 16}
    steps = [{"rule": "admit", "args": {}, "returns": "req_0"}, {"rule": "extend", "args": {"reqs": ["req_0"], "tokens": [8]}}]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"format": "kv-lockstep-trace/1", "config": config, "steps": steps}))
    results = []
    for version in ("0.5.20", "0.5.22"):
        run = subprocess.run([sys.executable, "-m", "state_machines.cli", "replay", str(trace), "--sglang-path",
                              str(release_dir(version))], cwd=REPO, capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, PYTHONPATH=str(REPO)))
        results.append((run.returncode, "TypeError" in run.stdout and "base.py:136" in run.stdout))
    assert results == [(1, True), (0, False)]


def test_eager_compaction_refuses_need_sort():
    """No server sorts frees with eager compaction (PD disaggregation requires lazy): the eager kinds refuse need_sort."""
    from state_machines.targets import TargetError
    from state_machines.targets.sglang import _sorting_needs_lazy

    _sorting_needs_lazy("multi-ended", True, True)
    with pytest.raises(TargetError, match="requires lazy compaction"):
        _sorting_needs_lazy("multi-ended-eager", True, False)


EVICT_SCRIPT = """
import sys
from state_machines.config import Config
from state_machines.harness import build
state = build(Config(target="sglang:unified-mamba-swa", page_size=4, size=16, sglang_path=sys.argv[1]))
req = state.alloc(n=8)
state.rematch(req=req, dup=0)
state.finish(req=req)
state.alloc(n=4)
state.make_room(full=1, swa=0)
print("cache", len(state.model.cache))
"""


@pytest.mark.sglang
@pytest.mark.parametrize("version", ["0.5.20", "0.5.22", "0.5.23"])
def test_a_float_chain_short_of_bytes_evicts_the_cache_to_make_room(version):
    """With the arena full and a cached entry unlocked, each release's Mamba-SWA evict_to_free_tokens evicts it through the cache; the checks agree."""
    run = subprocess.run([sys.executable, "-c", EVICT_SCRIPT, str(release_dir(version))], cwd=REPO, capture_output=True,
                         text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-2:] == ["cache", "0"]


class PlanWithoutPreference(UnifiedSWAAllocator):
    """0.5.21's reclaim_plan: no ``prefer_swa`` argument, always the SWA-least plan."""

    def reclaim_plan(self, full_tokens, swa_tokens, *, full_evictable_tokens=0, swa_evictable_tokens=0, empty_pool=False):
        return super().reclaim_plan(full_tokens, swa_tokens, full_evictable_tokens=full_evictable_tokens,
                                    swa_evictable_tokens=swa_evictable_tokens, empty_pool=empty_pool)


def test_a_reclaim_plan_without_prefer_swa_is_asked_without_it():
    """A reclaim_plan that takes no prefer_swa (0.5.21's) is asked without it and judged as the SWA-least plan: no false alarm."""
    from state_machines.config import Config
    from state_machines.runs.runner import fuzz

    outcome = fuzz(Config(target=f"{__name__}:PlanWithoutPreference", page_size=4), max_examples=60, seed=0)
    assert outcome.failures == ()


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_read_path_reads_the_table_as_indexing_does(page_size):
    """The built-in read paths gather with ``take``: a page id past 0 from
    the end (-1) wraps as ``v2p[pages]`` does, and an unbound page reads 0."""
    state = build(target="builtin:unified-swa", page_size=page_size)
    state.alloc(n=2 * page_size)
    a = state.allocator
    loc = torch.tensor([-1, 0, 1, page_size, 2 * page_size + 1, 5 * page_size - 1])
    for sub, read in ((a.full_attn_allocator, a.translate_kv_loc), (a.swa_attn_allocator, a.translate_loc_from_full_to_swa)):
        phys = sub.virtual_to_physical[loc // page_size]
        assert torch.equal(read(loc), torch.where(phys > 0, phys * page_size + loc % page_size, 0))
