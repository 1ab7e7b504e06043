"""Children that die with the process that made them (Linux's
``PR_SET_PDEATHSIG``).  A command killed outright, by SIGKILL too, would
otherwise leave a forked worker or import check running on, orphaned."""

from __future__ import annotations

import ctypes
import os

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
