"""Turning a ``--target`` string into an allocator factory.

- ``builtin:NAME`` — this project's allocators (``allocators.BUILTINS``),
  with ``--mutant`` choosing a named bug variant;
- ``sglang:NAME`` — the real allocators of an installed sglang, or of the
  checkout named by ``--sglang-path``;
- ``MODULE:ATTR`` — any importable factory, called as
  ``factory(size=, page_size=, device=, need_sort=)``.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from attrs import frozen

import allocators


class TargetError(Exception):
    """Bad user input about what to run; the CLI prints it on one line, exit 2."""


@frozen
class Target:
    spec: str
    factory: Callable[..., Any]
    # Page sizes the target accepts, or None for any.
    page_sizes: tuple[int, ...] | None = None
    # Whether free_group_begin() defers frees (HiSparse-style pools don't).
    defers_frees: bool = True
    # Which harness drives it: "free_group" (one pool) or "swa" (full + SWA pools).
    family: str = "free_group"
    # allocator -> {rule: reason} for rules it cannot run here (e.g. a method
    # that needs a device kernel); those rules are disabled, not failed.
    rule_gate: Callable[[Any], dict[str, str]] | None = None


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
        family=getattr(cls, "family", "free_group"),
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
        family=getattr(factory, "family", "free_group"),
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
    try:
        return target.factory(size=size, page_size=page_size, device=device, need_sort=need_sort)
    except TargetError:
        raise
    except Exception as exc:
        raise TargetError(f"cannot build {target.spec}: {type(exc).__name__}: {exc}") from None
