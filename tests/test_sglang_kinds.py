"""sglang's pure-SWA, HiSparse, Mamba and page-interleave allocators in the release gate.

Each release runs in a fresh process (``gate`` of ``test_sglang``); without
the releases these tests skip.
"""

import pytest

from tests.test_sglang import gate, is_aliasing_story

pytestmark = pytest.mark.sglang

NEW_KINDS = "pure-swa,hisparse,mamba,page-interleave"


@pytest.fixture(scope="module")
def rows_0_5_23(tmp_path_factory):
    return gate("0.5.23", tmp_path_factory.mktemp("traces"), NEW_KINDS)


@pytest.fixture(scope="module")
def rows_0_5_17(tmp_path_factory):
    return gate("0.5.17", tmp_path_factory.mktemp("traces"), NEW_KINDS)


@pytest.mark.parametrize("kind", NEW_KINDS.split(","))
def test_0_5_23_runs_each_new_kind_clean(rows_0_5_23, kind):
    """0.5.23's pure-SWA (page size 1), HiSparse (4), Mamba (1) and page-interleave (4) allocators pass the whole budget."""
    assert rows_0_5_23[kind]["result"] == "pass", rows_0_5_23[kind]


def test_0_5_17_pure_swa_fails_on_aliasing(rows_0_5_17):
    """0.5.17's PureSWATokenToKVPoolAllocator.free queues the caller's row view inside a group."""
    row = rows_0_5_17["pure-swa"]
    assert row["result"] == "FAIL", row
    assert any(is_aliasing_story(f["rules"]) for f in row["failures"]), row["failures"]


def test_0_5_17_hisparse_at_page_size_4_is_unavailable_not_failed(rows_0_5_17):
    """Its alloc_extend needs a Triton driver: the row says so, and runs nothing."""
    row = rows_0_5_17["hisparse"]
    assert row["result"].startswith("unavailable: sglang:hisparse at page size 4 allocates through alloc_extend"), row


def test_0_5_17_mamba_passes(rows_0_5_17):
    """0.5.17's MambaSlotAllocator keeps its allocation groups sound under its caller's pairing."""
    assert rows_0_5_17["mamba"]["result"] == "pass", rows_0_5_17["mamba"]


def test_0_5_17_has_no_page_interleave_allocator(rows_0_5_17):
    """The class arrives in 0.5.20: the row says it is unavailable, and runs nothing."""
    row = rows_0_5_17["page-interleave"]
    assert row["result"].startswith("unavailable:") and "page_interleave" in row["result"], row


@pytest.mark.sglang
@pytest.mark.parametrize("mode", [["--max-examples", "3"], ["--duration", "1s", "-j", "1"]], ids=["plain", "long"])
def test_the_fuzz_header_names_the_stand_ins_a_kind_runs_over(tmp_path, mode):
    """The README says dsv4-hisparse's stand-ins are named in the run's
    header; only ``targets --target`` named them (helper-80)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.test_sglang import release_dir

    run = subprocess.run([sys.executable, "-m", "state_machines.cli", "fuzz", "--target", "sglang:dsv4-hisparse",
                          "--page-size", "4", "--sglang-path", str(release_dir("0.5.23")), "--seed", "0", *mode,
                          "--trace-dir", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)))
    assert run.returncode == 0, run.stdout + run.stderr
    said = [line for line in run.stdout.splitlines() if line.startswith("stand-in: ")]
    assert [line.split(":")[1].strip() for line in said[:2]] == ["<DeepSeekV4TokenToKVPool stand-in", "<HiSparseC4DevicePool stand-in"], run.stdout
