"""The scheduler-hook steps (``state_machines/harness/hooks.py``): ``ask``,
``offload`` and ``finish_segments`` run where a target has the hooks, and a
broken hook is caught.  sglang's classes run in a fresh interpreter each
(one process imports one release); without 0.5.23 those tests skip."""

import os
import subprocess
import sys
import textwrap

import attrs
import pytest
import torch

from allocators.paged import PagedAllocator
from state_machines.config import Config
from state_machines.harness import InvariantViolation, build
from tests.test_sglang import REPO, release_dir


class DropsLastSegment(PagedAllocator):
    """A broken ``free_segments``: the last segment of a row is never freed."""

    def free_segments(self, segments) -> None:
        for free_index, start_pos in list(segments)[:-1]:
            self.free_segment(free_index, start_pos=start_pos)


def test_finish_segments_runs_clean_on_the_builtin_paged():
    """A request's row given back as two page-aligned segments, the last ending mid-page, leaves no page held."""
    state = build(target="builtin:paged", page_size=4)
    req = state.alloc(n=12)
    state.free_segment(req=req, start=8, n=2)
    state.finish_segments(req=req, cut=1)
    assert state.model.num_free == state.model.capacity


def test_finish_segments_catches_a_dropped_segment():
    """A free_segments that skips its last segment leaks those pages."""
    state = build(target="tests.test_hooks:DropsLastSegment", page_size=4)
    req = state.alloc(n=12)
    with pytest.raises(InvariantViolation) as caught:
        state.finish_segments(req=req, cut=1)
    assert caught.value.invariant == "free_sets_agree"


def test_finish_segments_sends_slid_pages_full_side_only_on_the_builtin_swa():
    """A row whose oldest page slid goes back through free_full_segments and free_segments, both pools whole again."""
    state = build(target="builtin:swa", page_size=4)
    req = state.alloc(n=12)
    state.slide(req=req, pages=1)
    state.finish_segments(req=req, cut=2)
    assert state.model.num_free == state.model.capacity and state.swa.num_free == state.swa.capacity


def test_the_hook_steps_are_disabled_with_a_reason_where_the_harness_does_not_model_them():
    """The page-interleave harness does not model ask, and says so."""
    state = build(target="builtin:page-interleave", page_size=4)
    assert state.why_not("ask") == "the PageInterleaveLockstep harness does not model ask"


def in_release(body: str, version: str = "0.5.23") -> str:
    """Run ``body`` (Python, with ``state`` built from ``TARGET`` / ``PS``
    lines it sets first) against sglang ``version`` in a fresh interpreter;
    its last line of output: ``ok``, or the invariant that failed."""
    folder = release_dir(version)
    script = textwrap.dedent("""
        from state_machines.harness import InvariantViolation, build
        def make(target, ps):
            return build(target=target, page_size=ps, sglang_path=FOLDER)
        try:
    """).replace("FOLDER", repr(str(folder))) + textwrap.indent(textwrap.dedent(body), "    ") + textwrap.dedent("""
            print("ok")
        except InvariantViolation as exc:
            print(exc.invariant)
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip().splitlines()[-1]


@pytest.mark.sglang
def test_every_hook_step_runs_clean_on_sglang_paged():
    """0.5.23's paged allocator answers every question as the model does, and a CPU round trip keeps its slots."""
    assert in_release("""
        state = make("sglang:paged", 4)
        req = state.alloc(n=8)
        for tokens in (1, 8, 32, 33, 48):
            state.ask(tokens=tokens)
        state.offload(req=req)
        state.finish_segments(req=req, cut=1)
    """) == "ok"


@pytest.mark.sglang
def test_ask_catches_a_decode_capacity_that_ignores_the_pool():
    """A check_decode_capacity that always says yes is caught once the pool is short."""
    assert in_release("""
        state = make("sglang:paged", 4)
        state.allocator.check_decode_capacity = lambda **kwargs: True
        state.alloc(n=36)
        state.ask(tokens=8)
    """) == "decode_capacity_agrees"


@pytest.mark.sglang
def test_offload_catches_a_copy_of_the_wrong_slots():
    """A get_cpu_copy that hands the KV pool the ids one past the request's is caught."""
    assert in_release("""
        state = make("sglang:token", 1)
        real = state.allocator.get_cpu_copy
        state.allocator.get_cpu_copy = lambda indices, **kw: real(indices + 1, **kw)
        req = state.alloc(n=3)
        state.offload(req=req)
    """) == "hook_answer_agrees"


@pytest.mark.sglang
def test_ask_checks_the_swa_ids_a_transfer_addresses():
    """On 0.5.23's SWA allocator a transfer that addresses the full ids as SWA ids is caught once they differ."""
    assert in_release("""
        state = make("sglang:swa", 4)
        req = state.alloc(n=8)
        state.slide(req=req, pages=1)
        state.ask(tokens=4)
        state.allocator.translate_swa_indices_for_transfer = lambda ids: ids
        state.ask(tokens=4)
    """) == "hook_answer_agrees"


def test_the_cpu_round_trip_stand_in_restores_its_stamps():
    """The KV stand-in copies stamps out and back: a round trip leaves it as it was."""
    from state_machines.targets.sglang import KVCopyStandIn

    kv = KVCopyStandIn()
    kv.kv_lockstep_init(8)
    before = kv.kv_lockstep_stamps.clone()
    ids = torch.tensor([3, 1, 2])
    kv.load_cpu_copy(kv.get_cpu_copy(ids), ids)
    assert torch.equal(kv.kv_lockstep_stamps, before) and kv.kv_lockstep_copies == [("get", [3, 1, 2]), ("load", [3, 1, 2])]


@pytest.mark.sglang
def test_resize_rebuilds_sglang_pools_around_the_new_size():
    """0.5.23's paged and SWA allocators, resized before any request, hold exactly the new pages, and serve from them."""
    assert in_release("""
        for target, ps in (("sglang:paged", 4), ("sglang:swa", 4), ("sglang:token", 1)):
            state = make(target, ps)
            state.resize(pages=5)
            state.finish(req=state.alloc(n=2 * ps))
            state.resize(pages=10)
    """) == "ok"


@pytest.mark.sglang
def test_resize_catches_a_pool_that_keeps_its_old_pages():
    """A resize that sets the size but leaves the free list as it was is caught."""
    assert in_release("""
        state = make("sglang:paged", 4)
        def keeps(config):
            state.allocator.size = config.max_total_num_tokens
        state.allocator.resize = keeps
        state.resize(pages=5)
    """) == "free_sets_agree"


@pytest.mark.sglang
def test_the_paged_kinds_run_with_sglangs_debug_checks_and_extend_still_probes_clean():
    """sglang:paged is built with SGLANG_DEBUG_MEMORY_POOL on, and the extend probe's batch passes its checks."""
    assert in_release("""
        state = make("sglang:paged", 4)
        assert state.allocator.debug_mode and state.why_not("extend") is None, state.why_not("extend")
    """) == "ok"


def test_a_swa_request_ending_mid_page_grows_by_extend_not_alloc():
    """Above page size 1 the SWA harness's alloc (an alloc_extend from the page-aligned end) skips a request whose last page is partly used."""
    state = build(target="builtin:swa", page_size=4)
    req = state.admit()
    state.extend(reqs=[req], tokens=[1])
    assert req not in state.allocatable() and req in state.extendable()


class StaleResize(PagedAllocator):
    """sglang 0.5.23's resize (base.py:261-265): ``num_pages`` follows only
    above page size 1."""

    def resize(self, config) -> None:
        self.size = config.max_total_num_tokens
        if self.page_size > 1:
            self.num_pages = self.size // self.page_size
        self.clear()


def test_resize_is_probed_off_whatever_pool_size_is_built_first():
    """At page size 1 a resize that leaves num_pages stale is off on a pool
    of 1 page, where a resize to 1 page cannot show it, and so on the
    default pool after it (the verdict is kept for every size)."""
    one = Config(target="tests.test_hooks:StaleResize", size=1)
    assert "num_pages at 1" in (build(one).why_not("resize") or "")
    assert "num_pages at 1" in (build(attrs.evolve(one, size=None)).why_not("resize") or "")
