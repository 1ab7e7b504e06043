"""How a run ends when the allocator does not play along: it exits, raises
KeyboardInterrupt or SystemExit, hangs where SIGALRM cannot reach it, is
killed, or is wrong from its first census; and when the user presses Ctrl-C
or sends SIGTERM.  Each ends with the right exit code, no traceback, and the
failure kept as a trace."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from state_machines.config import Config
from state_machines.runs.trace import Trace

REPO = Path(__file__).resolve().parent.parent
# How long a test waits for a command it started.  A long run (--duration)
# starts its forkserver and imports torch before any example: 3-5 s on an
# idle 2-core machine, over 20 s under CI's load; a hang it must cut is 3600 s.
WAIT_S = 300

# Allocators that misbehave in free_group_end() once a group queued a free;
# each is reached as --target bad_pools:NAME.
BAD_POOLS = textwrap.dedent(
    '''
    import ctypes, os, signal, time
    import torch

    class Pool:
        def __init__(self, size, page_size, device, need_sort):
            self.page_size = page_size
            self.free_set = set(range(1, size // page_size + 1))
            self.queue = None

        def alloc(self, n):
            k = n // self.page_size
            if k > len(self.free_set):
                return None
            pages = sorted(self.free_set)[:k]
            self.free_set -= set(pages)
            t = torch.tensor(pages, dtype=torch.int64)
            return (t[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

        def free(self, index):
            if self.queue is not None:
                self.queue.append(index.clone())
                return
            self.free_set |= set((index // self.page_size).tolist())

        def free_group_begin(self):
            self.queue = []

        def free_group_end(self):
            queue, self.queue = self.queue, None
            if queue:
                self.misbehave()
            for index in queue or ():
                self.free(index)

        def misbehave(self):
            pass

        def available_size(self):
            return len(self.free_set) * self.page_size

        def get_all_free_pages(self):
            return torch.tensor(sorted(self.free_set), dtype=torch.int64)

    class Exits(Pool):
        def misbehave(self):
            os._exit(3)

    class Interrupts(Pool):
        def misbehave(self):
            raise KeyboardInterrupt

    class SysExits(Pool):
        def misbehave(self):
            raise SystemExit(4)

    class Stuck(Pool):
        # A C call that holds the GIL and never returns, SIGALRM blocked in this
        # thread: no Python signal handler can run until it returns.
        def misbehave(self):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            while True:
                ctypes.PyDLL(None).sleep(3600)

    class Sleeps(Pool):
        # A hang SIGALRM does reach.
        def misbehave(self):
            # How long each hang lasted before the run's limit stopped it.
            started = time.monotonic()
            try:
                time.sleep(3600)
            finally:
                hangs.append(time.monotonic() - started)

    class EatsAlarm(Sleeps):
        # Takes the harness's SIGALRM for itself, once, then hangs: as when
        # CPython's sleep loses one (it landed after an earlier one's handler
        # had run, before the sleep went back to its system call).
        def misbehave(self):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            signal.sigtimedwait({signal.SIGALRM}, 30)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
            super().misbehave()

    class SlowToShrink(Pool):
        # A wrong answer found at once, but every example that reaches it costs
        # a second: shrinking takes long enough to be interrupted.
        def misbehave(self):
            time.sleep(1.0)
            raise ValueError("wrong")

    class BadCensus(Pool):
        def get_all_free_pages(self):
            return torch.tensor(sorted(self.free_set) + [1], dtype=torch.int64)

    class ExitsAtBuild(Pool):
        # A factory that ends the process while it builds: bad input, as a raise there is.
        def __init__(self, size, page_size, device, need_sort):
            os._exit(5)

    class RaisesAtBuild(Pool):
        def __init__(self, size, page_size, device, need_sort):
            raise SystemExit(4)

    class CensusExits(Pool):
        # Built, then exits in the first allocator call, its census: a failure.
        def get_all_free_pages(self):
            os._exit(6)

    class HangsAtBuild(Pool):
        # A factory that never returns (a device runtime that never comes
        # up), deaf to SIGTERM: only a SIGKILL ends it.  It leaves its pid
        # in hung.pid, where the test looks.
        def __init__(self, size, page_size, device, need_sort):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            with open("hung.pid", "w") as f:
                f.write(str(os.getpid()))
            time.sleep(3600)

    class ExitsInHookProbe(Pool):
        # Built, then exits when the one-off probe of its scheduler hooks
        # asks one, on a copy: bad input, as in the probe of its optional methods.
        def check_decode_capacity(self, num_tokens, tree_cache):
            os._exit(9)

    class Lost(Pool):
        # Slow allocs (0.3 s, well inside the run's limit), a leak outside
        # a group, a hang at a group's end: as MODE says.
        def alloc(self, n):
            if MODE["slow"]:
                time.sleep(0.3)
            return super().alloc(n)

        def free(self, index):
            if self.queue is None and MODE["wrong"]:
                return
            return super().free(index)

        def misbehave(self):
            if MODE["hang"]:
                time.sleep(3600)

    class CrashesAsCtrlCComes(Pool):
        # Ctrl-C to the command's group, then a crash of its own: the
        # command is interrupted, and the crash is still a death.
        def misbehave(self):
            import signal
            os.killpg(0, signal.SIGINT)
            time.sleep(0.5)  # the command's handler has run
            os.kill(os.getpid(), signal.SIGSEGV)

    MODE = {"slow": False, "hang": False, "wrong": False}
    hangs = []

    def _factory(cls):
        return lambda size, page_size, device, need_sort: cls(size, page_size, device, need_sort)

    exits, interrupts, sysexits, stuck, sleeps = map(_factory, (Exits, Interrupts, SysExits, Stuck, Sleeps))
    slow_to_shrink, bad_census = _factory(SlowToShrink), _factory(BadCensus)
    exits_at_build, raises_at_build, census_exits = map(_factory, (ExitsAtBuild, RaisesAtBuild, CensusExits))
    hangs_at_build, exits_in_hook_probe = _factory(HangsAtBuild), _factory(ExitsInHookProbe)
    lost, eats_alarm = _factory(Lost), _factory(EatsAlarm)
    crashes_as_ctrl_c_comes = _factory(CrashesAsCtrlCComes)
    '''
)


@pytest.fixture
def pools(tmp_path):
    (tmp_path / "bad_pools.py").write_text(BAD_POOLS)
    return tmp_path


def _env(tmp_path):
    return dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")


def cli(tmp_path, *args, timeout=WAIT_S):
    run = subprocess.run([sys.executable, "-m", "state_machines.cli", "fuzz", *args,
                          "--trace-dir", str(tmp_path / "traces")],
                         cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=timeout)
    return run


def popen(tmp_path, *args):
    return subprocess.Popen([sys.executable, "-m", "state_machines.cli", "fuzz", *args,
                             "--trace-dir", str(tmp_path / "traces")],
                            cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kept(tmp_path, invariant, where="unshrunk") -> Trace:
    """The one trace of ``invariant`` the run wrote, loaded."""
    paths = sorted((tmp_path / "traces" / where).glob(f"*{invariant}*.json"))
    assert paths, f"no {invariant} trace in {tmp_path / 'traces' / where}"
    return Trace.load(paths[0])


def ended(run, code):
    assert run.returncode == code, run.stdout + run.stderr
    assert "Traceback" not in run.stderr, run.stderr


LONG = ["--duration", "60s", "-j", "1"]


@pytest.mark.parametrize("mode", [[], LONG], ids=["plain", "long"])
def test_allocator_that_exits_fails_the_run(pools, mode):
    """os._exit inside the allocator: the worker dies, the run fails (not
    'time is up'), naming the worker, the call, and its last steps."""
    run = cli(pools, "--target", "bad_pools:exits", "--seed", "0", *mode)
    ended(run, 1)
    assert "worker_died" in run.stdout and "worker 0 exited with code 3 during free_group_end()" in run.stdout
    trace = kept(pools, "worker_died")
    assert trace.steps[-1].rule == "end" and any(s.rule == "begin" for s in trace.steps)


def test_allocator_raising_keyboard_interrupt_is_its_failure(pools):
    """KeyboardInterrupt raised by the allocator is allocator_raised, shrunk
    like any other failure, not an interrupt of the run."""
    run = cli(pools, "--target", "bad_pools:interrupts", "--seed", "0")
    ended(run, 1)
    assert "raised KeyboardInterrupt" in run.stdout
    assert kept(pools, "allocator_raised", where=".").steps[-1].rule == "end"
    kept(pools, "allocator_raised")  # and unshrunk, as soon as it was seen


def test_a_real_ctrl_c_inside_a_call_still_stops(pools, monkeypatch):
    """Lockstep._call: SystemExit from the allocator is its failure; so is
    KeyboardInterrupt, except where SIGINT has Python's default handler
    (in-process runs), where it may be a real Ctrl-C and stops the run."""
    from state_machines.config import Config
    from state_machines.harness.lockstep import InvariantViolation, Step
    from state_machines.runs.runner import replay

    monkeypatch.syspath_prepend(str(pools))
    steps = (Step("begin", {}), Step("alloc", {"n": 1}, "req_0"), Step("finish", {"req": "req_0"}), Step("end", {}))
    failure = replay(Trace(Config(target="bad_pools:sysexits"), steps))
    assert failure.invariant == "allocator_raised" and "raised SystemExit: 4" in failure.detail
    interrupts = Trace(Config(target="bad_pools:interrupts"), steps)
    monkeypatch.setattr(signal, "getsignal", lambda sig: signal.default_int_handler)  # as in-process
    with pytest.raises(KeyboardInterrupt):
        replay(interrupts)
    monkeypatch.setattr(signal, "getsignal", lambda sig: signal.SIG_IGN)  # as in a worker
    failure = replay(interrupts)
    assert isinstance(failure, InvariantViolation) and failure.invariant == "allocator_raised"


def test_long_run_allocator_raising_keyboard_interrupt_fails_the_run(pools):
    """In a long run too: exit 1 at the failure, never 'time is up'."""
    run = cli(pools, "--target", "bad_pools:interrupts", *LONG)
    ended(run, 1)
    assert "stopped at a failure" in run.stdout and "time is up" not in run.stdout
    assert kept(pools, "allocator_raised", where=".").invariant == "allocator_raised"


@pytest.mark.parametrize("mode", [[], LONG], ids=["plain", "long"])
def test_hang_sigalrm_cannot_reach_is_caught_by_the_watchdog(pools, mode):
    """A call stuck in C with SIGALRM blocked: the parent kills the worker
    after --call-timeout plus a margin and reports allocator_hung with the
    steps so far."""
    run = cli(pools, "--target", "bad_pools:stuck", "--seed", "0", "--call-timeout", "1", *mode)
    ended(run, 1)
    assert "allocator_hung" in run.stdout and "SIGALRM could not interrupt it" in run.stdout
    trace = kept(pools, "allocator_hung")
    assert trace.steps[-1].rule == "end" and "free_group_end()" in trace.detail
    # The hang itself is 3600 s: cli's own limit (WAIT_S) is what shows it was cut.


# fuzz() on bad_pools:sleeps in a process of its own: the call timer's
# SIGALRM went to the process (setitimer), and in pytest-xdist's worker,
# which has threads, it once went to one of those, leaving the main thread
# asleep in the hang for good (CPython runs handlers only in the main
# thread, and only a signal sent to that thread cuts its sleep short).  On
# 64-bit Linux it now goes to the main thread (harness/alarm.py); elsewhere
# it is still setitimer's.  In CI it once slept on for good after CPython's
# sleep lost a SIGALRM (alarm.set_alarm).  kv-lockstep's workers have their
# watchdog for such a hang; this test wants the timer.
_SHRINK_A_HANG = """\
import json
import re
import bad_pools
from state_machines.config import Config
from state_machines.runs.runner import fuzz

outcome = fuzz(Config(target="bad_pools:sleeps", call_timeout_s=5.0), max_examples=100, seed=0, database=None,
               derandomize=False)
print(json.dumps({"traces": [{"invariant": t.invariant, "limit": t.config.call_timeout_s, "detail": t.detail,
                              "rules": [s.rule for s in t.steps]} for t in outcome.failures],
                  "hangs": bad_pools.hangs}))
"""


def test_shrinking_a_hang_does_not_pay_the_full_limit_each_time(pools):
    """Once a call hangs, the shrinker's examples run under a short limit;
    the shrunk trace is checked once more under the full one."""
    run = subprocess.run([sys.executable, "-c", _SHRINK_A_HANG], cwd=pools, env=_env(pools), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    got = json.loads(run.stdout.splitlines()[-1])
    limit = 5.0
    (trace,) = got["traces"]
    assert trace["invariant"] == "allocator_hung" and trace["limit"] == limit
    assert f"no return within {limit:g} s" in trace["detail"]
    # Shrunk from the random walk's example: a group around a free of a request's pages, a few steps.
    rules = trace["rules"]
    assert rules[-1] == "end" and "begin" in rules and len(rules) <= 8, rules
    # Only the first hang and the shrunk trace's last check run under the full
    # limit; without the short one every hang would last it.  Each hang's own
    # length is measured, not the run's, so a loaded machine cannot fail this.
    hangs = got["hangs"]
    full = [t for t in hangs if t > 0.9 * limit]
    assert len(hangs) > 10 and len(full) <= 2, sorted(hangs)


_EATS_ALARM = """\
import bad_pools
from state_machines.config import Config
from state_machines.harness import Step
from state_machines.runs.runner import replay
from state_machines.runs.trace import Trace

steps = (Step("begin", {}), Step("alloc", {"n": 1}, "req_0"), Step("finish", {"req": "req_0"}), Step("end", {}))
failure = replay(Trace(Config(target="bad_pools:eats_alarm", call_timeout_s=0.2), steps))
print(failure.invariant, bad_pools.hangs)
"""


@pytest.mark.skipif(not hasattr(signal, "sigtimedwait"), reason="no sigtimedwait here")
def test_a_lost_alarm_does_not_leave_a_hang_asleep(pools):
    """The call timer fires again after a signal that went astray.  Here the
    allocator takes it (it is an earlier call's, due before this call's
    deadline); in CI, CPython's sleep lost one that landed after the handler
    of the one before had set the timer again and before the sleep went back
    to its system call, and a hang slept on for good."""
    run = subprocess.run([sys.executable, "-c", _EATS_ALARM], cwd=pools, env=_env(pools), capture_output=True,
                         text=True, timeout=60)  # 3 s here; without the repeat, asleep for good
    assert run.returncode == 0, run.stdout + run.stderr
    invariant, hangs = run.stdout.split(maxsplit=1)
    assert invariant == "allocator_hung"
    (hang,) = json.loads(hangs)
    assert hang < 5.0, hang


def test_after_a_saved_hang_hypothesiss_saved_failures_replay_under_the_full_limit(pools, monkeypatch):
    """A saved walk failure that hangs again moves the machine onto the
    shrinker's short per-call limit (0.1 s here: nothing ran before it);
    Hypothesis's saved failure, replayed after it, runs under the run's own
    limit, so a slow call there is not taken for a hang and the failure is
    reported.  Under the short limit it was lost, a duplicate hang."""
    from hypothesis.database import InMemoryExampleDatabase

    from state_machines.config import Config
    from state_machines.harness import Step, machine_for
    from state_machines.runs import runner

    monkeypatch.syspath_prepend(str(pools))
    monkeypatch.delitem(sys.modules, "bad_pools", raising=False)
    import bad_pools

    config, db = Config(target="bad_pools:lost", call_timeout_s=2.0), InMemoryExampleDatabase()
    bad_pools.MODE.update(wrong=True)
    walked = runner.walked_examples
    monkeypatch.setattr(runner, "walked_examples", lambda n: 0)  # Hypothesis alone finds and saves the leak
    assert [t.invariant for t in runner.fuzz(config, max_examples=40, seed=0, database=db, shrink=False).failures] \
        == ["free_sets_agree"]
    monkeypatch.setattr(runner, "walked_examples", walked)
    steps = (Step("begin", {}), Step("alloc", {"n": 1}, "req_0"), Step("finish", {"req": "req_0"}), Step("end", {}))
    db.save(runner._walk_key(machine_for(config)), runner._walk_value(Trace(config, steps)))
    bad_pools.MODE.update(hang=True, slow=True)
    again = runner.fuzz(config, max_examples=40, seed=0, database=db, shrink=False)
    assert [(t.invariant, t.config.call_timeout_s) for t in again.failures] == \
        [("allocator_hung", 2.0), ("free_sets_agree", 2.0)]


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(entry))
    return out


def _forks(pid: int) -> list[int]:
    """The children of ``pid`` that run its own program: forks, such as a
    worker, not a program it started (the forkserver, the resource tracker,
    a helper some library runs)."""
    def cmdline(p: int) -> bytes | None:
        try:
            return Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            return None

    own = cmdline(pid)
    return [c for c in _children(pid) if own is not None and cmdline(c) == own]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds workers through /proc")
@pytest.mark.parametrize("jobs", [0, 1, 2], ids=["plain", "long-j1", "long-j2"])
def test_killing_a_worker_fails_the_run(tmp_path, jobs):
    """kill -9 of the plain run's worker, of one long-run worker, or of the
    only one: exit 1, worker_died, its last steps kept."""
    mode = ["--duration", "300s", "-j", str(jobs)] if jobs else ["--max-examples", "100000"]
    proc = popen(tmp_path, "--target", "builtin:token", *mode)
    try:
        deadline = time.monotonic() + 120  # a loaded CI machine starts workers slowly
        workers = []
        while len(workers) < max(jobs, 1) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            # A plain run forks its worker; a long run's are forked by the forkserver, a child of the CLI.
            workers = _forks(proc.pid) if not jobs else [w for c in _children(proc.pid) for w in _forks(c)]
        assert len(workers) == max(jobs, 1) and proc.poll() is None, (workers, proc.poll())
        time.sleep(1.0)  # into their runs
        try:
            os.kill(workers[0], signal.SIGKILL)
        except ProcessLookupError:  # CI saw it once: say how the run ended, rather than a bare lookup error
            try:
                stdout, stderr = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"worker {workers[0]} was gone before the kill, and the run goes on") from None
            raise AssertionError(f"worker {workers[0]} was gone before the kill; the run ended with"
                                 f" {proc.returncode}:\n{stdout}{stderr}") from None
        stdout, stderr = proc.communicate(timeout=WAIT_S)
    finally:  # a run the test gave up on does not outlive it
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, stdout + stderr
    assert "Traceback" not in stderr
    assert "was killed by SIGKILL" in stdout and "time is up" not in stdout
    assert kept(tmp_path, "worker_died").invariant == "worker_died"


@pytest.mark.parametrize("mode, sig, code", [
    ([], signal.SIGINT, 130),
    ([], signal.SIGTERM, 143),
    (LONG, signal.SIGTERM, 143),  # tests/test_longrun.py sends a long run SIGINT
    # A terminal that hangs up (a closed ssh session): exit 129, no summary, before (helper-88).
    ([], signal.SIGHUP, 129),
    (LONG, signal.SIGHUP, 129),
], ids=["plain-SIGINT", "plain-SIGTERM", "long-SIGTERM", "plain-SIGHUP", "long-SIGHUP"])
def test_signal_during_shrinking_keeps_the_failure(pools, mode, sig, code):
    """Ctrl-C, SIGTERM or SIGHUP while a failure shrinks: exit 130 / 143 / 129, no
    traceback, and the failure as first seen is kept, unshrunk."""
    proc = popen(pools, "--target", "bad_pools:slow_to_shrink", "--seed", "0", *mode)
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith("found "):
            break
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=WAIT_S)
    stdout = "".join(out) + stdout
    assert proc.returncode == code, stdout + stderr
    assert "Traceback" not in stderr and "interrupted" in stdout
    assert kept(pools, "allocator_raised").steps[-1].rule == "end"


def test_ctrl_c_while_the_command_module_imports_is_exit_130(tmp_path):
    """The console script imported ``state_machines.cli`` (argparse, attrs)
    before ``main`` set SIGINT aside: a Ctrl-C in those first tens of
    milliseconds was a KeyboardInterrupt traceback.  Here the Ctrl-C comes
    as that module is looked up, through the entry pyproject.toml names."""
    entry = re.search(r'^kv-lockstep = "([\w.]+):(\w+)"', (REPO / "pyproject.toml").read_text(), re.M)
    script = textwrap.dedent(f"""
        import os, signal, sys

        class CtrlC:
            def find_spec(self, name, path=None, target=None):
                if name == "state_machines.cli":
                    os.kill(os.getpid(), signal.SIGINT)

        sys.meta_path.insert(0, CtrlC())
        from {entry[1]} import {entry[2]} as main
        sys.argv = ["kv-lockstep", "fuzz", "--max-examples", "1", "--trace-dir", "traces"]
        sys.exit(main())
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                         timeout=WAIT_S)
    assert (run.returncode, run.stdout, run.stderr) == (130, "", "kv-lockstep: interrupted\n"), run.stdout + run.stderr


@pytest.mark.parametrize("mode", [[], LONG], ids=["plain", "long"])
def test_a_terminal_that_hangs_up_ends_a_run_with_129(tmp_path, mode):
    """A closed terminal: SIGHUP, then every write to it fails (EIO).  The
    summary's write was taken for an output the command cannot write, exit
    2, the code of bad input (helper-91)."""
    import pty
    import select

    pid, fd = pty.fork()
    if pid == 0:  # the child: the command, on the pty as its terminal
        os.chdir(tmp_path)
        os.environ.update(_env(tmp_path))
        os.execv(sys.executable, [sys.executable, "-m", "state_machines.cli", "fuzz", "--target", "builtin:token",
                                  *(mode or ["--max-examples", "1000000"]), "--trace-dir", str(tmp_path / "traces")])
    said = b""
    deadline = time.monotonic() + WAIT_S
    while b"kv-lockstep fuzz:" not in said and time.monotonic() < deadline:
        if select.select([fd], [], [], 1)[0]:
            try:
                said += os.read(fd, 4096)
            except OSError:
                break
    time.sleep(1.0)
    os.close(fd)  # the terminal goes: the kernel sends SIGHUP
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 129, said


def test_a_run_under_nohup_outlives_a_hangup(tmp_path):
    """nohup starts the command with SIGHUP ignored, so that a run outlives
    its terminal: the run keeps that (SIGHUP stops a run otherwise)."""
    proc = subprocess.Popen([sys.executable, "-m", "state_machines.cli", "fuzz", "--target", "builtin:token",
                             "--max-examples", "100000", "--trace-dir", str(tmp_path / "traces")],
                            cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    for line in proc.stdout:
        if line.startswith("kv-lockstep fuzz:"):
            break
    time.sleep(0.5)
    proc.send_signal(signal.SIGHUP)
    time.sleep(1.0)
    assert proc.poll() is None, "a hangup stopped a run under nohup"
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 130, stdout + stderr
    assert "Traceback" not in stderr and "interrupted (SIGINT)" in stdout


def test_ctrl_c_on_a_clean_run_exits_130(tmp_path):
    """Ctrl-C before any failure: exit 130, one line, no traceback."""
    proc = popen(tmp_path, "--target", "builtin:token", "--max-examples", "100000")
    for line in proc.stdout:
        if line.startswith("kv-lockstep fuzz:"):
            break
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 130, stdout + stderr
    assert "Traceback" not in stderr and "interrupted" in stdout


@pytest.mark.parametrize("mode", [[], LONG], ids=["plain", "long"])
def test_allocator_wrong_from_its_first_census(pools, mode):
    """Inconsistent before any step: exit 1, 'FAILED before any step', the
    invariant with its detail, and a trace of no steps that replays."""
    run = cli(pools, "--target", "bad_pools:bad_census", *mode)
    ended(run, 1)
    assert "FAILED before any step: no_page_freed_twice" in run.stdout
    assert "pages [1]" in run.stdout
    trace = kept(pools, "no_page_freed_twice", where=".")
    assert trace.steps == ()


@pytest.mark.parametrize("seconds", ["0", "1e-9", "0.05", "1e19"])
def test_bad_call_timeout_is_exit_2(tmp_path, seconds):
    """0, under a tenth of a second, or more than a trace may carry (a day): a
    run with 1e19 failed the correct allocator with OverflowError from the
    timer, and the trace it wrote did not replay; one with 1e-9 failed it as
    allocator_hung on its first call, and a trace carrying it replayed so."""
    run = cli(tmp_path, "--call-timeout", seconds)
    ended(run, 2)
    assert run.stderr.count("\n") == 1 and "--call-timeout" in run.stderr


def test_a_dead_workers_trace_carries_its_examples_own_pool_shape():
    """The steps a dead worker leaves are bounded by its example's drawn shape
    (here twice the rows), not the run's: its trace names that shape, with the
    run's call limit, and loads back.  On the run's own configuration it was refused (row 5 of 0..3), as a
    kill -9 on a drawn shape once showed."""
    import multiprocessing

    import attrs

    from state_machines.harness import build, lockstep
    from state_machines.runs.watchdog import Beacon, died_verdict

    run = Config(target="builtin:token")
    shaped = attrs.evolve(run, rows=run.rows * 2)
    beacon = Beacon(multiprocessing.get_context("fork"))
    beacon.install()
    try:
        # A shrink replay's shorter call limit stays the replay's, not the trace's.
        state = build(attrs.evolve(shaped, call_timeout_s=0.5))
        state.alloc(4)
        state.overwrite_row(row=run.rows + 1)
        state.alloc(1)  # publishes the steps before it
    finally:
        lockstep.watch_calls(None)
        lockstep.disarm_call_timer()
    trace = died_verdict(run, beacon, 0, -signal.SIGKILL)
    assert trace.config == shaped
    assert [s.rule for s in trace.steps] == ["alloc", "overwrite_row", "alloc"]
    assert Trace.from_dict(json.loads(json.dumps(trace.to_dict()))) == trace


def test_each_call_publishes_its_name_its_examples_limit_and_its_start():
    """The parent judges a hang by what the worker last published: the call's
    name, whether it runs and the limit of the example it runs in, which
    changes from one example to the next (a shrink replay's is shorter)."""
    import multiprocessing

    import attrs

    from state_machines.harness import build, lockstep
    from state_machines.runs.watchdog import Beacon

    beacon = Beacon(multiprocessing.get_context("fork"))
    beacon.install()
    publisher = lockstep._observer
    during = []  # what the parent would read inside each call

    def started(state, what):
        publisher.call_started(state, what)
        during.append((state.config.call_timeout_s, beacon.limit(), beacon.in_call()))

    lockstep._observer = attrs.evolve(publisher, call_started=started)
    try:
        seen = []
        for limit in (2.0, 0.5, 2.0):
            state = build(attrs.evolve(Config(target="builtin:token"), call_timeout_s=limit))
            state.alloc(3)
            state.begin()
            seen.append((beacon.what(), beacon.limit(), beacon.in_call()))
    finally:
        lockstep.watch_calls(None)
        lockstep.disarm_call_timer()
    # The last call of each example is the census read after its begin, ended.
    assert [(limit, in_call) for _, limit, in_call in seen] == [(2.0, False), (0.5, False), (2.0, False)]
    assert len({what for what, _, _ in seen}) == 1 and seen[0][0]
    # Inside each call: started, under its own example's limit.
    assert during and all(in_call and got == want for want, got, in_call in during)
    assert {want for want, _, _ in during} == {2.0, 0.5}


@pytest.mark.parametrize("mode", [[], LONG], ids=["plain", "long"])
def test_factory_that_exits_is_bad_input(pools, mode):
    """os._exit in the factory, while the worker builds the target: exit 2
    and one line, as a factory that raises SystemExit gets; no trace (it
    was worker_died, exit 1, with a trace of no steps)."""
    raised = cli(pools, "--target", "bad_pools:raises_at_build", *mode)
    ended(raised, 2)
    assert raised.stderr == "kv-lockstep: error: cannot build bad_pools:raises_at_build: SystemExit: 4\n"
    run = cli(pools, "--target", "bad_pools:exits_at_build", *mode)
    ended(run, 2)
    assert run.stderr == "kv-lockstep: error: cannot build bad_pools:exits_at_build: its factory exited with code 5\n"
    assert "worker_died" not in run.stdout and not list((pools / "traces").rglob("*.json"))


def test_allocator_that_exits_in_its_first_census_is_a_failure(pools):
    """Built, then dead in its first allocator call: a failure (worker_died,
    exit 1), not bad input."""
    run = cli(pools, "--target", "bad_pools:census_exits")
    ended(run, 1)
    assert "worker 0 exited with code 6 during get_all_free_pages()" in run.stdout
    assert kept(pools, "worker_died").steps == ()


# A group around a finish: free_group_end() meets a queued free (``Pool.misbehave``).
GROUP_STEPS = [("begin", {}, None), ("alloc", {"n": 1}, "req_0"), ("finish", {"req": "req_0"}, None), ("end", {}, None)]


def replay_cli(tmp_path, target, *extra, timeout=WAIT_S):
    """``kv-lockstep replay`` of GROUP_STEPS (1 s call limit) on ``target``,
    with the command line's ``extra`` options."""
    from state_machines.harness import Step
    from state_machines.runs.trace import write

    steps = tuple(Step(rule, args, returns) for rule, args, returns in GROUP_STEPS)
    path = write(Trace(Config(target=target, call_timeout_s=1.0), steps), tmp_path / "in")
    run = subprocess.run([sys.executable, "-m", "state_machines.cli", "replay", str(path), "--target", target, *extra],
                         cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=timeout)
    return run


@pytest.mark.parametrize("name, invariant, detail", [
    ("exits", "worker_died", "worker 0 exited with code 3 during free_group_end()"),
    ("stuck", "allocator_hung", "free_group_end() hung: no return within 1 s, and SIGALRM could not interrupt it"),
    ("interrupts", "allocator_raised", "free_group_end() raised KeyboardInterrupt"),
    ("sysexits", "allocator_raised", "free_group_end() raised SystemExit: 4"),
])
def test_replay_watches_the_allocator_as_fuzz_does(pools, name, invariant, detail):
    """replay runs the steps in a watched worker: an allocator that exits or
    hangs where SIGALRM cannot reach it fails the replay at its step, exit 1
    (it exited with the allocator's code, silent, or hung for good), and
    its KeyboardInterrupt is its failure, as in fuzz (it was an interrupt,
    exit 130)."""
    run = replay_cli(pools, f"bad_pools:{name}")
    ended(run, 1)
    assert f"FAILED at step 3, state.end(): {invariant}\n    {detail}" in run.stdout
    assert run.stderr == ""  # and within replay_cli's limit, not the hang's 3600 s


@pytest.mark.parametrize("name, line", [
    ("exits_at_build", "cannot build bad_pools:exits_at_build: its factory exited with code 5"),
    ("raises_at_build", "cannot build bad_pools:raises_at_build: SystemExit: 4"),
])
def test_replay_onto_a_factory_that_exits_is_bad_input(pools, name, line):
    """A factory that exits while replay builds it is bad input, one line
    and exit 2, as one that raises (it exited with the factory's code)."""
    run = replay_cli(pools, f"bad_pools:{name}")
    ended(run, 2)
    assert run.stderr == f"kv-lockstep: error: {line}\n"


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_signal_during_a_replay_exits_128_plus_it(pools, sig, code):
    """Ctrl-C or SIGTERM while a replay's allocator call runs: the worker is
    stopped, exit 130 / 143 with one line naming the signal (SIGTERM killed
    the replay outright, no line, when it ran in-process)."""
    from state_machines.harness import Step
    from state_machines.runs.trace import write

    steps = tuple(Step(rule, args, returns) for rule, args, returns in GROUP_STEPS)
    path = write(Trace(Config(target="bad_pools:sleeps", call_timeout_s=60.0), steps), pools / "in")
    proc = subprocess.Popen([sys.executable, "-m", "state_machines.cli", "replay", str(path), "--target", "bad_pools:sleeps"],
                            cwd=pools, env=_env(pools), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("kv-lockstep replay: 4 steps")
    time.sleep(1.0)  # into the steps
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == code, stdout + stderr
    assert stderr == f"kv-lockstep: interrupted ({signal.Signals(sig).name})\n"


def test_a_death_while_building_is_bad_input_unless_it_was_killed_from_outside():
    """Exited or crashed in the factory: bad input.  SIGKILL or SIGTERM there
    (the factory runs at every example, and a kill -9 lands in it) is the
    run's worker_died; so is any death outside the factory."""
    import multiprocessing

    from state_machines.harness import lockstep
    from state_machines.runs.watchdog import Beacon, build_death

    config = Config(target="my_pool:make")
    beacon = Beacon(multiprocessing.get_context("fork"))
    beacon.install()
    try:
        with lockstep.building("its factory"):
            assert build_death(config, beacon, 5) == "cannot build my_pool:make: its factory exited with code 5"
            assert build_death(config, beacon, -signal.SIGSEGV) == (
                "cannot build my_pool:make: its factory was killed by SIGSEGV")
            assert build_death(config, beacon, -signal.SIGKILL) is None
            assert build_death(config, beacon, -signal.SIGTERM) is None
            with lockstep.building("the probe"):
                assert build_death(config, beacon, 5).endswith(": the probe exited with code 5")
            assert build_death(config, beacon, 5).endswith(": its factory exited with code 5")
        assert build_death(config, beacon, 5) is None
    finally:
        lockstep.watch_calls(None)


def gone(pid: int, within: float = 60) -> bool:
    """Whether process ``pid`` has ended (or is a zombie) within ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            if Path("/proc/self/stat").exists():
                return True
            try:  # no /proc: a zombie counts as alive here
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            state = "?"
        if state in ("Z", "X"):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


@pytest.mark.parametrize("command", ["fuzz", "long", "replay"])
def test_factory_that_never_returns_is_bad_input_and_its_worker_is_killed(pools, command):
    """A factory still running after --build-timeout: its worker is killed
    and the command ends as bad input, one line and exit 2, as where the
    factory exits (it hung for good: building had no limit)."""
    try:
        if command == "replay":
            run = replay_cli(pools, "bad_pools:hangs_at_build", "--build-timeout", "1")
        else:
            run = cli(pools, "--target", "bad_pools:hangs_at_build", "--build-timeout", "1", *(LONG if command == "long" else []))
        ended(run, 2)
        assert run.stderr == "kv-lockstep: error: cannot build bad_pools:hangs_at_build: its factory did not return within 1 s\n"
        assert "worker_died" not in run.stdout and not list((pools / "traces").rglob("*.json"))
        assert gone(int((pools / "hung.pid").read_text()))
    finally:  # without the watchdog's kill, no worker outlives the test
        kill_hung(pools)


def test_the_build_limit_runs_from_where_each_part_of_the_build_began():
    """build_hang: past the limit in the factory, the line names it; a probe
    that builds the factory inside it runs on its own clock again once the
    factory returns; nothing once the build is over.  (``now`` is given: no
    test waits for the limit.)"""
    import multiprocessing

    from state_machines.harness import lockstep
    from state_machines.runs.watchdog import Beacon, build_hang

    config = Config(target="my_pool:make")
    beacon = Beacon(multiprocessing.get_context("fork"))
    beacon.install()
    try:
        with lockstep.building("the probe"):
            probe_began = time.monotonic()
            assert build_hang(config, beacon, probe_began, 5.0) is None
            with lockstep.building("its factory"):
                factory_began = time.monotonic()
                assert build_hang(config, beacon, factory_began + 6, 5.0) == (
                    "cannot build my_pool:make: its factory did not return within 5 s")
            # Back in the probe, on the probe's clock, which began first.
            assert build_hang(config, beacon, probe_began + 4.9, 5.0) is None
            assert build_hang(config, beacon, factory_began + 5.1, 5.0) == (
                "cannot build my_pool:make: the probe did not return within 5 s")
        assert build_hang(config, beacon, time.monotonic() + 100, 5.0) is None
    finally:
        lockstep.watch_calls(None)


def test_bad_build_timeout_is_exit_2(tmp_path):
    run = subprocess.run([sys.executable, "-m", "state_machines.cli", "fuzz", "--build-timeout", "0"],
                         cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=WAIT_S)
    ended(run, 2)
    assert "--build-timeout: must be a positive number of seconds, got 0" in run.stderr


@pytest.mark.parametrize("mode", [[], LONG], ids=["plain", "long"])
def test_a_death_in_the_probe_of_the_scheduler_hooks_is_bad_input(pools, mode):
    """os._exit in a scheduler hook the one-off probe asks on a copy, while
    the worker sets the target up: bad input, as a death in the probe of its
    optional methods is (it was worker_died 'between allocator calls',
    exit 1)."""
    run = cli(pools, "--target", "bad_pools:exits_in_hook_probe", *mode)
    ended(run, 2)
    assert run.stderr == ("kv-lockstep: error: cannot build bad_pools:exits_in_hook_probe:"
                          " the probe of its scheduler hooks (called once on a copy) exited with code 9\n")
    assert "worker_died" not in run.stdout


# Target modules whose top level ends the process that imports it, or never returns (under --build-timeout 1).
ENDS_AT_IMPORT = {
    "exits_at_import": ("import os\nos._exit(7)\n", "exited with code 7"),
    "killed_at_import": ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", "was killed by SIGKILL"),
    "hangs_at_import": ("import os, time\nopen('importer.pid', 'w').write(str(os.getpid()))\ntime.sleep(3600)\n",
                        "did not return within 1 s"),
    # Closes the check's pipe too: the end of the pipe is no end of the import.
    "closes_fds_and_hangs_at_import": ("import os, time\nos.closerange(3, 65536)\ntime.sleep(3600)\n",
                                       "did not return within 1 s"),
    # Its child holds the check's pipe open past the limit: the exit is what counts.
    "exits_leaving_a_child_at_import": ("import os, time\nif os.fork() == 0:\n    time.sleep(3)\n    os._exit(0)\n"
                                        "os._exit(7)\n", "exited with code 7"),
}


@pytest.mark.parametrize("command", ["fuzz", "long", "replay", "targets"])
@pytest.mark.parametrize("module", list(ENDS_AT_IMPORT))
def test_a_target_module_that_ends_the_process_at_import_is_bad_input(tmp_path, module, command):
    """The command imports a MODULE:ATTR target itself, to check it before
    any worker starts: one whose import calls os._exit or is killed is bad
    input, one line and exit 2 (the command ended silently, with the
    module's code; one that never returned hung it)."""
    source, how = ENDS_AT_IMPORT[module]
    (tmp_path / f"{module}.py").write_text(source)
    target = f"{module}:make"
    if command == "replay":
        from state_machines.runs.trace import write

        args = ["replay", str(write(Trace(Config(target="builtin:token"), ()), tmp_path / "in")), "--target", target]
    elif command == "targets":
        args = ["targets", "--target", target]
    else:
        args = ["fuzz", "--target", target, "--trace-dir", str(tmp_path / "traces"), *(LONG if command == "long" else [])]
    run = subprocess.run([sys.executable, "-m", "state_machines.cli", *args, "--build-timeout", "1"],
                         cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=WAIT_S)
    ended(run, 2)
    assert run.stdout == "" and run.stderr == f"kv-lockstep: error: cannot load {target}: importing its module {how}\n"
    if (pid_file := tmp_path / "importer.pid").exists():
        assert gone(int(pid_file.read_text()), 0), "the import check's child outlived the command"


def _wait_for_pid(path: Path, proc, within: float = WAIT_S) -> int:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"no pid in {path}; the command ended with {proc.poll()}")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the child through /proc")
def test_the_import_check_dies_with_a_command_killed_outright(tmp_path):
    """A command SIGKILLed while import_death's child hangs in the target
    module's import takes the child with it (it ran on, orphaned)."""
    pid_file = tmp_path / "importer.pid"
    (tmp_path / "hangs_at_import.py").write_text(
        f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(3600)\n")
    proc = subprocess.Popen([sys.executable, "-m", "state_machines.cli", "targets", "--target", "hangs_at_import:make"],
                            cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        child = _wait_for_pid(pid_file, proc)
        assert child != proc.pid
        proc.kill()
        proc.wait(timeout=30)
        if not gone(child):
            os.kill(child, signal.SIGKILL)
            raise AssertionError("the import check's child outlived the command")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def hung_build(pools, *args, within: float = WAIT_S, **popen):
    """``kv-lockstep ARGS --build-timeout 600`` started in ``pools``, given
    back with its worker's pid once that hangs in a factory deaf to SIGTERM
    that leaves its pid in hung.pid there (bad_pools:hangs_at_build), within
    ``within`` seconds; neither outlives the test."""
    proc = subprocess.Popen([sys.executable, "-m", "state_machines.cli", *args, "--build-timeout", "600"],
                            cwd=pools, env=_env(pools), **popen)
    worker = None
    try:
        worker = _wait_for_pid(pools / "hung.pid", proc, within)
        yield proc, worker
    finally:
        _leave_none(proc, worker)


def _leave_none(proc, pid: int | None) -> None:
    """Kill the command ``proc`` and the process ``pid`` (if any) where they still run."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if pid is not None:
        _kill_if_running(pid)


def _kill_if_running(pid: int) -> None:
    if not gone(pid, 0):
        with contextlib.suppress(ProcessLookupError):  # it ended since
            os.kill(pid, signal.SIGKILL)


def kill_hung(folder: Path) -> None:
    """Kill the process that left its pid in ``folder``/hung.pid (a factory
    that never returns, bad_pools:hangs_at_build), where it still runs."""
    if (path := folder / "hung.pid").exists():
        _kill_if_running(int(path.read_text()))


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the worker through /proc")
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_targets_builds_a_factory_kills_its_worker(pools, sig, code):
    """``targets --target`` builds a custom factory in a watched worker: a
    signal there kills the worker, deaf to SIGTERM as this one is, and ends
    the command with 128 + the signal and one line (on SIGTERM the command
    died with no word, and the worker ran on, orphaned)."""
    with hung_build(pools, "targets", "--target", "bad_pools:hangs_at_build",
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as (proc, worker):
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=WAIT_S)
        assert proc.returncode == code, stdout + stderr
        assert stderr == f"kv-lockstep: interrupted ({sig.name})\n" and "Traceback" not in stderr
        assert gone(worker), "the build's worker outlived the command"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_die_with_parent_sets_the_signal_the_kernel_sends():
    """orphans.die_with_parent, in a forked child (it must not mark this
    process): the kernel reads back the signal asked for (PR_GET_PDEATHSIG),
    and it says it was set."""
    import ctypes

    from state_machines import orphans

    prctl = ctypes.CDLL(None).prctl  # looked up here: no dlopen in the forked child
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            said = orphans.die_with_parent(signal.SIGUSR1)
            got = ctypes.c_int(-1)
            prctl(2, ctypes.byref(got))  # PR_GET_PDEATHSIG
            os.write(write, f"{said} {got.value}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        answer = pipe.read()
    os.waitpid(pid, 0)
    assert answer == f"True {int(signal.SIGUSR1)}"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the worker through /proc")
@pytest.mark.parametrize("command", ["fuzz", "long", "targets"])
def test_a_worker_deaf_to_sigterm_dies_with_a_command_killed_outright(pools, command):
    """kill -9 of the command while its worker hangs in a factory that
    ignores SIGTERM: the worker goes too (the kernel's signal on its
    parent's death is SIGKILL; SIGTERM left this one running, orphaned)."""
    args = (["targets", "--target", "bad_pools:hangs_at_build"] if command == "targets" else
            ["fuzz", "--target", "bad_pools:hangs_at_build", "--trace-dir", str(pools / "traces"),
             *(LONG if command == "long" else [])])
    with hung_build(pools, *args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as (proc, worker):
        proc.kill()
        proc.wait(timeout=30)
        assert gone(worker), "the worker outlived the command"


_LATE_WORKER = """\
import multiprocessing, os, signal, sys, time

from state_machines.runs.watchdog import worker_signals


def work():
    parent = multiprocessing.parent_process().pid
    while os.getppid() == parent:  # the command dies before the worker sets its signals
        time.sleep(0.01)
    worker_signals()
    time.sleep(120)


if __name__ == "__main__":
    worker = multiprocessing.get_context(sys.argv[1]).Process(target=work)
    worker.start()
    with open("worker.pid", "w") as out:
        out.write(str(worker.pid))
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_worker_whose_command_died_before_it_set_its_signals_ends(tmp_path, method):
    """A command killed between a worker's start and its worker_signals: the
    kernel was asked to signal a parent's death that had already happened,
    so the worker ends itself there (it ran on, orphaned)."""
    (tmp_path / "late_worker.py").write_text(_LATE_WORKER)
    proc = subprocess.Popen([sys.executable, "late_worker.py", method], cwd=tmp_path, env=_env(tmp_path),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = None
    try:
        assert proc.wait(timeout=WAIT_S) == -signal.SIGKILL
        worker = int((tmp_path / "worker.pid").read_text())
        assert gone(worker, 30), "the worker outlived the command"
    finally:
        _leave_none(proc, worker)


def _import_limit(answer) -> None:
    from state_machines.targets import base

    answer.put(base.import_limit_s())


def test_a_fresh_worker_checks_imports_under_the_commands_build_timeout(monkeypatch):
    """--build-timeout reaches the import check of a worker started afresh
    (a device run, a long run, --cover), not only the command's own: such a
    worker checked under the default 120 s, cutting off a slow import the
    command allowed, or waiting past a shorter limit.  (Spawn only here: a
    forkserver keeps the environment it started with, which the command
    sets before it starts one, but a server an earlier test started would
    not see.)"""
    import multiprocessing

    from state_machines.targets import base

    monkeypatch.setenv(base._IMPORT_LIMIT_ENV, "not a number")  # restored after the test, whatever it was
    assert base.import_limit_s() == base.BUILD_TIMEOUT_S
    base.limit_imports(600)
    ctx = multiprocessing.get_context("spawn")
    answer = ctx.Queue()
    worker = ctx.Process(target=_import_limit, args=(answer,))
    worker.start()
    try:
        assert answer.get(timeout=120) == 600
    finally:
        worker.join(timeout=30)


def test_the_import_check_forks_only_for_a_module_not_yet_imported(tmp_path, monkeypatch):
    """import_death: a module that imports, or raises, is left to the
    caller's own import (None), and is not imported here by the check; one
    already imported, or one of sglang's, forks nothing."""
    from state_machines.targets import base

    (tmp_path / "kvl_fine.py").write_text("VALUE = 1\n")
    (tmp_path / "kvl_raises.py").write_text("raise ValueError('no')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert base.import_death("kvl_fine") is None and "kvl_fine" not in sys.modules
    assert base.import_death("kvl_raises") is None and "kvl_raises" not in sys.modules

    def no_fork():
        raise AssertionError("forked")

    monkeypatch.setattr(base.os, "fork", no_fork)
    assert base.import_death("os") is None
    assert base.import_death("sglang.srt.mem_cache.allocator") is None


@pytest.mark.parametrize("name, code, said", [
    ("exits_at_build", 2, "kv-lockstep: error: cannot build bad_pools:exits_at_build: its factory exited with code 5\n"),
    ("hangs_at_build", 2, "kv-lockstep: error: cannot build bad_pools:hangs_at_build: its factory did not return within 1 s\n"),
    ("exits_in_hook_probe", 2, "kv-lockstep: error: cannot build bad_pools:exits_in_hook_probe: the probe of its scheduler"
                               " hooks (called once on a copy) exited with code 9\n"),
    ("census_exits", 1, "FAILED before any step: worker_died\n    worker 0 exited with code 6 during get_all_free_pages()\n"
                        "  a trace: kv-lockstep fuzz --target bad_pools:census_exits (its failure shrinks to building the pool)\n"),
])
def test_targets_builds_a_custom_target_in_a_watched_worker(pools, name, code, said):
    """targets --target MODULE:ATTR builds the target to describe it, in a
    watched worker: a factory or probe that exits, or a factory still
    running after --build-timeout, is bad input (one line, exit 2); an
    allocator that dies in its first census fails before any step (exit 1).
    Each ended the command silently with the target's code, or hung it,
    when the build ran in the command's own process."""
    try:
        run = subprocess.run([sys.executable, "-m", "state_machines.cli", "targets", "--target", f"bad_pools:{name}",
                              "--build-timeout", "1"], cwd=pools, env=_env(pools), capture_output=True, text=True, timeout=WAIT_S)
        ended(run, code)
        assert (run.stderr if code == 2 else run.stdout) == said
    finally:  # without the watchdog's kill, no build outlives the test
        kill_hung(pools)


@pytest.mark.skipif(not hasattr(signal, "SIGCHLD"), reason="no SIGCHLD")
@pytest.mark.parametrize("args, code, said", [
    (["targets", "--target", "bad_pools:exits_at_build"], 2,
     "kv-lockstep: error: cannot build bad_pools:exits_at_build: its factory exited with code 5\n"),
    (["fuzz", "--target", "bad_pools:census_exits"], 1, "worker 0 exited with code 6 during get_all_free_pages()"),
], ids=["targets", "fuzz"])
def test_a_command_started_with_sigchld_ignored_still_reads_how_its_children_end(pools, args, code, said):
    """SIGCHLD ignored by whatever started the command (it carries over
    exec) has the kernel reap its children itself: the import check's
    waitpid raised ChildProcessError, a traceback and exit 1.  The command
    takes SIGCHLD's default back first."""
    run = subprocess.run([sys.executable, "-m", "state_machines.cli", *args], cwd=pools, env=_env(pools),
                         capture_output=True, text=True, timeout=120,
                         preexec_fn=lambda: signal.signal(signal.SIGCHLD, signal.SIG_IGN))
    ended(run, code)
    assert said in (run.stderr if code == 2 else run.stdout)


@pytest.mark.skipif(not hasattr(signal, "SIGCHLD"), reason="no SIGCHLD")
def test_the_import_check_reads_its_childs_end_where_a_library_caller_ignores_sigchld(tmp_path, monkeypatch):
    """A library caller (``runner.fuzz`` with a custom target) that ignores
    SIGCHLD, which only the command's ``main`` puts back: the kernel reaps
    the check's child at once, and waitpid raised ChildProcessError, a
    traceback.  A module that imports is still left to the caller; one
    that exits is still named, its status unread."""
    from state_machines.targets import base

    (tmp_path / "kvl_fine_ign.py").write_text("VALUE = 1\n")
    (tmp_path / "kvl_exits_ign.py").write_text("import os\nos._exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        assert base.import_death("kvl_fine_ign") is None
        assert base.import_death("kvl_exits_ign") == "ended before it returned (SIGCHLD is ignored here: how it ended is unknown)"
    finally:
        signal.signal(signal.SIGCHLD, previous)


# Allocators whose alloc raises what the harness's handler once let through
# (a class of their own derived from BaseException, GeneratorExit: a
# traceback and no trace), could not print (a __str__ that raises: the
# same), took for its own (TimeoutError: reported as a hang) or wrote into a
# trace replay refused (a message of 5 MB); and ones whose alloc_decode,
# probed once, raises SystemExit or KeyboardInterrupt (a traceback, or an
# exit 1 with no word).
RAISING_POOLS = textwrap.dedent(
    '''
    from allocators.paged import PagedAllocator
    from allocators.token import TokenAllocator

    class Base(BaseException):
        pass

    class BadStr(Exception):
        def __str__(self):
            raise RuntimeError("no text")

    def raising(exc):
        class Pool(TokenAllocator):
            def alloc(self, n):
                raise exc
        return Pool

    RaisesBase = raising(Base("of its own"))
    RaisesGeneratorExit = raising(GeneratorExit("closed"))
    RaisesBadStr = raising(BadStr())
    RaisesTimeoutError = raising(TimeoutError("lock busy"))
    RaisesHuge = raising(ValueError("z" * 5_000_000))

    def probed(exc):
        class Pool(PagedAllocator):
            def alloc_decode(self, *args):
                raise exc
        return Pool

    DecodeExits = probed(SystemExit(3))
    DecodeInterrupts = probed(KeyboardInterrupt())

    class ResizeExits(TokenAllocator):
        def resize(self, config):
            raise SystemExit(3)

    class ResizeForks(TokenAllocator):
        """Correct; its resize forks a child that ends with sys.exit(0)."""
        def resize(self, config):
            import os, sys
            pid = os.fork()
            if pid == 0:
                sys.exit(0)
            os.waitpid(pid, 0)
            return super().resize(config) if hasattr(super(), "resize") else None

    def factory_raises_its_own(size, page_size, device, need_sort):
        raise Base("no pool")
    '''
)


@pytest.mark.parametrize("name, said", [
    ("RaisesBase", "alloc(1) raised Base: of its own (at "),
    ("RaisesGeneratorExit", "alloc(1) raised GeneratorExit: closed (at "),
    ("RaisesBadStr", "alloc(1) raised BadStr: <its str() raised RuntimeError> (at "),
    ("RaisesTimeoutError", "alloc(1) raised TimeoutError: lock busy (at "),
    ("RaisesHuge", "alloc(1) raised ValueError: " + "z" * 2000 + "... (4,998,000 more characters) (at "),
])
def test_whatever_an_allocator_raises_is_allocator_raised_with_a_trace_that_replays(tmp_path, name, said):
    """Each is the allocator's failure, ``allocator_raised``, with a trace
    that ``replay`` reads and fails on the same way."""
    (tmp_path / "raising_pools.py").write_text(RAISING_POOLS)
    run = cli(tmp_path, "--target", f"raising_pools:{name}", "--max-examples", "5", "--seed", "1")
    ended(run, 1)
    assert "failure 1: allocator_raised" in run.stdout and said in run.stdout, run.stdout[:3000]
    [path] = sorted((tmp_path / "traces").glob("*allocator_raised*.json"))
    again = subprocess.run([sys.executable, "-m", "state_machines.cli", "replay", str(path), "--target", f"raising_pools:{name}"],
                           cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=WAIT_S)
    ended(again, 1)
    assert said in again.stdout


@pytest.mark.parametrize("name, reason", [
    ("ResizeExits", "rule resize disabled for raising_pools:ResizeExits: resize: SystemExit: 3"),
    ("ResizeForks", "no failure: 5 examples"),
    ("DecodeExits", "rule decode disabled for raising_pools:DecodeExits: alloc_decode: SystemExit: 3"),
    ("DecodeInterrupts", "rule decode disabled for raising_pools:DecodeInterrupts: alloc_decode: KeyboardInterrupt at "),
])
def test_a_probe_that_exits_or_interrupts_disables_its_step(tmp_path, name, reason):
    """A method that cannot run here disables its step, with the reason,
    whatever it raises (the hook probes' resize too: a traceback); the run
    goes on.  One that forks a child ending with sys.exit(0) makes no copy
    of the harness (a traceback: SystemExit: 0)."""
    (tmp_path / "raising_pools.py").write_text(RAISING_POOLS)
    page_size = "1" if name.startswith("Resize") else "4"
    run = cli(tmp_path, "--target", f"raising_pools:{name}", "--page-size", page_size, "--max-examples", "5", "--seed", "1")
    ended(run, 0)
    assert reason in run.stdout, run.stdout


@pytest.mark.parametrize("mode", [["--max-examples", "5"], ["--duration", "2s", "-j", "1"]], ids=["plain", "long"])
def test_the_fuzz_header_names_every_step_targets_names_disabled(tmp_path, mode):
    """The header listed only the probe's own disablements: a step disabled
    for want of what it stands on (``admit`` where ``extend`` cannot run;
    ``decode`` where there is no ``alloc_decode``) was listed by
    ``targets --target`` and not by ``fuzz`` (sglang:npu at page size 4:
    admit; helper-79)."""
    (tmp_path / "noext_pools.py").write_text(textwrap.dedent(
        '''
        from allocators.paged import PagedAllocator
        class NoExtend(PagedAllocator):
            def alloc_extend(self, *args, **kwargs):
                raise NotImplementedError
        '''))
    listed = subprocess.run([sys.executable, "-m", "state_machines.cli", "targets", "--target", "noext_pools:NoExtend",
                             "--page-size", "4"], cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=WAIT_S)
    ended(listed, 0)
    disabled = dict(re.findall(r"^  disabled: (\w+): (.+)$", listed.stdout, re.M))
    assert {"admit", "decode", "extend"} <= set(disabled), listed.stdout
    run = cli(tmp_path, "--target", "noext_pools:NoExtend", "--page-size", "4", "--seed", "1", *mode)
    ended(run, 0)
    assert dict(re.findall(r"^rule (\w+) disabled for noext_pools:NoExtend: (.+)$", run.stdout, re.M)) == disabled, run.stdout


# Correct allocators that fork once per process, at a call of each kind the
# harness makes (a step's, the factory, the probe of free groups), the child
# ending as Python code often does, with sys.exit(0), or returning as the
# parent does (the parent then waits for it and wants it gone at once, with
# code 0).  Once per process, so that a copy the harness failed to end
# forks no more copies.
FORKING_POOLS = textwrap.dedent(
    '''
    import os, sys
    from allocators.swa import PureSWAAllocator, SWAAllocator
    from allocators.token import TokenAllocator

    forked = False

    def log(name, pid):
        with open(name, "a") as f:
            f.write(f"{pid}\\n")

    def fork_once(child_returns):
        log("calls.log", os.getpid())
        global forked
        if forked:
            return
        forked = True
        pid = os.fork()
        if pid == 0:
            if child_returns:
                return
            sys.exit(0)
        log("children.log", pid)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise RuntimeError(f"the forked child ended with wait status {status}")

    class ExitsInAlloc(TokenAllocator):
        def alloc(self, n):
            fork_once(child_returns=False)
            return super().alloc(n)

    class ReturnsInAlloc(TokenAllocator):
        def alloc(self, n):
            fork_once(child_returns=True)
            return super().alloc(n)

    class ExitsInGroupProbe(TokenAllocator):
        def free_group_begin(self):
            fork_once(child_returns=False)
            return super().free_group_begin()

    class ExitsInSWAProbe(SWAAllocator):  # free_swa: first called by the probe of its group
        def free_swa(self, free_index):
            fork_once(child_returns=False)
            return super().free_swa(free_index)

    class ReturnsInPureSWAProbe(PureSWAAllocator):
        def free_swa(self, free_index):
            fork_once(child_returns=True)
            return super().free_swa(free_index)

    def exits_at_build(size, page_size, device, need_sort):
        fork_once(child_returns=False)
        return TokenAllocator(size, page_size, device, need_sort)

    def returns_at_build(size, page_size, device, need_sort):
        fork_once(child_returns=True)
        return TokenAllocator(size, page_size, device, need_sort)
    '''
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
@pytest.mark.parametrize("name", ["ExitsInAlloc", "ReturnsInAlloc", "ExitsInGroupProbe", "ExitsInSWAProbe",
                                  "ReturnsInPureSWAProbe", "exits_at_build", "returns_at_build"])
def test_a_copy_of_the_harness_that_a_target_forks_ends_as_the_call_returns(tmp_path, name):
    """A correct allocator that forks inside a call made a copy of the
    whole harness: the copy took the child's sys.exit(0) for the
    allocator's failure (``alloc(1) raised SystemExit: 0``), reported it
    over the parent's channel, and ran the rest of the run; one that
    forked at every alloc left thousands of processes.  The copy now ends
    as the call returns or raises into the harness, with its own exit
    code, and the run is clean: no child the target forked calls it again."""
    (tmp_path / "forking_pools.py").write_text(FORKING_POOLS)
    run = cli(tmp_path, "--target", f"forking_pools:{name}", "--max-examples", "20", "--seed", "1", timeout=120)
    ended(run, 0)
    assert "no failure: 20 examples" in run.stdout and run.stdout.count("kv-lockstep fuzz:") == 1, run.stdout
    children = set((tmp_path / "children.log").read_text().split())
    assert children and not children & set((tmp_path / "calls.log").read_text().split())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
@pytest.mark.parametrize("ends, code", [
    (lambda: 5, 0), (lambda: sys.exit(3), 3), (lambda: sys.exit(None), 0), (lambda: sys.exit("why"), 1), (lambda: 1 / 0, 1),
], ids=["returns", "exit-3", "exit-none", "exit-message", "raises"])
def test_a_copy_ends_with_the_code_its_own_exit_would_have(ends, code):
    """The copy's exit code is what its call's end would give a process:
    0 for a return, a SystemExit's own, 1 for any other raise."""
    from state_machines import orphans

    def target():
        return ends() if os.fork() == 0 else None

    me = os.getpid()
    with contextlib.suppress(BaseException):
        orphans.call_user_code(target)
    if os.getpid() != me:
        os._exit(99)  # a copy not ended: it must not run on in pytest
    _, status = os.wait()
    assert os.waitstatus_to_exitcode(status) == code


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_fork_outside_a_call_of_the_targets_code_makes_no_copy():
    """A fork the harness makes itself (a worker, the import check) runs
    inside no function that calls a target's code: its child goes on."""
    from state_machines import orphans

    pid = os.fork()
    if pid == 0:
        os._exit(9 if orphans.copied else 4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 4


def test_the_import_check_hears_a_module_that_closes_every_descriptor_and_opens_its_own(tmp_path, monkeypatch):
    """A module that closes every file descriptor and opens files of its
    own imports fine (the check's word travelled in a pipe, which the module
    closed: 'exited with code 0'), and no file of the module's gets the
    check's word (a file opened under the pipe's number got its '.')."""
    from state_machines.targets import base

    (tmp_path / "kvl_closes_fds.py").write_text(
        f"import os\nos.closerange(3, 65536)\nlogs = [open({str(tmp_path)!r} + f'/log{{i}}.txt', 'w') for i in range(8)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert base.import_death("kvl_closes_fds") is None
    assert all((tmp_path / f"log{i}.txt").read_text() == "" for i in range(8))


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="no interval timer")
def test_a_command_leaves_no_call_timer_set_as_it_returns():
    """``targets --target builtin:token`` builds the target in the command's
    own process, as a --caller header does: the allocator calls there set
    the call timer, which main() left running; it fired 10 s on, and where
    that fell in the interpreter's exit, after SIGALRM's default was put
    back, the command died of signal 14 (-14) after its last word (seen in
    CI, on a --duration --caller run)."""
    code = ("import contextlib, io\nfrom state_machines import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    rc = cli.main(['targets', '--target', 'builtin:token'])\n"
            "from state_machines.harness.alarm import alarm_left\nprint(rc, alarm_left())\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.stdout == "0 0.0\n", run.stdout + run.stderr


def test_the_import_check_is_not_told_the_import_returned_by_a_copy_the_module_forked(tmp_path, monkeypatch):
    """A module that forks at import, its first process exiting with 7 while
    the copy carries on: the copy finished the import in the check's child
    code and said it returned (None), and the command then imported the
    module itself and ended silently with 7."""
    from state_machines.targets import base

    (tmp_path / "kvl_forks.py").write_text("import os, time\nif os.fork():\n    time.sleep(0.3)\n    os._exit(7)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert base.import_death("kvl_forks") == "exited with code 7"


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="no interval timer")
def test_a_fuzz_whose_fresh_allocator_disagrees_leaves_no_call_timer_set(tmp_path):
    """fuzz() raising before any step (the fresh allocator's census is not
    the model's) switches off the call timer its census calls set, as it
    does on every other way out (it was left set, for an alarm 10 s on)."""
    (tmp_path / "kvl_short_census.py").write_text(
        "from allocators.token import TokenAllocator\n"
        "class Short(TokenAllocator):\n"
        "    def get_all_free_pages(self):\n        return super().get_all_free_pages()[1:]\n"
        "def make(size, page_size, device, need_sort):\n    return Short(size, page_size, device, need_sort)\n")
    code = ("from state_machines.config import Config\nfrom state_machines.harness import InvariantViolation\n"
            "from state_machines.runs.runner import fuzz\nfrom state_machines.harness.alarm import alarm_left\n"
            "try:\n    fuzz(Config(target='kvl_short_census:make'), max_examples=1)\n"
            "except InvariantViolation as exc:\n    print(exc.invariant, alarm_left())\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                         timeout=120)
    assert run.stdout.endswith(" 0.0\n"), run.stdout + run.stderr


def test_targets_builds_ours_in_its_own_process(monkeypatch, capsys):
    """A built-in target (like an sglang kind) runs only our code while it is
    built: targets --target describes it without a worker."""
    from state_machines import cli
    from state_machines.runs import watchdog

    def no_worker(*args, **kwargs):
        raise AssertionError("built in a worker")

    monkeypatch.setattr(watchdog, "build_watched", no_worker)
    assert cli.main(["targets", "--target", "builtin:token"]) == 0
    assert capsys.readouterr().out.startswith("builtin:token page_size=1: TokenAllocator, harness Lockstep\n")


@pytest.mark.parametrize("name, invariant, detail", [
    ("exits", "worker_died", "worker 0 exited with code 3 during free_group_end()"),
    ("stuck", "allocator_hung", "free_group_end() hung: no return within 1 s, and SIGALRM could not interrupt it;"),
])
def test_emit_pytest_of_a_trace_whose_allocator_dies_still_reports_the_replay(pools, name, invariant, detail):
    """replay --emit-pytest runs the steps again to record what each alloc
    returned, in a watched worker too: an allocator that dies or hangs there,
    as it did in the replay, leaves the file written without those returns,
    and the replay's failure reported, exit 1 (the command ended silently
    with the allocator's code 3 before the failure was printed, or hung)."""
    run = replay_cli(pools, f"bad_pools:{name}", "--emit-pytest", "test_emitted.py")
    ended(run, 1)
    said = run.stdout.splitlines()
    assert said[1].startswith(f"pytest file: test_emitted.py (without the slots each alloc returned: recording them,"
                              f" {invariant}: {detail}"), said
    assert f"FAILED at step 3, state.end(): {invariant}\n    {detail}" in run.stdout
    emitted = (pools / "test_emitted.py").read_text()
    compile(emitted, "test_emitted.py", "exec")
    assert "req_0 = state.alloc(n=1)\n" in emitted and "returned" not in emitted
    # The file fails its own test, and the session goes on: the steps ran
    # in pytest's process, and the allocator's exit ended the session with
    # no word (exit 3), its hang hung it.
    (pools / "test_after.py").write_text("def test_after():\n    pass\n")
    session = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_emitted.py", "test_after.py"],
                             cwd=pools, env=_env(pools), capture_output=True, text=True, timeout=300)
    assert session.returncode == 1, session.stdout + session.stderr
    said = {"exits": "the process running the steps exited with code 3 before they ended: the allocator ended it",
            "stuck": "the steps did not end within 17 s: a hang SIGALRM could not stop"}[name]
    assert f"{said} (the trace recorded no failure)" in session.stdout, session.stdout
    assert "1 failed, 1 passed" in session.stdout, session.stdout


def _loading(proc, library: str, within: float = WAIT_S) -> None:
    """Wait until ``proc`` has mapped a library whose path holds ``library``."""
    deadline = time.monotonic() + within
    while library not in Path(f"/proc/{proc.pid}/maps").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, f"the command never loaded {library}"
        time.sleep(0.002)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="no /proc/PID/maps here")
@pytest.mark.parametrize("library, delay", [("libtorch", 0.0), ("_multiarray_umath", 0.0), ("libtorch", 0.3),
                                            ("libtorch", 0.7), ("libtorch", 1.5)])
def test_ctrl_c_while_the_command_starts_is_exit_130(tmp_path, library, delay):
    """The command's imports (torch's) take a second or two: a Ctrl-C there
    ended in a KeyboardInterrupt traceback (rc -2), raised inside
    pybind11's C++ it aborted the process (rc -6), swallowed by an import
    it ran the command to its end, or it broke numpy's import into an
    ImportError traceback (rc 1).  ``delay`` counts from a library's first
    mapping, not from the start: the first tenth of a second, before the
    command's own code runs, is Python's (0.4 s under CI's load), and the
    command imports torch (which maps ``libtorch`` first, then loads numpy's
    C core) only in ``_main``, after ``main`` has set its SIGINT handler.
    Without that handler, a Ctrl-C as numpy loads was swallowed every time."""
    run = subprocess.Popen([sys.executable, "-m", "state_machines.cli", "fuzz", "--max-examples", "100000",
                            "--trace-dir", str(tmp_path / "traces")], start_new_session=True,
                           cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _loading(run, library)
        time.sleep(delay)
        run.send_signal(signal.SIGINT)
        out, err = run.communicate(timeout=WAIT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)  # a command that ran on, and any child of it
        run.communicate()
    assert run.returncode == 130, out + err
    # Still starting: main's word on stderr; once the run is under way, the run's report on stdout.
    assert "Traceback" not in out + err and "kv-lockstep: interrupted" in out + err, out + err


@pytest.mark.parametrize("stdout, code, said", [
    ("full", 2, "kv-lockstep: error: cannot write the output: No space left on device\n"),
    ("closed", 0, ""),
])
def test_an_output_that_cannot_be_written_is_one_line_not_a_traceback(tmp_path, stdout, code, said):
    """``>/dev/full`` ended in a traceback with exit 1 (a failure found,
    which none was); ``>&-`` in an AttributeError traceback.  A closed
    stdout now runs the command, its words going nowhere."""
    with open("/dev/full", "w") as full:
        run = subprocess.run([sys.executable, "-m", "state_machines.cli", "fuzz", "--max-examples", "5",
                              "--trace-dir", str(tmp_path / "traces")],
                             cwd=tmp_path, env=_env(tmp_path), stderr=subprocess.PIPE, text=True, timeout=120,
                             stdout=full if stdout == "full" else None,
                             preexec_fn=(lambda: os.close(1)) if stdout == "closed" else None)
    assert (run.returncode, run.stderr) == (code, said)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
@pytest.mark.parametrize("steps, said", [
    (lambda: None, None),
    (lambda: os._exit(0), "the process running the steps exited with code 0 before they ended"),
    (lambda: os._exit(2), "the process running the steps exited with code 2 before they ended"),
    (lambda: (os.closerange(3, 4096), time.sleep(30)), "the steps did not end within 2 s"),
], ids=["passes", "exit-0", "exit-2", "closes-its-pipe-and-hangs"])
def test_an_emitted_file_tells_how_its_child_ended_by_what_the_child_said(steps, said):
    """replay_apart: pass only on the child's word that the steps passed
    (an allocator's os._exit(0) passed the test, its os._exit(2) read as a
    harness error); the child waited for, not its pipe (one that closed it
    and hung made the wait block for ever)."""
    from state_machines.runs.emit import replay_apart

    if said is None:
        replay_apart(steps, "worker_died", 2)
        return
    with pytest.raises(pytest.fail.Exception, match=re.escape(said)):
        replay_apart(steps, "worker_died", 2)


def test_a_factory_that_raises_a_baseexception_of_its_own_is_bad_input(tmp_path):
    (tmp_path / "raising_pools.py").write_text(RAISING_POOLS)
    run = cli(tmp_path, "--target", "raising_pools:factory_raises_its_own", "--max-examples", "5")
    ended(run, 2)
    assert run.stderr == "kv-lockstep: error: cannot build raising_pools:factory_raises_its_own: Base: no pool\n"


def _in_a_session(tmp_path, args: list, act=None) -> tuple[str, str, int]:
    """``kv-lockstep fuzz ARGS`` in a session of its own (a signal to its
    group reaches no test): ``act(proc)``, when given, while it runs, then
    what ``act`` read of its stdout and the rest, its stderr and its exit
    code; it and its children are killed at the end, whatever came."""
    proc = subprocess.Popen([sys.executable, "-m", "state_machines.cli", "fuzz", *args, "--trace-dir", str(tmp_path / "traces")],
                            cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        read = act(proc) if act is not None else ""
        stdout, stderr = proc.communicate(timeout=WAIT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    return read + stdout, stderr, proc.returncode


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_a_signal_to_the_whole_group_stops_a_long_run_without_a_death(tmp_path, sig, code):
    """``timeout``, a CI job's cancel and ``docker stop`` send SIGTERM to
    every process of the command (a terminal's Ctrl-C sends SIGINT so): the
    workers and the forkserver end with the command, which is no worker's
    death.  Exit 128 + the signal, the summary, no trace, no traceback."""
    def signal_the_group(proc) -> str:
        out = []
        for line in proc.stdout:  # the workers are ready once the disabled rules are printed
            out.append(line)
            if line.startswith("rule "):
                break
        time.sleep(1.0)  # into the fuzzing
        os.killpg(proc.pid, sig)
        return "".join(out)

    stdout, stderr, code_got = _in_a_session(tmp_path, ["--target", "builtin:token", "--duration", "10m", "-j", "2"],
                                             signal_the_group)
    assert code_got == code, stdout + stderr
    assert "Traceback" not in stderr and "worker_died" not in stdout, stdout + stderr
    assert f"interrupted ({signal.Signals(sig).name})" in stdout
    assert not list((tmp_path / "traces").rglob("*.json"))


def test_a_signal_while_messages_are_read_raises_once_they_are_all_handled():
    """The parent's ``KeyboardInterrupt`` came wherever its signal did: in
    the middle of a worker's message it cut the pipe's framing, the next
    read dropped the channel, and a worker that then stopped as told (its
    ``done`` unread) was judged ``worker_died``, exit 0 (CI on 0422818,
    the SIGHUP case above).  Now a signal that comes while messages are
    read and handled raises once every one read is handled, and the
    channels stay whole."""
    from state_machines.runs import watchdog

    handled = []

    def signal_at_first(message):
        handled.append(message)
        if len(handled) == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # as a group's signal lands while a message is taken

    with _channels(3) as channels, _signals() as signals:
        with pytest.raises(KeyboardInterrupt):
            watchdog.receive(channels, 1.0, signal_at_first)
        assert signals.got == signal.SIGTERM
        assert handled == [("stats", 0), ("stats", 1), ("stats", 2)]
        while watchdog.receive(channels, 0, handled.append):
            pass
        assert handled[3:] == [("done", 0), ("done", 1), ("done", 2)]
    assert (watchdog._held, watchdog._deferred) == (0, False)


def test_a_signal_held_for_a_message_is_raised_when_its_handling_fails_and_a_second_at_once():
    """A signal held while a message is handled still stops the run when
    the handling raises (a print to a terminal that hung up: EIO): its
    ``KeyboardInterrupt``, chained to that error.  A second signal is not
    held: a worker stalled in the middle of a message would hold the first."""
    from state_machines.runs import watchdog

    def hangup_then_eio(message):
        os.kill(os.getpid(), signal.SIGHUP)
        raise OSError(5, "Input/output error")

    went_on = []

    def two_signals(message):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        went_on.append(message)  # the second signal did not raise at once

    for handle, last in ((hangup_then_eio, signal.SIGHUP), (two_signals, signal.SIGINT)):
        with _channels(1) as channels, _signals() as signals:
            with pytest.raises(KeyboardInterrupt) as raised:
                watchdog.receive(channels, 1.0, handle)
            assert signals.got == last
            if handle is hangup_then_eio:
                assert isinstance(raised.value.__context__, OSError)
        assert (watchdog._held, watchdog._deferred) == (0, False) and not went_on


@contextlib.contextmanager
def _channels(n: int):
    """``n`` worker channels (``watchdog.Channel``), each holding a
    ``stats`` and a ``done``, closed afterwards."""
    import multiprocessing

    from state_machines.runs.watchdog import Channel

    ctx = multiprocessing.get_context("fork")
    channels = {i: Channel(ctx) for i in range(n)}
    kept = list(channels.values())
    for i, channel in channels.items():
        channel.put(("stats", i))
        channel.put(("done", i))
    try:
        yield channels
    finally:
        for channel in kept:
            channel.reader.close()
            channel.writer.close()


@contextlib.contextmanager
def _signals():
    """The command's stop-signal handlers (``watchdog.Signals``) installed."""
    from state_machines.runs.watchdog import Signals

    signals = Signals()
    signals.install()
    try:
        yield signals
    finally:
        signals.restore()


def _forkserver_of(proc, within: float = WAIT_S) -> int:
    """The pid of ``proc``'s forkserver, once it runs."""
    deadline = time.monotonic() + within
    while True:
        for entry in Path("/proc").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                if (entry.name.isdigit() and int((entry / "stat").read_text().rpartition(")")[2].split()[1]) == proc.pid
                        and b"forkserver" in (entry / "cmdline").read_bytes()):
                    return int(entry.name)
        assert proc.poll() is None and time.monotonic() < deadline, "the command started no forkserver"
        time.sleep(0.01)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="no /proc/PID/maps here")
def test_ctrl_c_while_the_forkserver_imports_torch_is_exit_130(tmp_path):
    """A long run's forkserver imports torch and the harness before it
    serves a worker, and it sets SIGINT aside only after that: a Ctrl-C
    (to the whole group, as a terminal sends it) printed its
    KeyboardInterrupt traceback, 40 lines, under the command's own
    'interrupted'.  It now ignores SIGINT from its first preload."""
    def ctrl_c_as_torch_loads(proc) -> str:
        server = _forkserver_of(proc)
        deadline = time.monotonic() + WAIT_S
        while "libtorch" not in Path(f"/proc/{server}/maps").read_text():
            assert time.monotonic() < deadline, "the forkserver never loaded libtorch"
            time.sleep(0.002)
        os.killpg(proc.pid, signal.SIGINT)
        return ""

    stdout, stderr, code = _in_a_session(tmp_path, ["--target", "builtin:token", "--duration", "1m", "-j", "2"],
                                         ctrl_c_as_torch_loads)
    assert code == 130, stdout + stderr
    assert "Traceback" not in stderr and "worker_died" not in stdout, stdout + stderr


def test_a_reader_that_leaves_does_not_cut_the_run_short(tmp_path):
    """``kv-lockstep fuzz | head -1``: the first write after the reader left
    raised BrokenPipeError and the command ended at once with 141, the
    failure unshrunk and its trace not written.  Now its words go nowhere
    from there, as with a closed stdout, and it ends as it would have."""
    read, write = os.pipe()
    os.close(read)  # the reader gone before the first word
    try:
        run = subprocess.run([sys.executable, "-m", "state_machines.cli", "fuzz", "--mutant", "alias", "--seed", "2",
                              "--trace-dir", str(tmp_path / "traces")],
                             cwd=tmp_path, env=_env(tmp_path), stdout=write, stderr=subprocess.PIPE, text=True, timeout=WAIT_S)
    finally:
        os.close(write)
    assert (run.returncode, run.stderr) == (1, ""), run.stderr
    assert len(list((tmp_path / "traces").glob("*.json"))) == 2  # both failures, shrunk


def test_a_crash_as_ctrl_c_comes_is_still_a_death(pools):
    """A worker that crashed as the command was interrupted died of its
    own: its end is judged (worker_died, a trace) though the command was
    told to stop, where only an end the signal explains is not."""
    stdout, stderr, code = _in_a_session(pools, ["--target", "bad_pools:crashes_as_ctrl_c_comes", "--seed", "0", *LONG])
    assert code == 130, stdout + stderr
    assert "Traceback" not in stderr and "was killed by SIGSEGV" in stdout, stdout + stderr
    assert kept(pools, "worker_died").invariant == "worker_died"


def test_bad_input_to_a_stderr_whose_reader_left_is_still_exit_2(tmp_path):
    """``kv-lockstep fuzz --target nosuch:thing 2>&1 | true``: the one line's
    write raised BrokenPipeError inside the handler of the bad input, and
    the command ended with exit 1, a failure's (helper-89)."""
    read, write = os.pipe()
    os.close(read)
    try:
        run = subprocess.run([sys.executable, "-m", "state_machines.cli", "fuzz", "--target", "nosuch:thing"],
                             cwd=tmp_path, env=_env(tmp_path), stdout=write, stderr=write, timeout=WAIT_S)
    finally:
        os.close(write)
    assert run.returncode == 2
