"""Long fuzzing runs: ``kv-lockstep fuzz --duration 10m -j N [--db DIR|redis://]``.

N worker processes (forkserver or spawn, never threads) each run repeated
Hypothesis runs with fresh random seeds until the time is up, a failure is
found, or the user presses Ctrl-C.  Workers send coverage snapshots and
failures to the parent, each over a pipe of its own; the parent prints
progress, the summary and the traces, and watches for workers that hang or
die (``watchdog``).  The example database, when given, is the workers' (and
machines') shared memory: a failure one of them found is replayed first by
every later run.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from state_machines.config import Config
from state_machines.runs.coverage import INTERLEAVINGS, Coverage, merge, never_reached, shares, summary_table
from state_machines.runs.options import BadOption, check_jobs, open_database, parse_duration, worker_context

__all__ = ["BadOption", "default_jobs", "open_database", "parse_duration", "run"]

# Examples per Hypothesis run inside a worker; each run replays the database first.
CHUNK_EXAMPLES = 1000
# After the deadline, a worker still shrinking a failure gets this long to finish.
SHRINK_GRACE_S = 120.0
# After Ctrl-C or SIGTERM, workers get this long to stop before they are terminated.
INTERRUPT_GRACE_S = 3.0
PLAIN_PROGRESS_EVERY_S = 5.0


# -- the worker --


def _worker(index: int, config_dict: dict, db_spec, seed, trace_dir: str, messages, beacon) -> None:
    """Run Hypothesis runs until told to stop; report stats and failures.

    ``messages`` is the worker's own pipe to the parent, ``beacon`` its
    shared memory (``watchdog``): the parent's stop and abort flags."""
    from state_machines.runs.watchdog import start_worker, worker_signals

    # Ctrl-C reaches the whole process group: the parent alone decides what it means.
    worker_signals()
    from state_machines.harness import RunRecord
    from state_machines.runs.runner import fuzz
    from state_machines.runs.trace import Trace, write_or_why
    from state_machines.targets import TargetError

    config = Config.from_dict(config_dict)
    if config.caller != "harness":  # a fresh worker registers the caller family itself
        import state_machines.callers  # noqa: F401

    def on_failure(exc):
        # Keep the unshrunk trace at once, so Ctrl-C during shrinking loses nothing.
        trace = Trace.from_violation(exc)
        path = Path(trace_dir) / "unshrunk"
        written = write_or_why(trace, path)
        messages.put(("found", index, exc.invariant, str(written), coverage.examples))

    def should_stop(shrinking: bool) -> bool:
        return beacon.abort_requested() or (beacon.stop_requested() and not shrinking)

    coverage = Coverage(
        config,
        flush=lambda snap: messages.put(("stats", index, snap)),
        should_stop=should_stop,
        on_failure=on_failure,
    )
    run = 0
    try:
        # Publishes every allocator call to the parent's watchdog; builds the
        # target once and says whether it could.
        if start_worker(config, beacon, messages, index) is not None:
            database = open_database(db_spec)
            while not (beacon.stop_requested() or beacon.abort_requested()):
                run_seed = None if seed is None else seed * 1_000_003 + index * 10_007 + run
                run += 1
                outcome = fuzz(
                    config,
                    max_examples=CHUNK_EXAMPLES,
                    seed=run_seed,
                    database=database,
                    derandomize=False,
                    record=RunRecord(probe=coverage),
                    stop=beacon.abort_requested,
                )
                if outcome.failures:
                    paths = [write_or_why(trace, trace_dir) for trace in outcome.failures]
                    messages.put(("failures", index, [t.to_json() for t in outcome.failures], paths))
                    break
    except KeyboardInterrupt:
        pass
    except TargetError as exc:  # met in a step: a custom class lacks what the release calls on it
        messages.put(("bad_input", index, str(exc)))
    except BaseException as exc:  # a harness bug: report it rather than vanish
        messages.put(("error", index, f"{type(exc).__name__}: {exc}"))
    try:
        messages.put(("stats", index, coverage.snapshot()))
        messages.put(("done", index))
    except OSError:  # the parent is gone
        pass


# -- the parent --


def _database_said(db_spec: str | None) -> str:
    """The header's word on the example database: a folder by its full path
    (``--db none`` is a folder named none, not no database)."""
    from state_machines.runs.trace import shown

    if not db_spec:
        return "no database"
    if db_spec.startswith(("redis://", "rediss://")):
        return f"database {shown(db_spec)}"
    return f"database folder {shown(os.path.abspath(db_spec))}"


def _progress_line(elapsed, duration, total, failures, workers_alive, disabled=()) -> str:
    if not total["steps"]:  # no worker's figures yet: it starts, or failed at once (a saved failure replayed)
        if failures or not workers_alive:
            return f"[{elapsed:5.0f}s/{duration:.0f}s] {failures} failure(s), {workers_alive} worker(s)"
        return f"[{elapsed:5.0f}s/{duration:.0f}s] starting {workers_alive} worker(s)"
    rules_seen, rules, inter_seen, inter = shares(total, disabled)
    rate = total["steps"] / elapsed if elapsed > 0 else 0.0
    return (
        f"[{elapsed:5.0f}s/{duration:.0f}s] {total['examples']:,} examples, {rate:,.0f} steps/s,"
        f" {failures} failure(s), rules {rules_seen}/{rules}, interleavings {inter_seen}/{inter},"
        f" {workers_alive} worker(s)"
    )


def run(
    config: Config,
    *,
    duration_s: float,
    jobs: int,
    db_spec: str | None,
    seed: int | None,
    trace_dir: str,
    stats_json: str | None,
    out=None,
    err=None,
    build_timeout_s: float | None = None,
) -> int:
    """Fuzz ``config`` with ``jobs`` workers for ``duration_s``; returns the exit code.

    Workers are watched (``watchdog``): one that hangs in an allocator call
    past the limit is killed, and one that dies without saying it is done
    fails the run too, each with an unshrunk trace of its last steps.  One
    that dies building its target, or is still building it after
    ``build_timeout_s`` (default ``watchdog.BUILD_TIMEOUT_S``), is killed
    and ends the run as bad input.
    """
    from state_machines.runs.trace import replay_command, shown, write_or_why, written
    from state_machines.runs.watchdog import (
        BUILD_TIMEOUT_S,
        POLL_S,
        Beacon,
        Channel,
        Signals,
        build_death,
        build_hang,
        died_verdict,
        hung_verdict,
        kill,
        receive,
        receive_all,
        start_blocked,
    )

    out, err = out or sys.stdout, err or sys.stderr
    build_timeout_s = BUILD_TIMEOUT_S if build_timeout_s is None else build_timeout_s
    open_database(db_spec)  # bad --db fails here, before workers start
    check_jobs(jobs, default_jobs())
    tty = out.isatty()
    ctx = worker_context()
    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    # Each worker its own pipe and shared memory: nothing a killed worker
    # could leave locked is shared (a queue's lock, an Event's).
    beacons = [Beacon(ctx) for _ in range(jobs)]
    channels = {i: Channel(ctx) for i in range(jobs)}
    workers = [
        ctx.Process(
            target=_worker,
            args=(i, config.to_dict(), db_spec, seed, trace_dir, channels[i], beacons[i]),
            name=f"kv-lockstep-worker-{i}",
            daemon=True,
        )
        for i in range(jobs)
    ]
    print(
        f"kv-lockstep fuzz: {config.label()}, {jobs} worker(s) for {duration_s:g} s"
        f", {_database_said(db_spec)}",
        file=out,
        flush=True,
    )
    started = time.monotonic()
    # The clock runs from the first worker's "ready": a worker's start-up
    # (the release's import, ~10 s for sglang on 2 cores) is not fuzzing,
    # and a `--duration 5` that ended before any worker was ready ran 0
    # examples and passed.  Until then, the build limit bounds the wait.
    deadline, fuzzing_since = started + build_timeout_s + duration_s, None
    snaps: dict[int, dict] = {}
    found: list[tuple[int, str, str]] = []
    # Examples the finding worker had run when it first failed (1: replayed from the database).
    first_examples: list[int] = []
    failures: list[tuple[str, str]] = []  # (trace json, path), shrunk
    errors: list[str] = []
    # Hangs and deaths the parent saw itself: (trace, path), unshrunk.
    verdicts: list = []
    setup: dict = {}  # "ready" (disabled rules printed), "bad_input", "before"
    done: set[int] = set()
    ended: set[int] = set()  # done, dead, or killed by the watchdog
    interrupted = False
    last_print = 0.0
    last_watch = 0.0

    flags = {"stop": False}

    def stop():
        if not flags["stop"]:
            flags["stopped_at"] = time.monotonic()
        flags["stop"] = True
        for beacon in beacons:
            beacon.request_stop()

    def abort():
        for beacon in beacons:
            beacon.request_abort()

    def handle(message):
        nonlocal deadline, fuzzing_since
        kind, index = message[0], message[1]
        if kind == "stats":
            snaps[index] = message[2]
        elif kind == "ready":
            if "ready" not in setup:
                setup["ready"] = True
                setup["disabled"] = dict(message[2])
                fuzzing_since = time.monotonic()
                deadline = fuzzing_since + duration_s
                for rule, reason in sorted(message[2].items()):
                    print(("\n" if tty else "") + f"rule {rule} disabled for {config.target}: {reason}", file=out)
                for what in message[3]:
                    print(("\n" if tty else "") + f"stand-in: {what}", file=out)
        elif kind in ("bad_input", "before_any_step"):
            setup.setdefault(kind, message[2])
            stop()
            abort()
        elif kind == "found":
            found.append((index, message[2], message[3]))
            first_examples.append(message[4])
            stop()  # the others stop; the finder shrinks
            print(("\n" if tty else "") + f"found {message[2]} (worker {index}, its example {message[4]}); shrinking it;"
                  f" unshrunk trace: {message[3]}", file=out, flush=True)
        elif kind == "failures":
            # Workers sharing a database may shrink the same bug to the same trace file.
            # (A trace not written names no file: each such failure is kept.)
            known = {path for _, path in failures if written(path)}
            failures.extend((t, p) for t, p in zip(message[2], message[3]) if p not in known)
            # One shrunk failure is the answer; others still shrinking keep their unshrunk traces.
            stop()
            abort()
        elif kind == "error":
            errors.append(f"worker {index}: {message[2]}")
            stop()
        elif kind == "done":
            done.add(index)
            ended.add(index)

    def drain_now():
        receive_all(channels, handle)

    def verdict(trace, line):
        path = write_or_why(trace, Path(trace_dir) / "unshrunk")
        verdicts.append((trace, path))
        print(("\n" if tty else "") + f"{line}; unshrunk trace: {path}", file=out, flush=True)
        stop()

    def watch():
        """Hung and dead workers: what no message can say."""
        now = time.monotonic()
        for i in range(len(started_workers)):
            if i in ended:
                continue
            w, beacon = started_workers[i], beacons[i]
            seconds = beacon.overdue(now)
            if seconds is not None:
                kill(w)
                ended.add(i)
                trace = hung_verdict(config, beacon, i, seconds)
                verdict(trace, f"worker {i} hung in {beacon.what()}; killed after {seconds:.1f} s")
            elif (line := build_hang(config, beacon, now, build_timeout_s)) is not None:
                kill(w)
                ended.add(i)
                handle(("bad_input", i, line))
            elif not w.is_alive():
                w.join(timeout=1)
                drain_now()  # what it put just before it ended
                if i not in done:
                    ended.add(i)
                    if signals.got is not None and w.exitcode in (-signals.got, 255):
                        # The command was stopped by a signal, which went to
                        # the whole process group (``timeout``, a CI job's
                        # cancel, ``docker stop``): the worker ended of it,
                        # or the forkserver that reports its end did (code
                        # 255: the server gone).  Any other end, a crash
                        # met before or after the signal, is judged.
                        continue
                    if (line := build_death(config, beacon, w.exitcode)) is not None:
                        handle(("bad_input", i, line))
                        continue
                    trace = died_verdict(config, beacon, i, w.exitcode)
                    verdict(trace, f"worker_died: {trace.detail}")

    def pump(until: float):
        nonlocal last_watch
        while any(i not in ended for i in range(len(started_workers))) and time.monotonic() < until:
            receive(channels, POLL_S, handle)
            if time.monotonic() - last_watch >= POLL_S:
                last_watch = time.monotonic()
                watch()

    signals = Signals()
    signals.install()
    started_workers = []
    try:
        for i, w in enumerate(workers):
            try:
                start_blocked(w)
            except (OSError, EOFError) as exc:  # a fork refused (EAGAIN, ENOMEM), the server gone
                why = getattr(exc, "strerror", None) or type(exc).__name__
                handle(("bad_input", i, f"-j {jobs}: worker {i} could not start ({why}): give fewer workers"))
                ended.update(range(i, jobs))
                break
            channels[i].started()
            started_workers.append(w)
        while len(ended) < jobs:
            pump(time.monotonic() + POLL_S)
            now = time.monotonic()
            if now >= deadline and not flags["stop"]:
                stop()
            if now >= deadline + SHRINK_GRACE_S:
                abort()
                break
            if now - last_print >= (1.0 if tty else PLAIN_PROGRESS_EVERY_S):
                last_print = now
                line = _progress_line(now - (fuzzing_since or now), duration_s, merge(snaps.values()),
                                      len(found) + len(verdicts), jobs - len(ended), setup.get("disabled", ()))
                print(("\r" + line) if tty else line, end="" if tty else "\n", file=out, flush=True)
    except KeyboardInterrupt:
        interrupted = True
        abort()
        stop()
    # A second Ctrl-C must not cut the summary short.
    signals.ignore()
    try:
        pump(time.monotonic() + (INTERRUPT_GRACE_S if interrupted else 10.0))
    except KeyboardInterrupt:
        pass
    for i, w in enumerate(started_workers):
        w.join(timeout=0.5)
        if w.is_alive():  # stopped by us, not a death
            ended.add(i)
            w.terminate()
            w.join(timeout=2)
            kill(w)
    # Last messages a worker put before exiting.
    drain_now()
    if tty:
        print(file=out)
    try:
        if "bad_input" in setup:
            print(f"kv-lockstep: error: {setup['bad_input']}", file=err)
            return 2
        if "before_any_step" in setup:
            trace = setup["before_any_step"]
            path = write_or_why(trace, trace_dir)
            print(f"FAILED before any step: {trace.invariant}", file=out)
            print(f"    {trace.detail}", file=out)
            print(f"  trace: {path}", file=out)
            print(f"  replay: {replay_command(path, trace.config)}", file=out)
            return 1
        elapsed = time.monotonic() - started
        total = merge(snaps.values())
        disabled = setup.get("disabled", {})
        # The rate is of the fuzzing: not the workers' start, nor the shrinking after a stop.
        fuzzing_s = flags.get("stopped_at", time.monotonic()) - fuzzing_since if fuzzing_since else 0.0
        _summary(out, config, jobs, elapsed, total, found, failures, errors, interrupted, verdicts, signals.got,
                 disabled, fuzzing_s)
        code = signals.exit_code() if interrupted else 1 if (found or failures or errors or verdicts) else 0
        if stats_json:
            try:
                _write_stats(stats_json, config, jobs, duration_s, elapsed, total, found, failures, interrupted,
                             min(first_examples, default=None), verdicts, disabled)
            except OSError as exc:  # a disk that filled during the run: the verdict above stands
                print(f"kv-lockstep: --stats-json {shown(stats_json)} not written: {exc.strerror or type(exc).__name__}",
                      file=err)
                return code or 2
        return code
    finally:
        signals.restore()


def _summary(out, config, jobs, elapsed, total, found, failures, errors, interrupted, verdicts=(),
             signum=None, disabled=None, fuzzing_s=None) -> None:
    from state_machines.runs.trace import Trace, counted, replay_command
    from state_machines.runs.watchdog import signal_name

    if interrupted:
        why = f"interrupted ({signal_name(signum or signal.SIGINT)})"
    else:
        why = "stopped at a failure" if (found or failures or verdicts) else "time is up"
    fuzzing_s = elapsed if fuzzing_s is None else fuzzing_s
    # Under a second, the parent's polling (a worker's ready and its first
    # failure read together) is most of what it measures: no rate.
    rate = f" in {fuzzing_s:.1f} s of fuzzing ({total['steps'] / fuzzing_s:,.0f}/s)" if fuzzing_s >= 1 else ""
    print(f"\nsummary: {config.label()}, {jobs} worker(s), {elapsed:.1f} s, {why}", file=out)
    print(
        f"  {total['examples']:,} examples, {total['steps']:,} steps{rate},"
        f" {(len(failures) or len({f[1] for f in found})) + len(verdicts)} failure(s)",
        file=out,
    )
    if total["rules"] or disabled:
        print(summary_table(total, config, disabled), file=out)
    else:  # no worker said what it runs: a table would call every order n/a, "needs ?"
        print("  nothing counted: no worker reported what it ran before the stop", file=out)
    for text in errors:
        print(f"harness error in {text}", file=out)
    for trace_json, path in failures:
        trace = Trace.from_dict(json.loads(trace_json))  # what the worker sent: the file may not be written
        print(f"\nFAILED: {trace.invariant}", file=out)
        print(f"    {trace.detail}", file=out)
        print("\n".join("    " + line for line in trace.program().splitlines()), file=out)
        print(f"  shrunk to {counted(len(trace.steps), 'step')}; trace: {path}", file=out)
        print(f"  replay: {replay_command(path, trace.config)}", file=out)
    if found and not failures:
        for _, invariant, path in found:
            print(f"\nFAILED (not shrunk, stopped first): {invariant}; trace: {path}", file=out)
            print(f"  replay: {replay_command(path, config)}", file=out)
    for trace, path in verdicts:
        print(f"\nFAILED (seen by the watchdog, not shrunk): {trace.invariant}", file=out)
        print(f"    {trace.detail}", file=out)
        print("\n".join("    " + line for line in trace.program().splitlines()), file=out)
        print(f"  {counted(len(trace.steps), 'step')}; trace: {path}", file=out)
        print(f"  replay: {replay_command(path, trace.config)}", file=out)
    out.flush()


def _write_stats(path, config, jobs, duration_s, elapsed, total, found, failures, interrupted, first,
                 verdicts=(), disabled=None) -> None:
    from state_machines.runs.trace import trace_fields, write_atomic

    disabled = disabled or {}
    data = {
        "config": config.to_dict(),
        "jobs": jobs,
        "duration_s": duration_s,
        "elapsed_s": round(elapsed, 3),
        "interrupted": interrupted,
        "examples": total["examples"],
        "steps": total["steps"],
        "precondition_checks": total["checks"],
        # A rule the probe disabled never ran: its failed preconditions are not a blockage.
        "rules": {rule: {"ran": 0, "blocked": 0, "disabled": disabled[rule]} if rule in disabled
                  else {**total["rules"][rule], "disabled": None} for rule in sorted(set(total["rules"]) | set(disabled))},
        "interleavings": {
            i.name: {"count": total["interleavings"].get(i.name), "summary": i.summary,
                     "applicable": i.name in total["interleavings"]}
            for i in INTERLEAVINGS
        },
        "never_reached": never_reached(total),
        "first_failure_after_examples": first,
        "failures": [
            {"invariant": json.loads(t)["failure"]["invariant"], **trace_fields(p), "shrunk": True} for t, p in failures
        ]
        or [{"invariant": inv, **trace_fields(p), "shrunk": False} for _, inv, p in found],
    }
    data["failures"] += [{"invariant": t.invariant, **trace_fields(p), "shrunk": False} for t, p in verdicts]
    # Atomic, through a link to where it leads: a reader never sees half a file.
    write_atomic(os.path.realpath(path), json.dumps(data, indent=1) + "\n")


def default_jobs() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
