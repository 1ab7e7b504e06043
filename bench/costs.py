"""Where a step's time goes: the allocator, the census, each invariant, the rest.

``timed_checks`` swaps each predicate the harness checks, and the call
through which it reaches the allocator, for timed wrappers.  The baseline
driver runs the machine with them and times each rule, so the rest of a
step (model updates, row writes, argument normalization) is what is left
over.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from contextlib import contextmanager

from state_machines.harness import lockstep, swa
from state_machines.harness.lockstep import Lockstep, census_of

ALLOCATOR = "allocator calls"
CENSUS = "census (get_all_free_pages, available_size)"


class Timer:
    """Seconds spent per category inside steps, summed; what runs between
    steps (building a state, teardown) is not counted."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.step_s = 0.0
        self._inside = False

    def add(self, what: str, seconds: float) -> None:
        if self._inside:
            self.seconds[what] += seconds

    @contextmanager
    def step(self, name: str):
        self._inside = True
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.step_s += time.perf_counter() - t0
            self.steps += 1
            self._inside = False


# One timer per process: Lockstep.build makes the state, so it cannot be handed one.
TIMER = Timer()


def _timed_call(call):
    """``Lockstep._call`` (inherited by every family's harness), charging
    each allocator call to ``TIMER``."""

    @functools.wraps(call)
    def wrapper(self, what, fn, *args):
        t0 = time.perf_counter()
        try:
            return call(self, what, fn, *args)
        finally:
            census = fn is census_of or getattr(fn, "__name__", "") == "available_size"
            TIMER.add(CENSUS if census else ALLOCATOR, time.perf_counter() - t0)

    return wrapper


def _timed(predicate):
    @functools.wraps(predicate)
    def wrapper(*args):
        t0 = time.perf_counter()
        try:
            return predicate(*args)
        finally:
            TIMER.add(predicate.__name__, time.perf_counter() - t0)

    return wrapper


@contextmanager
def timed_checks():
    """Every predicate the harness checks (``CHECKS`` after each step, and
    the check after each alloc) and every allocator call, timed while the
    block runs."""
    saved = lockstep.CHECKS, lockstep.no_slot_handed_out_twice, swa.CHECKS, Lockstep._call
    lockstep.CHECKS = swa.CHECKS = tuple(_timed(p) for p in saved[0])
    lockstep.no_slot_handed_out_twice = _timed(saved[1])
    Lockstep._call = _timed_call(saved[3])
    try:
        yield
    finally:
        lockstep.CHECKS, lockstep.no_slot_handed_out_twice, swa.CHECKS, Lockstep._call = saved


def reset() -> Timer:
    global TIMER
    TIMER = Timer()
    return TIMER
