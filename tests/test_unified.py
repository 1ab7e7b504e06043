"""The unified family: virtual page ids over compacting physical pages.

The predicates of ``reference_model.unified`` on hand-made tables, the twin
``builtin:multi-ended`` and its row-dtype mutant, and sglang's
``MultiEndedAllocator`` (each release in a fresh process; without the
releases those tests skip).
"""

import os
import subprocess
import sys

import pytest

from reference_model import OwnershipModel
from reference_model import unified as ru
from state_machines.config import Config
from state_machines.harness import build
from state_machines.runs.runner import fuzz
from state_machines.targets import TargetError
from tests.test_sglang import REPO, release_dir

# Pages 0 (anchor) .. 5; virtual 1 -> physical 2, virtual 2 -> physical 1;
# the span [1, 4) holds a hole at 3; pages 4, 5 lie beyond the watermark.
V2P = (0, 2, 1, -1, -1, -1, -1)
P2V = (0, 2, 1, -1, -1, -1, -1)


def tables(v2p=V2P, p2v=P2V, span=(1, 4), holes=(3,)):
    return ru.PageTables(v2p=v2p, p2v=p2v, first_page=1, num_pages=6, span=span, holes=holes)


def model_holding(*pages):
    model = OwnershipModel.from_census([1, 2, 3, 4, 5])
    model.new_request(0, list(pages))
    return model


def test_consistent_tables_pass_every_predicate():
    """Two live pages mapped both ways, one hole, nothing lent: no predicate objects."""
    t = tables()
    assert ru.tables_bijective(t, {1, 2}) is None
    assert ru.physical_pages_owned_once(t, []) is None
    assert ru.span_within_arena(t, 4, 24) is None
    assert ru.physical_frees_match_logical(t, model_holding(1, 2)) is None
    assert ru.kv_follows_mapping({2: 1, 1: 2}, t, {1, 2}) is None


def test_a_freed_page_still_mapped_breaks_the_bijection():
    """A virtual page the model says is free but v2p still maps is named."""
    problem = ru.tables_bijective(tables(), {1})
    assert problem is not None and "virtual pages [2] are mapped but not held" in problem


def test_two_virtual_pages_on_one_physical_page_break_the_bijection():
    """Two virtual ids backed by one physical page is reported as shared."""
    problem = ru.tables_bijective(tables(v2p=(0, 2, 2, -1, -1, -1, -1)), {1, 2})
    assert problem is not None and "physical pages [2] back more than one virtual page" in problem


def test_a_page_both_bound_and_a_hole_has_two_roles():
    """A physical page in the free list that still holds a live page is caught."""
    problem = ru.physical_pages_owned_once(tables(holes=(1, 3)), [])
    assert problem is not None and "pages [1] have two roles (bound/hole)" in problem


def test_a_page_inside_the_span_with_no_role_is_lost():
    """A page the watermark covers that is neither bound, a hole nor lent leaked."""
    problem = ru.physical_pages_owned_once(tables(holes=()), [])
    assert problem is not None and "pages [3] inside the span have no role (lost)" in problem


def test_a_lent_page_counts_as_a_role():
    """A page lent by alloc_physical fills its place in the span."""
    assert ru.physical_pages_owned_once(tables(holes=()), [3]) is None


def test_a_span_past_the_arena_is_caught():
    """A watermark past the arena's bytes breaks span_within_arena."""
    assert ru.span_within_arena(tables(span=(1, 5)), 6, 24) is not None


def test_bound_pages_must_equal_held_pages():
    """One more page held than bound: a logical free that freed no physical page, or the reverse."""
    problem = ru.physical_frees_match_logical(tables(), model_holding(1, 2, 3))
    assert problem is not None and problem.startswith("physical pages bound 2 / virtual pages held 3")


def test_kv_left_behind_by_a_move_is_caught():
    """A mapping that points at a page holding another page's KV is named."""
    problem = ru.kv_follows_mapping({2: 2, 1: 2}, tables(), {1, 2})
    assert problem is not None and "virtual pages [1]" in problem


def test_available_size_counts_lent_pages_out():
    """available_size() is the free virtual pages less the lent ones."""
    assert ru.available_counts_lent(8, 3, 1, 4) is None
    assert ru.available_counts_lent(12, 3, 1, 4) is not None


def test_segment_view_mutant_is_refused_with_int32_rows():
    """The view mutant cannot show at int32 rows, and the run is refused saying so."""
    with pytest.raises(TargetError, match="needs --row-dtype int64"):
        build(Config(target="builtin:multi-ended", mutant="segment-view", page_size=4))


def test_int32_rows_hide_the_segment_view_queue():
    """The same queue of ``row.to(int64)[::ps]`` is a copy of an int32 row: a full budget finds nothing."""
    from allocators.multi_ended import SegmentViewAllocator

    config = Config(target="tests.test_unified:segment_view_unrefused", page_size=4)
    assert SegmentViewAllocator.family == "unified"
    outcome = fuzz(config)
    assert outcome.ok, [t.program() for t in outcome.failures]


def segment_view_unrefused(size: int, page_size: int):
    """The segment-view mutant as a custom target: no row-dtype need attached."""
    from allocators.multi_ended import SegmentViewAllocator

    return SegmentViewAllocator(size, page_size)


segment_view_unrefused.family = "unified"


def test_flush_and_loans_run_on_the_twin():
    """flush, alloc_physical and free_physical run on builtin:multi-ended and check out."""
    state = build(Config(target="builtin:multi-ended", page_size=4))
    req = state.alloc(8)
    state.finish(req)
    state.alloc_physical(4)
    state.flush(True)
    state.free_physical(0)
    state.flush(True)
    assert state.allocator.available_size() == 10 * 4


# --------------------------------------------------------------------------- #
# sglang's MultiEndedAllocator


def fuzz_release(version: str, *flags: str, kind: str = "multi-ended") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "state_machines.cli", "fuzz", "--target", f"sglang:{kind}",
         "--sglang-path", str(release_dir(version)), "--seed", "0", "--max-examples", "100", *flags],
        cwd=REPO, capture_output=True, text=True, timeout=1200, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )


@pytest.mark.sglang
@pytest.mark.parametrize("page_size", ["1", "4"])
def test_0_5_23_multi_ended_passes(page_size):
    """0.5.23's MultiEndedAllocator keeps virtual ids, page tables and KV in step at int32 rows."""
    run = fuzz_release("0.5.23", "--page-size", page_size)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.sglang
def test_0_5_23_multi_ended_with_eager_compaction_passes():
    """With eager compaction (every free compacts at once) 0.5.23's tables and KV stay in step."""
    run = fuzz_release("0.5.23", "--page-size", "4", kind="multi-ended-eager")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.sglang
def test_0_5_23_multi_ended_frees_an_overwritten_int64_row_view():
    """With int64 rows, 0.5.23's free_segment queues a view; a row rewritten before end frees page 0."""
    run = fuzz_release("0.5.23", "--page-size", "4", "--row-dtype", "int64", "--max-examples", "300")
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "state.free_segment(" in run.stdout and "state.overwrite_row(" in run.stdout


@pytest.mark.sglang
def test_targets_lists_multi_ended_once_with_its_steps():
    """`targets` on 0.5.23 shows sglang:multi-ended once, on the unified harness at each gate page size, with its stand-ins."""
    run = subprocess.run(
        [sys.executable, "-m", "state_machines.cli", "targets", "--sglang-path", str(release_dir("0.5.23"))],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    lines = run.stdout.splitlines()
    head = "  sglang:multi-ended: MultiEndedAllocator (sglang.srt.mem_cache.allocator.unified_sub_pool), any page size"
    assert lines.count(head) == 1, run.stdout
    sizes = [line for line in lines[lines.index(head) + 1 :] if line.startswith("    at page size")][:2]
    assert sizes == ["    at page size 1: harness UnifiedLockstep", "    at page size 4: harness UnifiedLockstep"]
    assert "    stand-in: KV pool stand-in: a stamp per physical page, carried by move_physical_pages / move_kv_cache" in lines


def test_replay_refuses_a_free_physical_of_a_loan_not_out():
    """A trace returning a loan no alloc_physical made is refused, not run."""
    from state_machines.harness import Step
    from state_machines.runs.trace import TraceError, run_steps

    with pytest.raises(TraceError, match="loan 0 is not out"):
        run_steps(build(Config(target="builtin:multi-ended")), (Step("free_physical", {"loan": 0}),))


def test_a_loan_stops_compaction_and_its_return_frees_it():
    """While a loan is out no page moves; once returned, an urgent flush packs the span to the live pages."""
    state = build(Config(target="builtin:multi-ended"))
    first = state.alloc(2)
    state.alloc(1)
    state.finish(first)
    state.alloc_physical(1)
    state.flush(True)
    assert state.allocator.watermark_physical == 4  # page 1 lent (the lowest hole), 2 a hole, 3 live
    state.free_physical(0)
    state.flush(True)
    assert state.allocator.watermark_physical == 2  # page 3's virtual page moved to page 1
