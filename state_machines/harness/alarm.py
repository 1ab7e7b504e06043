"""The call timer's clock: SIGALRM, sent to the main thread.

``setitimer``'s SIGALRM is sent to the process, and the kernel may hand a
process's signal to any of its threads.  CPython runs a Python handler in
the main thread only, and only a signal sent to that thread cuts short a
system call it is blocked in: where another thread took it (seen in CI, an
execnet thread of a pytest-xdist worker), an allocator call asleep in
``time.sleep`` was never interrupted, and the suite hung.

On 64-bit Linux the alarm is a POSIX timer whose signal goes to one thread
(``timer_create`` with ``SIGEV_THREAD_ID``): the thread that sets it, which
the harness makes sure is the main thread.  Elsewhere, or where the timer
cannot be created, it is ``setitimer``'s, as before.  One timer per
process; a forked child has none (fork copies no timer) and creates its
own the first time it sets one.

Once due, the alarm repeats until it is set again or switched off
(``set_alarm``: one SIGALRM can be lost).  Being the harness's own, the
timer is switched off by the harness alone: code that cancels the
process's alarm (``signal.alarm(0)``) leaves it set.  ``fuzz`` and
``replay`` switch it off as they return, and an exit handler as the
interpreter exits; the harness's handler switches it off when it fires
between calls.  A ``Lockstep`` driven directly leaves it set until then,
or until ``disarm_call_timer()``; where another SIGALRM handler has been
installed meanwhile, that handler gets it, once per call limit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading

# From the kernel's uapi headers (asm-generic/siginfo.h, linux/time.h).
_SIGEV_THREAD_ID = 4
_CLOCK_MONOTONIC = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _timespec(seconds: float) -> _Timespec:
    whole = int(seconds)
    return _Timespec(whole, int((seconds - whole) * 1e9))


class _Sigevent(ctypes.Structure):
    # struct sigevent: 64 bytes on every Linux ABI; the thread id sits where
    # the union of notification details starts.
    _fields_ = [
        ("sigev_value", ctypes.c_void_p), ("sigev_signo", ctypes.c_int), ("sigev_notify", ctypes.c_int),
        ("sigev_tid", ctypes.c_int), ("_pad", ctypes.c_byte * (64 - ctypes.sizeof(ctypes.c_void_p) - 12)),
    ]


def _librt():
    """libc's (or, before glibc 2.34, librt's) timer calls; None where there
    are none, or off 64-bit Linux, where ``_Timespec``'s longs might not be
    the ABI's ``time_t`` (x32: 64 bits beside 32-bit longs)."""
    if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    for path in (None, "rt"):
        if path == "rt":
            path = ctypes.util.find_library("rt")
            if path is None:
                break
        try:
            lib = ctypes.CDLL(path, use_errno=True)  # None: the libraries this process has loaded
            calls = lib.timer_create, lib.timer_settime, lib.timer_gettime
        except (OSError, AttributeError):
            continue
        calls[0].argtypes = [ctypes.c_int, ctypes.POINTER(_Sigevent), ctypes.POINTER(ctypes.c_void_p)]
        calls[1].argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.POINTER(_Itimerspec)]
        calls[2].argtypes = [ctypes.c_void_p, ctypes.POINTER(_Itimerspec)]
        for call in calls:
            call.restype = ctypes.c_int
        return calls
    return None


_calls = _librt()
# This process's timer, and the process it was created in (None: not yet;
# the pid also tells a child forked where no at-fork hook runs, a C fork).
_timer: ctypes.c_void_p | None = None
_owner: int | None = None


def _forget() -> None:
    """In a forked child, which has no timer (fork copies none): it creates
    its own when it first sets one.  The pid alone would not tell: a child
    can be given the pid of a process gone that owned one."""
    global _timer, _owner
    _timer = _owner = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)


def _own_timer():
    """This process's timer where it has one, else None."""
    return _timer if _calls is not None and _owner == os.getpid() else None


def _thread_timer():
    """This process's timer, created on first use and aimed at the calling
    (main) thread; None where none can be created."""
    global _timer, _owner, _calls
    timer = _own_timer()
    if timer is not None or _calls is None:
        return timer
    event = _Sigevent(sigev_signo=signal.SIGALRM, sigev_notify=_SIGEV_THREAD_ID, sigev_tid=threading.get_native_id())
    timer = ctypes.c_void_p()
    # SIGALRM held back until the timer is known: a handler run in between
    # (another's alarm, inside a timed call) would make a second one.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    try:
        if _calls[0](_CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
            _calls = None  # not here (no such call, no room): setitimer from now on
            return None
        _timer, _owner = timer, os.getpid()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return _timer


def alarm_is_private() -> bool:
    """Whether the alarm is this module's own timer, which no other code
    sets or switches off (else it is the process's one ``setitimer``
    timer, which the harness shares with any other code)."""
    return _calls is not None


# The longest alarm set, in seconds: a longer one is set again for the rest
# when it fires (the harness's handler), and any spec within it is one the
# kernel takes, so the timer is never given up for a value.
_LONGEST = 2**31 - 1

# What ``set_alarm`` last gave setitimer to repeat, where the alarm is
# setitimer's (``shared_alarm_is_ours``); 0.0 before it has set one.
_shared_again = 0.0


def set_alarm(seconds: float, again: float) -> None:
    """SIGALRM to this (the main) thread ``seconds`` (> 0) from now, or
    ``_LONGEST`` seconds at most, and every ``again`` seconds after that
    until it is set again or switched off, replacing any alarm set before.

    It repeats because a SIGALRM can be lost.  CPython's blocking calls
    (``time.sleep``, ``select``, ``waitpid``), woken by one, run its
    handler and go back to their system call; one that lands after the
    handler has run and before that call is entered again (the handler set
    the timer again for a few hundred µs: ``lockstep._on_alarm``; a loaded
    machine widens the gap) wakes nothing, and a hung call slept on for
    good (seen in CI).  The next one wakes it.  The harness repeats it
    after the call's own limit, so that a call still inside C code, where
    no handler runs, is woken no more often than before (a C loop that
    starts its whole wait again on EINTR would never end under a short
    repeat)."""
    global _calls, _shared_again
    seconds = min(seconds, _LONGEST) if seconds > 1e-6 else 1e-6
    again = min(max(again, 1e-3), _LONGEST)
    spec = _Itimerspec(it_interval=_timespec(again), it_value=_timespec(seconds))
    for _attempt in range(2):
        timer = _thread_timer()
        if timer is None:
            break
        if _calls[1](timer, 0, ctypes.byref(spec), None) == 0:
            return
        _forget()  # no such timer here after all: a new one
    else:
        _calls = None  # none will take: setitimer from now on, never untimed
    signal.setitimer(signal.ITIMER_REAL, seconds, again)
    _shared_again = signal.getitimer(signal.ITIMER_REAL)[1]  # as the kernel rounded it


def shared_alarm_is_ours() -> bool:
    """Whether setitimer's timer, shared with any other code, repeats as
    ``set_alarm`` last set it to (other code that sets it again will
    rarely choose the same repeat): the harness's own, to switch off even
    where another SIGALRM handler has been installed since."""
    return _calls is None and _shared_again > 0 and signal.getitimer(signal.ITIMER_REAL)[1] == _shared_again


def cancel_alarm() -> None:
    """Switch the alarm off, where one can be set in this process."""
    global _shared_again
    timer = _own_timer()
    if timer is not None:
        _calls[1](timer, 0, ctypes.byref(_Itimerspec()), None)
    elif _calls is None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        _shared_again = 0.0  # a timer set from now on is another's


def alarm_left() -> float:
    """Seconds until the alarm is next due (once due, until it repeats);
    0.0 where none is set."""
    if _calls is None:
        return signal.getitimer(signal.ITIMER_REAL)[0]
    timer = _own_timer()
    if timer is None:
        return 0.0  # none set in this process yet
    spec = _Itimerspec()
    _calls[2](timer, ctypes.byref(spec))
    return spec.it_value.tv_sec + spec.it_value.tv_nsec / 1e9
