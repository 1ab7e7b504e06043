"""Devices: probing never crashes, unavailable ones are refused on one line, available ones run."""

import re

import pytest

from state_machines.config import Config
from state_machines.harness import build
from state_machines.runs.runner import fuzz
from state_machines.targets import TargetError, devices
from tests.test_cli import kv_lockstep


def test_every_device_has_a_one_line_status():
    """Each device kind probes to available or not, with a one-line reason."""
    statuses = devices.probe_all()
    assert [s.name for s in statuses] == ["cpu", "cuda", "npu"]
    assert statuses[0].available
    assert all(s.reason and "\n" not in s.reason for s in statuses)


@pytest.mark.parametrize("device", devices.DEVICES)
@pytest.mark.parametrize("target", ["builtin:swa", "builtin:npu"])
def test_targets_run_on_every_available_device(device, target):
    """Where a device is available, the family's machines run on it clean; elsewhere it is skipped with its reason."""
    status = devices.probe(device)
    if not status.available:
        pytest.skip(status.reason)
    outcome = fuzz(Config(target=target, page_size=4, device=device), max_examples=30)
    assert outcome.ok, [f"{t.invariant}: {t.detail}" for t in outcome.failures]


@pytest.mark.parametrize("device", [d for d in devices.DEVICES if not devices.probe(d).available] or ["nope"])
def test_unavailable_device_is_a_target_error(device):
    """Building on an unavailable device raises TargetError naming the reason."""
    reason = devices.probe(device).reason
    with pytest.raises(TargetError, match=re.escape(f"device '{device}' is not available: {reason}")):
        build(target="builtin:npu", page_size=4, device=device)


def test_cli_unavailable_device_exits_2_and_devices_lists_all(tmp_path):
    """`fuzz --device` on a missing device exits 2 on one line; `devices` reports every kind."""
    missing = next((d for d in devices.DEVICES if not devices.probe(d).available), "nope")
    run = kv_lockstep("fuzz", "--target", "builtin:npu", "--page-size", "4", "--device", missing, cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    reason = devices.probe(missing).reason
    assert (run.stdout, run.stderr) == ("", f"kv-lockstep: error: device '{missing}' is not available: {reason}\n")
    listing = kv_lockstep("devices", cwd=tmp_path)
    assert listing.returncode == 0, listing.stdout + listing.stderr
    rows = [line.split(maxsplit=2) for line in listing.stdout.splitlines()]
    assert rows == [[s.name, "available" if s.available else "unavailable", s.reason] for s in devices.probe_all()]
