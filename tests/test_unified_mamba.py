"""The unified Mamba pool's caller-facing views and steps (``idle_flush``,
``prepare_mamba``), the predicates that judge them, and the hazards issue 12
read in the unified allocators, each driven by hand on 0.5.23
(``tests/unified_hazards.py``, a fresh process per release; skipped without it).
"""

import os
import subprocess
import sys

import pytest

from reference_model import unified as ru
from state_machines.harness import build
from state_machines.harness.lockstep import InvariantViolation
from tests.test_sglang import REPO, release_dir
from tests.test_unified import fuzz_release

# -- the predicates --


def test_a_translation_off_the_tables_is_named_with_both_sides():
    """Token 5 of virtual page 1 (v2p 3, page size 4) must read physical 13; 9 is named against it."""
    problem = ru.translation_follows_tables([4, 5], [12, 9], (0, 3, -1, -1), 4)
    assert problem is not None and "t5->9 (tables say 13)" in problem


def test_an_unmapped_page_translates_to_the_sink():
    """A token of an unmapped virtual page reads the padding sink 0; anything else is reported."""
    assert ru.translation_follows_tables([8], [0], (0, 3, -1, -1), 4) is None
    assert ru.translation_follows_tables([8], [8], (0, 3, -1, -1), 4) is not None


def test_is_slot_allocated_must_match_the_live_pages():
    """A live page said free and a free page said allocated are both named."""
    problem = ru.slot_allocated_agrees({1: False, 2: True}, {1})
    assert problem is not None and "live pages said free [1]" in problem and "said allocated [2]" in problem


def test_a_capacity_view_above_the_room_is_an_overpromise():
    """available 8 where only 4 fit fails; 4 or less passes."""
    assert ru.capacity_view_within_room("available_size()", 8, 4) is not None
    assert ru.capacity_view_within_room("available_size()", 4, 4) is None


def test_a_refused_alloc_the_schedulable_view_promised_is_named():
    """schedulable 2 >= 2 and alloc(2) refused breaks the promise; schedulable 1 does not promise 2."""
    assert ru.schedulable_promise_kept("alloc(2)", 2, 2, True) is not None
    assert ru.schedulable_promise_kept("alloc(2)", 1, 2, True) is None


def test_size_minus_available_must_be_the_tokens_held():
    """size 40, available 24: 16 tokens held balances, 12 does not."""
    assert ru.size_balances(40, 24, 16) is None
    assert ru.size_balances(40, 24, 12) is not None


def test_the_recheck_bound_is_zero_exactly_when_the_slots_are_there():
    """0 with room, positive without; 0 without room (or positive with it) is named."""
    assert ru.recheck_bound_zero_iff_room(0, 3, 2) is None and ru.recheck_bound_zero_iff_room(2, 1, 2) is None
    assert ru.recheck_bound_zero_iff_room(0, 1, 2) is not None and ru.recheck_bound_zero_iff_room(1, 3, 2) is not None


# -- the twin's new steps and mutants --


def test_prepare_mamba_applies_the_queued_frees_and_keeps_the_group_open():
    """A finish queued in a group is applied by prepare_mamba; a free after it is still deferred."""
    state = build(target="builtin:unified-mamba")
    first, second = state.alloc(n=2), state.alloc(n=2)
    state.begin()
    state.finish(req=first)
    state.prepare_mamba(n=1)
    assert state.allocator.free_group == [] and len(state.model.free_pages) == len(state.universe) - 2
    state.finish(req=second)
    assert len(state.allocator.free_group) == 1


def test_a_prepare_that_closes_the_free_group_is_caught():
    """prepare-closes-group: the free after it runs at once while the caller defers it (free_sets_agree)."""
    state = build(target="builtin:unified-mamba", mutant="prepare-closes-group")
    first, second = state.alloc(n=2), state.alloc(n=2)
    state.begin()
    state.finish(req=first)
    state.prepare_mamba(n=1)
    with pytest.raises(InvariantViolation, match="free_sets_agree"):
        state.finish(req=second)


def test_a_schedulable_view_that_ignores_the_full_bytes_is_caught():
    """schedulable-overpromises: with the full side holding the arena, the Mamba view still counts every free id."""
    state = build(target="builtin:unified-mamba", mutant="schedulable-overpromises")
    with pytest.raises(InvariantViolation, match="mamba_capacity_view_within_room"):
        state.alloc(n=8)


# -- sglang 0.5.23 --


@pytest.mark.sglang
def test_0_5_23_unified_mamba_with_lazy_compaction_passes():
    """0.5.23's Mamba composite in sglang's default mode (lazy compaction) stays in step, its views included."""
    run = fuzz_release("0.5.23", "--page-size", "4", kind="unified-mamba")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.sglang
@pytest.mark.parametrize("kind", ["multi-ended", "unified-mamba"])
def test_0_5_23_unified_decode_and_extend_run_above_page_size_one(kind):
    """With the kernel stand-ins, 0.5.23's own alloc_decode / alloc_extend run at page size 4: neither step is disabled."""
    run = fuzz_release("0.5.23", "--page-size", "4", "--max-examples", "20", kind=kind)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "rule decode disabled" not in run.stdout + run.stderr and "rule extend disabled" not in run.stdout + run.stderr


def hazard(name: str, kind: str) -> str:
    run = subprocess.run([sys.executable, "-m", "tests.unified_hazards", name, str(release_dir("0.5.23")), kind],
                         cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip().splitlines()[-1]


@pytest.mark.sglang
def test_0_5_23_lazy_free_takes_a_double_free_that_eager_refuses():
    """A second free of a page: eager raises (unified_sub_pool.py:1358), lazy lists the id twice (no_page_freed_twice)."""
    assert hazard("double_free", "multi-ended-eager").startswith("raised AssertionError")
    assert hazard("double_free", "multi-ended") == "caught no_page_freed_twice"


@pytest.mark.sglang
def test_0_5_23_two_segment_frees_of_one_page_in_a_group_free_it_twice():
    """free_segment twice of one page in a group (its contract forbids it): both modes list the id twice."""
    assert hazard("segment_freed_twice_in_group", "multi-ended") == "caught no_page_freed_twice"
    assert hazard("segment_freed_twice_in_group", "multi-ended-eager") == "caught no_page_freed_twice"


@pytest.mark.sglang
def test_0_5_23_a_nested_mamba_allocation_group_drops_the_first_reserve():
    """alloc_group_begin(2) then alloc_group_begin(1), end: the first two slots are neither free nor handed out."""
    assert hazard("group_begin_while_open", "unified-mamba") == "2 slot(s) neither free nor handed out"


@pytest.mark.sglang
def test_0_5_23_a_mamba_slot_free_of_minus_one_joins_the_free_ids_when_lazy():
    """free(tensor([-1])) on the Mamba slots: lazy lists -1 as a free id, eager raises."""
    assert hazard("slot_free_of_minus_one", "unified-mamba") == "free ids now hold [-1]"
    assert hazard("slot_free_of_minus_one", "unified-mamba-eager").startswith("raised AssertionError")


@pytest.mark.parametrize("target", ["builtin:multi-ended", "builtin:unified-mamba", "builtin:unified-swa"])
def test_an_empty_free_changes_nothing(target):
    """free_nothing (an empty free_segment, then an empty free) leaves the free ids as they were."""
    state = build(target=target, page_size=4)
    state.alloc(n=4)
    before = sorted(state.model.free_pages)
    state.free_nothing(segment=True)
    state.free_nothing(segment=False)
    assert sorted(state.model.free_pages) == before


@pytest.mark.parametrize("target, harness", [("builtin:multi-ended", "UnifiedLockstep"),
                                             ("builtin:unified-mamba", "UnifiedMambaLockstep"),
                                             ("builtin:unified-swa", "UnifiedSWALockstep")])
def test_the_unified_families_free_nothing_in_their_own_step(tmp_path, target, harness):
    """free_empty_span's guard never held on these (no empty_frees): it was
    listed as a step, ran 0 times and counted as blocked 100% in the
    rules' share; unified-swa had no free_nothing at all, so no empty free
    ever reached it (helper-80)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    stats = tmp_path / "stats.json"
    run = subprocess.run([sys.executable, "-m", "state_machines.cli", "fuzz", "--target", target, "--page-size", "4",
                          "--duration", "3s", "-j", "1", "--seed", "0", "--stats-json", str(stats),
                          "--trace-dir", str(tmp_path / "traces")], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)))
    assert run.returncode == 0, run.stdout + run.stderr
    rules = json.loads(stats.read_text())["rules"]
    assert rules["free_empty_span"]["disabled"] == f"the {harness} harness frees an empty span in its own step, free_nothing"
    assert rules["free_nothing"]["ran"] > 0, rules
