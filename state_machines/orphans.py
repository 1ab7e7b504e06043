"""Processes that must not run on: children that die with the process
that made them (Linux's ``PR_SET_PDEATHSIG``), since a command killed
outright, by SIGKILL too, would otherwise leave a forked worker or import
check running on, orphaned; and copies of the harness that a target's own
``os.fork`` makes, which end as the target's code returns to the harness
(``calls_user_code``)."""

from __future__ import annotations

import ctypes
import os
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _find_prctl():
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError, TypeError):  # no libc to load, no prctl in it, or no CDLL(None): not Linux
        return None
    prctl.restype = ctypes.c_int
    return prctl


# Looked up here, when the parent imports this module, never in a forked
# child: a dlopen there can deadlock on a loader lock another of the
# parent's threads held at the fork.
_PRCTL = _find_prctl()


def die_with_parent(signum: int) -> bool:
    """Ask the kernel to send this process ``signum`` when its parent dies.
    Best effort: False where there is no prctl or the kernel refused, and
    the caller's other ends (a daemon worker, a parent that kills its
    children) are then the only ones."""
    return _PRCTL is not None and _PRCTL(PR_SET_PDEATHSIG, ctypes.c_ulong(signum)) == 0


def let_the_forkserver_go() -> None:
    """In a worker: close the write end of the forkserver's liveness pipe.

    The forkserver hands every child it forks that end (so the child could
    ask it for children of its own), and the server exits only when no one
    holds it: while a worker lived, a command killed outright left the
    server, so the worker, whose parent it is, running on, orphaned.  With
    the worker's copy closed, the command's death ends the server, and the
    server's the worker (``die_with_parent``).  A worker that wants a
    forkserver of its own later gets a new one."""
    import multiprocessing.forkserver as forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is None:
        return
    server._forkserver_alive_fd = None
    server._forkserver_pid = None
    try:
        os.close(fd)
    except OSError:
        pass


def parent_died_first() -> bool:
    """In a multiprocessing worker, just after ``die_with_parent``: whether
    the process that started it had died before that (fork and spawn: this
    process is no longer its child), so that the kernel will never send the
    signal.  A forkserver's worker is the server's child: the command's
    death cannot end the server before ``let_the_forkserver_go`` (the
    worker's own copy of the liveness pipe keeps it), and after that the
    server's death is the one the kernel signals (a server killed on its
    own, by the OOM killer say, before the worker asked is not seen)."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    # Only where the starter is known to be the parent: a worker made by
    # the default context does not say how it was started.
    if parent is None or getattr(multiprocessing.current_process(), "_start_method", None) not in ("fork", "spawn"):
        return False
    return os.getppid() != parent.pid


# Copies of the harness.  A target that forks inside a call (``os.fork()``
# in ``alloc``, the child ending with ``sys.exit(0)`` or returning as the
# parent does) made a copy of the whole harness, which took the call's
# return, or its SystemExit, for the allocator's and ran the rest of the
# run: it reported a failure the parent never had (``alloc(1) raised
# SystemExit: 0``), forked anew at its own next alloc, and a short fuzz
# left thousands of processes running.  Each function that calls a
# target's code and leaves through ``leave_if_a_copy`` is registered here;
# a fork inside one of them marks the child a copy (``_after_fork``), which
# then ends as the call returns or raises into the harness, with the code
# its own exit would have had.  Nothing is flushed: the buffers it holds
# are the parent's too.  A fork the harness makes itself (a worker, the
# import check) runs inside none of them.
_CALLERS: set = set()

# Whether this process is such a copy: read after every call of the
# target's code, so a module global, not a function.
copied = False


def calls_user_code(fn):
    """Register ``fn`` as one that calls a target's code and, after each
    call, returns or raises through ``leave_if_a_copy``."""
    _CALLERS.add(fn.__code__)
    return fn


def _after_fork() -> None:
    """In a forked child: a copy where the fork ran inside a registered function."""
    global copied
    frame = sys._getframe(1)
    while frame is not None and frame.f_code not in _CALLERS:
        frame = frame.f_back
    copied = frame is not None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def leave_if_a_copy(raised: BaseException | None = None) -> None:
    """Where this process is a copy (``copied``), end it now, as the
    target's code returned (0) or raised ``raised``: a ``SystemExit``'s
    own code, 1 for anything else.  Else nothing."""
    if not copied:
        return
    code = 0
    if isinstance(raised, SystemExit):
        code = raised.code if isinstance(raised.code, int) else 0 if raised.code is None else 1
    elif raised is not None:
        code = 1
    os._exit(code & 0xFF)


@calls_user_code
def call_user_code(fn, /, *args, **kwargs):
    """``fn(*args, **kwargs)``, a target's code; a copy it forked ends here (``leave_if_a_copy``)."""
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        leave_if_a_copy(exc)
        raise
    leave_if_a_copy()
    return result
