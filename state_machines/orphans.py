"""Children that die with the process that made them (Linux's
``PR_SET_PDEATHSIG``).  A command killed outright, by SIGKILL too, would
otherwise leave a forked worker or import check running on, orphaned."""

from __future__ import annotations

import ctypes

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
