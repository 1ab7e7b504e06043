"""Running a configuration under Hypothesis, and replaying a trace."""

from __future__ import annotations

import time

import attrs
from attrs import frozen
from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis import seed as hypothesis_seed
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
        # Hypothesis's own report is replaced by the trace's program form.
        verbosity=Verbosity.quiet,
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
    stop=None,
) -> Outcome:
    """Run ``config`` under Hypothesis until ``max_examples`` or a failure.

    The configuration is built once first, so bad input raises
    ``TargetError`` here rather than inside Hypothesis.  ``stop()``, when
    given, is asked between the deletions of ``minimize``; true stops the
    run with ``KeyboardInterrupt`` (a probe on ``record`` stops the
    Hypothesis part).

    Once an allocator call hangs, every later example (the shrinker's) runs
    under a short per-call limit, ``shrink_call_timeout``: each candidate
    that hangs again would otherwise cost the whole limit.  The shrunk hang
    is then replayed once under the full limit, and kept only if it still
    hangs there; else the first hang, unshrunk, is the answer.
    """
    build(config)
    record = record if record is not None else RunRecord()
    machine = machine_for(config, record)
    if seed is not None:
        machine = hypothesis_seed(seed)(machine)
    watch = _HangWatch(record.probe, machine, config)
    record.probe = watch
    started = time.monotonic()
    failures: tuple[Trace, ...] = ()
    try:
        run_state_machine_as_test(machine, settings=fuzz_settings(max_examples, database, derandomize, shrink))
    except Exception as exc:
        found = violations_in(exc)
        if not found:
            raise
        traces = [Trace.from_violation(v) for v in found]
        if shrink:
            traces = [minimize(t, stop=stop) for t in traces]
        elif watch.first_hang is not None:
            traces = [Trace.from_violation(watch.first_hang) if t.invariant == "allocator_hung" else t for t in traces]
        failures = tuple(_under_full_limit(t, config, watch.first_hang) for t in traces)
    finally:
        record.probe = watch.inner
    return Outcome(config, failures, record, time.monotonic() - started)


def shrink_call_timeout(limit: float, slowest_step_s: float) -> float:
    """The per-call limit while a hang shrinks: ten times the slowest step
    that returned, at least 0.1 s, at most the run's own limit."""
    return min(limit, max(0.1, 10 * slowest_step_s))


class _HangWatch:
    """The run's probe (``inner``, may be None), wrapped: it times each step,
    and the first ``allocator_hung`` moves the machine onto a short per-call
    limit (``shrink_call_timeout``)."""

    def __init__(self, inner, machine, config: Config) -> None:
        self.inner = inner
        self.machine = machine
        self.config = config
        self.first_hang: InvariantViolation | None = None
        self.slowest_step_s = 0.0
        self._began = 0.0

    def before(self, machine, name, call) -> None:
        if self.inner is not None:
            self.inner.before(machine, name, call)
        self._began = time.perf_counter()

    def after(self, machine, name) -> None:
        took = time.perf_counter() - self._began
        if took > self.slowest_step_s:
            self.slowest_step_s = took
        if self.inner is not None:
            self.inner.after(machine, name)

    def failed(self, machine, exc) -> None:
        if exc.invariant == "allocator_hung" and self.first_hang is None:
            self.first_hang = exc
            short = shrink_call_timeout(self.config.call_timeout_s, self.slowest_step_s)
            # Machines build their Lockstep from the class's config.
            self.machine.config = attrs.evolve(self.config, call_timeout_s=short)
        if self.inner is not None:
            self.inner.failed(machine, exc)


def _under_full_limit(trace: Trace, config: Config, first_hang: InvariantViolation | None) -> Trace:
    """``trace`` as the run's own per-call limit sees it (see ``fuzz``)."""
    if trace.config.call_timeout_s == config.call_timeout_s:
        return trace
    full = attrs.evolve(trace, config=attrs.evolve(trace.config, call_timeout_s=config.call_timeout_s))
    again = replay(full)
    if again is not None and again.invariant == trace.invariant:
        return Trace.from_violation(again)
    if trace.invariant == "allocator_hung" and first_hang is not None:
        return Trace.from_violation(first_hang)
    return full


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


def minimize(trace: Trace, stop=None) -> Trace:
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
                if stop is not None and stop():
                    raise KeyboardInterrupt("stop requested")
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
