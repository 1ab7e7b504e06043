"""Runs that end right, whatever the allocator does.

``kv-lockstep fuzz`` calls the allocator only in worker processes (one for
a plain run, N for a long run); the process the user started watches them.
Each worker publishes into shared memory, at every allocator call
(``Lockstep._call``): when the call began, the per-call limit it runs
under, what it calls, and the steps of its current example so far with
the configuration they run on (the example's pool shape).  From
that the parent knows, without asking the worker:

- a call running past its limit plus a margin hangs where SIGALRM cannot
  reach it (a blocked signal, a C call that never returns): the parent
  kills the worker and reports ``allocator_hung``;
- a worker that exits or is killed without saying it is done failed the
  run (``worker_died``): ``os._exit`` in the allocator, a crash, kill -9;
- a worker whose target's own code (its factory, a probe) runs past the
  build limit outside any allocator call is killed, and the command ends as
  bad input (``build_hang``), as where that code exits (``build_death``);

each with the steps recorded so far, written at once as an unshrunk trace
(``TRACE_DIR/unshrunk/``).  Publishing costs a shared-memory write per call
and a short JSON line per step.

``fuzz_watched`` is the plain run (``--max-examples``) done this way;
``longrun`` watches its workers with the same ``Beacon``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import attrs

from state_machines.config import BUILD_TIMEOUT_S, Config
from state_machines.orphans import die_with_parent, let_the_forkserver_go, parent_died_first

STEPS_BYTES = 1 << 18
WHAT_BYTES = 1 << 10
CONFIG_BYTES = 1 << 12
# How often the parent looks at its workers.
POLL_S = 0.2
# After Ctrl-C or SIGTERM, a worker gets this long to stop before it is killed.
INTERRUPT_GRACE_S = 3.0

_STARTED, _LIMIT, _STEPS_LEN, _WHAT_LEN, _STOP, _ABORT, _CONFIG_LEN, _BUILDING = range(8)


def margin_s(limit: float) -> float:
    """How far past its limit a call may run before the watchdog acts:
    SIGALRM inside the worker gets the first chance."""
    return max(1.0, 0.2 * limit)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class Beacon:
    """Shared memory one worker writes (``install``) and its parent reads;
    also the parent's stop and abort flags for it.  No lock: a worker killed
    at any moment can leave none held."""

    def __init__(self, ctx) -> None:
        self.nums = ctx.RawArray(ctypes.c_double, 8)
        self.text = ctx.RawArray(ctypes.c_char, STEPS_BYTES + WHAT_BYTES + CONFIG_BYTES)

    # -- the worker --

    def install(self) -> None:
        """In this process, every allocator call the harness makes publishes
        itself (``harness.lockstep.watch_calls``)."""
        from state_machines.harness import lockstep

        lockstep.watch_calls(_Publisher(self))

    def stop_requested(self) -> bool:
        return bool(self.nums[_STOP])

    def abort_requested(self) -> bool:
        return bool(self.nums[_ABORT])

    # -- the parent --

    def request_stop(self) -> None:
        self.nums[_STOP] = 1.0

    def request_abort(self) -> None:
        self.nums[_ABORT] = 1.0

    def in_call(self) -> bool:
        return bool(self.nums[_STARTED])

    def building(self) -> str | None:
        """What of the target's own code the worker was running outside any
        allocator call (``harness.lockstep.building``: its factory, the
        probes of its optional methods and scheduler hooks), or None."""
        if not self.nums[_BUILDING] or self.in_call():
            return None
        return self.what()

    def build_overdue(self, now: float, limit: float) -> float | None:
        """Seconds the target's own code has run outside any allocator call
        (``building``), when that is past ``limit``; else None."""
        started = self.nums[_BUILDING]
        if started and not self.in_call() and now - started > limit:
            return now - started
        return None

    def overdue(self, now: float) -> float | None:
        """Seconds the current allocator call has run, when that is past
        its limit plus the margin; else None."""
        started, limit = self.nums[_STARTED], self.nums[_LIMIT]
        if started and now - started > limit + margin_s(limit):
            return now - started
        return None

    def limit(self) -> float:
        return self.nums[_LIMIT]

    def what(self) -> str:
        n = int(self.nums[_WHAT_LEN])
        return ctypes.string_at(ctypes.addressof(self.text) + STEPS_BYTES, n).decode("utf-8", "replace")

    def config(self, run: Config) -> Config:
        """The configuration the worker's current example runs on, with the
        run's ``run`` call limit: its own pool shape, drawn per example (or
        a shrink replay's), which its steps are bounded by (a trace of them
        on ``run``'s shape may not load); a shrink's shorter call limit is
        not the trace's.  ``run`` until the worker has published one (or
        where one passed ``CONFIG_BYTES``, which no shape comes near)."""
        n = int(self.nums[_CONFIG_LEN])
        if not n:
            return run
        try:
            own = Config.from_dict(json.loads(ctypes.string_at(ctypes.addressof(self.text) + STEPS_BYTES + WHAT_BYTES, n)))
        except Exception:  # noqa: BLE001 - the worker wrote it from a Config; anything else is the run's
            return run
        return attrs.evolve(own, call_timeout_s=run.call_timeout_s)

    def steps(self) -> list:
        """The steps of the worker's current example (or replay), as of its
        last allocator call; a line torn by a kill mid-write is dropped."""
        from state_machines.harness import Step

        n = int(self.nums[_STEPS_LEN])
        out = []
        for line in ctypes.string_at(ctypes.addressof(self.text), n).splitlines():
            try:
                data = json.loads(line)
                out.append(Step(data["rule"], dict(data["args"]), data.get("returns")))
            except (ValueError, KeyError, TypeError):
                break
        return out


class Channel:
    """One worker's messages to its parent: a pipe of its own.  A queue
    shared by workers has a lock that a worker killed while writing keeps
    forever, and a message cut short there would block its reader; here the
    parent holds no write end, so a dead worker's pipe ends (EOF)."""

    def __init__(self, ctx) -> None:
        self.reader, self.writer = ctx.Pipe(duplex=False)

    def put(self, message) -> None:
        """In the worker."""
        self.writer.send(message)

    def started(self) -> None:
        """In the parent, once the worker has started."""
        self.writer.close()


def receive(channels: dict, timeout: float, handle) -> int:
    """Pass the messages ready within ``timeout`` on the open ``channels``
    (index: Channel), at most one each, to ``handle``; returns how many.  A
    channel that has ended is dropped from ``channels``.

    A stop signal that comes while a message is read or handled raises its
    ``KeyboardInterrupt`` once all are handled (``whole_messages``): raised
    in the middle of a read, it cut the message's framing, the channel's
    next read failed and dropped it, and a worker that then ended as told
    (its ``done`` unread) was judged dead, exit 0."""
    from multiprocessing.connection import wait

    if not channels:
        time.sleep(timeout)
        return 0
    ready = wait([c.reader for c in channels.values()], timeout)
    count = 0
    with whole_messages():
        for index, channel in list(channels.items()):
            if channel.reader in ready:
                try:
                    message = channel.reader.recv()
                except (EOFError, OSError):
                    channel.reader.close()
                    del channels[index]
                    continue
                handle(message)
                count += 1
    return count


def receive_all(channels: dict, handle) -> None:
    """Pass everything already sent on ``channels`` to ``handle``, without waiting."""
    while channels and receive(channels, 0, handle):
        pass


class _Publisher:
    """The worker's side: one JSON line per step, written as the step list
    grows; only the last step is ever rewritten (the step seam names what
    an alloc made after its call)."""

    def __init__(self, beacon: Beacon) -> None:
        self.nums = beacon.nums
        self.base = ctypes.addressof(beacon.text)
        self.state = None
        self.written: list = []  # the Step objects published, in order
        self.ends = [0]  # byte offset after each

    def call_ended(self, category: str, seconds: float) -> None:
        self.nums[_STARTED] = 0.0

    def building(self, what: str | None, since: float | None) -> None:
        """``what`` runs since ``since`` (``time.monotonic``), the flag set
        last: 0 while its name is written, so a reader never pairs a start
        with the name before it."""
        self.nums[_BUILDING] = 0.0
        if what is not None:
            self._write_what(what)
            self.nums[_BUILDING] = since

    def _write_what(self, what: str) -> None:
        """``what`` where ``Beacon.what`` reads it."""
        text = what.encode("utf-8", "replace")[:WHAT_BYTES]
        ctypes.memmove(self.base + STEPS_BYTES, text, len(text))
        self.nums[_WHAT_LEN] = len(text)

    def call_started(self, state, what: str) -> None:
        nums = self.nums
        steps = state.steps
        if state is not self.state:
            self.state, self.written, self.ends = state, [], [0]
            nums[_STEPS_LEN] = 0
            # The example's configuration, its length set last: one torn
            # by a kill mid-write reads as none (``Beacon.config``).
            nums[_CONFIG_LEN] = 0
            shape = json.dumps(state.config.to_dict(), separators=(",", ":")).encode()
            if len(shape) <= CONFIG_BYTES:
                ctypes.memmove(self.base + STEPS_BYTES + WHAT_BYTES, shape, len(shape))
                nums[_CONFIG_LEN] = len(shape)
        written = self.written
        if len(steps) != len(written) or (written and steps[-1] is not written[-1]):
            keep = min(len(written), len(steps))
            if keep and steps[keep - 1] is not written[keep - 1]:
                keep -= 1
            del written[keep:], self.ends[keep + 1 :]
            offset = self.ends[-1]
            for step in steps[keep:]:
                line = (json.dumps(step.to_dict(), separators=(",", ":"), default=repr) + "\n").encode()
                if offset + len(line) > STEPS_BYTES:
                    break
                ctypes.memmove(self.base + offset, line, len(line))
                offset += len(line)
                written.append(step)
                self.ends.append(offset)
            nums[_STEPS_LEN] = offset
        self._write_what(what)
        nums[_LIMIT] = state.config.call_timeout_s
        nums[_STARTED] = time.monotonic()


# -- verdicts the parent reaches on its own --


def hung_verdict(config: Config, beacon: Beacon, index: int, seconds: float):
    """The trace of a hang the worker could not report: its steps so far."""
    from state_machines.runs.trace import Trace

    limit = beacon.limit()
    detail = (
        f"{beacon.what()} hung: no return within {limit:g} s, and SIGALRM could not interrupt it;"
        f" the watchdog killed worker {index} after {seconds:.1f} s"
    )
    return Trace(beacon.config(config), tuple(beacon.steps()), "allocator_hung", detail)


def died_verdict(config: Config, beacon: Beacon, index: int, exitcode: int | None):
    """The trace of a worker that ended without saying it was done."""
    from state_machines.runs.trace import Trace

    how = _how(exitcode)
    where = f"during {beacon.what()}" if beacon.in_call() else "between allocator calls"
    return Trace(beacon.config(config), tuple(beacon.steps()), "worker_died", f"worker {index} {how} {where}")


# Signals that come from outside (a user's kill, the OOM killer), not
# from the code the worker runs.
_SENT = (signal.SIGKILL, signal.SIGTERM)


def build_death(config: Config, beacon: Beacon, exitcode: int | None) -> str | None:
    """The bad-input line for a worker that exited or crashed while its
    target's own code ran outside any allocator call (a factory that calls
    ``os._exit`` or segfaults while it builds): that is the target's
    configuration failing, as a factory that raises is (exit 2), not a
    failure the run found.  None where it died anywhere else, or was
    killed by SIGKILL or SIGTERM: the factory runs at every example, and a
    kill -9 landing there (as tests/test_run_ends.py's long-j2 kill once
    did) is the run's death, ``worker_died``, not bad input."""
    what = beacon.building()
    if what is None or (exitcode is not None and -exitcode in _SENT):
        return None
    return f"cannot build {config.target}: {what} {_how(exitcode)}"


def build_hang(config: Config, beacon: Beacon, now: float, limit: float) -> str | None:
    """The bad-input line for a worker whose target's own code has run past
    ``limit`` outside any allocator call (a factory that never returns: a
    device runtime that does not come up, a lock it waits on for ever); the
    caller kills the worker.  Bad input, as a factory that raises or exits
    (``build_death``): it is the target's configuration failing, and its
    code there is no call of the run's (a call the allocator never returns
    from is ``allocator_hung``, under the call limit).  None where it is not
    building or not yet past the limit."""
    what = beacon.building()
    if what is None or beacon.build_overdue(now, limit) is None:
        return None
    return f"cannot build {config.target}: {what} did not return within {limit:g} s"


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"was killed by {signal_name(-exitcode)}"
    return f"exited with code {exitcode}"


def kill(process) -> None:
    """SIGKILL: a worker stuck in a call cannot be asked."""
    if process.is_alive():
        process.kill()
    process.join(timeout=5)


# What stops a run: Ctrl-C, a kill or a CI cancel, and a terminal that
# hangs up (a closed ssh session: it ended the command with 129 and no
# summary, helper-88).
STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# Each stop signal the command took (``Signals``): an output it can no
# longer write (a terminal that hung up: EIO) still ends it with 128 + the
# signal, not as bad input (exit 2), helper-91.
RECEIVED: list[int] = []


# Set by ``whole_messages``: a stop signal's ``KeyboardInterrupt`` waits.
_held = 0
_deferred = False


@contextlib.contextmanager
def whole_messages():
    """A stop signal (``Signals``) that comes inside raises its
    ``KeyboardInterrupt`` on the way out, not where it came: a message is
    never read in part nor read and dropped.  Leaving by an exception (a
    print to a terminal that hung up: EIO) raises it all the same, chained
    to that exception: the stop came first.  A second signal inside raises
    at once: a worker stalled in the middle of a message (stopped, under a
    debugger) would hold the first until it went on.  (Blocking the signals
    would not do: the kernel gives a signal the main thread blocks to
    another thread, and Python runs its handler in the main thread all the
    same.)"""
    global _held, _deferred
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        if _deferred and not _held:
            _deferred = False
            raise KeyboardInterrupt


class Signals:
    """SIGINT, SIGTERM and SIGHUP (``STOPS``) raise ``KeyboardInterrupt`` in
    the parent, which remembers which came (the exit code is 128 + its
    number)."""

    def __init__(self) -> None:
        self.got: int | None = None
        self.previous: dict = {}

    def install(self) -> None:
        # Installed explicitly: a shell starts background jobs with SIGINT
        # ignored.  SIGHUP ignored is nohup's ask: the run outlives its terminal.
        self.previous = {sig: signal.signal(sig, self._handle) for sig in STOPS
                         if sig != signal.SIGHUP or signal.getsignal(sig) != signal.SIG_IGN}

    def _handle(self, signum, frame):
        global _deferred
        self.got = signum
        RECEIVED.append(signum)
        if _held and not _deferred:
            _deferred = True
            return
        _deferred = False
        raise KeyboardInterrupt

    def ignore(self) -> None:
        """A second Ctrl-C must not cut the summary short."""
        for sig in self.previous:
            signal.signal(sig, signal.SIG_IGN)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def exit_code(self) -> int:
        return 128 + (self.got or signal.SIGINT)


def start_blocked(process) -> None:
    """Start a worker with ``STOPS`` blocked, so that none reaches it before
    it sets its own handlers (``worker_signals``)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOPS))
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def worker_signals() -> None:
    """In a worker: Ctrl-C and a hangup reach the whole process group, and
    the parent alone decides what they mean; SIGTERM ends the worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # When its parent dies, however (kill -9 too), the kernel SIGKILLs it:
    # no one is left to report to, and a target's code may ignore SIGTERM.
    # Under forkserver the parent is the server, which exits with the
    # command once no worker holds its liveness pipe.
    die_with_parent(signal.SIGKILL)
    let_the_forkserver_go()
    if parent_died_first():
        # The command died before the kernel was asked: it will send nothing.
        os.kill(os.getpid(), signal.SIGKILL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(STOPS))


def start_worker(config: Config, beacon: Beacon, messages, index: int):
    """In a worker: publish calls, build the target once, and say so.

    Returns the built state, or None after reporting ``bad_input`` (a
    ``TargetError``) or ``before_any_step`` (the fresh allocator already
    disagrees with the model).
    """
    from state_machines.harness import InvariantViolation, build
    from state_machines.harness.steps import disabled_steps
    from state_machines.runs.trace import Trace
    from state_machines.targets import TargetError

    beacon.install()
    try:
        state = build(config)
    except TargetError as exc:
        messages.put(("bad_input", index, str(exc)))
        return None
    except InvariantViolation as exc:
        messages.put(("before_any_step", index, Trace.from_violation(exc)))
        return None
    # The caller's header names its own stand-ins (``_print_caller_header``).
    stand_ins = [str(what) for what in getattr(state, "stand_ins", ())] if config.caller == "harness" else []
    messages.put(("ready", index, disabled_steps(state), stand_ins))
    return state


class FirstSight:
    """A run's probe: writes each invariant's first failing example at once,
    unshrunk, so an interrupt during shrinking loses nothing; stops the run
    (``KeyboardInterrupt``, which Hypothesis neither shrinks nor saves) when
    ``should_stop()`` says so."""

    def __init__(self, trace_dir, on_found, should_stop) -> None:
        self.trace_dir = Path(trace_dir) / "unshrunk"
        self.on_found = on_found
        self.should_stop = should_stop
        self.seen: set[str] = set()

    # It never reads a step's arguments (``RunRecord.probe``).
    reads_call = False

    def before(self, machine, name, call) -> None:
        pass

    def after(self, machine, name) -> None:
        if self.should_stop():
            raise KeyboardInterrupt("stop requested")

    def failed(self, machine, exc) -> None:
        if exc.invariant in self.seen:
            return
        self.seen.add(exc.invariant)
        from state_machines.runs.trace import Trace, write_or_why

        path = write_or_why(Trace.from_violation(exc), self.trace_dir)
        self.on_found(exc.invariant, str(path), machine.record.examples)


# -- the plain run --


def _plain_child(config_dict, max_examples, seed, db_spec, trace_dir, messages, beacon, cover=None) -> None:
    worker_signals()
    if cover is not None:  # first: the target's import-time lines count too
        cover.start()
    try:
        from state_machines.harness import RunRecord
        from state_machines.runs.options import open_database
        from state_machines.runs.runner import fuzz
        from state_machines.runs.trace import write_or_why

        config = Config.from_dict(config_dict)
        if config.caller != "harness":  # a fresh worker (--cover's) registers the caller family itself
            import state_machines.callers  # noqa: F401
        if start_worker(config, beacon, messages, 0) is None:
            return
        probe = FirstSight(
            trace_dir, lambda inv, path, examples: messages.put(("found", 0, inv, path, examples)), beacon.stop_requested
        )
        outcome = fuzz(
            config, max_examples=max_examples, seed=seed, database=open_database(db_spec), derandomize=False,
            record=RunRecord(probe=probe), stop=beacon.stop_requested,
        )
        rec = outcome.record
        messages.put((
            "outcome", 0,
            [(t, write_or_why(t, trace_dir)) for t in outcome.failures],
            {"examples": rec.examples, "steps": rec.steps, "first_failure_s": rec.first_failure_s,
             "examples_to_failure": rec.examples_to_failure, "elapsed_s": outcome.elapsed_s},
        ))
    except KeyboardInterrupt:
        messages.put(("interrupted", 0))
    except BaseException as exc:
        from state_machines.targets import TargetError

        if isinstance(exc, TargetError):  # met in a step: a custom class lacks what the release calls on it
            messages.put(("bad_input", 0, str(exc)))
        else:  # a harness bug: report it rather than vanish
            messages.put(("error", 0, traceback.format_exc()))
    finally:
        if cover is not None:
            messages.put(("cover", 0, cover.stop()))
        messages.put(("done", 0))


def _plain_context(config: Config, fresh: bool = False):
    """Fork where it is safe (CPU: the child shares the imports already
    made, torch included); elsewhere, or when ``fresh`` asks for a worker
    that imports everything itself, a fresh interpreter."""
    if fresh:
        return multiprocessing.get_context("spawn")
    if _forks(config):
        import state_machines.runs.runner  # noqa: F401 - imported once, shared by the fork
    return _context(config)


def _forks(config: Config) -> bool:
    return config.device == "cpu" and "fork" in multiprocessing.get_all_start_methods()


def _context(config: Config):
    """Fork on CPU; elsewhere the long run's start method (forkserver or
    spawn: a device runtime does not survive a fork)."""
    if _forks(config):
        return multiprocessing.get_context("fork")
    from state_machines.runs.options import worker_context

    return worker_context()


def _indent(text: str, by: str = "    ") -> str:
    return "\n".join(by + line for line in text.splitlines())


def print_trace(out, trace, path, *, shrunk: bool) -> None:
    from state_machines.runs.trace import counted, replay_command

    print(_indent(trace.detail or ""), file=out)
    print(f"  {'shrunk to' if shrunk else 'not shrunk;'} {counted(len(trace.steps), 'step')}:", file=out)
    print(_indent(trace.program()), file=out)
    print(f"  trace: {path}", file=out)
    print(f"  replay: {replay_command(path, trace.config)}", file=out)


def fuzz_watched(config: Config, *, max_examples: int, seed: int | None, db_spec: str | None, trace_dir: str,
                 out=None, err=None, cover=None, on_cover=None, build_timeout_s: float = BUILD_TIMEOUT_S) -> int:
    """``kv-lockstep fuzz`` without ``--duration``: Hypothesis runs in one
    worker, watched from here.  Returns the exit code: 0 no failure, 1 a
    failure, 2 bad input, 128 + the signal on SIGINT / SIGTERM / SIGHUP.
    ``build_timeout_s``: the build limit (``build_hang``).

    ``cover`` (``runs.cover.Recorder``) records statement coverage in the
    worker, a fresh interpreter then; ``on_cover(lines)`` receives what it
    saw, unless the worker died first."""
    out, err = out or sys.stdout, err or sys.stderr
    ctx = _plain_context(config, fresh=cover is not None)
    channels = {0: Channel(ctx)}
    beacon = Beacon(ctx)
    child = ctx.Process(
        target=_plain_child,
        args=(config.to_dict(), max_examples, seed, db_spec, trace_dir, channels[0], beacon, cover),
        name="kv-lockstep-worker-0",
        daemon=True,
    )
    got: dict = {"found": [], "outcome": None, "verdict": None, "bad_input": None, "before": None, "error": None}
    done = False

    def handle(message) -> None:
        nonlocal done
        kind = message[0]
        if kind == "ready":
            print(f"kv-lockstep fuzz: {config.label()}, up to {max_examples} examples,"
                  f" seed {seed if seed is not None else 'random'}", file=out)
            for rule, reason in sorted(message[2].items()):
                print(f"rule {rule} disabled for {config.target}: {reason}", file=out)
            for what in message[3]:
                print(f"stand-in: {what}", file=out)
            out.flush()
        elif kind == "found":
            got["found"].append((message[2], message[3]))
            print(f"found {message[2]} (example {message[4]}); shrinking it; unshrunk trace: {message[3]}",
                  file=out, flush=True)
        elif kind in ("outcome", "bad_input", "error"):
            got[kind] = message[2:] if kind == "outcome" else message[2]
        elif kind == "before_any_step":
            got["before"] = message[2]
        elif kind == "cover" and on_cover is not None:
            on_cover(message[2])
        elif kind == "done":
            done = True

    def drain(timeout: float = 0.0) -> None:
        _drain(channels, handle, lambda: done, timeout)

    signals = Signals()
    signals.install()
    interrupted = False
    try:
        start_blocked(child)
        channels[0].started()
        if (ended := _watch(child, channels, beacon, config, handle, lambda: done, build_timeout_s)) is not None:
            got[ended[0]] = ended[1]
    except KeyboardInterrupt:
        interrupted = True
        signals.ignore()
        beacon.request_stop()
        drain(INTERRUPT_GRACE_S)
    finally:
        signals.ignore()
        child.join(timeout=2 if done else 0)
        if child.is_alive():
            kill(child)
    try:
        drain()
        return _plain_report(out, err, config, got, interrupted, signals, trace_dir)
    finally:
        signals.restore()


def _latent_tag(trace, needed: bool) -> str:
    """How a failure of a ``--latent`` run is labeled.  One that ``needed``
    it (``trace.needs_latent``) is outside the caller's contract, a latent
    finding rather than a gate failure.  One that did not (the aliasing
    bug: alloc, finish, overwrite, end) is a gate failure, and says so."""
    if needed:
        return " [latent: outside the caller's contract, not a gate failure]"
    return " [a gate failure: no step of it needs --latent]" if trace.config.latent else ""


def _plain_report(out, err, config, got, interrupted, signals, trace_dir) -> int:
    from state_machines.runs.trace import needs_latent, replay_command, write_or_why

    if got["bad_input"] is not None:
        print(f"kv-lockstep: error: {got['bad_input']}", file=err)
        return 2
    if got["before"] is not None:
        trace = got["before"]
        path = write_or_why(trace, trace_dir)
        print(f"FAILED before any step: {trace.invariant}", file=out)
        print(_indent(trace.detail or ""), file=out)
        print(f"  trace: {path}", file=out)
        print(f"  replay: {replay_command(path, trace.config)}", file=out)
        return 1
    verdict = got["verdict"]
    verdict_path = write_or_why(verdict, Path(trace_dir) / "unshrunk") if verdict is not None else None
    failures = []
    if got["outcome"] is not None:
        pairs, rec = got["outcome"]
        failures = list(pairs)
        if not failures and verdict is None and not interrupted and got["error"] is None:
            print(f"no failure: {rec['examples']} examples, {rec['steps']} steps in {rec['elapsed_s']:.1f} s", file=out)
            return 0
        if failures:
            # A failure no step counted (None: found outside the machine's steps) still reports.
            when = (f"first failure after {rec['first_failure_s']:.2f} s"
                    f" ({rec['examples_to_failure']} example{'' if rec['examples_to_failure'] == 1 else 's'}); "
                    if rec["first_failure_s"] is not None else "")
            needed = [needs_latent(trace.config, trace.steps) for trace, _ in failures]
            print(
                f"{'LATENT FINDING' if all(needed) else 'FAILED'}: {when}"
                f"{len(failures)} distinct failure(s), shrunk in {rec['elapsed_s']:.1f} s total",
                file=out,
            )
            for number, ((trace, path), latent) in enumerate(zip(failures, needed), 1):
                print(f"\nfailure {number}: {trace.invariant}{_latent_tag(trace, latent)}", file=out)
                print_trace(out, trace, path, shrunk=True)
    if verdict is not None:
        print(f"\nFAILED: {verdict.invariant} (seen by the watchdog, not shrunk)", file=out)
        print_trace(out, verdict, verdict_path, shrunk=False)
    shrunk = {t.invariant for t, _ in failures}
    kept = [(inv, path) for inv, path in got["found"] if inv not in shrunk]
    if got["error"] is not None:
        print(f"kv-lockstep: harness error in the worker:\n{got['error']}", file=err)
    if interrupted:
        print(f"\nkv-lockstep: interrupted ({signal_name(signals.got or signal.SIGINT)})", file=out)
    for invariant, path in kept:
        print(f"\nFAILED (not shrunk, {'interrupted' if interrupted else 'stopped'} first): {invariant}; trace: {path}",
              file=out)
        print(f"  replay: {replay_command(path, config)}", file=out)
    out.flush()
    if interrupted:
        return signals.exit_code()
    return 1


def _drain(channels: dict, handle, done, timeout: float = 0.0) -> None:
    """Pass what the workers put to ``handle`` until ``done()``, or until
    ``timeout`` seconds have brought nothing more."""
    end = time.monotonic() + timeout
    while not done() and channels:
        if not receive(channels, max(0.0, end - time.monotonic()), handle) and time.monotonic() >= end:
            return


def _watch(child, channels: dict, beacon: Beacon, config: Config, handle, done,
           build_timeout_s: float) -> tuple[str, object] | None:
    """Pass one worker's messages to ``handle`` until ``done()``: None.  Or
    the verdict reached here on a worker that does not say it is done: one
    past its call's limit is killed, ``("verdict", allocator_hung trace)``;
    one building its target past ``build_timeout_s`` is killed,
    ``("bad_input", line)`` (``build_hang``); one that ended (after a second
    for what it put just before) is ``("bad_input", line)`` where it died
    building its target (``build_death``), else ``("verdict", worker_died
    trace)``."""
    while not done():
        receive(channels, POLL_S, handle)
        if done():
            return None
        now = time.monotonic()
        seconds = beacon.overdue(now)
        if seconds is not None:
            kill(child)
            return "verdict", hung_verdict(config, beacon, 0, seconds)
        if (line := build_hang(config, beacon, now, build_timeout_s)) is not None:
            kill(child)
            return "bad_input", line
        if not child.is_alive():
            _drain(channels, handle, done, 1.0)
            if done():
                return None
            line = build_death(config, beacon, child.exitcode)
            return ("bad_input", line) if line is not None else ("verdict", died_verdict(config, beacon, 0, child.exitcode))
    return None


# -- replay --


@attrs.frozen
class Replayed:
    """How a watched replay ended: ``failure`` (a trace: the violation the
    replay hit, or the watchdog's ``allocator_hung`` / ``worker_died``) or
    none; else ``bad_input`` (one line, exit 2), ``error`` (a harness bug,
    with its traceback) or ``signal`` (SIGINT or SIGTERM stopped it)."""

    failure: object = None
    bad_input: str | None = None
    error: str | None = None
    signal: int | None = None


def _replayed(config: Config, trace):
    """``replay_watched``'s job in its worker (``_build_child``): the
    violation ``trace``'s steps meet, as a trace, or None."""
    from state_machines.runs.trace import Trace, replay

    failure = replay(trace, config)
    return None if failure is None else Trace.from_violation(failure)


def replay_watched(trace, config: Config, build_timeout_s: float = BUILD_TIMEOUT_S) -> Replayed:
    """``kv-lockstep replay``: the trace's steps run in one worker, watched
    from here as a plain fuzz run's are (``fuzz_watched``), so an allocator
    that exits, crashes, is killed or hangs where SIGALRM cannot reach ends
    the replay with ``worker_died`` or ``allocator_hung`` naming the call,
    and one that raises ``KeyboardInterrupt`` is ``allocator_raised``, as in
    ``fuzz``; a target that dies while it is built, or is still building
    after ``build_timeout_s``, is bad input.  The
    worker is forked on CPU, so the replay's imports are made once, here."""
    try:
        got = _watched(_plain_context(config), config, _replayed, (trace,), "kv-lockstep-replay", build_timeout_s)
    except Interrupted as stopped:
        return Replayed(signal=stopped.signal)
    if "bad_input" in got:
        return Replayed(bad_input=got["bad_input"])
    if "error" in got:
        return Replayed(error=got["error"])
    for answer in ("before_any_step", "verdict", "built"):
        if answer in got:
            return Replayed(failure=got[answer])
    raise AssertionError(f"a watched replay ended without an answer: {sorted(got)}")


# -- a build the command itself needs --


class WorkerError(Exception):
    """A harness bug in a watched build's worker: its traceback, as text."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM (``signal``) came while a watched build or replay
    ran (``_watched``); its worker was killed.  The command ends with 128 +
    ``signal``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signal = signum


def _build_child(job, config_dict, args, messages, beacon) -> None:
    """A watched worker's body (``build_watched``, ``replay_watched``): puts
    ``("built", 0, job(config, *args))``, or how it failed: ``bad_input``,
    ``before_any_step`` (a violation's trace), ``error`` (a harness bug's
    traceback); then ``done``."""
    worker_signals()
    try:
        from state_machines.harness import InvariantViolation
        from state_machines.runs.trace import Trace, TraceError
        from state_machines.targets import TargetError

        config = Config.from_dict(config_dict)
        if config.caller != "harness":
            import state_machines.callers  # noqa: F401 - a fresh worker registers the caller family itself
        beacon.install()
        try:
            messages.put(("built", 0, job(config, *args)))
        except (TargetError, TraceError) as exc:
            messages.put(("bad_input", 0, str(exc)))
        except InvariantViolation as exc:
            messages.put(("before_any_step", 0, Trace.from_violation(exc)))
    except BaseException:  # a harness bug: report it rather than vanish
        messages.put(("error", 0, traceback.format_exc()))
    finally:
        messages.put(("done", 0))


def _watched(ctx, config: Config, job, args: tuple, name: str, build_timeout_s: float) -> dict:
    """Run ``job(config, *args)`` in a worker (``_build_child``) watched by
    ``_watch``: what it answered, by kind (``built``, ``bad_input``,
    ``before_any_step``, ``error``), or the watchdog's own verdict on it
    (``verdict``: an ``allocator_hung`` or ``worker_died`` trace;
    ``bad_input``: a death or hang while building).  SIGINT or SIGTERM
    here kills the worker and raises ``Interrupted``."""
    channel = Channel(ctx)
    beacon = Beacon(ctx)
    child = ctx.Process(target=_build_child, args=(job, config.to_dict(), args, channel, beacon),
                        name=name, daemon=True)
    got: dict = {}

    def take(message) -> None:
        got.setdefault(message[0], message[2] if len(message) > 2 else None)

    signals = Signals()
    signals.install()
    try:
        start_blocked(child)
        channel.started()
        if (ended := _watch(child, {0: channel}, beacon, config, take, lambda: "done" in got, build_timeout_s)) is not None:
            got[ended[0]] = ended[1]
    except KeyboardInterrupt:
        signals.ignore()
        kill(child)
        raise Interrupted(signals.got or signal.SIGINT) from None
    finally:
        signals.ignore()
        child.join(timeout=2 if "done" in got else 0)
        if child.is_alive():
            kill(child)
        signals.restore()
    return got


def build_watched(config: Config, job, *args, build_timeout_s: float = BUILD_TIMEOUT_S):
    """``job(config, *args)``, which builds ``config``'s target, in a worker
    watched from here as ``fuzz``'s is; returns what it returns (something
    that pickles).  For what the command itself builds before any run
    (``targets --target``, the ``--caller`` header): a custom factory that
    exits or crashes there ended the command silently with its code, and
    one that never returned hung it.  Now a death or a hang while the target
    is built is ``TargetError`` (``build_death``, ``build_hang``: bad input,
    one line, exit 2), as a raise there is; a fresh allocator that already
    disagrees, or dies or hangs in an allocator call, is the
    ``InvariantViolation`` of its trace (``worker_died``, ``allocator_hung``);
    a harness bug in the worker is ``WorkerError``; SIGINT or SIGTERM here
    kills the worker and raises ``Interrupted``.  Forked on CPU (a
    module-level ``job`` elsewhere: the worker is a fresh interpreter)."""
    from state_machines.harness.lockstep import violation_type
    from state_machines.targets import TargetError

    got = _watched(_context(config), config, job, args, "kv-lockstep-build", build_timeout_s)
    if "bad_input" in got:
        raise TargetError(got["bad_input"])
    if "error" in got:
        raise WorkerError(got["error"])
    trace = got.get("before_any_step") or got.get("verdict")
    if trace is not None:
        raise violation_type(trace.invariant)(trace.detail, list(trace.steps), trace.config)
    return got["built"]
