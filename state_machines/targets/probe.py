"""Capabilities, probed for every target (built-in, sglang or custom).

An optional step runs only where its method runs here: each is called once
on a throwaway copy of a freshly built allocator, and a method that raises
(``NotImplementedError`` in a base class, a device kernel, an assertion
about the pool's shape) disables its step with the reason, which ``fuzz``
and ``targets`` print.  It is never a failure.  Probed once per class and
pool shape.
"""

from __future__ import annotations

import copy
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from state_machines.targets.base import one_line, quiet


def _decode(allocator, page_size: int, device: str):
    # One request of page_size + 1 tokens growing by one: a mid-page slot.
    i64 = dict(dtype=torch.int64, device=device)
    return allocator.alloc_decode(
        torch.tensor([page_size + 1], **i64), torch.tensor([page_size + 1]), torch.tensor([page_size - 1], **i64)
    )


# step -> (the method it needs, how to call it once)
OPTIONAL: dict[str, tuple[str, Callable[[Any, int, str], Any]]] = {
    "decode": ("alloc_decode", _decode),
}

_PROBED: dict[tuple, dict[str, str]] = {}


def disabled_steps(allocator, *, page_size: int, device: str) -> dict[str, str]:
    """Optional steps this allocator cannot run here, each with the reason."""
    key = (type(allocator), page_size, device, getattr(allocator, "need_sort", None))
    if key not in _PROBED:
        _PROBED[key] = _probe(allocator, page_size, device)
    return _PROBED[key]


def _probe(allocator, page_size: int, device: str) -> dict[str, str]:
    out = {}
    for step, (method, call) in OPTIONAL.items():
        if not callable(getattr(allocator, method, None)):
            continue
        try:
            throwaway = copy.deepcopy(allocator)
        except Exception as exc:  # noqa: BLE001 - a pool that cannot be copied cannot be probed safely
            out[step] = f"{method}: not probed, the allocator cannot be copied ({one_line(exc)})"
            continue
        try:
            with quiet():
                call(throwaway, page_size, device)
        except NotImplementedError:
            out[step] = f"{method}: not provided (NotImplementedError)"
        except Exception as exc:  # noqa: BLE001 - whatever stops it here disables the step
            out[step] = f"{method}: {one_line(exc)}{_raised_at(exc)}"
    return out


def _raised_at(exc: BaseException) -> str:
    """Where a bare exception (an ``assert`` with no message) came from."""
    if str(exc).strip():
        return ""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f" at {Path(last.filename).name}:{last.lineno} ({(last.line or '').strip()[:60]})"
