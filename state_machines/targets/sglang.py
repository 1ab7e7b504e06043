"""Real sglang KV-slot allocators as kv-lockstep targets (CPU only).

``load_sglang(path)`` puts one sglang release on ``sys.path`` and imports its
allocator modules; every failure becomes a one-line ``TargetError``.  The
factories build allocators from the loaded release with the uniform signature
``factory(size, page_size, device, need_sort)``; they pass constructor
arguments by parameter name, so a release that reorders or adds parameters
still works.  ``describe_capabilities(allocator)`` reports which contract
style the release follows, found by looking at the object and by probing a
throwaway copy -- never from version strings.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import logging
import re
import sys
import warnings
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


from state_machines.targets import Target, TargetError


@dataclasses.dataclass
class SglangInfo:
    path: str  # directory holding the sglang package
    version: str
    torch_version: str
    modules: dict[str, ModuleType]  # kind -> imported module
    unavailable: dict[str, str]  # kind -> one-line reason (optional kinds only)


_loaded: SglangInfo | None = None


# --------------------------------------------------------------------------- #
# helpers


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


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


@contextlib.contextmanager
def _quiet_import():
    """sglang warns and logs freely at import time on a GPU-less host."""
    root = logging.getLogger()
    level = root.level
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        root.setLevel(max(level, logging.ERROR))
        try:
            yield
        finally:
            root.setLevel(level)


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
        raise TargetError(f"torch not importable: {_one_line(exc)} ({_hint(release)})")
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
    with _quiet_import():
        for kind, name in MODULES.items():
            try:
                modules[kind] = importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001
                reason = _one_line(exc)
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
        torch_version=torch.__version__,
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
    params = inspect.signature(cls.__init__).parameters
    kwargs = {}
    for name, p in params.items():
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in available:
            kwargs[name] = available[name]
        elif p.default is p.empty:
            raise TargetError(f"{cls.__name__}() wants parameter {name!r}, which kv-lockstep cannot supply")
    try:
        return cls(**kwargs)
    except TargetError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise TargetError(f"{cls.__name__}({', '.join(kwargs)}) failed: {_one_line(exc)}")


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


# --------------------------------------------------------------------------- #
# capabilities


def _probe_free_segment(allocator) -> str:
    if not hasattr(allocator, "free_segment"):
        return "absent"
    ps = allocator.page_size
    if ps == 1:
        return "n/a (page_size 1)"
    probe = copy.deepcopy(allocator)
    try:
        idx = probe.alloc(2 * ps)
    except Exception as exc:  # noqa: BLE001 - e.g. SWA's alloc() is page_size-1 only
        return f"unknown (alloc for the probe failed: {_one_line(exc)})"
    if idx is None:
        return "unknown (pool too small to probe)"
    try:
        probe.free_segment(idx[1:], start_pos=1)
    except AssertionError:
        return "asserts page-aligned start"
    except Exception as exc:  # noqa: BLE001
        return f"unknown ({_one_line(exc)})"
    return "accepts unaligned start"


def _probe_cpu_methods(allocator) -> dict[str, str]:
    """Run alloc_extend / alloc_decode once on a throwaway copy; report what
    cannot run here (a device kernel, a missing kernel package)."""
    import torch

    ps = allocator.page_size
    out: dict[str, str] = {}
    i64 = dict(dtype=torch.int64, device=allocator.device)
    calls = {
        "alloc_extend": lambda a: a.alloc_extend(
            torch.tensor([0], **i64), torch.tensor([0]),
            torch.tensor([ps + 1], **i64), torch.tensor([ps + 1]),
            torch.tensor([-1], **i64), ps + 1,
        ),
        "alloc_decode": lambda a: a.alloc_decode(
            torch.tensor([ps + 1], **i64), torch.tensor([ps + 1]),
            torch.tensor([ps - 1], **i64),
        ),
    }
    for name, call in calls.items():
        if not hasattr(allocator, name):
            continue
        probe = copy.deepcopy(allocator)
        try:
            with _quiet_import():
                call(probe)
        except NotImplementedError:
            out[name] = "not provided"
        except Exception as exc:  # noqa: BLE001
            out[name] = _one_line(exc) + _raised_at(exc)
    return out


def _raised_at(exc: BaseException) -> str:
    """Where a bare exception (an ``assert`` with no message) came from."""
    if str(exc).strip():
        return ""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f" at {Path(last.filename).name}:{last.lineno} ({(last.line or '').strip()[:60]})"


def describe_capabilities(allocator) -> dict:
    a = allocator
    if getattr(a, "free_group", "missing") is None:
        free_group = "none-or-list"
    elif hasattr(a, "is_not_in_free_group"):
        free_group = "flag+list"
    else:
        free_group = "unknown"

    fields = [f for f in ("free_pages", "release_pages", "staged_pages") if getattr(a, f, None) is not None]
    census = "get_all_free_pages" if callable(getattr(a, "get_all_free_pages", None)) else "+".join(fields) or "none"

    return {
        "class": type(a).__name__,
        "page_size": a.page_size,
        "need_sort": a.need_sort,
        "free_group": free_group,
        "census": census,
        "census_fields": fields,
        "free_segment": _probe_free_segment(a),
        "free_segments": hasattr(a, "free_segments"),
        "free_page_ids": hasattr(a, "free_page_ids"),
        "alloc_backend": (
            ("triton" if a.use_triton_kernels else "torch")
            if hasattr(a, "use_triton_kernels")
            else "class default"
        ),
        "cpu_unavailable": _probe_cpu_methods(a),
    }


_GATES: dict[tuple, dict[str, str]] = {}


def rule_gate(allocator) -> dict[str, str]:
    """Rules this allocator cannot run here, each with the reason: a method
    that raises on a throwaway copy (a device kernel, a missing kernel
    package, or a base class's NotImplementedError) disables its rule.
    Probed once per class and pool shape."""
    key = (type(allocator), allocator.page_size, allocator.need_sort)
    if key not in _GATES:
        cant = _probe_cpu_methods(allocator)
        _GATES[key] = {"decode": f"alloc_decode: {cant['alloc_decode']}"} if "alloc_decode" in cant else {}
    return _GATES[key]


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
        family="swa" if kind == "swa" else "free_group",
        rule_gate=rule_gate,
    )


__all__ = [
    "TargetError",
    "SglangInfo",
    "load_sglang",
    "factory",
    "make_token",
    "make_paged",
    "make_swa",
    "make_npu",
    "describe_capabilities",
    "resolve",
    "rule_gate",
]
