"""Real sglang KV-slot allocators as kv-lockstep targets (CPU only).

``load_sglang(path)`` puts one sglang release on ``sys.path`` and imports its
allocator modules; every failure becomes a one-line ``TargetError``.  Two
layouts exist, told apart by what the release's folder holds: a package
``sglang/srt/mem_cache/allocator/`` (one module per kind, ``MODULES``) and,
in older releases, one file ``sglang/srt/mem_cache/allocator.py``
(``SINGLE_FILE_MODULES``).  The
factories build allocators from the loaded release with the uniform signature
``factory(size, page_size, device, need_sort)``; they pass constructor
arguments by parameter name, so a release that reorders or adds parameters
still works.  What a release can run here is probed like every target's
(``probe.py``), never read from version strings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import signal
import sys
import threading
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO_ROOT / "constraints" / "sglang.txt"
FALLBACK_TORCH = "2.14.1"

# Where each kind's class lives when mem_cache/allocator/ is a package.
MODULES = {
    "token": "sglang.srt.mem_cache.allocator.token",
    "paged": "sglang.srt.mem_cache.allocator.paged",
    "swa": "sglang.srt.mem_cache.allocator.swa",
    "npu": "sglang.srt.hardware_backend.npu.allocator_npu",
    # one pool of SWA pages, HiSparse pairs, Mamba state slots.
    "pure-swa": "sglang.srt.mem_cache.allocator.swa",
    "hisparse": "sglang.srt.mem_cache.allocator.hisparse",
    # DeepSeek V4's HiSparse wrapper over an SWA pair (same module).
    "dsv4-hisparse": "sglang.srt.mem_cache.allocator.hisparse",
    "mamba": "sglang.srt.mem_cache.allocator.mamba",
    # owner-classed pages (logical-page KV sharding), from 0.5.20.
    "page-interleave": "sglang.srt.mem_cache.allocator.page_interleave",
    # one sub-pool of the unified byte arena (0.5.20 on).
    "multi-ended": "sglang.srt.mem_cache.allocator.unified_sub_pool",
    "multi-ended-eager": "sglang.srt.mem_cache.allocator.unified_sub_pool",
    # the unified hybrid pools (sub-pools in one byte arena).
    "unified-swa": "sglang.srt.mem_cache.allocator.unified_hybrid_swa",
    "unified-swa-eager": "sglang.srt.mem_cache.allocator.unified_hybrid_swa",
    "unified-mamba-swa": "sglang.srt.mem_cache.allocator.unified_hybrid_swa",
    "unified-mamba-swa-eager": "sglang.srt.mem_cache.allocator.unified_hybrid_swa",
    "unified-mamba": "sglang.srt.mem_cache.allocator.unified_mamba",
    "unified-mamba-eager": "sglang.srt.mem_cache.allocator.unified_mamba",
}
# The same when mem_cache/allocator.py is one file (sglang up to 0.5.12);
# a kind missing here is unavailable in that layout, with the reason shown.
SINGLE_FILE_MODULES = {
    "token": "sglang.srt.mem_cache.allocator",
    "paged": "sglang.srt.mem_cache.allocator",
    "swa": "sglang.srt.mem_cache.swa_memory_pool",
    "npu": "sglang.srt.hardware_backend.npu.allocator_npu",
}
PACKAGE = "package"
SINGLE_FILE = "single-file"
LAYOUTS = {PACKAGE: MODULES, SINGLE_FILE: SINGLE_FILE_MODULES}
# Allocator code outside mem_cache/ that a kind runs (``release_files``).
NPU_FILE = ("srt", "hardware_backend", "npu", "allocator_npu.py")
REQUIRED = ("token", "paged")
# Kinds that work at page size 1 only.
PAGE_SIZE_ONE = ("token", "pure-swa", "mamba")
# The page size a kind that takes any is gated and described at (``gate_kinds``).
GATE_PAGE_SIZE = 4
# Kinds gated at more than one page size, each with its reason: the SWA
# allocator allocates through alloc() at 1 and through alloc_extend /
# alloc_decode above it; the unified sub-pool takes decode and extend through
# alloc() at 1 and frees by page representatives above it, and so do the
# unified SWA pool's sub-pools and the lazy unified Mamba pool (sglang's default mode);
# the paged allocator at 1 too, where decode is an alloc() as the caller makes it.
# DeepSeek V4 HiSparse: the compressed page is a quarter of the logical one;
# at 16 (compressed pages of 4) a device buffer's reserved page can hold a
# row's partial last page.
DSV4_PAGE_SIZES = (4, 8, 16)
GATE_PAGE_SIZES = {
    "paged": (1, 4), "swa": (1, 4), "multi-ended": (1, 4), "unified-swa": (1, 4), "unified-mamba": (1, 4),
    "dsv4-hisparse": DSV4_PAGE_SIZES,
}
CLASSES = {
    "token": "TokenToKVPoolAllocator",
    "paged": "PagedTokenToKVPoolAllocator",
    "swa": "SWATokenToKVPoolAllocator",
    "npu": "NPUPagedTokenToKVPoolAllocator",
    "pure-swa": "PureSWATokenToKVPoolAllocator",
    "hisparse": "HiSparseTokenToKVPoolAllocator",
    "dsv4-hisparse": "DeepSeekV4HiSparseTokenToKVPoolAllocator",
    "mamba": "MambaSlotAllocator",
    "page-interleave": "PageInterleavePoolAllocator",
    "multi-ended": "MultiEndedAllocator",
    "multi-ended-eager": "MultiEndedAllocator",
    "unified-swa": "UnifiedSWATokenToKVPoolAllocator",
    "unified-swa-eager": "UnifiedSWATokenToKVPoolAllocator",
    "unified-mamba-swa": "UnifiedMambaSWATokenToKVPoolAllocator",
    "unified-mamba-swa-eager": "UnifiedMambaSWATokenToKVPoolAllocator",
    "unified-mamba": "UnifiedMambaTokenToKVPoolAllocator",
    "unified-mamba-eager": "UnifiedMambaTokenToKVPoolAllocator",
}


from state_machines.targets.base import Target, TargetError, construct, import_limit_s, one_line, quiet
from state_machines.targets.cpu_paths import cpu_kernels, unified_cpu_kernels


@dataclasses.dataclass
class SglangInfo:
    path: str  # directory holding the sglang package
    version: str
    modules: dict[str, ModuleType]  # kind -> imported module
    unavailable: dict[str, str]  # kind -> one-line reason (optional kinds only)
    layout: str = PACKAGE  # PACKAGE or SINGLE_FILE (``layout_of``)


_loaded: SglangInfo | None = None


# --------------------------------------------------------------------------- #
# helpers


def _required_torch() -> str:
    try:
        for line in CONSTRAINTS.read_text().splitlines():
            m = re.match(r"\s*torch\s*==\s*([^\s#;]+)", line)
            if m:
                return m.group(1)
    except OSError:
        pass
    return FALLBACK_TORCH


def _release_of(path: Path) -> str | None:
    """Version of the sglang in ``path``: wheel dist-info, else the package."""
    for meta in sorted(path.glob("sglang-*.dist-info")):
        m = re.match(r"sglang-(.+)\.dist-info$", meta.name)
        if m:
            return m.group(1)
    vfile = path / "sglang" / "version.py"
    with contextlib.suppress(OSError):
        m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", vfile.read_text())
        if m:
            return m.group(1)
    return None


def _named(release: str | None, path: Path) -> str:
    return f"sglang {release}" if release else f"sglang at {path}"


def _package_dir(mod: ModuleType) -> Path | None:
    f = getattr(mod, "__file__", None)
    if f:
        return Path(f).resolve().parent.parent
    paths = list(getattr(mod, "__path__", []) or [])
    return Path(paths[0]).resolve().parent if paths else None


def _find_sglang() -> Path:
    """The folder holding the ``sglang`` that ``import sglang`` would find,
    located without running it."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise TargetError("no sglang is importable here: run `make sglang V=<version>` and pass --sglang-path .sglang/<version>")
    return Path(locations[0]).resolve().parent


def layout_of(path: Path) -> str:
    """How the sglang in ``path`` lays out its allocators, read from its
    files (never from its version): ``PACKAGE`` or ``SINGLE_FILE``."""
    mem_cache = path / "sglang" / "srt" / "mem_cache"
    if (mem_cache / "allocator" / "__init__.py").is_file():
        return PACKAGE
    if (mem_cache / "allocator.py").is_file():
        return SINGLE_FILE
    raise TargetError(
        f"sglang at {path} has neither sglang/srt/mem_cache/allocator/ nor sglang/srt/mem_cache/allocator.py:"
        " no allocator layout kv-lockstep knows"
    )


def release_files(sglang_path: str | None) -> list[Path]:
    """The allocator code of the sglang in ``sglang_path`` (else the one
    ``import sglang`` finds), read from its folder without importing it:
    every file of the allocator package (or the one allocator.py), then the
    NPU allocator where present."""
    path = Path(sglang_path).expanduser().resolve() if sglang_path else _find_sglang()
    mem_cache = path / "sglang" / "srt" / "mem_cache"
    files = sorted((mem_cache / "allocator").glob("*.py")) if layout_of(path) == PACKAGE else [mem_cache / "allocator.py"]
    npu = path.joinpath("sglang", *NPU_FILE)
    return files + ([npu] if npu.is_file() else [])


def _where(exc: BaseException, path: Path) -> str:
    """`` (at FILE:LINE)``: the innermost line of the release at ``path``
    that ``exc`` passed through, or ``""``."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        with contextlib.suppress(ValueError):
            return f" (at {Path(frame.filename).resolve().relative_to(path)}:{frame.lineno})"
    return ""


# The least and the most a release's import is given (``_import_clock``):
# the ceiling keeps setitimer in range (1e12 s was an OverflowError traceback).
IMPORT_FLOOR_S = 300.0
IMPORT_CEILING_S = 86400.0


class _ImportHung(BaseException):
    """Raised by ``_import_clock`` when it is due: not an ``Exception``, so
    that no ``except Exception`` of the release's takes it."""


@contextlib.contextmanager
def _import_clock(seconds: float):
    """``_ImportHung`` raised where the block runs past ``seconds``: a
    release whose import never returns (a lock, a wait on a device or a
    server) hung the command, ``targets`` and ``replay`` too, as
    ``--build-timeout`` covered a custom module's import only.  Checking
    the import in a fork, as those are, would pay sglang's (about 10 s)
    twice.  SIGALRM reaches Python code, and a sleep or a lock's wait; a
    call into C that never returns stays hung.  Only in the main thread,
    and where no other code handles SIGALRM or has a timer set (a worker's
    call timer): there the block runs unclocked."""
    if (threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGALRM) is not signal.SIG_DFL
            or signal.getitimer(signal.ITIMER_REAL)[0]):
        yield
        return

    def due(signum, frame):
        raise _ImportHung

    signal.signal(signal.SIGALRM, due)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


def _missing_package(exc: BaseException, release: str | None, path: Path) -> str | None:
    """When an allocator module failed to import for want of a package
    outside sglang, one line naming it and the line of sglang that imports
    it; else None."""
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    top = (missing or "").split(".")[0]
    if not top or top == "sglang":
        return None
    return (
        f"{_named(release, path)} needs the package {top}, which the import set lacks: {one_line(exc)}{_where(exc, path)};"
        f" add it to {CONSTRAINTS.relative_to(REPO_ROOT)} and rerun `make sglang V={release or '<version>'}`"
    )


# --------------------------------------------------------------------------- #
# loading


def load_sglang(sglang_path: str | None = None) -> SglangInfo:
    """Import sglang's allocator modules, from ``sglang_path`` if given.

    ``sglang_path`` is a directory holding a ``sglang/`` package: a checkout's
    ``python/`` folder or an unpacked release such as ``.sglang/0.5.23``.
    Without it, the sglang ``import sglang`` finds.  Its layout is read from
    its files (``layout_of``).  Raises a one-line ``TargetError`` when a
    required kind (token, paged) cannot be imported; an optional kind that
    cannot is recorded in ``unavailable`` with its reason.
    """
    global _loaded

    path: Path | None = None
    if sglang_path is not None:
        path = Path(sglang_path).expanduser().resolve()
        if not path.is_dir():
            raise TargetError(f"--sglang-path {sglang_path} is not a directory")
        if not (path / "sglang" / "__init__.py").is_file():
            raise TargetError(f"--sglang-path {sglang_path} holds no sglang package")

    already = sys.modules.get("sglang")
    if already is not None:
        have = _package_dir(already)
        if path is not None and have is not None and have != path:
            raise TargetError(
                f"sglang from {have} is already imported in this process; "
                f"cannot also load {path} (use a fresh process)"
            )
        if path is None and have is not None:
            path = have
    if _loaded is not None and path is not None and Path(_loaded.path) == path:
        return _loaded
    if path is None:
        path = _find_sglang()

    release = _release_of(path)
    layout = layout_of(path)

    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any failure is user-facing
        raise TargetError(f"torch not importable: {one_line(exc)} (run `make sglang V={release or '<version>'}`)")
    need = _required_torch()
    have_torch = torch.__version__.split("+")[0]
    if have_torch != need:
        raise TargetError(
            f"sglang at {path} needs torch {need}, found {torch.__version__}: "
            f"run `make sglang V={release or '<version>'}`"
        )

    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

    import importlib

    names = LAYOUTS[layout]
    modules: dict[str, ModuleType] = {}
    unavailable: dict[str, str] = {}
    # --build-timeout is sized for a factory (a test gives 1 s); sglang's own
    # import takes about 10 s here, more under load: never less than the floor.
    limit = min(max(import_limit_s(), IMPORT_FLOOR_S), IMPORT_CEILING_S)
    try:
        with quiet(), _import_clock(limit):
            for kind in MODULES:
                if kind not in names:
                    unavailable[kind] = f"this release keeps its allocators in one file, mem_cache/allocator.py, with no {kind} allocator"
                    continue
                try:
                    modules[kind] = importlib.import_module(names[kind])
                except (Exception, SystemExit) as exc:  # noqa: BLE001 - sys.exit() at a module's top level too (it ended the command with exit 0 and no word); a Ctrl-C stays one
                    missing = _missing_package(exc, release, path)
                    if kind in REQUIRED:
                        raise TargetError(missing or f"{_named(release, path)} not importable: {one_line(exc)}{_where(exc, path)}") from None
                    unavailable[kind] = missing or one_line(exc)
    except _ImportHung as exc:
        raise TargetError(f"{_named(release, path)}: importing its allocators did not return within {limit:g} s"
                          f" (--build-timeout){_where(exc, path)}") from None

    import sglang

    got = _package_dir(sglang)
    if got is not None and got != path:
        raise TargetError(f"imported sglang from {got}, not from {path}")
    version = getattr(sglang, "__version__", None) or release or "unknown"
    _loaded = SglangInfo(
        path=str(path),
        version=str(version),
        modules=modules,
        unavailable=unavailable,
        layout=layout,
    )
    return _loaded


def _info() -> SglangInfo:
    return _loaded if _loaded is not None else load_sglang(None)


def _cls(kind: str) -> type:
    info = _info()
    if kind not in info.modules:
        reason = info.unavailable.get(kind, "not imported")
        raise TargetError(f"sglang {info.version}: {kind} allocator unavailable: {reason}")
    module = info.modules[kind]
    cls = getattr(module, CLASSES[kind], None)
    if cls is None:
        raise TargetError(f"sglang {info.version}: {module.__name__} has no {CLASSES[kind]}")
    return cls


def class_of(kind: str) -> type:
    """The loaded release's class for ``kind``, or a one-line ``TargetError``
    saying why it has none."""
    return _cls(kind)


def _construct(cls: type, **available: Any):
    """Call ``cls`` with the constructor parameters it names, by keyword."""
    try:
        return construct(cls, **available)
    except TargetError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise TargetError(f"{cls.__name__}({', '.join(available)}) failed: {one_line(exc)}")


def _common(size: int, page_size: int, device: str, need_sort: bool) -> dict:
    import torch

    if device != "cpu" and not device.startswith("cpu"):
        raise TargetError(f"device {device!r}: sglang targets run on cpu only")
    return dict(
        size=size,
        page_size=page_size,
        dtype=torch.float16,  # the KV dtype; allocators only store it
        device=device,
        kvcache=None,
        need_sort=need_sort,
    )


# --------------------------------------------------------------------------- #
# factories


# sglang's own debug checks of the paged pools (``debug_mode``: no page
# handed out or freed twice, ``last_loc`` congruent with the lengths, each
# page-interleave class holding only its own pages), read once when a pool
# is built.  The gate builds its paged, NPU and page-interleave kinds with
# them on: an assertion of sglang's that fires is ``allocator_raised``, at
# the call that broke it.
POOL_DEBUG = "SGLANG_DEBUG_MEMORY_POOL"


@contextlib.contextmanager
def pool_debug():
    """``SGLANG_DEBUG_MEMORY_POOL=1`` while the block builds a pool."""
    import os

    saved = os.environ.get(POOL_DEBUG)
    os.environ[POOL_DEBUG] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[POOL_DEBUG]
        else:
            os.environ[POOL_DEBUG] = saved


class KVCopyStandIn:
    """What a KV pool's ``get_cpu_copy`` / ``load_cpu_copy`` need, and no
    more: one stamp per slot (a distinct negative number), copied out and
    back in, each call's slot ids recorded in ``kv_lockstep_copies`` as
    ("get" | "load", ids) for the harness's ``offload`` step to judge."""

    kv_lockstep_copies: list | None = None

    def kv_lockstep_init(self, slots: int) -> None:
        import torch

        self.kv_lockstep_stamps = -1 - torch.arange(slots, dtype=torch.int64)
        self.kv_lockstep_copies = []

    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        ids = indices.to("cpu").long()
        self.kv_lockstep_copies.append(("get", ids.tolist()))
        return self.kv_lockstep_stamps[ids].clone()

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None):
        ids = indices.to("cpu").long()
        self.kv_lockstep_copies.append(("load", ids.tolist()))
        self.kv_lockstep_stamps[ids] = kv_cache_cpu


class _KVStandIn(KVCopyStandIn):
    def __repr__(self) -> str:
        return "<KV pool stand-in: one stamp per slot>"


def _with_kv(args: dict, size: int, page_size: int) -> dict:
    """``args`` with a KV stand-in (the ids past ``size`` cover a page of padding)."""
    kv = _KVStandIn()
    kv.kv_lockstep_init(size + 2 * page_size)
    return {**args, "kvcache": kv}


def make_token(size: int, page_size: int, device: str, need_sort: bool):
    if page_size != 1:
        raise TargetError(f"token allocator needs page_size 1, got {page_size}")
    return _construct(_cls("token"), **_with_kv(_common(size, page_size, device, need_sort), size, page_size))


def make_paged(size: int, page_size: int, device: str, need_sort: bool):
    with pool_debug():
        return _construct(_cls("paged"), **_with_kv(_common(size, page_size, device, need_sort), size, page_size))


def make_npu(size: int, page_size: int, device: str, need_sort: bool):
    """The NPU subclass on CPU: its Python paths, no torch_npu."""
    with pool_debug():
        return _construct(_cls("npu"), **_with_kv(_common(size, page_size, device, need_sort), size, page_size))


def _swa_standin(base: type, **held: Any):
    """Smallest BaseSWAKVPool the SWA allocator's constructor accepts: no
    sub-pools, and it keeps the full->swa mapping handed to it; ``held``
    are more attributes a wrapper reads off it."""

    def register_mapping(self, full_to_swa_index_mapping):
        self.full_to_swa_index_mapping = full_to_swa_index_mapping

    def translate_loc_from_full_to_swa(self, kv_indices):
        return self.full_to_swa_index_mapping[kv_indices]

    def unused(name):
        def method(self, *args, **kwargs):
            raise NotImplementedError(f"kv-lockstep SWA stand-in has no {name}()")

        method.__name__ = name
        return method

    ns: dict[str, Any] = {
        name: unused(name) for name in getattr(base, "__abstractmethods__", ())
        if name not in ("get_cpu_copy", "load_cpu_copy")
    }
    ns.update(
        register_mapping=register_mapping,
        translate_loc_from_full_to_swa=translate_loc_from_full_to_swa,
        __init__=lambda self: None,
        full_kv_pool=None,
        swa_kv_pool=None,
        full_to_swa_index_mapping=None,
        __repr__=lambda self: f"<{base.__name__} stand-in{': ' + ', '.join(held) if held else ''}>",
    )
    ns.update(held)
    return type("KVLockstepSWAStandIn", (KVCopyStandIn, base), ns)()


def make_swa(size: int, page_size: int, device: str, need_sort: bool, size_swa: int | None = None, kvcache: Any = None):
    cls = _cls("swa")
    mod = sys.modules[cls.__module__]
    # The pool class the allocator asserts its kvcache is: the abstract base
    # where the release has one, else (0.5.8) the concrete pool.
    base = getattr(mod, "BaseSWAKVPool", None) or getattr(mod, "SWAKVPool", None)
    if base is None:
        raise TargetError(f"sglang {_info().version}: {mod.__name__} exposes neither BaseSWAKVPool nor SWAKVPool")
    args = _common(size, page_size, device, need_sort)
    kvcache = _swa_standin(base) if kvcache is None else kvcache
    kvcache.kv_lockstep_init(size + 2 * page_size)
    args.update(size_swa=size if size_swa is None else size_swa, kvcache=kvcache)
    # Not under pool_debug(): its pools' last_loc check reads the SWA peer of
    # a last page whose window slid, 0, and trips (README, Latent findings).
    allocator = _construct(cls, **args)
    # Above page size 1 both pools are paged allocators whose alloc_extend /
    # alloc_decode may be Triton-only (to 0.5.20): CPU stand-ins, named.
    replaced = []
    if page_size > 1:
        for pool in ("full_attn_allocator", "swa_attn_allocator"):
            replaced += [f"{pool}: {line}" for line in cpu_kernels(getattr(allocator, pool), page_size)]
    allocator.kv_lockstep_stand_ins = replaced
    return allocator


# --------------------------------------------------------------------------- #
# pure-SWA, HiSparse and Mamba: each its own family.


def make_pure_swa(size: int, page_size: int, device: str, need_sort: bool):
    """``PureSWATokenToKVPoolAllocator`` (page size 1) over the SWA stand-in."""
    cls = _cls("pure-swa")
    base = getattr(sys.modules[cls.__module__], "BaseSWAKVPool", None)
    if base is None:
        raise TargetError(f"sglang {_info().version}: swa allocator module exposes no BaseSWAKVPool")
    args = _common(size, page_size, device, need_sort)
    kvcache = _swa_standin(base)
    # One stamp per slot, for the offload step's round trip (KVCopyStandIn).
    kvcache.kv_lockstep_init(size + 2 * page_size)
    args.update(size_swa=size, kvcache=kvcache)
    return _construct(cls, **args)


class _HiSparseKVStandIn:
    """Smallest KV pool ``HiSparseTokenToKVPoolAllocator`` works over: it
    translates logical slots through the allocator's own mapping (the
    allocator registers only a weak proxy of it, which a copy cannot keep)."""

    allocator: Any = None

    def register_mapping(self, full_to_hisparse_device_index_mapping) -> None:
        return

    def _translate_loc_to_hisparse_device(self, indices):
        return self.allocator.full_to_hisparse_device_index_mapping[indices]

    def translate_loc_from_full_to_compressed(self, indices):
        return indices

    def __repr__(self) -> str:
        return "<HiSparse kvcache stand-in>"


def make_hisparse(size: int, page_size: int, device: str, need_sort: bool):
    """``HiSparseTokenToKVPoolAllocator``: a logical pool of twice ``size``
    and a device pool of ``size``, over the stand-in above."""
    standin = _HiSparseKVStandIn()
    allocator = _construct(_cls("hisparse"), **{**_common(size, page_size, device, need_sort), "kvcache": standin})
    standin.allocator = allocator
    return allocator


def _c4_pool_standin(base: type, size: int, page_size: int, device: str):
    """Smallest ``HiSparseC4DevicePool`` the DeepSeek V4 HiSparse wrapper
    works over: its ``size``, ``page_size``, ``dtype``, ``device`` and
    ``compress_ratio``, and its own translate methods, reading the wrapper's
    mapping (the wrapper registers only a weak proxy of it, which a copy
    cannot keep); no KV buffers."""
    import torch

    def unused(name):
        def method(self, *args, **kwargs):
            raise NotImplementedError(f"kv-lockstep C4 pool stand-in has no {name}()")

        method.__name__ = name
        return method

    ns: dict[str, Any] = {name: unused(name) for name in getattr(base, "__abstractmethods__", ())}
    ns.update(
        __init__=lambda self: None,
        size=size, page_size=page_size, dtype=torch.float16, device=device, compress_ratio=4, allocator=None,
        register_mapping=lambda self, mapping: None,
        full_to_hisparse_device_index_mapping=property(lambda self: self.allocator.full_to_hisparse_device_index_mapping),
        __repr__=lambda self: f"<{base.__name__} stand-in: size {self.size}, page_size {self.page_size}>",
    )
    return type("KVLockstepC4PoolStandIn", (base,), ns)()


def make_dsv4_hisparse(size: int, page_size: int, device: str, need_sort: bool):
    """``DeepSeekV4HiSparseTokenToKVPoolAllocator`` over ``SWATokenToKVPoolAllocator``
    (as ``kv_cache_configurator.py`` builds it), whose kvcache is a
    ``DeepSeekV4TokenToKVPool`` stand-in holding ``c4_kv_pool`` (a
    ``HiSparseC4DevicePool`` stand-in: half as many pages as the full pool,
    a quarter of its page size) and ``c4_logical_size`` (``size // 4``)."""
    cls = _cls("dsv4-hisparse")
    mod = sys.modules[cls.__module__]
    if page_size % 4:
        raise TargetError(f"sglang:dsv4-hisparse needs a page size that is a multiple of 4 (the compress ratio), got {page_size}")
    hps = page_size // 4
    c4 = _c4_pool_standin(mod.HiSparseC4DevicePool, max(2, size // page_size // 2) * hps, hps, device)
    kvcache = _swa_standin(mod.DeepSeekV4TokenToKVPool, c4_kv_pool=c4, c4_logical_size=size // 4)
    logical = make_swa(size, page_size, device, need_sort, kvcache=kvcache)
    allocator = _construct(cls, logical_attn_allocator=logical)
    c4.allocator = allocator
    # The C4 device pool's alloc_extend may be Triton-only too (to 0.5.20), at any page size.
    device_kernels = cpu_kernels(allocator.hisparse_attn_allocator, hps, at_page_size_one=True)
    allocator.kv_lockstep_stand_ins = [repr(kvcache), repr(c4)] + [f"logical_attn_allocator.{line}" for line in logical.kv_lockstep_stand_ins] + [
        f"hisparse_attn_allocator: {line}" for line in device_kernels]
    return allocator


def make_mamba(size: int, page_size: int, device: str, need_sort: bool):
    """``MambaSlotAllocator(size, device)``: slots, page size 1."""
    return _construct(_cls("mamba"), **_common(size, page_size, device, need_sort))


# Shard-group size a page-interleaved pool is built with: 3 owner classes.
SHARD_SIZE = 3


def make_page_interleave(size: int, page_size: int, device: str, need_sort: bool):
    """``PageInterleavePoolAllocator`` over ``SHARD_SIZE`` ranks of ``size``
    slots each (its ``size`` is one rank's), physical page ``page_size``, no
    shard spec (what sglang's own unit tests pass) and no KV pool."""
    args = _common(size, page_size, device, need_sort)
    args.update(physical_page_size=page_size, shard_size=SHARD_SIZE)
    with pool_debug():
        return _construct(_cls("page-interleave"), **args)


# --------------------------------------------------------------------------- #
# Unified pools: sub-pools of one byte arena (UnifiedKVPool stand-ins), the
# single sub-pool (MultiEndedAllocator) and the hybrid composites.

# Bytes one slot of each sub-pool takes in the stand-in arena: full and SWA
# differ, so that a byte a slide frees is worth a different count to each.
UNIFIED_ENTRY_BYTES = {"full": 16, "swa": 8, "mamba": 32}


class _UnifiedSpecStandIn:
    """One sub-pool's layout, as the allocators read it: its slot bytes,
    grow direction and dtype (``blocks_per_page`` for 0.5.20)."""

    def __init__(self, name: str, entry_bytes: int, grow_direction: str):
        import torch

        self.name, self._entry_bytes, self.grow_direction = name, entry_bytes, grow_direction
        self.store_dtype = torch.bfloat16

    def entry_bytes(self) -> int:
        return self._entry_bytes

    def get_dtype(self):
        return self.store_dtype

    def blocks_per_page(self) -> int:
        return 1


class _StampedKVStandIn:
    """The KV pool a compaction moves pages in, reduced to who wrote each
    physical page (``stamps``, written by the harness as a forward would):
    ``move_physical_pages(dst, src, page_size)`` by page id (0.5.23),
    ``move_kv_cache(tgt_loc, src_loc)`` by page-major token ids (0.5.20,
    0.5.22)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.stamps: dict[int, int] = {}

    def move_physical_pages(self, dst, src, page_size: int) -> None:
        for d, s in zip(dst.tolist(), src.tolist()):
            self.stamps[d] = self.stamps.pop(s, None)

    def move_kv_cache(self, tgt_loc, src_loc) -> None:
        ps = self.page_size
        self.move_physical_pages(tgt_loc.view(-1, ps)[:, 0] // ps, src_loc.view(-1, ps)[:, 0] // ps, ps)

    def __repr__(self) -> str:
        return "KV pool stand-in: a stamp per physical page, carried by move_physical_pages / move_kv_cache"


def _sorting_needs_lazy(kind: str, need_sort: bool, lazy_compaction: bool) -> None:
    """Refuse need_sort with eager compaction: no server builds it.  sglang
    sorts frees only under PD disaggregation (``need_sort`` is
    ``disaggregation_mode in ("decode", "prefill")``,
    ``kv_cache_configurator.py``), and the unified pool asserts lazy
    compaction there (``handle_unified_memory_pool``,
    ``arg_groups/kv_cache_hook.py``, 0.5.20 on)."""
    if need_sort and not lazy_compaction:
        raise TargetError(f"sglang:{kind}: need_sort with eager compaction is no server's: sglang sorts frees only under "
                          "PD disaggregation, where the unified pool requires lazy compaction (kv_cache_hook.py)")


def make_multi_ended(size: int, page_size: int, device: str, need_sort: bool, lazy_compaction: bool = True):
    """``MultiEndedAllocator``: the id-owning, grow-up sub-pool of ``size``
    slots (plus the reserved first page), over the stand-ins above; lazy
    compaction is sglang's default (``SGLANG_DISABLE_LAZY_COMPACTION`` unset)."""
    kind = "multi-ended" if lazy_compaction else "multi-ended-eager"
    _sorting_needs_lazy(kind, need_sort, lazy_compaction)
    args = _common(size, page_size, device, need_sort)
    args.update(
        kvcache=_StampedKVStandIn(page_size),
        # One grow-up sub-pool of one-byte slots; its first page is the reserved padding floor.
        unified_buffer=_UnifiedArenaStandIn(size + page_size, [_UnifiedSpecStandIn("full", 1, "up")], page_size),
        sub_pool_name="full",
        is_id_owner=True,
        lazy_compaction=lazy_compaction,
    )
    allocator = _construct(_cls(kind), **args)
    allocator.kv_lockstep_kernels = unified_cpu_kernels(allocator, page_size)
    # As the scheduler does once its pools exist (scheduler.py, enable_unified_memory; 0.5.23 on).
    if callable(prewarm := getattr(allocator, "prewarm_compaction", None)):
        prewarm()
    return allocator


def make_multi_ended_eager(size: int, page_size: int, device: str, need_sort: bool):
    """The same with eager compaction (``SGLANG_DISABLE_LAZY_COMPACTION=1``):
    every free compacts at once."""
    return make_multi_ended(size, page_size, device, need_sort, lazy_compaction=False)


class _UnifiedArenaStandIn:
    """Smallest ``UnifiedKVPool`` the unified allocators accept: no bytes
    at all, only its geometry (``total_bytes``, each sub-pool's spec,
    ``max_slots`` = total // slot bytes, ``min_slot_index`` past the
    page-0 sink reserved for the largest page), as ``UnifiedKVPool`` sets it."""

    post_capture_active = False

    def __init__(self, total_bytes: int, specs: list[_UnifiedSpecStandIn], page_size: int):
        self.total_bytes = total_bytes
        self._specs = {s.name: s for s in specs}
        floor = max(s.entry_bytes() * page_size for s in specs)
        self._min_slot = {s.name: -(-floor // s.entry_bytes()) for s in specs}

    def spec(self, name: str) -> _UnifiedSpecStandIn:
        return self._specs[name]

    mha_spec = spec

    def max_slots(self, name: str) -> int:
        return self.total_bytes // self._specs[name].entry_bytes()

    def min_slot_index(self, name: str) -> int:
        return self._min_slot[name]

    def __repr__(self) -> str:
        return f"<UnifiedKVPool stand-in: {self.total_bytes} bytes, no storage>"


class _UnifiedSubKVStandIn:
    """A sub-pool's KV cache: page moves and zeroing touch no bytes (there
    are none); the host-transfer attributes the composite sets are kept."""

    def move_physical_pages(self, dst_pages, src_pages, page_size) -> None:
        return

    def move_kv_cache(self, dst, src) -> None:
        return

    def zero_physical_pages(self, pages) -> None:
        return


class _UnifiedKVStandIn:
    """The composite's kvcache: its full, SWA and Mamba sub-pool caches
    (each kind reads the ones it has), and ``attach_allocators`` (nothing to
    attach to)."""

    def __init__(self):
        self.full_kv_pool, self.swa_kv_pool = _UnifiedSubKVStandIn(), _UnifiedSubKVStandIn()
        self.mamba_pool = _UnifiedSubKVStandIn()

    def attach_allocators(self, **allocators) -> None:
        return

    def __repr__(self) -> str:
        return "<unified SWA kvcache stand-in>"


def _required(cls: type, name: str) -> bool:
    """Whether ``cls``'s constructor takes ``name`` with no default."""
    import inspect

    param = inspect.signature(cls.__init__).parameters.get(name)
    return param is not None and param.default is inspect.Parameter.empty


def _make_unified(kind: str, directions: dict[str, str], size: int, page_size: int, device: str, need_sort: bool,
                  lazy_compaction: bool = False):
    """A unified composite over the arena stand-in: its sub-pools (name ->
    grow direction) in ``(size + page_size) * 16`` bytes, so the full side
    alone would hold ``size`` tokens; eager compaction unless
    ``lazy_compaction`` (sglang's default, ``SGLANG_DISABLE_LAZY_COMPACTION`` unset)."""
    _sorting_needs_lazy(kind, need_sort, lazy_compaction)
    cls = _cls(kind)
    if device != "cpu" and not device.startswith("cpu"):
        raise TargetError(f"device {device!r}: sglang targets run on cpu only")
    specs = [_UnifiedSpecStandIn(name, UNIFIED_ENTRY_BYTES[name], grows) for name, grows in directions.items()]
    arena = _UnifiedArenaStandIn((size + page_size) * UNIFIED_ENTRY_BYTES["full"], specs, page_size)
    kvcache = _UnifiedKVStandIn()
    args: dict[str, Any] = dict(unified_buffer=arena, kvcache=kvcache, mamba_kvcache=kvcache.mamba_pool,
                                device=device, page_size=page_size, need_sort=need_sort)
    if lazy_compaction:
        args["lazy_compaction"] = True
    # Static caps where a release requires them (0.5.20's leak check); later releases derive them.
    for name in ("full", "swa"):
        if _required(cls, f"{name}_max_total_num_tokens"):
            args[f"{name}_max_total_num_tokens"] = arena.max_slots(name) - page_size
    allocator = _construct(cls, **args)
    # Named in `targets` and the run header (the SWA harness reads this).
    allocator.kv_lockstep_stand_ins = [repr(arena), repr(kvcache)]
    return allocator


def make_unified_swa(size: int, page_size: int, device: str, need_sort: bool, lazy_compaction: bool = True):
    """``UnifiedSWATokenToKVPoolAllocator``: full (16-byte slots) at the
    arena's high end, growing down, and SWA (8-byte slots) at its low end,
    growing up, as sglang's factory places them (``unified_memory_pool.py``,
    ``full_spec`` / ``swa_spec``); both sides together hold about two thirds
    of what the full side alone would.  Lazy compaction, as sglang's server
    builds it (``SGLANG_DISABLE_LAZY_COMPACTION`` unset)."""
    kind = "unified-swa" if lazy_compaction else "unified-swa-eager"
    return _with_cpu_kernels(_make_unified(kind, {"full": "down", "swa": "up"}, size, page_size, device, need_sort,
                                           lazy_compaction))


def make_unified_swa_eager(size: int, page_size: int, device: str, need_sort: bool):
    """The same with eager compaction (``SGLANG_DISABLE_LAZY_COMPACTION=1``)."""
    return make_unified_swa(size, page_size, device, need_sort, lazy_compaction=False)


def make_unified_mamba_swa(size: int, page_size: int, device: str, need_sort: bool, lazy_compaction: bool = True):
    """``UnifiedMambaSWATokenToKVPoolAllocator``: [mamba (32-byte slots, up)
    | SWA (8, float) | full (16, down)], its sglang chain; lazy compaction
    at the ends (sglang's default; the float middle never runs it)."""
    kind = "unified-mamba-swa" if lazy_compaction else "unified-mamba-swa-eager"
    return _with_cpu_kernels(_make_unified(kind, {"mamba": "up", "swa": "float", "full": "down"},
                                           size, page_size, device, need_sort, lazy_compaction))


def make_unified_mamba_swa_eager(size: int, page_size: int, device: str, need_sort: bool):
    """The same with eager compaction (``SGLANG_DISABLE_LAZY_COMPACTION=1``)."""
    return make_unified_mamba_swa(size, page_size, device, need_sort, lazy_compaction=False)


def make_unified_mamba(size: int, page_size: int, device: str, need_sort: bool, lazy_compaction: bool = True):
    """``UnifiedMambaTokenToKVPoolAllocator``: full (16-byte slots, up) and
    Mamba state slots (32 bytes, down, page size 1).  Two stand-ins beyond
    the arena: the parallel width ``attn_dcp_size`` set to 1 for the process
    and its rank ``attn_dcp_rank`` to 0 (``get_parallel().override_permanently``,
    where unpublished: one GPU, as a server with no decode context parallelism
    publishes), and the Mamba slots driven through
    the release's ``UnifiedMambaSlotAllocator`` over ``mamba_allocator``
    (what ``UnifiedHybridReqToTokenPool`` builds), kept as ``mamba_slots``."""
    import importlib

    runtime = importlib.import_module("sglang.srt.runtime_context")
    kind = "unified-mamba" if lazy_compaction else "unified-mamba-eager"
    parallel = runtime.get_parallel()
    for name, value in (("attn_dcp_size", 1), ("attn_dcp_rank", 0)):
        try:
            getattr(parallel, name)
        except Exception:  # noqa: BLE001 - unpublished in this process: one GPU's values
            parallel.override_permanently(**{name: value})
    allocator = _with_mamba_slots(_make_unified(kind, {"full": "up", "mamba": "down"}, size, page_size, device,
                                                need_sort, lazy_compaction))
    # As the scheduler does once its pools exist (scheduler.py, enable_unified_memory; 0.5.23 on).
    if callable(prewarm := getattr(allocator, "prewarm_compaction", None)):
        prewarm()
    return allocator


def make_unified_mamba_eager(size: int, page_size: int, device: str, need_sort: bool):
    """The same with eager compaction (``SGLANG_DISABLE_LAZY_COMPACTION=1``;
    lazy is sglang's default, ``kv_cache_configurator.py``
    ``_should_enable_lazy_compaction``)."""
    return make_unified_mamba(size, page_size, device, need_sort, lazy_compaction=False)


def _with_cpu_kernels(allocator):
    """A unified composite whose paged ``alloc_extend`` / ``alloc_decode``
    (and PD decode's ``alloc_extend_swa_tail``) run on CPU: they go through
    the full sub-pool's own, whose two Triton kernels find CPU stand-ins
    during each call (``unified_cpu_kernels``); the SWA side binds what the
    full side took, with no kernel."""
    full = allocator.full_attn_allocator
    allocator.kv_lockstep_stand_ins = list(getattr(allocator, "kv_lockstep_stand_ins", ())) + unified_cpu_kernels(
        full, full.page_size)
    return allocator


def _with_mamba_slots(allocator):
    import importlib

    pool = importlib.import_module("sglang.srt.mem_cache.unified_memory_pool")
    wrapper = getattr(pool, "UnifiedMambaSlotAllocator", None)
    if wrapper is None:
        raise TargetError(f"sglang {_info().version}: unified_memory_pool has no UnifiedMambaSlotAllocator")
    mea = allocator.mamba_allocator
    allocator.mamba_slots = wrapper(mea, mea.max_slots - 1, mea.device)
    allocator.kv_lockstep_stand_ins = list(getattr(allocator, "kv_lockstep_stand_ins", ())) + unified_cpu_kernels(
        allocator.full_attn_allocator, allocator.full_attn_allocator.page_size)
    return allocator


# kind -> its family, and whether its frees are deferred in a free group.
KIND_TARGETS: dict[str, dict[str, Any]] = {
    "swa": dict(family="swa"),
    "pure-swa": dict(family="pure_swa"),
    "hisparse": dict(family="hisparse", defers_frees=False),
    "dsv4-hisparse": dict(family="dsv4_hisparse", min_page_size=4),
    "mamba": dict(family="mamba", defers_frees=False),
    # Its caller sends page size 1 to alloc(), which raises.
    "page-interleave": dict(family="page_interleave", min_page_size=2),
    "multi-ended": dict(family="unified"),
    "multi-ended-eager": dict(family="unified"),
    "unified-swa": dict(family="unified_swa"),
    "unified-swa-eager": dict(family="unified_swa"),
    "unified-mamba-swa": dict(family="unified_swa"),
    "unified-mamba-swa-eager": dict(family="unified_swa"),
    "unified-mamba": dict(family="unified_mamba"),
    "unified-mamba-eager": dict(family="unified_mamba"),
}


FACTORIES: dict[str, Callable[..., Any]] = {
    "token": make_token,
    "paged": make_paged,
    "swa": make_swa,
    "npu": make_npu,
    "pure-swa": make_pure_swa,
    "hisparse": make_hisparse,
    "dsv4-hisparse": make_dsv4_hisparse,
    "mamba": make_mamba,
    "page-interleave": make_page_interleave,
    "multi-ended": make_multi_ended,
    "multi-ended-eager": make_multi_ended_eager,
    "unified-swa": make_unified_swa,
    "unified-swa-eager": make_unified_swa_eager,
    "unified-mamba": make_unified_mamba,
    "unified-mamba-eager": make_unified_mamba_eager,
    "unified-mamba-swa": make_unified_mamba_swa,
    "unified-mamba-swa-eager": make_unified_mamba_swa_eager,
}


def gate_kinds() -> list[tuple[str, int]]:
    """Every kind with the page size the gate runs it at: 1 where the kind
    takes only 1, those ``GATE_PAGE_SIZES`` names, else ``GATE_PAGE_SIZE``."""
    return [
        (kind, page_size)
        for kind in FACTORIES
        for page_size in GATE_PAGE_SIZES.get(kind, (1 if kind in PAGE_SIZE_ONE else GATE_PAGE_SIZE,))
    ]


def factory(kind: str) -> Callable[..., Any]:
    try:
        return FACTORIES[kind]
    except KeyError:
        raise TargetError(f"unknown sglang allocator kind {kind!r} (known: {', '.join(FACTORIES)})") from None


def resolve(kind: str, sglang_path: str | None) -> Target:
    """``sglang:KIND`` as a target: the class of the sglang that
    ``sglang_path`` (or ``import sglang``) finds."""
    make = factory(kind)
    load_sglang(sglang_path)
    _cls(kind)  # an unavailable kind fails here, with its reason
    return Target(
        spec=f"sglang:{kind}",
        factory=make,
        page_sizes=(1,) if kind in PAGE_SIZE_ONE else None,
        **KIND_TARGETS.get(kind, {}),
    )


__all__ = [
    "SglangInfo",
    "class_of",
    "factory",
    "gate_kinds",
    "layout_of",
    "load_sglang",
    "make_dsv4_hisparse",
    "make_hisparse",
    "make_mamba",
    "make_multi_ended",
    "make_multi_ended_eager",
    "make_npu",
    "make_page_interleave",
    "make_paged",
    "make_pure_swa",
    "make_swa",
    "make_token",
    "make_unified_mamba",
    "make_unified_mamba_eager",
    "make_unified_mamba_swa",
    "make_unified_mamba_swa_eager",
    "make_unified_swa",
    "make_unified_swa_eager",
    "release_files",
    "resolve",
]
