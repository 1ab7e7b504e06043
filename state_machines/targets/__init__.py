"""Turning a ``--target`` string into an allocator factory.

- ``builtin:NAME`` — this project's allocators (``allocators.BUILTINS``),
  with ``--mutant`` choosing a named bug variant;
- ``sglang:NAME`` — the real allocators of an installed sglang, or of the
  checkout named by ``--sglang-path``;
- ``MODULE:ATTR`` — any importable factory or class, called with the
  parameters it names among ``size, page_size, device, need_sort, dtype,
  kvcache`` (so sglang's own classes load as custom targets too).
"""

from __future__ import annotations

import importlib

import allocators
from state_machines.targets.base import Target, TargetError, construct

__all__ = ["Target", "TargetError", "build", "builtin_names", "resolve"]


def builtin_names() -> list[str]:
    return sorted(allocators.BUILTINS)


def _builtin(name: str, mutant: str | None) -> Target:
    if name not in allocators.BUILTINS:
        raise TargetError(f"unknown built-in target 'builtin:{name}'; known: {', '.join('builtin:' + n for n in builtin_names())}")
    cls, mutants = allocators.BUILTINS[name]
    if mutant is not None:
        if mutant not in mutants:
            known = ", ".join(sorted(mutants)) or "none"
            raise TargetError(f"unknown mutant '{mutant}' for builtin:{name}; known: {known}")
        cls = mutants[mutant].cls
    return Target(
        spec=f"builtin:{name}",
        factory=cls,
        page_sizes=(1,) if issubclass(allocators.BUILTINS[name][0], allocators.TokenAllocator) else None,
        defers_frees=getattr(cls, "defers_frees", True),
        family=getattr(cls, "family", None),
    )


def _custom(spec: str) -> Target:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure is the user's target, not us
        raise TargetError(f"cannot import target module '{module_name}': {type(exc).__name__}: {exc}") from None
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise TargetError(f"module '{module_name}' has no attribute '{attr}'")
    if not callable(factory):
        raise TargetError(f"target '{spec}' is not callable")
    return Target(
        spec=spec,
        factory=factory,
        defers_frees=getattr(factory, "defers_frees", True),
        family=getattr(factory, "family", None),
    )


def resolve(spec: str, mutant: str | None = None, sglang_path: str | None = None) -> Target:
    """The target named by ``spec``, or a one-line ``TargetError``."""
    kind, sep, name = spec.partition(":")
    if not sep or not kind or not name:
        raise TargetError(f"target '{spec}' is not of the form builtin:NAME, sglang:NAME or MODULE:ATTR")
    if kind == "builtin":
        return _builtin(name, mutant)
    if mutant is not None:
        raise TargetError(f"--mutant applies to builtin targets only, not '{spec}'")
    if kind == "sglang":
        from state_machines.targets import sglang as sglang_targets

        return sglang_targets.resolve(name, sglang_path)
    return _custom(spec)


def build(target: Target, *, size: int, page_size: int, device: str, need_sort: bool):
    """Call the target's factory; a failure here is the user's configuration."""
    if target.page_sizes is not None and page_size not in target.page_sizes:
        allowed = ", ".join(map(str, target.page_sizes))
        raise TargetError(f"{target.spec} takes page size {allowed}, not {page_size}")
    import torch

    try:
        # The KV dtype and cache are what sglang's classes take; allocators only store them.
        return construct(
            target.factory, size=size, page_size=page_size, device=device, need_sort=need_sort,
            dtype=torch.float16, kvcache=None,
        )
    except TargetError:
        raise
    except Exception as exc:
        raise TargetError(f"cannot build {target.spec}: {type(exc).__name__}: {exc}") from None
