"""A target that keeps free groups out: the probe turns begin and end off,
with the reason, and no machine draws them.  And a probe's verdict does
not hang on the pool size a process builds first."""

import attrs
import pytest

from allocators.paged import PagedAllocator
from allocators.swa import PureSWAAllocator, SWAAllocator
from allocators.token import TokenAllocator
from allocators.unified_swa import UnifiedSWAAllocator
from state_machines.config import Config
from state_machines.harness import Step, build, machine_for
from state_machines.harness.machines import machine_rules
from state_machines.runs.runner import fuzz, replay
from state_machines.runs.trace import Trace, TraceError, run_steps


class WithoutGroups(TokenAllocator):
    """A token pool whose free groups are not provided."""

    def free_group_begin(self) -> None:
        raise NotImplementedError("no groups here")

    def free_group_end(self) -> None:
        raise NotImplementedError("no groups here")


class EndRaises(TokenAllocator):
    """A token pool whose free_group_end() fails outright: a bug, not a capability."""

    def free_group_end(self) -> None:
        raise RuntimeError("broken end")


WITHOUT = Config(target="tests.test_probe_groups:WithoutGroups")
END_RAISES = Config(target="tests.test_probe_groups:EndRaises")


def test_begin_and_end_are_disabled_with_the_targets_reason():
    """Both free-group steps go off together, and the reason names the method and its message."""
    state = build(WITHOUT)
    assert state.why_not("begin") == state.why_not("end")
    assert state.why_not("begin") == "no free groups: free_group_begin: NotImplementedError: no groups here"


def test_a_machine_for_a_target_without_free_groups_draws_neither_begin_nor_end():
    """The machine's rules lose begin and end and keep the rest."""
    names = {r.name for r in machine_rules(machine_for(WITHOUT))}
    assert not names & {"begin", "end"}
    assert {"alloc", "free", "finish"} <= names


def test_a_run_on_a_target_without_free_groups_is_clean():
    """No step calls the refused methods: a run passes its examples."""
    outcome = fuzz(WITHOUT, max_examples=30, seed=0, database=None)
    assert outcome.ok, outcome.failures[0].program()


def test_a_trace_holding_begin_is_refused_on_a_target_without_free_groups():
    """Replay refuses a begin there with the probe's reason, before any call."""
    with pytest.raises(TraceError, match="rule begin does not run .*no free groups"):
        run_steps(build(WITHOUT), (Step("begin", {}),))


def test_a_free_group_end_that_fails_otherwise_leaves_the_steps_on_for_the_run_to_report():
    """Only NotImplementedError is a capability: another raise keeps end on, and the run reports it."""
    state = build(END_RAISES)
    assert state.runs("begin") and state.runs("end")
    assert replay(Trace(END_RAISES, (Step("end", {}),))).invariant == "allocator_raised"


class SglangLikeWithoutGroups(WithoutGroups):
    """The same refusal in a class that says it is sglang's (whose allocators always have free groups)."""

    __module__ = "sglang.srt.mem_cache.allocator"


def test_an_sglang_allocator_that_raises_not_implemented_in_its_groups_keeps_them_on():
    """Only a custom target may keep free groups out: in sglang's own class the raise is a failure the run reports."""
    state = build(Config(target="tests.test_probe_groups:SglangLikeWithoutGroups"))
    assert state.runs("begin") and state.runs("end")
    assert replay(Trace(state.config, (Step("begin", {}),))).invariant == "allocator_raised"


def test_a_target_without_free_groups_counts_no_group_order_as_unreached():
    """Coverage lists no group interleaving as applicable where begin and end cannot run."""
    from state_machines.runs.coverage import Coverage

    coverage = Coverage(WITHOUT, use_hypothesis=False)
    coverage._new_example(build(WITHOUT))
    assert not {"group_free_overwrite_end", "end_without_group", "end_after_end", "evict_in_group"} & set(coverage.applicable)


class ExtendNeedsAKernel(PagedAllocator):
    """A paged pool whose ``alloc_extend`` returns None where the pool is
    short, before anything else (as sglang's does), and otherwise needs a
    kernel this machine lacks (as 0.5.18's NPU one needs sgl_kernel_npu)."""

    def alloc_extend(self, *args, **kwargs):
        if self.available_size() < args[5]:
            return None
        raise ModuleNotFoundError("No module named 'a_kernel'")


def test_extend_is_probed_on_the_runs_own_pool_whatever_size_is_built_first():
    """Built first on a 2-page pool, where the probe's extend (10 slots)
    returns None before the kernel, extend is still off, with the kernel's
    reason, there and on the default pool (a shrunk trace replayed in a
    fresh process builds its small pool first)."""
    small = Config(target="tests.test_probe_groups:ExtendNeedsAKernel", page_size=4, size=8)
    assert "a_kernel" in (build(small).why_not("extend") or "")
    assert "a_kernel" in (build(attrs.evolve(small, size=None)).why_not("extend") or "")


class SegmentNotProvided(PagedAllocator):
    """A paged pool whose free_segment is a base class's NotImplementedError."""

    def free_segment(self, free_index, start_pos=0) -> None:
        raise NotImplementedError("no segments here")

    free_segments = None  # the base's frees each segment with free_segment


class SegmentsNotProvided(PagedAllocator):
    """A paged pool whose free_segments is a base class's NotImplementedError."""

    def free_segments(self, segments) -> None:
        raise NotImplementedError("no segments here")


def _not_provided(*methods):
    """Methods that are a base class's NotImplementedError stubs."""
    def stub(self, *args, **kwargs):
        raise NotImplementedError("not here")
    return dict.fromkeys(methods, stub)


# The optional frees of the other families, each a base class's stub: the
# harness falls back as for an allocator without it.
FullSegmentsNotProvided = type("FullSegmentsNotProvided", (SWAAllocator,), _not_provided("free_full_segments"))
FullSegmentNotProvided = type("FullSegmentNotProvided", (SWAAllocator,),
                              _not_provided("free_full_segment", "free_full_segments"))


class SWASegmentNotProvided(SWAAllocator):
    """Its free_swa_segment a base class's stub; its free_segment frees the SWA side with free_swa."""

    def free_swa_segment(self, free_index, *, start_pos):
        raise NotImplementedError("not here")

    def free_segment(self, free_index, *, start_pos):
        if free_index.numel():
            self.free_swa(free_index)
            self.full_attn_allocator.free_segment(free_index, start_pos=start_pos)


PureFullSegmentNotProvided = type("PureFullSegmentNotProvided", (PureSWAAllocator,),
                                  _not_provided("free_full_segment", "free_full_segments"))
UnifiedSegmentNotProvided = type("UnifiedSegmentNotProvided", (UnifiedSWAAllocator,), _not_provided("free_segment"))


@pytest.mark.parametrize("name, page_size, methods", [
    ("FullSegmentsNotProvided", 4, {"free_full_segments"}),
    ("FullSegmentNotProvided", 4, {"free_full_segment", "free_full_segments"}),
    ("SWASegmentNotProvided", 4, {"free_swa_segment"}),
    ("PureFullSegmentNotProvided", 1, {"free_full_segment", "free_full_segments"}),
    ("UnifiedSegmentNotProvided", 4, {"free_segment"}),
])
def test_an_optional_free_of_another_family_not_provided_falls_back(name, page_size, methods):
    """SWA's free_full_segments and free_swa_segment, pure SWA's
    free_full_segment, the unified family's free_segment: a stub's
    NotImplementedError failed a correct allocator as allocator_raised (the
    probe covered free_segment and free_segments of the core harness only).
    Each is now left for the free it stands in for, and a run is clean."""
    config = Config(target=f"tests.test_probe_groups:{name}", page_size=page_size)
    state = build(config)
    assert state.not_provided == {m: f"{name}.{m}: not provided (NotImplementedError)" for m in methods}
    outcome = fuzz(config, max_examples=100, seed=1, database=None)
    assert not outcome.failures, outcome.failures[0].detail


@pytest.mark.parametrize("name, step, method", [
    ("SegmentNotProvided", "free_segment", "free_segment"),
    ("SegmentsNotProvided", "finish_segments", "free_segments"),
])
def test_a_segment_free_that_is_not_provided_disables_its_step(name, step, method):
    """The README calls them optional: their NotImplementedError failed a
    correct allocator as allocator_raised.  Segments then go back through
    free, and a fuzz run is clean."""
    config = Config(target=f"tests.test_probe_groups:{name}", page_size=4)
    state = build(config)
    assert state.disabled_rules[step] == f"{name}.{method}: not provided (NotImplementedError)"
    assert state.has_free_segment is (step != "free_segment")
    assert "free_segment" not in state.empty_free_methods() or step != "free_segment"
    outcome = fuzz(config, max_examples=60, seed=1, database=None)
    assert not outcome.failures, outcome.failures[0].detail
