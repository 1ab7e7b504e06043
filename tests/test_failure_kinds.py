"""An allocator that raises or hangs fails the run with a trace, like any broken invariant."""

import time

import attrs

from allocators import TokenAllocator
from state_machines.config import Config
from state_machines.harness import Step
from state_machines.runs.runner import fuzz


class RaisesOnAlloc(TokenAllocator):
    """A token pool whose alloc() always raises."""

    def alloc(self, need_size):
        raise RuntimeError("pool on fire")


# The line of the raise above, which the failure must name.
RAISE_LINE = RaisesOnAlloc.alloc.__code__.co_firstlineno + 1


class HangsOnAlloc(TokenAllocator):
    """A token pool whose alloc() does not return for a minute."""

    def alloc(self, need_size):
        time.sleep(60)


def _target(cls) -> Config:
    return Config(target=f"{__name__}:{cls.__name__}")


def test_an_exception_in_the_allocator_is_an_allocator_raised_failure():
    """fuzz reports allocator_raised, naming the call, the exception and its file:line, shrunk to one alloc."""
    outcome = fuzz(_target(RaisesOnAlloc), max_examples=20)
    assert [t.invariant for t in outcome.failures] == ["allocator_raised"]
    (trace,) = outcome.failures
    assert trace.detail == f"alloc(1) raised RuntimeError: pool on fire (at {__file__}:{RAISE_LINE})"
    assert trace.steps == (Step("alloc", {"n": 1}),)


def test_an_allocator_call_past_the_limit_is_an_allocator_hung_failure():
    """fuzz reports allocator_hung when alloc() outlives the per-call limit, shrunk to one alloc."""
    outcome = fuzz(attrs.evolve(_target(HangsOnAlloc), call_timeout_s=0.2), max_examples=20)
    assert [t.invariant for t in outcome.failures] == ["allocator_hung"]
    (trace,) = outcome.failures
    assert trace.detail == "alloc(1) hung: no return within 0.2 s"
    assert trace.steps == (Step("alloc", {"n": 1}),)


def test_a_call_made_inside_a_timed_call_leaves_the_outer_deadline_standing():
    """A nested timed call (an allocator calling back into the harness) returning does not switch the outer timer off."""
    from state_machines.harness.lockstep import _with_deadline

    def outer():
        _with_deadline(5.0, lambda: None, ())
        time.sleep(2)  # past the outer call's 0.2 s: must be interrupted

    t0 = time.perf_counter()
    try:
        _with_deadline(0.2, outer, ())
    except TimeoutError:
        pass
    else:
        raise AssertionError("the outer call ran past its deadline")
    assert time.perf_counter() - t0 < 1.5
