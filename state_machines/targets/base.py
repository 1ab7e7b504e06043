"""What every kind of target shares: ``Target``, ``TargetError``, and
calling a factory with the constructor arguments it names."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import mmap
import os
import signal
import sys
import time
import warnings
import weakref
from typing import Any, Callable

from attrs import field, frozen

from state_machines.config import BUILD_TIMEOUT_S
from state_machines.orphans import call_user_code, die_with_parent


class TargetError(Exception):
    """Bad user input about what to run; the CLI prints it on one line, exit 2."""


@frozen
class Target:
    spec: str
    factory: Callable[..., Any]
    # Page sizes the target accepts, or None for any.
    page_sizes: tuple[int, ...] | None = None
    # The least page size it takes (a page-interleaved pool's caller sends
    # page size 1 to alloc(), which it does not provide).
    min_page_size: int = 1
    # Whether free_group_begin() defers frees (HiSparse-style pools don't).
    defers_frees: bool = True
    # The family (harness) it names, or None: the registry recognizes it.
    family: str | None = None
    # The built-in mutant, and the settings its bug needs to show at all
    # (``Mutant.needs``: ``{"need_sort": True}``, ``{"min_page_size": 2}``).
    mutant: str | None = None
    needs: dict = field(factory=dict)


def exception_text(exc: BaseException) -> str:
    """``str(exc)``; where that raises (a user's ``__str__``), a note saying
    so, not a second raise."""
    try:
        return str(exc)
    except BaseException as inner:  # noqa: BLE001 - the user's __str__, whatever it raises
        return f"<its str() raised {type(inner).__name__}>"


def one_line(exc: BaseException) -> str:
    """An exception as one line of at most about 200 characters."""
    text = " ".join(exception_text(exc).split())
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@contextlib.contextmanager
def quiet():
    """sglang warns and logs freely on a GPU-less host.  torch's own logger
    too, which has a handler of its own and does not pass to the root: its
    ``No CUDA runtime is found`` (``torch.utils.cpp_extension``, imported by
    sglang) was a second line on stderr before a bad-input line."""
    loggers = [logging.getLogger(), logging.getLogger("torch")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger, level in zip(loggers, levels):
            logger.setLevel(max(level, logging.ERROR))
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


# Each example builds its allocator anew; reading the factory's signature
# cost a third of a build.  Weak keys: a factory made per build (a closure)
# leaves with its build.
_PARAMETERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _parameters(factory: Callable[..., Any]):
    """``inspect.signature(factory).parameters``, read once per factory (one
    that takes no weak reference, or no hash, each time)."""
    try:
        return _PARAMETERS[factory]
    except KeyError:
        params = _PARAMETERS[factory] = inspect.signature(factory).parameters
        return params
    except TypeError:
        return inspect.signature(factory).parameters


def is_passed(factory: Callable[..., Any], name: str) -> bool:
    """Whether ``construct`` passes ``factory`` the parameter ``name``: it
    names it, takes ``**kwargs``, or has a signature that cannot be read
    (then everything is passed)."""
    try:
        params = _parameters(factory)
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def construct(factory: Callable[..., Any], **available: Any):
    """Call ``factory`` with the parameters it names among ``available``, by
    keyword: a factory ``f(size, page_size, device, need_sort)`` and a class
    such as sglang's ``TokenToKVPoolAllocator(size, dtype, device, kvcache,
    need_sort)`` are both served.  A required parameter nobody can supply is
    a ``TargetError``."""
    try:
        params = _parameters(factory)
    except (TypeError, ValueError):
        return call_user_code(factory, **available)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return call_user_code(factory, **available)
    kwargs = {}
    for name, p in params.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in available:
            kwargs[name] = available[name]
        elif p.default is p.empty:
            name_of = getattr(factory, "__name__", repr(factory))
            raise TargetError(f"{name_of}() wants parameter {name!r}, which kv-lockstep cannot supply (it supplies {', '.join(available)})")
    return call_user_code(factory, **kwargs)


# The limit travels in the environment, so that the command's workers
# that start afresh (spawn, forkserver: a device run, a long run, --cover)
# check their own import of the module under it too.
_IMPORT_LIMIT_ENV = "KV_LOCKSTEP_IMPORT_LIMIT_S"


def limit_imports(seconds: float) -> None:
    """How long ``import_death`` waits for a module's import from now on,
    here and in the processes started from here: the command's
    ``--build-timeout``."""
    os.environ[_IMPORT_LIMIT_ENV] = repr(float(seconds))


def import_limit_s() -> float:
    """``limit_imports``'s seconds, or ``BUILD_TIMEOUT_S`` where none (or no
    positive number) was set."""
    try:
        seconds = float(os.environ[_IMPORT_LIMIT_ENV])
    except (KeyError, ValueError):
        return BUILD_TIMEOUT_S
    return seconds if seconds > 0 else BUILD_TIMEOUT_S


def import_death(module_name: str) -> str | None:
    """How a fork of this process ended while it imported ``module_name``
    (``exited with code 7``, ``was killed by SIGSEGV``, ``did not return
    within 120 s``: ``limit_imports``, after which it is killed), or None
    where the import returned or raised there: the caller then imports it
    itself, and reports a raise as it reports any.  Without this, a user's
    module that calls ``os._exit`` or crashes at its top level would end
    the command with no word, and one that never returns would hang it,
    before any watched worker starts.  Nothing is forked for
    a module already imported (a worker forked from a process that checked
    it), one of sglang's (its release loads unchecked for ``sglang:`` kinds
    too, and twice would cost its import twice), or where there is no
    fork.  The child reads nothing and its output goes nowhere: the module
    speaks once, when the caller imports it."""
    if module_name in sys.modules or module_name.partition(".")[0] == "sglang" or not hasattr(os, "fork"):
        return None
    # The child's word that the import returned: a byte of memory shared
    # across the fork, which no file descriptor names (a module may close
    # every descriptor, and open its own files under their numbers).
    word = mmap.mmap(-1, 1)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child, which leaves by os._exit alone
        try:
            _die_with_parent(parent)
            me = os.getpid()
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):  # it reads no input of the user's, and says nothing twice
                os.dup2(null, fd)
            try:
                importlib.import_module(module_name)
            except BaseException:  # noqa: BLE001 - a raise is the caller's to report, from its own import
                pass
            if os.getpid() == me:  # not a copy the module forked, which goes on here while the child ends
                word[0] = _RETURNED
        finally:
            os._exit(0)  # not exit(): the parent's buffers and exit handlers are the parent's
    limit = import_limit_s()
    status = None
    try:
        status = _ended_within(pid, limit)
        returned = word[0] == _RETURNED
    finally:
        word.close()
        if status is None:  # still importing past the limit, or interrupted while it imports: it goes
            with contextlib.suppress(ProcessLookupError, ChildProcessError):  # reaped as the interrupt came
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
    if status is None:
        return f"did not return within {limit:g} s"
    if returned:
        return None
    if status is _UNREAD:
        return "ended before it returned (SIGCHLD is ignored here: how it ended is unknown)"
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        return f"was killed by {name}"
    return f"exited with code {os.waitstatus_to_exitcode(status)}"


_RETURNED = ord(".")

# ``_ended_within``'s word for a child that ended where its wait status
# cannot be read: SIGCHLD ignored (a library caller's, which the command's
# ``main`` would have put back) has the kernel reap it at once, and waitpid
# then finds no such child.
_UNREAD = object()


def _ended_within(pid: int, limit: float) -> int | object | None:
    """Child ``pid``'s wait status once it ends, reaped, ``_UNREAD`` where
    it ended and the kernel reaped it, or None where it is still running
    after ``limit`` seconds.  The child itself is watched, not a pipe of
    its, which a module can close, or hand to a process of its own that
    outlives it."""
    deadline = time.monotonic() + limit
    pause = 0.001
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return _UNREAD
        if done:
            return status
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.02)


def _die_with_parent(parent: int) -> None:
    """In import_death's child: have the kernel SIGKILL it when ``parent``
    dies, and leave at once where the parent died before that was set.  A
    command killed outright while the child hangs in a user's import would
    otherwise leave the child running on, orphaned.  Where there is no
    prctl, only the check of the parent is made."""
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(0)
