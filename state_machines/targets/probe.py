"""Capabilities, probed for every target (built-in, sglang or custom).

An optional step runs only where its method runs here: each method the
caller sends a step to (``caller_sends``: at page size 1, sglang's callers
send decode and extend to ``alloc()``, which every target has) is called once
on a throwaway copy of a freshly built allocator, and a method that raises
(``NotImplementedError`` in a base class, a device kernel, an assertion
about the pool's shape) disables its step with the reason, which ``fuzz``
and ``targets`` print.  It is never a failure.  The free-group steps
(``begin``, ``end``) go off together where a custom target says it has no free
groups (``NotImplementedError``; ``_groups``).  Probed once per class,
page size, device, ``need_sort`` and ``latent``, on the default pool size
(``disabled_steps``), the verdict kept for every size.
"""

from __future__ import annotations

import copy
import inspect
import signal
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from state_machines.orphans import call_user_code
from state_machines.targets.base import exception_text, one_line, quiet


def _decode(allocator, page_size: int, device: str):
    # One request of page_size + 1 tokens growing by one: a mid-page slot.
    i64 = dict(dtype=torch.int64, device=device)
    return allocator.alloc_decode(
        torch.tensor([page_size + 1], **i64), torch.tensor([page_size + 1]), torch.tensor([page_size - 1], **i64)
    )


def _extend(allocator, page_size: int, device: str):
    # A batch of two: one request continuing mid-page (its prefix ends one
    # token into the reserved page 0, which no fresh pool hands out, so the
    # continued slots and the new pages cannot meet: sglang's debug check
    # would call that a slot handed out twice), one fresh; each grows by
    # page_size + 1 tokens.
    # An allocator taking rotation bases (page-interleaved) is sent what its
    # caller sends: page-aligned prefixes (one page here) and one base each.
    rotated = _takes(allocator.alloc_extend, "rotation_bases")
    prefix, grow = ([page_size, 0] if rotated else [page_size + 1, 0]), page_size + 1
    last = [2 * page_size - 1 if rotated else 0, -1]
    seq = [p + grow for p in prefix]
    i64 = dict(dtype=torch.int64)
    # The continuing chain's last page is page 1, its base that page's class.
    more = dict(rotation_bases=[1 % getattr(allocator, "shard_size", 1), None]) if rotated else {}
    return allocator.alloc_extend(
        torch.tensor(prefix, device=device, **i64), torch.tensor(prefix, **i64),
        torch.tensor(seq, device=device, **i64), torch.tensor(seq, **i64),
        torch.tensor(last, device=device, **i64), 2 * grow, **more,
    )


def _takes(method, name: str) -> bool:
    try:
        return name in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


# step -> (the method it needs, how to call it once)
OPTIONAL: dict[str, tuple[str, Callable[[Any, int, str], Any]]] = {
    "decode": ("alloc_decode", _decode),
    "extend": ("alloc_extend", _extend),
}


def caller_sends(step: str, page_size: int, latent: bool) -> str | None:
    """The allocator method sglang's caller sends ``step`` to, when it is
    an optional one (``OPTIONAL``); None when the caller uses ``alloc()``.

    At page size 1 every release's caller sends decode and extend to
    ``alloc()`` (``alloc_token_slots`` in ``mem_cache/allocation.py``),
    never to ``alloc_decode`` / ``alloc_extend``; ``latent`` drives those
    anyway, outside the contract."""
    if step not in OPTIONAL:
        return None
    return OPTIONAL[step][0] if page_size > 1 or latent else None


_PROBED: dict[tuple, dict[str, str]] = {}


def disabled_steps(allocator, *, page_size: int, device: str, latent: bool = False, own=None) -> dict[str, str]:
    """Optional steps this allocator cannot run here, each with the reason.
    Only the methods the caller sends a step to are probed (``caller_sends``).
    The verdict is kept for every pool size, so it is taken on the pool
    ``own()`` builds (``family.build``: the target's default size, 10
    pages, where the configuration pins another) where ``own`` is given
    and builds: on a pool too small for the probe's calls a method may
    return before it reaches what fails here (0.5.18's NPU ``alloc_extend``
    returns None on a 2-page pool before it imports ``sgl_kernel_npu``), and
    the first size built would decide for all."""
    key = (type(allocator), page_size, device, getattr(allocator, "need_sort", None), latent)
    if key not in _PROBED:
        _PROBED[key] = _probe(_own_or(allocator, own), page_size, device, latent)
    return _PROBED[key]


def _own_or(allocator, own):
    """``own()``'s allocator where it builds one of the same class; else ``allocator``."""
    if own is None:
        return allocator
    try:
        built = own()
    except Exception:  # noqa: BLE001 - the pool the run asked for is probed instead
        return allocator
    return built if type(built) is type(allocator) else allocator


# The free-group steps, and the method each calls.
GROUP_STEPS = {"begin": "free_group_begin", "end": "free_group_end"}
# Packages whose allocators provide what they define (free groups, segment
# frees): a NotImplementedError there (a base class's, one of our stand-ins')
# is a failure, not a capability.
OWN_PACKAGES = frozenset({"sglang", "allocators", "state_machines"})


def _groups(allocator) -> dict[str, str]:
    """``begin`` and ``end`` with the reason, where opening and closing an
    empty free group on a throwaway copy raises ``NotImplementedError`` (a
    target that keeps free groups out, such as a bench bug that reaches a
    release's decode bug past its group bugs); else nothing.  Any other
    raise is left to the run, which reports it: an empty group that cannot
    close is the allocator's failure, not a capability.  Only a custom
    target may say so: sglang's allocators and this project's have free
    groups (sglang's scheduler calls them), so there a raise is a failure
    the run reports, never a step turned off."""
    if type(allocator).__module__.partition(".")[0] in OWN_PACKAGES:
        return {}
    if not all(callable(getattr(allocator, m, None)) for m in GROUP_STEPS.values()):
        return {}
    try:
        throwaway = copy.deepcopy(allocator)
    except Exception:  # noqa: BLE001 - uncopied, the steps stay on and the run judges them
        return {}
    for step, method in GROUP_STEPS.items():
        try:
            with quiet():
                call_user_code(getattr(throwaway, method))
        except NotImplementedError as exc:
            # Both go: an end with no begin runs only the repeated end.
            return dict.fromkeys(GROUP_STEPS, f"no free groups: {method}: {one_line(exc)}")
        except BaseException as exc:  # noqa: BLE001 - the run reports it (see above)
            real_interrupt(exc)
            return {}
    return {}


def real_interrupt(exc: BaseException) -> None:
    """Raise ``exc`` again where it may be a real Ctrl-C (SIGINT has
    Python's default handler, as in a process of the user's own): a probe
    must not take that for a method that cannot run, nor a call
    (``Lockstep._call``) for the allocator's failure.  In a worker, which
    ignores SIGINT, the allocator's own ``KeyboardInterrupt`` is its
    answer, as its ``SystemExit`` or any class of its own derived from
    ``BaseException`` is (they ended the command in a traceback)."""
    if isinstance(exc, KeyboardInterrupt) and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        raise exc


def _probe(allocator, page_size: int, device: str, latent: bool) -> dict[str, str]:
    out = _groups(allocator)
    for step, (method, call) in OPTIONAL.items():
        if caller_sends(step, page_size, latent) is None or not callable(getattr(allocator, method, None)):
            continue
        try:
            throwaway = copy.deepcopy(allocator)
        except Exception as exc:  # noqa: BLE001 - a pool that cannot be copied cannot be probed safely
            out[step] = f"{method}: not probed, the allocator cannot be copied ({one_line(exc)})"
            continue
        try:
            with quiet():
                call_user_code(call, throwaway, page_size, device)
        except NotImplementedError:
            out[step] = f"{method}: not provided (NotImplementedError)"
        except BaseException as exc:  # noqa: BLE001 - whatever stops it here disables the step
            real_interrupt(exc)
            out[step] = f"{method}: {one_line(exc)}{_raised_at(exc)}"
    return out


def _raised_at(exc: BaseException) -> str:
    """Where a bare exception (an ``assert`` with no message) came from."""
    if exception_text(exc).strip():
        return ""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f" at {Path(last.filename).name}:{last.lineno} ({(last.line or '').strip()[:60]})"
