"""One sglang release, ready to be driven as its own scheduler drives it.

``open_release`` imports the release's request, cache and scheduler-helper
modules, installs a runtime config (``install_runtime_config``),
reads where its scheduler opens free groups, and picks the adapter of its
API generation.  ``build_parts`` then makes the real objects of one run:
the allocator (the ``--target``), a ``ReqToTokenPool`` and the prefix cache
(``--caller``), each stand-in a release forces named in ``stand_ins``.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any

from attrs import frozen

from state_machines.callers import placement as placement_mod
from state_machines.callers.adapters import Generation, generation_of
from state_machines.targets.base import TargetError, import_death, one_line, quiet

# The named caches; anything else is MODULE:ATTR, a cache class.
KINDS = ("radix", "unified", "unified-swa", "swa-radix")
# The caches that pair every full slot with a sliding-window (SWA) peer: they
# need the hybrid SWA allocator (``--target sglang:swa``).
SWA_KINDS = ("unified-swa", "swa-radix")
# A token id past every id a run draws (the alphabet is 1..3).
VOCAB_SIZE = 16

# The runtime config's stand-in, as the header names it: the release's own
# test hook where it has one (0.5.17 on), else the global server args.
RUNTIME_HOOK = (
    "runtime config: a dummy ServerArgs through the release's own test hook,"
    " get_context().override_server_args(attention_backend='torch_native').install()"
)
RUNTIME_GLOBAL = (
    "runtime config: a ServerArgs of the dataclass defaults (no __post_init__: no model to load),"
    " attention_backend='torch_native' and the run's page_size, through set_global_server_args_for_scheduler"
)

# The stand-ins every run uses besides the runtime config, as the header names them.
STAND_INS = (
    "ScheduleBatch: a duck-typed batch holding only what alloc_for_extend / alloc_for_decode read"
    " (reqs, pools, tree_cache, prefix/extend/seq lens, req_pool_indices, device)",
    "scheduler bookkeeping by hand: admission lock, extend range, committed length (prepare_for_extend/decode)",
    "model forward: none; each next token is (sum of the sequence so far) % 3 + 1, so equal prefixes continue alike",
)

# What an SWA cache's run adds.
SWA_STAND_INS = (
    "SWA kvcache: a BaseSWAKVPool stand-in that only keeps the full-to-SWA mapping (no KV tensors)",
    "SGLANG_SWA_EVICTION_INTERVAL=1: every window slide frees what fell out of the window",
)


@frozen
class Modules:
    """The release's classes and modules a caller run uses."""

    version: str
    path: str
    Req: Any
    SamplingParams: Any
    FINISH_ABORT: Any
    common: Any
    allocation: Any
    ReqToTokenPool: Any
    CacheInitParams: Any
    EvictParams: Any
    DecLockRefParams: Any
    BasePrefixCache: Any
    RadixCache: Any
    UnifiedRadixCache: Any  # None where the release has none
    ComponentType: Any
    SWARadixCache: Any  # None where the release has none (it has, until 0.5.20)
    ScheduleBatch: Any
    ForwardMode: Any
    ReqKvInfo: Any  # None where the release has none


@frozen
class Release:
    modules: Modules
    generation: Generation
    placement: placement_mod.ReleasePlacement
    # The runtime config's stand-in line (RUNTIME_HOOK or RUNTIME_GLOBAL).
    runtime: str = RUNTIME_HOOK
    # The global ServerArgs stand-in, or None under the release's own hook.
    server_args: Any = None

    def configure(self, page_size: int) -> None:
        """What a run's server args must say: the global stand-in's page size
        (0.5.13's ``release_kv_cache`` reads it); the hook needs nothing."""
        if self.server_args is not None:
            self.server_args.page_size = page_size


def _default_server_args(cls):
    """A ``ServerArgs`` holding every field's default, without
    ``__post_init__`` (which resolves a model)."""
    args = object.__new__(cls)
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            setattr(args, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            setattr(args, f.name, f.default_factory())
    return args


def install_runtime_config() -> tuple[str, Any]:
    """Install the runtime config the helpers read: the release's own test
    hook (``runtime_context``), else a default ``ServerArgs`` as the global
    server args.  Returns the stand-in line and the installed global (None
    under the hook)."""
    try:
        rc = importlib.import_module("sglang.srt.runtime_context")
    except ModuleNotFoundError:
        sa = importlib.import_module("sglang.srt.server_args")
        args = _default_server_args(sa.ServerArgs)
        args.attention_backend = "torch_native"
        sa.set_global_server_args_for_scheduler(args)
        return RUNTIME_GLOBAL, args
    rc.get_context().override_server_args(attention_backend="torch_native").install()
    return RUNTIME_HOOK, None


_opened: Release | None = None


def open_release(sglang_path: str | None) -> Release:
    """The loaded sglang (``--sglang-path``, else ``import sglang``), once per
    process; ``TargetError`` (one line) for whatever a run cannot use."""
    global _opened
    from state_machines.targets import sglang as sglang_targets

    info = sglang_targets.load_sglang(sglang_path)
    if _opened is not None and _opened.modules.path == info.path:
        return _opened
    # Read at each slide (envs.SGLANG_SWA_EVICTION_INTERVAL.get()); 128 by default.
    os.environ["SGLANG_SWA_EVICTION_INTERVAL"] = "1"
    with quiet():
        try:
            runtime, server_args = install_runtime_config()
            sb = importlib.import_module("sglang.srt.managers.schedule_batch")
            mods = {
                name: importlib.import_module(f"sglang.srt.{name}")
                for name in ("mem_cache.common", "mem_cache.memory_pool",
                             "mem_cache.cache_init_params", "mem_cache.base_prefix_cache", "mem_cache.radix_cache",
                             "sampling.sampling_params")
            }
            # alloc_for_extend / alloc_for_decode moved from common.py to allocation.py after 0.5.13.
            try:
                mods["mem_cache.allocation"] = importlib.import_module("sglang.srt.mem_cache.allocation")
            except ModuleNotFoundError:
                mods["mem_cache.allocation"] = mods["mem_cache.common"]
        except Exception as exc:  # noqa: BLE001 - any failure is the release's, shown in one line
            raise TargetError(f"sglang {info.version}: cannot import what --caller drives: {one_line(exc)}") from None
        try:
            unified = importlib.import_module("sglang.srt.mem_cache.unified_radix_cache").UnifiedRadixCache
            component_type = _component_type()
        except Exception:  # noqa: BLE001 - an older release without it: --caller unified says so
            unified = component_type = None
        try:
            swa_radix = importlib.import_module("sglang.srt.mem_cache.swa_radix_cache").SWARadixCache
        except Exception:  # noqa: BLE001 - a newer release without it: --caller swa-radix says so
            swa_radix = None
    m = Modules(
        version=info.version,
        path=info.path,
        Req=sb.Req,
        SamplingParams=mods["sampling.sampling_params"].SamplingParams,
        FINISH_ABORT=sb.FINISH_ABORT,
        common=mods["mem_cache.common"],
        allocation=mods["mem_cache.allocation"],
        ReqToTokenPool=mods["mem_cache.memory_pool"].ReqToTokenPool,
        CacheInitParams=mods["mem_cache.cache_init_params"].CacheInitParams,
        EvictParams=mods["mem_cache.base_prefix_cache"].EvictParams,
        DecLockRefParams=mods["mem_cache.base_prefix_cache"].DecLockRefParams,
        BasePrefixCache=mods["mem_cache.base_prefix_cache"].BasePrefixCache,
        RadixCache=mods["mem_cache.radix_cache"].RadixCache,
        UnifiedRadixCache=unified,
        ComponentType=component_type,
        SWARadixCache=swa_radix,
        ScheduleBatch=sb.ScheduleBatch,
        ForwardMode=sb.ForwardMode,
        ReqKvInfo=getattr(sb, "ReqKvInfo", None),
    )
    _opened = Release(m, generation_of(m), placement_mod.read_release(info.path), runtime, server_args)
    return _opened


def _component_type():
    """``ComponentType``: under ``unified_cache/components`` from 0.5.17,
    ``unified_cache_components/tree_component.py`` before."""
    try:
        return importlib.import_module("sglang.srt.mem_cache.unified_cache.components").ComponentType
    except ModuleNotFoundError:
        return importlib.import_module("sglang.srt.mem_cache.unified_cache_components.tree_component").ComponentType


def default_target(caller: str, page_size: int) -> str:
    """The allocator ``--caller`` drives when ``--target`` names none: the
    release's hybrid SWA allocator under an SWA cache, else the token
    allocator at page size 1 and the paged one above it."""
    if caller in SWA_KINDS:
        return "sglang:swa"
    return "sglang:token" if page_size == 1 else "sglang:paged"


def cache_class(release: Release, caller: str) -> type:
    """``radix``, ``unified``, ``unified-swa``, ``swa-radix``, or
    ``MODULE:ATTR`` naming a cache class."""
    m = release.modules
    if caller == "radix":
        return m.RadixCache
    if caller in ("unified", "unified-swa"):
        if m.UnifiedRadixCache is None:
            raise TargetError(f"sglang {m.version} has no UnifiedRadixCache: --caller {caller} needs a release that has it")
        return m.UnifiedRadixCache
    if caller == "swa-radix":
        if m.SWARadixCache is None:
            raise TargetError(f"sglang {m.version} has no SWARadixCache (releases until 0.5.20 have it):"
                              " --caller unified-swa drives its successor")
        return m.SWARadixCache
    module_name, sep, attr = caller.partition(":")
    if not sep or not module_name or not attr:
        raise TargetError(f"--caller {caller!r}: choose harness, {', '.join(KINDS)} or MODULE:ATTR (a cache class)")
    if (how := import_death(module_name)) is not None:
        raise TargetError(f"--caller {caller}: cannot load it: importing its module {how}")
    try:
        found: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            found = getattr(found, part)
    except (Exception, SystemExit, KeyboardInterrupt) as exc:  # noqa: BLE001 - the user's module
        raise TargetError(f"--caller {caller}: cannot load it: {one_line(exc)}") from None
    if not (isinstance(found, type) and issubclass(found, m.BasePrefixCache)):
        raise TargetError(f"--caller {caller} is not a subclass of sglang's BasePrefixCache")
    return found


def sliding_window(page_size: int) -> int:
    """The SWA window of a run, in tokens: one page (two tokens at page size
    1), so that requests of a few pages slide their windows."""
    return max(2, page_size)


def make_cache(release: Release, cls: type, pool, allocator, page_size: int, swa: bool = False):
    """The cache as sglang's registry builds it: a unified tree gets the
    FULL component (a plain model), and the SWA component too when ``swa``
    (a hybrid SWA model, over the SWA allocator), with a window of
    ``sliding_window(page_size)`` tokens."""
    m = release.modules
    params = m.CacheInitParams(
        disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=allocator, page_size=page_size
    )
    if swa:
        params.sliding_window_size = sliding_window(page_size)
    if m.UnifiedRadixCache is not None and issubclass(cls, m.UnifiedRadixCache):
        params.tree_components = (m.ComponentType.FULL, m.ComponentType.SWA) if swa else (m.ComponentType.FULL,)
    try:
        return cls(params)
    except Exception as exc:  # noqa: BLE001 - a cache the release cannot build here is bad input
        raise TargetError(f"cannot build {cls.__name__} on CPU: {one_line(exc)}") from None
