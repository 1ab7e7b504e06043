"""The gate on real sglang releases finds the two historical bugs, from
the single-file releases (0.5.8-0.5.12) on.

Each release runs in a fresh process (one process imports one sglang).  The
releases come from `make sglang V=...`; without them these tests skip.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

REPO = Path(__file__).resolve().parent.parent
# The free_group bugs live in free(); these rules free a view of a row.
FREES_A_VIEW = {"free", "free_segment", "finish", "rematch"}
# These overwrite a row a queued view may point into.
OVERWRITES_A_ROW = {"overwrite_row", "rematch", "alloc", "admit", "decode", "extend"}


def release_dir(version: str) -> Path:
    folder = REPO / ".sglang" / version
    if not (folder / "sglang").is_dir():
        pytest.skip(f"sglang {version} not installed: run `make sglang V={version}`")
    import torch

    if not torch.__version__.startswith("2.14.1"):
        pytest.skip(f"sglang's import set needs torch 2.14.1, this venv has {torch.__version__}: run `make sglang V={version}`")
    return folder


def gate(version: str, trace_dir: Path, kinds: str = "token,paged") -> dict[str, dict]:
    """The matrix rows of one release, by target kind."""
    run = subprocess.run(
        [sys.executable, "-m", "state_machines.runs.matrix", "--one", str(release_dir(version)),
         "--kinds", kinds, "--max-examples", "200", "--seed", "0", "--trace-dir", str(trace_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=1200,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    # By kind (its first page size) and by kind@page_size: swa is gated at 1 and 4.
    out = {}
    for row in rows:
        kind, _, rest = row["target"].partition(" ")
        kind = kind.partition(":")[2] or kind
        out.setdefault(kind, row)
        out[f"{kind}@{rest.removeprefix('page_size=')}"] = row
    return out


def is_aliasing_story(rules: list[str]) -> bool:
    """begin, then a free of a row view, then an overwrite of a row, then end
    (a rematch is both: it frees the duplicated span as a view of the row,
    then writes the cache's slots over that row)."""
    if "begin" not in rules or rules[-1] != "end":
        return False
    inside = rules[rules.index("begin") + 1 : -1]
    if "end" in inside:
        return False
    frees = [i for i, r in enumerate(inside) if r in FREES_A_VIEW]
    if not frees:
        return False
    return inside[frees[0]] == "rematch" or any(r in OVERWRITES_A_ROW for r in inside[frees[0] + 1 :])


def test_0_5_17_fails_on_aliasing_and_its_trace_passes_on_0_5_23(tmp_path):
    """0.5.17 frees an overwritten row view at end; the fixed release replays that trace clean."""
    rows = gate("0.5.17", tmp_path)
    for kind in ("token", "paged"):
        row = rows[kind]
        assert row["result"] == "FAIL", row
        aliasing = [f for f in row["failures"] if is_aliasing_story(f["rules"])]
        assert aliasing, f"sglang:{kind} on 0.5.17: no aliasing trace among {row['failures']}"
    fixed = release_dir("0.5.23")
    trace = aliasing[0]["trace"]
    replay = subprocess.run(
        [sys.executable, "-m", "state_machines.cli", "replay", trace, "--sglang-path", str(fixed)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    steps = len(json.loads(Path(trace).read_text())["steps"])
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert replay.stdout.splitlines()[-1] == f"trace passes: all {steps} steps and the teardown check out"
    buggy = subprocess.run(
        # A trace's own sglang_path is never put on sys.path: the command line names it.
        [sys.executable, "-m", "state_machines.cli", "replay", trace, "--sglang-path", str(release_dir("0.5.17"))],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert buggy.returncode == 1, buggy.stdout + buggy.stderr
    assert buggy.stdout.splitlines()[1] == f"FAILED at step {steps - 1}, state.end(): {aliasing[0]['invariant']}"


def is_repeated_end(rules: list[str]) -> bool:
    """The trace fails at an end that follows an end with no begin between."""
    if rules[-1] != "end" or "end" not in rules[:-1]:
        return False
    previous_end = len(rules) - 2 - rules[-2::-1].index("end")
    return "begin" not in rules[previous_end:]


def test_0_5_18_fails_on_a_repeated_end(tmp_path):
    """0.5.18 clones what it queues but frees again on a second free_group_end():
    the same page twice, or a page a later request already holds."""
    rows = gate("0.5.18", tmp_path)
    for kind in ("token", "paged"):
        row = rows[kind]
        assert row["result"] == "FAIL", row
        assert all(is_repeated_end(f["rules"]) for f in row["failures"]), row["failures"]
        assert not any(is_aliasing_story(f["rules"]) for f in row["failures"]), row["failures"]


def test_0_5_23_runs_its_whole_budget_clean(tmp_path):
    """The fixed release raises no alarm on any target it has."""
    rows = gate("0.5.23", tmp_path, kinds="token,paged,swa,npu")
    for kind, row in rows.items():
        assert row["result"] == "pass", row
        assert row["examples"] >= 200


def targets_listing(version: str) -> list[str]:
    """`kv-lockstep targets --sglang-path` of one release, as lines."""
    run = subprocess.run(
        [sys.executable, "-m", "state_machines.cli", "targets", "--sglang-path", str(release_dir(version))],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout.splitlines()


def test_0_5_12_loads_its_single_file_as_token_paged_swa_and_npu():
    """0.5.12 keeps every allocator in mem_cache/allocator.py; each kind loads from where that release keeps it."""
    lines = targets_listing("0.5.12")
    assert lines[0].endswith(": allocators in one file, sglang/srt/mem_cache/allocator.py")
    assert lines[0].startswith("sglang 0.5.12 at ")
    kinds = [line for line in lines if line.startswith("  sglang:")]
    assert kinds == [
        "  sglang:token: TokenToKVPoolAllocator (sglang.srt.mem_cache.allocator), page size 1 only",
        "  sglang:paged: PagedTokenToKVPoolAllocator (sglang.srt.mem_cache.allocator), any page size",
        "  sglang:swa: SWATokenToKVPoolAllocator (sglang.srt.mem_cache.swa_memory_pool), any page size",
        "  sglang:npu: NPUPagedTokenToKVPoolAllocator (sglang.srt.hardware_backend.npu.allocator_npu), any page size",
    ] + [
        f"  sglang:{kind}: unavailable: sglang 0.5.12: {kind} allocator unavailable: this release keeps its allocators"
        f" in one file, mem_cache/allocator.py, with no {kind} allocator"
        for kind in ("pure-swa", "hisparse", "dsv4-hisparse", "mamba", "page-interleave", "multi-ended", "multi-ended-eager", "unified-swa", "unified-swa-eager", "unified-mamba", "unified-mamba-eager", "unified-mamba-swa", "unified-mamba-swa-eager")
    ]


def test_0_5_12_token_fails_on_the_seed_bugs(tmp_path):
    """The single-file release's token allocator fails, each shrunk trace the aliasing story or a repeated end."""
    row = gate("0.5.12", tmp_path, kinds="token")["token"]
    assert row["result"] == "FAIL", row
    assert row["failures"], row
    for failure in row["failures"]:
        assert is_aliasing_story(failure["rules"]) or is_repeated_end(failure["rules"]), failure


def test_targets_lists_every_kind_of_a_release_with_its_steps():
    """`targets --sglang-path` on 0.5.23: each kind's class and page sizes, the page size it is shown at, its steps and disabled steps."""
    lines = targets_listing("0.5.23")
    assert lines[0].endswith(": allocators in a package, sglang/srt/mem_cache/allocator/")
    at = lines.index("  sglang:token: TokenToKVPoolAllocator (sglang.srt.mem_cache.allocator.token), page size 1 only")
    # At page size 1 the caller sends decode and extend to alloc(), which the token allocator has.
    assert lines[at + 1 : at + 4] == [
        "    at page size 1: harness Lockstep",
        "    steps: admit, alloc, ask, begin, decode, end, evict, extend, finish, finish_segments, free, free_empty_span,"
        " free_segment, offload, overwrite_row, rematch, resize",
        "  sglang:paged: PagedTokenToKVPoolAllocator (sglang.srt.mem_cache.allocator.paged), any page size",
    ]
    # Gated at 1 and 4; at 1 a resize is outside the caller's contract (the token allocator is built there).
    at = lines.index("  sglang:paged: PagedTokenToKVPoolAllocator (sglang.srt.mem_cache.allocator.paged), any page size")
    assert lines[at + 1] == "    at page size 1: harness Lockstep"
    assert lines[at + 3].startswith("    disabled: resize: resize to 1 page leaves PagedTokenToKVPoolAllocator.num_pages")
    assert lines[at + 4 : at + 6] == [
        "    at page size 4: harness Lockstep",
        "    steps: admit, alloc, ask, begin, decode, end, evict, extend, finish, finish_segments, free, free_empty_span,"
        " free_segment, offload, overwrite_row, rematch, resize",
    ]
    at = lines.index("  sglang:swa: SWATokenToKVPoolAllocator (sglang.srt.mem_cache.allocator.swa), any page size")
    assert [line for line in lines[at + 1 :] if line.startswith("    at page size")][:2] == [
        "    at page size 1: harness SWALockstep",
        "    at page size 4: harness SWALockstep",
    ]
    assert ("  sglang:npu: NPUPagedTokenToKVPoolAllocator (sglang.srt.hardware_backend.npu.allocator_npu), any page size"
            in lines)


def test_targets_lists_page_interleave_from_page_size_2_with_decode_disabled():
    """0.5.23's page-interleave kind: page size 2 or more, shown at 4, extend and load_back run, decode disabled with the reason."""
    lines = targets_listing("0.5.23")
    at = lines.index("  sglang:page-interleave: PageInterleavePoolAllocator"
                     " (sglang.srt.mem_cache.allocator.page_interleave), page size 2 or more")
    assert lines[at + 1 : at + 3] == [
        "    at page size 4: harness PageInterleaveLockstep",
        "    steps: admit, alloc, begin, end, evict, extend, finish, free, free_empty_span, free_segment, load_back,"
            " overwrite_row, rematch",
    ]
    assert "    disabled: decode: alloc_decode: not provided (NotImplementedError)" in lines[at + 3 : at + 8]


def test_0_5_23_swa_at_page_size_4_runs_clean(tmp_path):
    """0.5.23's SWA allocator through alloc_extend, alloc_decode and alloc_extend_swa_tail raises no alarm."""
    row = gate("0.5.23", tmp_path, kinds="swa")["swa@4"]
    assert row["result"] == "pass", row


def test_0_5_17_swa_at_page_size_4_fails_on_aliasing(tmp_path):
    """0.5.17's SWA free() queues the caller's row view in a group; paged, through the CPU stand-ins, it still does."""
    row = gate("0.5.17", tmp_path, kinds="swa")["swa@4"]
    assert row["result"] == "FAIL", row
    assert any(is_aliasing_story(f["rules"]) for f in row["failures"]), row["failures"]


def test_an_emitted_file_names_the_release_by_its_full_path(tmp_path, monkeypatch):
    """A relative --sglang-path went into the emitted file as given: run
    from another folder (pytest's own, CI's), the test failed on a setup
    error ('--sglang-path .sglang/0.5.23 is not a directory'), read as a
    regression (helper-80)."""
    from state_machines.config import Config
    from state_machines.runs.emit import pytest_source
    from state_machines.runs.trace import Step, Trace

    release = release_dir("0.5.23")
    monkeypatch.chdir(release.parent.parent)
    config = Config(target="sglang:token", sglang_path=f".sglang/{release.name}")
    text = pytest_source(Trace(config, (Step("alloc", {"n": 1}, "req_0"),)), config, recorded=False)
    assert f"sglang_path={str(release)!r}" in text and "sglang_path='.sglang/" not in text


@pytest.mark.sglang
def test_the_merge_order_is_counted_on_0_5_23s_staged_pages():
    """0.5.23's paged allocator keeps the frees need_sort holds back in
    ``staged_pages`` (its ``release_pages`` is None): the coverage counter,
    which read ``release_pages`` alone, said of every run "alloc_merged_release
    NEVER REACHED" while the merge ran (helper-87)."""
    from state_machines.config import Config
    from state_machines.harness import build
    from state_machines.runs.coverage import Coverage

    config = Config(target="sglang:paged", page_size=4, need_sort=True, sglang_path=str(release_dir("0.5.23")))
    state = build(config)
    coverage = Coverage(config, use_hypothesis=False)
    coverage._new_example(state)
    first = state.alloc(n=4 * 6)
    state.alloc(n=4 * 3)
    state.free(req=first, n=4 * 6)  # six pages staged, three free
    assert state.allocator.release_pages is None and sum(len(p) for p in state.allocator.staged_pages) == 6
    assert list(coverage._interleavings(state, "alloc", {"n": 4 * 4})) == ["alloc_merged_release"]
    assert list(coverage._interleavings(state, "alloc", {"n": 4 * 1})) == []


@pytest.mark.sglang
def test_the_merge_order_is_not_applicable_where_the_allocator_keeps_no_waiting_pages():
    """0.5.23's SWA pair keeps its held-back frees in its inner pools, and
    its own ``release_pages`` is None: the counter cannot see the merge
    there, so the order is n/a, not "NEVER REACHED" (helper-87)."""
    from state_machines.config import Config
    from state_machines.harness import build
    from state_machines.runs.coverage import Coverage, waiting_pages

    config = Config(target="sglang:swa", page_size=4, need_sort=True, sglang_path=str(release_dir("0.5.23")))
    state = build(config)
    assert waiting_pages(state.allocator) is None
    coverage = Coverage(config, use_hypothesis=False)
    assert "alloc_merged_release" in coverage.applicable  # the configuration alone
    coverage._new_example(state)
    assert "alloc_merged_release" not in coverage.applicable
