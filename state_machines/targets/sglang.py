"""Real sglang KV-slot allocators as kv-lockstep targets (CPU only).

``load_sglang(path)`` puts one sglang release on ``sys.path`` and imports its
allocator modules; every failure becomes a one-line ``TargetError``.  The
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
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO_ROOT / "constraints" / "sglang.txt"
FALLBACK_TORCH = "2.14.1"

MODULES = {
    "token": "sglang.srt.mem_cache.allocator.token",
    "paged": "sglang.srt.mem_cache.allocator.paged",
    "swa": "sglang.srt.mem_cache.allocator.swa",
    "npu": "sglang.srt.hardware_backend.npu.allocator_npu",
}
REQUIRED = ("token", "paged")
CLASSES = {
    "token": "TokenToKVPoolAllocator",
    "paged": "PagedTokenToKVPoolAllocator",
    "swa": "SWATokenToKVPoolAllocator",
    "npu": "NPUPagedTokenToKVPoolAllocator",
}


from state_machines.targets.base import Target, TargetError, construct, one_line, quiet


@dataclasses.dataclass
class SglangInfo:
    path: str  # directory holding the sglang package
    version: str
    modules: dict[str, ModuleType]  # kind -> imported module
    unavailable: dict[str, str]  # kind -> one-line reason (optional kinds only)


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


def _hint(version: str | None) -> str:
    return f"run `make sglang V={version or '<version>'}` or pass --sglang-path"


def _package_dir(mod: ModuleType) -> Path | None:
    f = getattr(mod, "__file__", None)
    if f:
        return Path(f).resolve().parent.parent
    paths = list(getattr(mod, "__path__", []) or [])
    return Path(paths[0]).resolve().parent if paths else None


# --------------------------------------------------------------------------- #
# loading


def load_sglang(sglang_path: str | None = None) -> SglangInfo:
    """Import sglang's allocator modules, from ``sglang_path`` if given.

    ``sglang_path`` is a directory holding a ``sglang/`` package: a checkout's
    ``python/`` folder or an unpacked release such as ``.sglang/0.5.23``.
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

    release = _release_of(path) if path is not None else None

    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any failure is user-facing
        raise TargetError(f"torch not importable: {one_line(exc)} ({_hint(release)})")
    need = _required_torch()
    have_torch = torch.__version__.split("+")[0]
    if have_torch != need:
        where = f"at {path} " if path is not None else ""
        raise TargetError(
            f"sglang {where}needs torch {need}, found {torch.__version__}: "
            f"run `make sglang V={release or '<version>'}`"
        )

    if path is not None and str(path) not in sys.path:
        sys.path.insert(0, str(path))

    import importlib

    modules: dict[str, ModuleType] = {}
    unavailable: dict[str, str] = {}
    with quiet():
        for kind, name in MODULES.items():
            try:
                modules[kind] = importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001
                reason = one_line(exc)
                if kind in REQUIRED:
                    raise TargetError(f"sglang not importable: {reason} ({_hint(release)})")
                unavailable[kind] = reason

    import sglang

    got = _package_dir(sglang)
    if path is not None and got is not None and got != path:
        raise TargetError(f"imported sglang from {got}, not from {path}")
    version = getattr(sglang, "__version__", None) or release or "unknown"
    _loaded = SglangInfo(
        path=str(got or path or ""),
        version=str(version),
        modules=modules,
        unavailable=unavailable,
    )
    return _loaded


def _info() -> SglangInfo:
    return _loaded if _loaded is not None else load_sglang(None)


def _cls(kind: str) -> type:
    info = _info()
    if kind not in info.modules:
        reason = info.unavailable.get(kind, "not imported")
        raise TargetError(f"sglang {info.version}: {kind} allocator unavailable: {reason}")
    cls = getattr(info.modules[kind], CLASSES[kind], None)
    if cls is None:
        raise TargetError(f"sglang {info.version}: {MODULES[kind]} has no {CLASSES[kind]}")
    return cls


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


def make_token(size: int, page_size: int, device: str, need_sort: bool):
    if page_size != 1:
        raise TargetError(f"token allocator needs page_size 1, got {page_size}")
    return _construct(_cls("token"), **_common(size, page_size, device, need_sort))


def make_paged(size: int, page_size: int, device: str, need_sort: bool):
    return _construct(_cls("paged"), **_common(size, page_size, device, need_sort))


def make_npu(size: int, page_size: int, device: str, need_sort: bool):
    """The NPU subclass on CPU; see describe_capabilities()["cpu_unavailable"]."""
    return _construct(_cls("npu"), **_common(size, page_size, device, need_sort))


def _swa_standin(base: type):
    """Smallest BaseSWAKVPool the SWA allocator's constructor accepts: no
    sub-pools, and it keeps the full->swa mapping handed to it."""

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
    }
    ns.update(
        register_mapping=register_mapping,
        translate_loc_from_full_to_swa=translate_loc_from_full_to_swa,
        __init__=lambda self: None,
        full_kv_pool=None,
        swa_kv_pool=None,
        full_to_swa_index_mapping=None,
        __repr__=lambda self: "<SWA kvcache stand-in>",
    )
    return type("KVLockstepSWAStandIn", (base,), ns)()


def make_swa(size: int, page_size: int, device: str, need_sort: bool, size_swa: int | None = None):
    cls = _cls("swa")
    mod = sys.modules[cls.__module__]
    base = getattr(mod, "BaseSWAKVPool", None)
    if base is None:
        raise TargetError(f"sglang {_info().version}: swa allocator module exposes no BaseSWAKVPool")
    args = _common(size, page_size, device, need_sort)
    args.update(size_swa=size if size_swa is None else size_swa, kvcache=_swa_standin(base))
    return _construct(cls, **args)


FACTORIES: dict[str, Callable[..., Any]] = {
    "token": make_token,
    "paged": make_paged,
    "swa": make_swa,
    "npu": make_npu,
}


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
        # The token allocator, and SWA's alloc(), work at page size 1 only.
        page_sizes=(1,) if kind in ("token", "swa") else None,
        family="swa" if kind == "swa" else None,
    )


__all__ = [
    "SglangInfo",
    "factory",
    "load_sglang",
    "make_npu",
    "make_paged",
    "make_swa",
    "make_token",
    "resolve",
]
