"""An allocator that raises or hangs fails the run with a trace, like any broken invariant."""

import os
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest

from allocators import TokenAllocator
from state_machines.config import Config
from state_machines.harness import Step
from state_machines.harness.alarm import alarm_is_private
from state_machines.runs.runner import fuzz

REPO = Path(__file__).resolve().parent.parent


class RaisesOnAlloc(TokenAllocator):
    """A token pool whose alloc() always raises."""

    def alloc(self, need_size):
        raise RuntimeError("pool on fire")


# The line of the raise above, which the failure must name.
RAISE_LINE = RaisesOnAlloc.alloc.__code__.co_firstlineno + 1


class AssertsOnAlloc(TokenAllocator):
    """A token pool whose alloc() fails a bare assert: an exception without a message."""

    def alloc(self, need_size):
        raise AssertionError


class HangsOnAlloc(TokenAllocator):
    """A token pool whose alloc() does not return for a minute."""

    def alloc(self, need_size):
        time.sleep(60)


def _target(cls) -> Config:
    return Config(target=f"{__name__}:{cls.__name__}")


def test_an_exception_in_the_allocator_is_an_allocator_raised_failure():
    """fuzz reports allocator_raised, naming the call, the exception and its file:line, shrunk to one alloc."""
    outcome = fuzz(_target(RaisesOnAlloc), max_examples=20)
    assert [t.invariant for t in outcome.failures] == ["allocator_raised"]
    (trace,) = outcome.failures
    assert trace.detail == f"alloc(1) raised RuntimeError: pool on fire (at {__file__}:{RAISE_LINE})"
    assert trace.steps == (Step("alloc", {"n": 1}),)


def test_an_exception_without_a_message_is_named_alone():
    """An exception with no message reads 'raised AssertionError (at ...)', not 'raised AssertionError:  (at ...)'."""
    from state_machines.harness import InvariantViolation, build

    state = build(_target(AssertsOnAlloc))
    with pytest.raises(InvariantViolation) as raised:
        state.alloc(1)
    detail = raised.value.detail
    line = AssertsOnAlloc.alloc.__code__.co_firstlineno + 1
    assert detail == f"alloc(1) raised AssertionError (at {__file__}:{line})"


def test_an_allocator_call_past_the_limit_is_an_allocator_hung_failure():
    """fuzz reports allocator_hung when alloc() outlives the per-call limit, shrunk to one alloc."""
    outcome = fuzz(attrs.evolve(_target(HangsOnAlloc), call_timeout_s=0.2), max_examples=20)
    assert [t.invariant for t in outcome.failures] == ["allocator_hung"]
    (trace,) = outcome.failures
    assert trace.detail == "alloc(1) hung: no return within 0.2 s"
    assert trace.steps == (Step("alloc", {"n": 1}),)


def test_a_call_made_inside_a_timed_call_leaves_the_outer_deadline_standing():
    """A nested timed call (an allocator calling back into the harness) returning does not switch the outer timer off."""
    from state_machines.harness.lockstep import _with_deadline

    def outer():
        _with_deadline(5.0, lambda: None, ())
        time.sleep(2)  # past the outer call's 0.2 s: must be interrupted

    t0 = time.perf_counter()
    try:
        _with_deadline(0.2, outer, ())
    except TimeoutError:
        pass
    else:
        raise AssertionError("the outer call ran past its deadline")
    assert time.perf_counter() - t0 < 1.5


def test_a_call_after_one_with_a_longer_limit_is_cut_at_its_own():
    """The timer an earlier call left running (10 s ahead) does not stand for a later call's shorter limit."""
    from state_machines.harness.lockstep import _with_deadline

    _with_deadline(10.0, lambda: None, ())
    t0 = time.perf_counter()
    try:
        _with_deadline(0.2, time.sleep, (2,))
    except TimeoutError:
        pass
    else:
        raise AssertionError("the call ran past its 0.2 s limit")
    assert time.perf_counter() - t0 < 1.5


def test_the_timer_left_by_a_call_does_nothing_when_it_fires_between_calls():
    """The timer outlives the call; firing after it, outside any call, it raises nothing."""
    from state_machines.harness.lockstep import _with_deadline

    _with_deadline(0.1, lambda: None, ())
    time.sleep(0.4)  # the timer fires here, between calls


def test_a_call_within_its_limit_runs_on_when_an_earlier_calls_timer_fires_inside_it():
    """A timer set for an earlier call's deadline fires inside a later call that is
    still within its own limit: the call is not cut, it runs to the end."""
    from state_machines.harness import alarm
    from state_machines.harness.lockstep import _with_deadline, disarm_call_timer

    disarm_call_timer()  # none an earlier test left
    _with_deadline(2.4, lambda: None, ())  # the timer: due at 2.4 s
    time.sleep(0.8)
    due = []

    def call():
        due.append(alarm.alarm_left())
        time.sleep(2.0)

    # Deadline 3.2 s.  The timer, kept (at least half the limit ahead, had
    # the call started as late as 1.2 s), fires at 2.4 s, inside the call,
    # which ends at 2.8 s: 0.4 s of margin each way.
    _with_deadline(2.4, call, ())
    assert due[0] < 2.0, f"the earlier call's timer was not kept: due in {due[0]:.2f} s"


@pytest.mark.skipif(not alarm_is_private(), reason="setitimer's alarm here: no timer aimed at one thread")
def test_the_call_timer_signals_the_main_thread_not_the_process():
    """setitimer's SIGALRM went to the process, and the kernel may hand it
    to any thread: where another took it (an execnet thread in CI), the
    main thread asleep in a timed call was never woken and the suite hung.
    Here the main thread blocks SIGALRM, so a signal sent to the process
    goes to the other thread at once; one sent to the main thread waits
    there, pending."""
    import signal
    import threading

    from state_machines.harness.lockstep import _with_deadline, disarm_call_timer

    stop = threading.Event()
    other = threading.Thread(target=stop.wait)  # started with SIGALRM open
    other.start()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    try:
        _with_deadline(0.05, lambda: None, ())  # the timer: 0.05 s from now
        time.sleep(0.3)
        pending = signal.SIGALRM in signal.sigpending()
        signal.sigtimedwait({signal.SIGALRM}, 0)  # taken here, never delivered
        disarm_call_timer()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        stop.set()
        other.join()
    assert pending, "the alarm went to another thread, not the main one"


def _cut_short_in_a_child(limit: float, seconds: float, first=lambda: None) -> bool:
    """Whether, in a forked child, after ``first()``, a timed call asleep
    for ``seconds`` under ``limit`` is cut short (``TimeoutError``)."""
    from state_machines.harness.lockstep import _with_deadline

    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            first()
            _with_deadline(limit, time.sleep, (seconds,))
        except TimeoutError:
            code = 0
        finally:
            os._exit(code)  # never back into pytest from the child
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


@pytest.mark.skipif(not alarm_is_private(), reason="setitimer's alarm here: no timer of the harness's own")
def test_a_call_is_timed_where_the_timer_the_process_believes_it_has_is_not_there():
    """A forked child given the pid of a process gone that owned a timer
    believed it had one: setting it failed (EINVAL), unseen, and the
    child's calls ran untimed.  Here the child is told outright that the
    parent's timer is its own."""
    from state_machines.harness import alarm
    from state_machines.harness.lockstep import _with_deadline, disarm_call_timer

    _with_deadline(1.0, lambda: None, ())  # the parent's timer, made if not yet
    parents = alarm._timer

    def believe_the_parents_timer_its_own():
        alarm._timer, alarm._owner = parents, os.getpid()

    cut = _cut_short_in_a_child(0.2, 2.0, believe_the_parents_timer_its_own)
    disarm_call_timer()
    assert cut, "the child's 2 s call under a 0.2 s limit ran untimed"


@pytest.mark.parametrize("timer", ["private", "setitimer"])
def test_a_stray_sigalrm_between_calls_does_not_leave_the_timer_set_past_a_disarm(timer, monkeypatch):
    """A SIGALRM not the timer's (a kill) reaches the handler between calls,
    which then no longer knew the timer was set, and the disarm left it."""
    import signal

    from state_machines.harness import alarm
    from state_machines.harness.lockstep import _with_deadline, disarm_call_timer

    if timer == "private" and not alarm_is_private():
        pytest.skip("setitimer's alarm here: no timer of the harness's own")
    disarm_call_timer()
    if timer == "setitimer":
        monkeypatch.setattr(alarm, "_calls", None)
    _with_deadline(5.0, lambda: None, ())
    os.kill(os.getpid(), signal.SIGALRM)
    time.sleep(0.05)  # the handler runs here
    disarm_call_timer()
    assert alarm.alarm_left() == 0.0


def test_a_disarm_switches_off_setitimers_timer_it_set_though_another_handler_came_since(monkeypatch):
    """setitimer's timer repeats once due (a SIGALRM can be lost); where code
    installed its own SIGALRM handler after the calls, the disarm still
    switches the harness's timer off, or that handler got one every limit
    and the interpreter's exit, SIGALRM's default back, died of one.  A
    timer that other code set since is left alone."""
    import signal

    from state_machines.harness import alarm
    from state_machines.harness.lockstep import _with_deadline, disarm_call_timer

    disarm_call_timer()
    monkeypatch.setattr(alarm, "_calls", None)
    got = []
    before = signal.getsignal(signal.SIGALRM)
    try:
        _with_deadline(0.1, lambda: None, ())
        signal.signal(signal.SIGALRM, lambda *a: got.append(1))
        disarm_call_timer()
        time.sleep(0.35)
        assert (got, alarm.alarm_left()) == ([], 0.0)
        signal.setitimer(signal.ITIMER_REAL, 30.0)  # another's
        disarm_call_timer()
        assert alarm.alarm_left() > 25.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def test_the_timer_repeats_at_the_limit_of_the_call_it_was_set_for(monkeypatch):
    """Once due, the timer repeats every call limit (a SIGALRM can be lost);
    a call under another limit sets it again, so a hang under the
    shrinker's short limit is not reported one long limit late."""
    import signal

    from state_machines.harness import alarm
    from state_machines.harness.lockstep import _with_deadline, disarm_call_timer

    disarm_call_timer()
    monkeypatch.setattr(alarm, "_calls", None)  # setitimer's, whose repeat getitimer shows
    try:
        _with_deadline(0.8, lambda: None, ())
        assert signal.getitimer(signal.ITIMER_REAL)[1] == pytest.approx(0.8)
        time.sleep(0.3)
        # Due in 0.5 s, within this call's 0.6 s and at least half of it
        # ahead: it would be kept, but for its repeat.
        _with_deadline(0.6, lambda: None, ())
        assert signal.getitimer(signal.ITIMER_REAL)[1] == pytest.approx(0.6)
    finally:
        disarm_call_timer()
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_timer_a_lockstep_left_set_does_not_end_the_interpreters_exit():
    """A Lockstep driven directly leaves the call timer set; where it fired
    in the interpreter's exit, after SIGALRM's default was put back, the
    process died of it (-14), its work done."""
    code = ("import time\nfrom state_machines.harness.lockstep import _with_deadline\n"
            "class Slow:\n    def __del__(self, sleep=time.sleep):\n        sleep(0.6)\n"
            "teardown = Slow()\n_with_deadline(0.3, lambda: None, ())\nprint('done')\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stdout) == (0, "done\n"), run.stderr


def test_no_call_timer_outlives_a_run():
    """The timer calls leave running is switched off as fuzz and replay return:
    an alarm of theirs must not reach code that runs after them."""
    from state_machines.harness.alarm import alarm_left
    from state_machines.runs.trace import replay

    outcome = fuzz(Config(target="builtin:token"), max_examples=5)
    assert not outcome.failures
    assert alarm_left() == 0.0
    trace = fuzz(_target(RaisesOnAlloc), max_examples=5).failures[0]
    assert replay(trace) is not None
    assert alarm_left() == 0.0


def test_a_forked_child_times_its_calls_though_the_parent_left_its_timer_set():
    """fork copies no interval timer: a child that trusted the parent's would
    let its first calls run untimed (the watched run forks its worker after
    the CLI's own timed calls)."""
    from state_machines.harness.lockstep import _with_deadline, disarm_call_timer

    _with_deadline(1.0, lambda: None, ())  # the parent's timer: 1 s from now
    # Same limit: the parent's timer, due before this call's deadline and
    # more than half a limit ahead, is one the call would keep.
    cut = _cut_short_in_a_child(1.0, 2.5)
    disarm_call_timer()
    assert cut, "the child's 2.5 s call under a 1 s limit ran untimed"


def test_rows_are_written_through_the_tensor_where_its_numpy_bridge_fails(monkeypatch):
    """A torch whose NumPy bridge raises (built against another NumPy): the
    harness writes its rows through the tensor instead, and the step checks out."""
    import torch

    from state_machines.harness import build

    def broken(self, *args, **kwargs):
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", broken)
    state = build(Config(target="builtin:token"))
    state.alloc(4)
    assert state._rows_host() is None
    assert (state.rows[0, :4] > 0).all()


@pytest.mark.parametrize("seconds", [1e-9, 0.05, 1e19, float("nan")])
def test_a_call_limit_no_allocator_can_meet_is_refused_by_the_library_too(seconds):
    """fuzz(Config(call_timeout_s=1e-9)) failed builtin:token as
    allocator_hung on its first call: the floor the command line and a
    trace keep holds for a library caller's Config as well."""
    with pytest.raises(ValueError, match="call_timeout_s is .*, not a number of seconds in \\[0.1, 86400\\]"):
        Config(call_timeout_s=seconds)
