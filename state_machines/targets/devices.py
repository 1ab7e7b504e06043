"""Which torch devices this machine can run the allocators on, and why not.

Probing never raises: a missing driver or runtime is a reason, not a crash.
torch_npu is imported explicitly here (``state_machines`` turns torch's
backend autoload off), because torch_npu without Huawei's CANN runtime fails
at import with an ``OSError`` about ``libhccl.so`` and friends.
"""

from __future__ import annotations

from functools import lru_cache

from attrs import frozen

from state_machines.targets.base import TargetError, one_line

DEVICES = ("cpu", "cuda", "npu")


@frozen
class DeviceStatus:
    name: str
    available: bool
    # Why it is (not) available, on one line.
    reason: str


def _probe_cuda() -> DeviceStatus:
    try:
        import torch

        if torch.version.cuda is None:
            return DeviceStatus("cuda", False, f"no CUDA: torch {torch.__version__} is a build without CUDA")
        if not torch.cuda.is_available():
            return DeviceStatus("cuda", False, f"no CUDA device visible to torch {torch.__version__} (CUDA {torch.version.cuda})")
        return DeviceStatus("cuda", True, f"{torch.cuda.device_count()} device(s), {torch.cuda.get_device_name(0)}")
    except Exception as exc:
        return DeviceStatus("cuda", False, f"CUDA probe failed: {one_line(exc)}")


def _probe_npu() -> DeviceStatus:
    try:
        import torch  # noqa: F401
        import torch_npu  # noqa: F401
    except ImportError as exc:
        if getattr(exc, "name", None) == "torch_npu":
            return DeviceStatus("npu", False, "torch_npu not installed (pip install torch_npu, with Huawei's CANN runtime)")
        return DeviceStatus("npu", False, f"torch_npu present but its runtime (CANN) is missing: {one_line(exc)}")
    except OSError as exc:
        # Typically libhccl.so / libascendcl.so: CANN is not installed or not sourced.
        return DeviceStatus("npu", False, f"torch_npu present but its runtime (CANN) is missing: {one_line(exc)}")
    except Exception as exc:
        return DeviceStatus("npu", False, f"torch_npu present but failed to load: {one_line(exc)}")
    try:
        import torch

        if not torch.npu.is_available():
            return DeviceStatus("npu", False, "torch_npu loaded but no NPU device is visible")
        return DeviceStatus("npu", True, f"{torch.npu.device_count()} device(s)")
    except Exception as exc:
        return DeviceStatus("npu", False, f"torch_npu loaded but the NPU runtime failed: {one_line(exc)}")


@lru_cache(maxsize=None)
def probe(name: str) -> DeviceStatus:
    """The status of one device kind (``cpu``, ``cuda``, ``npu``); cached."""
    if name == "cpu":
        return DeviceStatus("cpu", True, "always")
    if name == "cuda":
        return _probe_cuda()
    if name == "npu":
        return _probe_npu()
    return DeviceStatus(name, False, f"unknown device '{name}'; known: {', '.join(DEVICES)}")


def probe_all() -> list[DeviceStatus]:
    return [probe(name) for name in DEVICES]


def require(device: str) -> None:
    """Raise ``TargetError`` (one line, exit 2) unless ``device`` is usable.
    ``cuda:1`` is checked as ``cuda``."""
    status = probe(device.partition(":")[0])
    if not status.available:
        raise TargetError(f"device '{device}' is not available: {status.reason}")
