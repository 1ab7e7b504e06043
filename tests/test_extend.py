"""Extend, the caller's contract per page size, --latent and int32 rows."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from allocators import NPUPagedAllocator, PagedAllocator
from reference_model import OwnershipModel
from reference_model.invariants import extend_continues_last_page, extend_takes_whole_new_pages
from state_machines.cli import main
from state_machines.config import Config
from state_machines.harness import build
from state_machines.harness.steps import Step
from state_machines.runs.emit import pytest_source
from state_machines.runs.runner import fuzz
from state_machines.runs.trace import Trace, run_steps

REPO = Path(__file__).resolve().parent.parent


class Calls(PagedAllocator):
    """A correct paged allocator that records which alloc method each call used."""

    def __init__(self, size, page_size=1, device="cpu", need_sort=False):
        super().__init__(size, page_size, device, need_sort)
        self.calls = []

    def alloc(self, need_size):
        self.calls.append("alloc")
        return super().alloc(need_size)

    def alloc_extend(self, *args):
        self.calls.append("alloc_extend")
        return super().alloc_extend(*args)

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        self.calls.append("alloc_decode")
        return NPUPagedAllocator.alloc_decode(self, seq_lens, seq_lens_cpu, last_loc)

    def _starts_page(self, seq_lens):
        return NPUPagedAllocator._starts_page(self, seq_lens)

    _in_range = staticmethod(NPUPagedAllocator._in_range)


def _state(page_size, latent=False):
    return build(target="tests.test_extend:Calls", page_size=page_size, latent=latent)


def test_at_page_size_1_decode_and_extend_go_to_alloc():
    """As every sglang release's caller does: one alloc() per batch, never alloc_decode or alloc_extend."""
    state = _state(1)
    a, b = state.admit(), state.admit()
    state.extend([a, b], [3, 2])
    state.decode([a, b])
    assert state.allocator.calls == ["alloc", "alloc"]
    assert state.model.tokens(a.rid, 1) == 4 and state.model.tokens(b.rid, 1) == 3


def test_latent_sends_page_size_1_decode_and_extend_to_their_own_methods():
    """--latent drives alloc_extend and alloc_decode at page size 1, which no caller does."""
    state = _state(1, latent=True)
    a = state.admit()
    state.extend([a], [3])
    state.decode([a])
    assert state.allocator.calls == ["alloc_extend", "alloc_decode"]


def test_at_page_size_4_a_mixed_batch_is_one_alloc_extend():
    """Continuing, fresh and cached-prefix requests share one call, and the rows hold their slots."""
    state = _state(4)
    old = state.admit()
    state.extend([old], [6])  # 6 tokens: the second page is half used
    state.rematch(old, 0)
    cached = state.entries()[0]
    cont, fresh, on_prefix = state.admit(), state.admit(), state.admit(prefix=cached)
    state.finish(old)
    state.extend([cont, fresh], [5, 3])
    state.extend([cont, fresh, on_prefix], [2, 1, 4])
    assert state.allocator.calls == ["alloc_extend", "alloc_extend", "alloc_extend"]
    ps = 4
    for req, tokens in ((cont, 7), (fresh, 4), (on_prefix, 12)):
        assert state.model.tokens(req.rid, ps) == tokens
        row = state.rows[state.model.requests[req.rid].row, : len(state.model.requests[req.rid].pages) * ps].tolist()
        # Whole pages, each slot at its offset: the row and the model agree.
        assert [s // ps for s in row[::ps]] == state.model.requests[req.rid].pages
        assert all(s % ps == i % ps for i, s in enumerate(row))


def test_extend_continues_last_page_names_the_early_slot():
    """A continuation starting on the request's own last slot is reported with both sides."""
    got = extend_continues_last_page("alloc_extend(...)", ["req_0"], [1], [4], [[4, 5]], 4)
    assert got == "alloc_extend(...) gave req_0 (prefix 1 tokens, last slot 4) [4, 5] first / the rest of its last page, [5, 6]"
    assert extend_continues_last_page("x", ["req_0"], [1], [4], [[5, 6, 7, 12]], 4) is None


def test_extend_takes_whole_new_pages_rejects_a_page_entered_mid_way():
    """Past the last page, slots must start each new page at its first slot."""
    assert extend_takes_whole_new_pages("x", ["req_0"], [0], [[13, 14]], 4) is not None
    assert extend_takes_whole_new_pages("x", ["req_0"], [3], [[3, 12, 13]], 4) is None


def test_model_counts_new_pages_as_ceil_minus_ceil():
    """ceil(seq_len / page_size) - ceil(prefix_len / page_size), and the spare slots left after."""
    model = OwnershipModel.from_census(list(range(1, 9)))
    req = model.new_request(row=0, pages=[])
    assert model.extend_new_pages(req.rid, 5, 4) == 2
    model.extend(req.rid, [1, 2], 5, 4)
    assert (model.tokens(req.rid, 4), model.requests[req.rid].spare) == (5, 3)
    assert model.extend_new_pages(req.rid, 3, 4) == 0
    assert model.extend_new_pages(req.rid, 4, 4) == 1
    model.extend(req.rid, [], 3, 4)
    assert model.requests[req.rid].spare == 0 and model.violations() == []


def test_rows_are_int32_by_default_and_int64_on_request():
    """req_to_token is int32 as sglang's ReqToTokenPool keeps it; --row-dtype int64 widens it."""
    assert build(target="builtin:paged", page_size=4).rows.dtype == torch.int32
    assert build(target="builtin:paged", page_size=4, row_dtype="int64").rows.dtype == torch.int64


def test_a_clean_target_passes_with_int64_rows():
    """The int64 rows raise no false alarm."""
    outcome = fuzz(Config(target="builtin:npu", page_size=2, row_dtype="int64"), max_examples=100)
    assert outcome.ok, [t.program() for t in outcome.failures]


def test_latent_at_a_page_size_above_1_is_bad_input(capsys):
    """--latent changes nothing above page size 1, so it is refused there."""
    assert main(["fuzz", "--target", "builtin:paged", "--page-size", "4", "--latent"]) == 2
    assert "--latent drives alloc_decode / alloc_extend at page size 1" in capsys.readouterr().err


def test_emitted_alloc_comments_skip_allocs_that_decode_made():
    """At page size 1 decode calls alloc() too; each alloc step's comment shows its own slots."""
    steps = (Step("alloc", {"n": 1}, "req_0"), Step("decode", {"reqs": ["req_0"]}), Step("alloc", {"n": 1}, "req_1"))
    source = pytest_source(Trace(Config(target="builtin:token"), steps), Config(target="builtin:token"))
    assert "req_1 = state.alloc(n=1)  # returned torch.tensor([3])" in source


def test_extend_steps_replay_from_a_trace():
    """An extend trace replays through the schema and the same checks."""
    steps = (Step("admit", {}, "req_0"), Step("extend", {"reqs": ["req_0"], "tokens": [5]}),
             Step("admit", {}, "req_1"), Step("extend", {"reqs": ["req_0", "req_1"], "tokens": [3, 1]}))
    trace = Trace(Config(target="builtin:paged", page_size=4), steps).checked()
    state = build(trace.config)
    run_steps(state, trace.steps)
    assert [state.model.tokens(r, 4) for r in (0, 1)] == [8, 1]


def _sglang(*args):
    if not (REPO / ".sglang" / "0.5.23" / "sglang").is_dir() or not torch.__version__.startswith("2.14.1"):
        pytest.skip("sglang 0.5.23 not installed: run `make sglang V=0.5.23`")
    return subprocess.run(
        [sys.executable, "-m", "state_machines.cli", "fuzz", "--target", "sglang:paged", "--page-size", "1",
         "--sglang-path", str(REPO / ".sglang" / "0.5.23"), "--max-examples", "100", "--seed", "0", *args],
        cwd=REPO, capture_output=True, text=True, timeout=900, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )


@pytest.mark.sglang
def test_sglang_0_5_23_paged_at_page_size_1_passes_in_contract(tmp_path):
    """0.5.23's paged allocator at page size 1, driven as its callers drive it, raises no alarm."""
    run = _sglang("--trace-dir", str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.sglang
def test_sglang_0_5_23_paged_alloc_decode_at_page_size_1_is_a_latent_finding(tmp_path):
    """Under --latent, alloc_decode at page size 1 hands out last_loc + 1 and keeps it free
    (it counts new pages as seq_len % 1 == 1, never true); the failure is labeled latent."""
    run = _sglang("--latent", "--trace-dir", str(tmp_path))
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stdout.splitlines()[0].startswith("kv-lockstep fuzz: sglang:paged page_size=1 sglang=0.5.23 latent,")
    assert re.search(r"^LATENT FINDING: first failure after", run.stdout, re.M), run.stdout
    assert re.search(r"^failure 1: \w+ \[latent: outside the caller's contract, not a gate failure\]$", run.stdout, re.M)
    assert "state.decode(" in run.stdout
    assert all("latent" in p.name for p in tmp_path.glob("*.json"))


def test_a_latent_runs_failure_with_no_latent_step_is_a_gate_failure(tmp_path):
    """--latent labeled every failure latent, "not a gate failure": the
    aliasing bug (alloc, begin, finish, overwrite, end) too, which no
    decode or extend reaches (helper-90).  A CI job that kept --latent on
    read its seed bug as a finding."""
    run = subprocess.run(
        [sys.executable, "-m", "state_machines.cli", "fuzz", "--target", "builtin:token", "--mutant", "alias", "--latent",
         "--max-examples", "5", "--seed", "2", "--trace-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert re.search(r"^FAILED: first failure after", run.stdout, re.M), run.stdout
    # One trace per distinct failure: the walk may meet both of alias's invariants.
    failures = re.findall(r"^failure \d+: .*$", run.stdout, re.M)
    assert failures and all(re.fullmatch(r"failure \d+: \w+ \[a gate failure: no step of it needs --latent\]", f)
                            for f in failures), run.stdout
    assert "decode" not in run.stdout.partition("failure 1:")[2]
    paths = sorted(tmp_path.glob("*.json"))
    assert len(paths) == len(failures), (paths, failures)
    for path in paths:
        replayed = subprocess.run([sys.executable, "-m", "state_machines.cli", "replay", str(path)], cwd=REPO,
                                  capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert replayed.returncode == 1 and "latent" not in replayed.stdout.partition("FAILED at")[2], replayed.stdout
