"""Where a step's time goes: the allocator, the census, each invariant, the rest.

``timed_checks`` has the harness time each predicate it judges and each
call through which it reaches the allocator (``harness.lockstep.observe``).  The baseline
driver runs the machine with them and times each rule, so the rest of a
step (model updates, row writes, argument normalization) is what is left
over.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

from state_machines.harness import lockstep
from state_machines.harness.lockstep import ALLOCATOR, CENSUS

__all__ = ["ALLOCATOR", "CENSUS", "Timer", "reset", "timed_checks"]


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

    # The harness's call observer (``harness.lockstep.watch_calls``).
    call_ended = judged = add

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


# One timer per process: build() makes the state, so it cannot be handed one.
TIMER = Timer()


def timed_checks():
    """Every predicate the harness judges and every allocator call, timed
    into ``TIMER`` while the block runs (the harness's ``observe`` hook)."""
    return lockstep.observe(TIMER)


def reset() -> Timer:
    global TIMER
    TIMER = Timer()
    return TIMER
