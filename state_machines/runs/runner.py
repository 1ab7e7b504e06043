"""Running a configuration: a seeded walk, then Hypothesis, each failure
shrunk by ``minimize`` (``state_machines/runs/minimize.py``)."""

from __future__ import annotations

import json
import math
import random
import time
from unittest import SkipTest

import attrs
from attrs import frozen
from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.stateful import run_state_machine_as_test

from state_machines.config import Config
from state_machines.harness import InvariantViolation, RunRecord, build, machine_for
from state_machines.harness.lockstep import disarm_call_timer
from state_machines.harness.machines import BudgetSpent
from state_machines.runs.minimize import minimize, shrink_configs
from state_machines.runs.trace import Trace, replay, run_steps
from state_machines.runs.walk import WalkFailures, walk

# Steps in one example; long enough for begin .. free .. overwrite .. end.
STEPS_PER_EXAMPLE = 20

# Eighths of a run's examples the walk (runs/walk.py) takes, from the first;
# Hypothesis takes the rest where the walk found nothing.  Per example the walk
# finds failures sooner than Hypothesis on every bench bug (it met each one
# first in the last `make bench`), most of all on the deepest, sglang 0.5.18's
# NPU decode (bench.bugs:npu_without_free_groups), measured on seeds 0-19 with
# the ci profile's 200 examples: the walk alone found it on 20 of 20 (2-138
# examples, median 26.5), Hypothesis alone on 5 of 20 (6 with the walk's two
# levers in its step rule too, which took bench.bugs:TenthAlloc from 1
# example to 69.5, median over 10 seeds: not kept), half and half on 18 of 20.
# And a Hypothesis step, its engine's work per example included, costs 3 to 7
# walk steps on clean builtin:token runs of 100 examples (each phase timed in
# three runs: 524-887 µs against 144-198; about 6.7 solved from the two
# throughputs below; ``machines._StepChoice``): three quarters walked ran
# 4,507 steps/s and seven eighths 5,853 (medians of 4 alternating rounds of
# 3 runs, 2-core machine).  The walk's examples do not depend on its share,
# so a larger share moves no first failure the walk met within the smaller
# one (after it, the walk may meet more distinct failures in examples
# Hypothesis had before).
# What it costs: Hypothesis runs 25 of the ci profile's 200 examples (50
# before) and 38 of `kv-lockstep fuzz`'s default 300 (75).  No bench bug
# reaches Hypothesis (the walk meets each within 70 examples), so the bench
# cannot show what that costs a bug only Hypothesis would find; none is known.
WALK_EIGHTHS = 7


def walked_examples(max_examples: int) -> int:
    """How many of a run's ``max_examples`` the walk takes (``WALK_EIGHTHS``)."""
    return max_examples * WALK_EIGHTHS // 8


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
        # The pool size an example draws (``PoolShapeRule``) is a step to Hypothesis.
        stateful_step_count=STEPS_PER_EXAMPLE + 1,
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
    """Run ``config`` (a seeded random walk, then Hypothesis) until ``max_examples`` or a failure.

    The configuration is built once first, so bad input raises
    ``TargetError`` here rather than inside Hypothesis.  Seven eighths of
    the examples (``walked_examples``) are a seeded random walk over the
    same rules (``walk``; seeded by ``seed``, or 0 under ``derandomize``),
    the rest Hypothesis's, whose new examples run only where the walk found
    nothing; no more than ``max_examples`` examples start before a failure,
    the saved failures replayed included, but those always replay in full
    (``_hypothesis_capped``).  A failure the walk finds is saved in the
    example database (when there is one) and replayed first next time, in
    the order found, as Hypothesis replays its own.  Where a saved walk
    failure still fails, neither the walk nor Hypothesis's generation runs,
    but Hypothesis's saved examples still replay, as they do where the walk
    meets a failure, and the run reports the first failure of each
    invariant among them all, the walk's first.  With ``shrink``, each
    failure Hypothesis found is shrunk by ``minimize`` (on the run's own
    pool shape or a smaller pool where the failure still shows), not by
    Hypothesis's shrinker, which replays whole examples through the engine
    and took 5-20 s a failure; Hypothesis still keeps the failing example
    in its database and replays it first next time.  ``stop()``, when
    given, is asked between the replays of ``minimize``; true stops the
    run with ``KeyboardInterrupt`` (a probe on ``record`` stops the
    Hypothesis part).

    Once an allocator call hangs, a hang is minimised under a short
    per-call limit, ``shrink_call_timeout``: each candidate that hangs
    again would otherwise cost the whole limit.  The shrunk hang is then
    replayed once under the full limit, and kept only if it still hangs
    there; else the first hang, unshrunk, is the answer.
    """
    # The run's clock (the record's, which the bench reads) starts before
    # its one build, as bench/baseline.py's does.
    record = record if record is not None else RunRecord()
    try:
        # The check's build is the first example's state: passed on, not kept (freed at that example's teardown).
        machine = machine_for(config, record, built=build(config))
    except BaseException:
        disarm_call_timer()  # bad input, or a fresh allocator that disagrees: the calls made set it
        raise
    if seed is not None:
        machine = hypothesis_seed(seed)(machine)
    watch = _HangWatch(record.probe, machine, config)
    record.probe = watch
    started = time.monotonic()
    failures: tuple[Trace, ...] = ()
    chosen = fuzz_settings(max_examples, database, derandomize, shrink=False)
    # The budget counts every example as it starts: the saved failures
    # replayed, the walk's, and Hypothesis's (``_hypothesis_capped``).
    start = record.examples
    try:
        full = machine.config
        saved = _walk_saved(machine, chosen.database, record)
        replayed = record.examples - start
        walked = min(walked_examples(chosen.max_examples), chosen.max_examples - replayed)
        budget = chosen.max_examples - replayed - walked
        if saved:
            raise _distinct(saved + _saved_by_hypothesis(machine, full, chosen, budget))
        # Each failure is saved as the walk meets it, so an interrupt later
        # (the walk running on, or shrinking) loses nothing.
        save = None if chosen.database is None else lambda violation: chosen.database.save(
            _walk_key(machine), _walk_value(Trace.from_violation(violation)))
        try:
            walk(machine, random.Random(seed if seed is not None else 0 if chosen.derandomize else None), walked,
                 on_failure=save)
        except Exception as exc:
            met = violations_in(exc)
            if not met:
                raise
            raise _distinct(met + _saved_by_hypothesis(machine, full, chosen, budget)) from None
        _hypothesis_capped(machine, chosen, budget, record, start + chosen.max_examples)
    except Exception as exc:
        found = violations_in(exc)
        if not found:
            raise
        traces = [Trace.from_violation(v) for v in found]
        if shrink:
            traces = [watch.for_shrinking(t) for t in traces]
            traces = [minimize(t, stop=stop, configs=shrink_configs(t, config, machine.shapes().sizes)) for t in traces]
        elif watch.first_hang is not None:
            traces = [Trace.from_violation(watch.first_hang) if t.invariant == "allocator_hung" else t for t in traces]
        failures = tuple(_under_full_limit(t, config, watch.first_hang) for t in traces)
    finally:
        record.probe = watch.inner
        disarm_call_timer()
    return Outcome(config, failures, record, time.monotonic() - started)


def _hypothesis_capped(machine, chosen: settings, budget: int, record: RunRecord, cap: int) -> None:
    """Hypothesis's part of a run: the examples its database keeps replayed
    first, all of them, then at most ``budget`` of its own, stopped once
    ``record`` counts ``cap`` examples.  Its ``max_examples`` counts only
    the examples it calls valid: one cut off at its size limit (an
    overrun: the early examples' reduced limit, a mutation's) ran steps
    all the same and is not counted.  On ``builtin:token``, seed 1, 38
    Hypothesis examples ran with 4 overruns besides, 125 with 40 (runs of
    300 and 1,000 examples).  The saved examples replay in a run of their
    own, not under the cap: under it, a budget the walk's saved failures
    had taken left Hypothesis's own saved failure unreplayed (``--max-examples
    1`` and one walk failure saved: the run came back clean)."""
    _hypothesis_saved(machine, chosen, budget)
    chosen = settings(chosen, phases=[p for p in chosen.phases if p != Phase.reuse])
    if budget <= 0 or Phase.generate not in chosen.phases:
        return
    record.cap, record.raised = cap, False
    try:
        run_state_machine_as_test(machine, settings=settings(chosen, max_examples=budget))
    except BudgetSpent:
        pass
    finally:
        record.cap = None


def _hypothesis_saved(machine, chosen: settings, budget: int) -> None:
    """Replay the examples Hypothesis's database keeps for ``machine``, all
    of its failures and, from the rest, as many as its reuse phase would
    take before a run of ``budget`` examples; generate none.  Raises what
    the failing ones raise."""
    if chosen.database is None or Phase.reuse not in chosen.phases:
        return
    # Without the generate phase Hypothesis replays up to max_examples of
    # its secondary corpus, not a tenth: a tenth of the budget keeps that.
    try:
        run_state_machine_as_test(machine, settings=settings(
            chosen, phases=[Phase.reuse], max_examples=max(1, math.ceil(max(budget, 1) / 10))))
    except SkipTest:  # nothing saved: no example ran
        pass


def _saved_by_hypothesis(machine, full: Config, chosen: settings, budget: int) -> list[InvariantViolation]:
    """The failures among Hypothesis's saved examples (``_hypothesis_saved``),
    replayed where the walk's failures, saved or new, end the run before
    Hypothesis's own reuse phase: else a failure only Hypothesis found stays
    unreported beside them.  They replay under the run's own per-call limit
    ``full``: a hang just met moved the machine onto the shrinker's short
    one (``_HangWatch``), under which a slow call passes for a hang.  An
    error of the harness's there is raised, not hidden: the walk's failures
    are then lost to the outcome, though the command has reported each as
    first seen (``FirstSight``), unshrunk, and the database keeps them."""
    machine.config = full
    try:
        _hypothesis_saved(machine, chosen, budget)
    except Exception as exc:
        more = violations_in(exc)
        if not more:
            raise
        return more
    return []


def _distinct(violations: list[InvariantViolation]) -> InvariantViolation | WalkFailures:
    """The first of ``violations`` for each invariant, as one exception to raise."""
    found: dict[str, InvariantViolation] = {}
    for violation in violations:
        found.setdefault(violation.invariant, violation)
    return next(iter(found.values())) if len(found) == 1 else WalkFailures(list(found.values()))


def _walk_key(machine) -> bytes:
    """Where the example database keeps the walk's failures for ``machine``
    (its name spells the configuration), each with when it was found
    (``_walk_value``)."""
    return b"kv-lockstep walk failures v2: " + machine.__name__.encode()


def _walk_key_before_v2(machine) -> bytes:
    """Where earlier versions kept them (a trace's JSON alone, or, for a
    while, ``_walk_value``'s form): read, never written.  Such a version
    reads only this key and forgot what it could not run, so a value of
    today's form kept here would be deleted by any older run sharing the
    database."""
    return b"kv-lockstep walk failures: " + machine.__name__.encode()


def _walk_value(trace: Trace, found: int | None = None) -> bytes:
    """``trace`` as the example database keeps a walk failure: JSON of
    ``found`` (``time.time_ns()`` unless given; wall-clock time, which
    processes and machines sharing a database agree on) and the trace."""
    return json.dumps({"found": time.time_ns() if found is None else found, "trace": trace.to_dict()}).encode()


def _walk_entry(value: bytes) -> tuple[int | None, dict]:
    """A saved walk failure's ``found`` and trace (``_walk_value``); ``found``
    is None for a value from before it was kept, a trace's JSON alone."""
    data = json.loads(value)
    if not isinstance(data, dict):
        raise ValueError(f"a walk failure is a JSON object, not {type(data).__name__}")
    if "trace" not in data:
        return None, data
    if not isinstance(data.get("found"), int) or isinstance(data["found"], bool):
        raise ValueError(f"a walk failure's 'found' is an integer, not {data.get('found')!r}")
    return data["found"], data["trace"]


def _is_trace(data) -> bool:
    """Whether ``data`` says it is a trace, of this version's form or any
    other's (``trace.FORMAT``)."""
    return isinstance(data, dict) and isinstance(data.get("format"), str) and data["format"].startswith("kv-lockstep-trace/")


def _same_failure(data) -> str:
    """What makes two saved walk failures one: the configuration, less the
    per-call limit (a hang's is set by timing), the steps and the
    invariant, not the detail (an exception's text names paths, a hang's
    its limit)."""
    if not _is_trace(data):
        return json.dumps(data, sort_keys=True)
    config, failure = data.get("config"), data.get("failure")
    config = {k: v for k, v in config.items() if k != "call_timeout_s"} if isinstance(config, dict) else config
    invariant = failure.get("invariant") if isinstance(failure, dict) else failure
    return json.dumps([config, data.get("steps"), invariant], sort_keys=True)


def _walk_saved(machine, database, record: RunRecord) -> list[InvariantViolation]:
    """Replay the walk failures ``database`` kept for ``machine``, each an
    example that the run's probe sees start and fail: return what those
    that still fail raised, in turn; forget those that pass, and values
    that are no trace at all.  A trace this version or machine cannot run
    (another version's form, a target not here) is kept for those that
    can.  They replay in the order found (the database keeps a set), then
    those saved without ``found`` (``_walk_entry``: an older version's) in
    the order of their bytes.  A failure kept more than once (runs that
    shared the database each found it) replays once, the first found;
    under the same key the others are forgotten, under the other key kept
    (an older version reads only its own)."""
    if database is None:
        return []
    entries = []
    for key in (_walk_key(machine), _walk_key_before_v2(machine)):
        for value in list(database.fetch(key)):  # deleting from it as it is read
            try:
                found, data = _walk_entry(value)
                same = _same_failure(data)
            except (ValueError, RecursionError):  # not JSON (or nested past the parser), not a walk failure: forgotten
                database.delete(key, value)
                continue
            entries.append((found is None, found or 0, value, key, data, same))
    failed: list[InvariantViolation] = []
    replayed: dict[str, bytes] = {}  # each failure replayed: the key it was kept under
    for *_, value, key, data, same in sorted(entries, key=lambda entry: entry[:3]):
        if same in replayed:
            if replayed[same] == key:
                database.delete(key, value)
            continue
        replayed[same] = key
        try:
            trace = Trace.from_dict(data)
        except Exception:  # noqa: BLE001 - a form this version cannot read: no example spent on it
            if not _is_trace(data):
                database.delete(key, value)
            continue
        example = machine(engine=False, with_state=False)
        try:
            example.state = build(trace.config)
            if record.probe is not None:
                record.probe.before(example, "teardown", {})  # a new example, no step
            run_steps(example.state, trace.steps)
            example.state.teardown()
        except InvariantViolation as exc:
            record.saw_failure()
            if record.probe is not None:
                record.probe.failed(example, exc)
            failed.append(exc)
            continue
        except Exception:  # noqa: BLE001 - one this version or machine cannot run is kept for those that can
            if _is_trace(data):
                continue
        database.delete(key, value)
    return failed


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

    @property
    def reads_call(self) -> bool:
        """Whether ``before`` needs the step's arguments: only for the inner probe."""
        return self.inner is not None and getattr(self.inner, "reads_call", True)

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

    def for_shrinking(self, trace: Trace) -> Trace:
        """``trace``, under the short per-call limit if it is a hang."""
        if trace.invariant != "allocator_hung":
            return trace
        short = shrink_call_timeout(self.config.call_timeout_s, self.slowest_step_s)
        return attrs.evolve(trace, config=attrs.evolve(trace.config, call_timeout_s=short))

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
