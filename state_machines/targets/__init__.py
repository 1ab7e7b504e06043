"""Turning a ``--target`` string into an allocator factory.

- ``builtin:NAME`` — this project's allocators (``allocators.BUILTINS``),
  with ``--mutant`` choosing a named bug variant;
- ``sglang:NAME`` — the real allocators of an installed sglang, or of the
  checkout named by ``--sglang-path``;
- ``MODULE:ATTR`` — any importable factory or class, called with the
  parameters it names among ``size, page_size, device, need_sort, dtype,
  kvcache`` (so sglang's own classes load as custom targets too); with
  ``--sglang-path`` that release is loaded first, so the factory may
  build on its classes.
"""

from __future__ import annotations

import importlib
import importlib.util

import allocators
from state_machines.targets.base import Target, TargetError, construct, import_death, one_line

__all__ = ["Target", "TargetError", "build", "builtin_names", "builtin_page_sizes", "describe_needs", "resolve", "unmet_need"]

# What the harness calls on every allocator; a factory that returns something
# without them is bad input, not a failure.
ALLOCATOR_METHODS = ("alloc", "free", "free_group_begin", "free_group_end", "available_size")
# A family whose allocators have no free groups names what it calls instead.
FAMILY_METHODS = {"mamba": ("alloc", "free", "alloc_group_begin", "alloc_group_end", "available_size")}
# Failures of user code that are bad input: an import or a factory that
# raises, exits or interrupts itself.
_USER_FAILURES = (BaseException,)  # its own BaseException subclasses and GeneratorExit too


def builtin_names() -> list[str]:
    return sorted(allocators.BUILTINS)


def builtin_page_sizes(name: str) -> tuple[int, ...] | None:
    """The page sizes a built-in target takes (None: any): a token pool's
    and a class that says ``page_sizes`` (Mamba's slots) take 1 only."""
    cls = allocators.BUILTINS[name][0]
    return getattr(cls, "page_sizes", None) or ((1,) if issubclass(cls, allocators.TokenAllocator) else None)


def _builtin(name: str, mutant: str | None) -> Target:
    if name not in allocators.BUILTINS:
        raise TargetError(f"unknown built-in target 'builtin:{name}'; known: {', '.join('builtin:' + n for n in builtin_names())}")
    cls, mutants = allocators.BUILTINS[name]
    needs = {}
    if mutant is not None:
        if mutant not in mutants:
            known = ", ".join(sorted(mutants)) or "none"
            raise TargetError(f"unknown mutant '{mutant}' for builtin:{name}; known: {known}")
        cls, needs = mutants[mutant].cls, dict(mutants[mutant].needs)
    return Target(
        spec=f"builtin:{name}",
        factory=cls,
        page_sizes=builtin_page_sizes(name),
        min_page_size=getattr(cls, "min_page_size", 1),
        defers_frees=getattr(cls, "defers_frees", True),
        family=getattr(cls, "family", None),
        mutant=mutant,
        needs=needs,
    )


def _custom(spec: str) -> Target:
    module_name, _, attr = spec.partition(":")
    if (how := import_death(module_name)) is not None:
        raise TargetError(f"cannot load {spec}: importing its module {how}")
    try:
        module = importlib.import_module(module_name)
    except _USER_FAILURES as exc:  # any import-time failure, sys.exit() included, is the user's target
        raise TargetError(f"cannot import target module '{module_name}': {one_line(exc)}") from None
    factory = module
    for part in attr.split("."):
        try:
            factory = getattr(factory, part, None)
        except _USER_FAILURES as exc:
            raise TargetError(f"cannot look up '{attr}' in module '{module_name}': {one_line(exc)}") from None
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


def miscased(spec: str) -> str | None:
    """Why ``spec`` is refused where its kind is ``builtin`` or ``sglang``
    in other letters (``BUILTIN:TOKEN``), or None: taken for a module of
    the user's, it was an import error, or a trace's custom target.  A
    module of the user's that is named so (``Builtin.py``) is its own."""
    kind, _, name = spec.partition(":")
    if kind.lower() in ("builtin", "sglang") and kind not in ("builtin", "sglang"):
        try:
            if importlib.util.find_spec(kind) is not None:  # finds, imports nothing
                return None
        except (ImportError, ValueError):
            pass
        return f"target '{spec}': kinds are lower case: did you mean {kind.lower()}:{name.lower()}?"
    return None


def resolve(spec: str, mutant: str | None = None, sglang_path: str | None = None) -> Target:
    """The target named by ``spec``, or a one-line ``TargetError``."""
    kind, sep, name = spec.partition(":")
    if not sep or not kind or not name:
        raise TargetError(f"target '{spec}' is not of the form builtin:NAME, sglang:NAME or MODULE:ATTR")
    if why := miscased(spec):
        raise TargetError(why)
    if kind == "builtin":
        return _builtin(name, mutant)
    if mutant is not None:
        raise TargetError(f"--mutant applies to builtin targets only, not '{spec}'")
    if kind == "sglang":
        from state_machines.targets import sglang as sglang_targets

        return sglang_targets.resolve(name, sglang_path)
    if sglang_path is not None:
        # A custom target may build on a release's classes: that release
        # loads first, as for sglang:NAME (one per process).
        from state_machines.targets import sglang as sglang_targets

        sglang_targets.load_sglang(sglang_path)
    return _custom(spec)


_FLAGS = {"page_size": "--page-size", "need_sort": "--need-sort", "size": "--size", "device": "--device", "row_dtype": "--row-dtype"}


def unmet_need(target: Target, **settings) -> str | None:
    """Why ``target``'s mutant cannot show its bug under ``settings``, or None.

    A need ``{"min_F": N}`` asks for setting F of at least N; any other
    ``{"F": V}`` asks for F equal to V.
    """
    for key, want in target.needs.items():
        name = key.removeprefix("min_")
        if name not in settings:
            continue
        have, flag = settings[name], _FLAGS.get(name, name)
        if key.startswith("min_"):
            if have is not None and have < want:
                return f"mutant {target.mutant} of {target.spec} cannot show its bug at {flag} {have}: it needs {flag} {want} or more"
        elif have != want:
            if want is True:
                return f"mutant {target.mutant} of {target.spec} cannot show its bug without {flag}"
            return f"mutant {target.mutant} of {target.spec} cannot show its bug at {flag} {have}: it needs {flag} {want}"
    return None


def describe_needs(needs: dict) -> str:
    """A mutant's needs as command-line flags: ``--page-size >= 2, --need-sort``."""
    bits = []
    for key, want in needs.items():
        name = key.removeprefix("min_")
        flag = _FLAGS.get(name, name)
        if key.startswith("min_"):
            bits.append(f"{flag} >= {want}")
        elif want is True:
            bits.append(flag)
        else:
            bits.append(f"{flag} {want}")
    return ", ".join(bits)


def _what(value) -> str:
    if value is None:
        return "None"
    name = " ".join(type(value).__name__.split())[:60]
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


def build(target: Target, *, size: int, page_size: int, device: str, need_sort: bool, row_dtype: str = "int32"):
    """Call the target's factory; a failure here is the user's configuration."""
    if target.page_sizes is not None and page_size not in target.page_sizes:
        allowed = ", ".join(map(str, target.page_sizes))
        raise TargetError(f"{target.spec} takes page size {allowed}, not {page_size}")
    if page_size < target.min_page_size:
        raise TargetError(f"{target.spec} takes page size {target.min_page_size} or more, not {page_size}")
    if reason := unmet_need(target, size=size, page_size=page_size, device=device, need_sort=need_sort, row_dtype=row_dtype):
        raise TargetError(reason)
    import torch

    try:
        # The KV dtype and cache are what sglang's classes take; allocators only store them.
        allocator = construct(
            target.factory, size=size, page_size=page_size, device=device, need_sort=need_sort,
            dtype=torch.float16, kvcache=None,
        )
    except TargetError:
        raise
    except _USER_FAILURES as exc:  # sys.exit() and KeyboardInterrupt from a factory included
        raise TargetError(f"cannot build {target.spec}: {one_line(exc)}") from None
    missing = []
    for name in FAMILY_METHODS.get(target.family, ALLOCATOR_METHODS):
        try:
            method = getattr(allocator, name, None)
        except Exception:  # noqa: BLE001 - a property that raises: not a method
            method = None
        if not callable(method):
            missing.append(name)
    if missing:
        raise TargetError(
            f"{target.spec} returned {_what(allocator)}, not an allocator: it lacks {', '.join(m + '()' for m in missing)}"
        )
    return allocator
