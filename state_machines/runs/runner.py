"""Running a configuration under Hypothesis, and replaying a trace."""

from __future__ import annotations

import time

import attrs
from attrs import frozen
from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.reporting import with_reporter
from hypothesis.stateful import run_state_machine_as_test

from state_machines.config import Config
from state_machines.harness import InvariantViolation, RunRecord, build, machine_for
from state_machines.runs.trace import Trace, run_steps

# Steps in one example; long enough for begin .. free .. overwrite .. end.
STEPS_PER_EXAMPLE = 20


@frozen
class Outcome:
    """What one fuzz run found: shrunk failing traces (empty when clean)."""

    config: Config
    failures: tuple[Trace, ...]
    record: RunRecord
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return not self.failures


_INHERIT = object()


def fuzz_settings(
    max_examples: int | None = None, database=_INHERIT, derandomize: bool | None = None, shrink: bool = True
) -> settings:
    """The active Hypothesis profile, with what a lockstep run always needs
    and whatever the caller names; ``None`` keeps the profile's value."""
    chosen = {"max_examples": max_examples, "derandomize": derandomize}
    if not shrink:
        chosen["phases"] = [p for p in settings.default.phases if p not in (Phase.shrink, Phase.explain)]
    if database is not _INHERIT:
        chosen["database"] = database
    return settings(
        settings.default,
        stateful_step_count=STEPS_PER_EXAMPLE,
        deadline=None,
        print_blob=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
        **{k: v for k, v in chosen.items() if v is not None or k == "database"},
    )


def violations_in(exc: BaseException) -> list[InvariantViolation]:
    """The invariant violations inside what Hypothesis raised, in order."""
    if isinstance(exc, InvariantViolation):
        return [exc]
    found = []
    for inner in getattr(exc, "exceptions", ()):
        found += violations_in(inner)
    if not found and exc.__cause__ is not None:
        found = violations_in(exc.__cause__)
    return found


def fuzz(
    config: Config,
    *,
    max_examples: int | None = None,
    seed: int | None = None,
    database=_INHERIT,
    derandomize: bool | None = None,
    record: RunRecord | None = None,
    shrink: bool = True,
) -> Outcome:
    """Run ``config`` under Hypothesis until ``max_examples`` or a failure.

    The configuration is built once first, so bad input raises
    ``TargetError`` here rather than inside Hypothesis.
    """
    build(config)
    record = record if record is not None else RunRecord()
    machine = machine_for(config, record)
    if seed is not None:
        machine = hypothesis_seed(seed)(machine)
    started = time.monotonic()
    failures: tuple[Trace, ...] = ()
    try:
        # Hypothesis's own report is replaced by the trace's program form.
        with with_reporter(lambda _: None):
            run_state_machine_as_test(machine, settings=fuzz_settings(max_examples, database, derandomize, shrink))
    except Exception as exc:
        found = violations_in(exc)
        if not found:
            raise
        failures = tuple(minimize(Trace.from_violation(v)) for v in found) if shrink else tuple(
            Trace.from_violation(v) for v in found
        )
    return Outcome(config, failures, record, time.monotonic() - started)


def replay(trace: Trace, config: Config | None = None) -> InvariantViolation | None:
    """Run the trace's steps again, on its own configuration or ``config``.

    Returns the violation it hits, or ``None`` when every step and the
    teardown check out.
    """
    try:
        state = build(config or trace.config)
        run_steps(state, trace.steps)
        state.teardown()
    except InvariantViolation as exc:
        return exc
    return None


def minimize(trace: Trace) -> Trace:
    """Delete steps Hypothesis's shrinker left behind, while the trace still
    fails on the same invariant.

    The shrinker works on the integers the rules draw; deleting a ``begin``
    there can disable the step after it, so a pair that does nothing can
    survive.  Here steps are deleted directly (two, then one at a time) and
    each candidate is replayed; the result is re-recorded, so its names run
    ``req_0``, ``req_1``, ... again.
    """
    best = trace
    changed = True
    while changed:
        changed = False
        for width in (2, 1):
            i = 0
            while i + width <= len(best.steps):
                candidate = attrs.evolve(best, steps=best.steps[:i] + best.steps[i + width :])
                try:
                    again = replay(candidate)
                except Exception:  # noqa: BLE001 - the deletion broke the trace itself,
                    # e.g. a later step names what it deleted, or a group now nests
                    again = None
                # Strictly shorter: a replay's teardown may close the group with
                # an `end` of its own, which would give back the step deleted.
                if again is not None and again.invariant == best.invariant and len(again.steps) < len(best.steps):
                    best = Trace.from_violation(again)
                    changed = True
                else:
                    i += 1
    return best
