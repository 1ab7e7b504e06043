"""A fuzz run's first phase: a seeded random walk over the machine's rules.

Hypothesis pays several times a step's own cost per step (its engine
records, spans and mutates every choice), so a failure a plain walk meets in
a few examples costs it many times as long.  The walk runs the very machine
Hypothesis runs (rules, guards, argument normalization, checks), drawing
each example's pool size as Hypothesis would (``FreeGroupMachine.sizes``),
then each step's rule uniformly among those whose guard holds and each
argument uniformly in its declared range.  Its failures are shrunk like
Hypothesis's (``runner.minimize``); a run it leaves clean goes on to
Hypothesis, with its database, replay and mutations, for the rest of the
examples.
"""

from __future__ import annotations

import random

from state_machines.harness.machines import machine_rules

# Steps in one walk example: longer than Hypothesis's (a failure that needs
# a long history, ten allocs, a request grown to 9 pages, shows sooner), and
# a failure at step k is shrunk the same whether the example ran on or not.
WALK_STEPS = 40


def walk(machine_class, rng: random.Random, examples: int, steps: int = WALK_STEPS) -> None:
    """Run ``examples`` examples of ``steps`` steps each on fresh machines
    of ``machine_class``.

    Returns when all ran clean; raises what a step raised, the first
    ``InvariantViolation`` included (the machine's ``record`` counts the
    examples and steps, and the time to it, as under Hypothesis).
    """
    rules = machine_rules(machine_class)
    for _ in range(examples):
        machine = machine_class()
        if len(machine.sizes) > 1 or len(machine.sorts) > 1:
            machine.shape(rng.randrange(len(machine.sizes)), rng.randrange(len(machine.sorts)))
        for _ in range(steps):
            chosen = rng.choice([r for r in rules if r.applies(machine)])
            args = {k: rng.random() < 0.5 if r is bool else rng.randint(*r) for k, r in sorted(chosen.draws.items())}
            chosen.body(machine, **args)
        machine.teardown()
