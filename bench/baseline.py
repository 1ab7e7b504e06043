"""The baseline: a plain random-sequence fuzzer over the same rules.

It drives the very machine the harness runs (``machine_for``), so rules,
preconditions, argument normalization and invariants are the harness's own;
only the choosing differs.  A seeded ``random.Random`` picks a rule uniformly
among those whose preconditions hold and each argument uniformly in the
range its strategy names.  No Hypothesis engine, no shrinking: the style of
a ``parametrize("seed", range(10))`` test.
"""

from __future__ import annotations

import random
import time
from contextlib import nullcontext

from attrs import frozen

from state_machines.config import Config
from state_machines.harness import InvariantViolation, RunRecord, build, machine_for
from state_machines.harness.machines import MachineRule, machine_rules
from state_machines.runs.trace import Trace

# Steps in one random example: the harness's length before issue 13, kept so
# that the baseline is the one every earlier figure was measured against.
STEPS_PER_EXAMPLE = 20


@frozen
class RandomRule:
    """One rule of the machine, as the baseline draws it."""

    name: str
    # argument -> inclusive (low, high); booleans are (False, True)
    ranges: dict
    declared: MachineRule

    def applies(self, machine) -> bool:
        return self.declared.applies(machine)

    def draw(self, rng: random.Random) -> dict:
        return {arg: type(low)(rng.randint(low, high)) for arg, (low, high) in self.ranges.items()}


def random_rules(machine) -> list[RandomRule]:
    """The machine's rules, with the range of each argument as the rule declares it."""
    return [
        RandomRule(r.name, {arg: (False, True) if d is bool else d for arg, d in sorted(r.draws.items())}, r)
        for r in machine_rules(type(machine))
    ]


@frozen
class BaselineOutcome:
    """What one random run found: the first failure, unshrunk, or none."""

    config: Config
    failure: Trace | None
    record: RunRecord
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return self.failure is None


def random_fuzz(
    config: Config,
    *,
    seed: int,
    max_examples: int,
    steps_per_example: int = STEPS_PER_EXAMPLE,
    around_step=None,
) -> BaselineOutcome:
    """Run ``max_examples`` random examples of ``steps_per_example`` steps
    each, stopping at the first failure.

    ``around_step(name)`` is a context manager each rule runs inside.
    """
    # The run's clock (the record's) starts before its one build, as ``fuzz``'s does.
    record = RunRecord()
    # The harness's walk is seeded with ``random.Random(seed)``: with the bare
    # seed the two sides would share a stream (once, drawn in the same order,
    # a seed's first example was the same walk on both); a stream of its own
    # keeps the baseline independent, as the bench's comparison needs.
    rng = random.Random(f"baseline:{seed}")
    # The run's own pool in every example: the baseline draws no pool size.
    machine_class = machine_for(config, record, draw_size=False, built=build(config))
    rules = None
    started = time.monotonic()
    failure = None
    try:
        for _ in range(max_examples):
            machine = machine_class(engine=False)
            rules = rules or random_rules(machine)
            for _ in range(steps_per_example):
                chosen = rng.choice([r for r in rules if r.applies(machine)])
                args = chosen.draw(rng)
                with around_step(chosen.name) if around_step else nullcontext():
                    getattr(machine, chosen.name)(**args)
            machine.teardown()
    except InvariantViolation as exc:
        failure = Trace.from_violation(exc)
    return BaselineOutcome(config, failure, record, time.monotonic() - started)
