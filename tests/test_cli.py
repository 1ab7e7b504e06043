"""The command line as a user meets it: exit codes, messages, traces."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def kv_lockstep(*args, cwd, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "state_machines.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_mutant_run_fails_with_a_trace_that_replays(tmp_path):
    """fuzz exits 1 and names a trace; replay fails on the mutant and passes without it."""
    run = kv_lockstep("fuzz", "--target", "builtin:token", "--mutant", "flag-drift", "--seed", "0",
                      "--trace-dir", str(tmp_path), cwd=tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "FAILED" in run.stdout and "no_page_freed_twice" in run.stdout
    assert "state.end()" in run.stdout
    traces = sorted(tmp_path.glob("*.json"))
    assert traces, run.stdout
    trace = json.loads(traces[0].read_text())
    assert trace["failure"]["invariant"] == "no_page_freed_twice"
    again = kv_lockstep("replay", str(traces[0]), cwd=tmp_path)
    assert again.returncode == 1 and "no_page_freed_twice" in again.stdout
    fixed = kv_lockstep("replay", str(traces[0]), "--target", "builtin:token", cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["fuzz", "--target", "nope"], "not of the form"),
        (["fuzz", "--target", "builtin:nope"], "unknown built-in target"),
        (["fuzz", "--mutant", "nope"], "unknown mutant"),
        (["fuzz", "--page-size", "0"], "must be at least 1"),
        (["fuzz", "--target", "no_such_module_xyz:make"], "cannot import"),
        (["fuzz", "--bogus"], "unrecognized arguments"),
        (["replay", "missing.json"], "cannot read trace"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
    """Bad input gets one line on stderr, no traceback, exit code 2."""
    run = kv_lockstep(*args, cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.count("\n") == 1 and message in run.stderr
    assert "Traceback" not in run.stderr


def test_unreadable_trace_is_exit_2(tmp_path):
    """A file that is not a trace is bad input."""
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    run = kv_lockstep("replay", str(bad), cwd=tmp_path)
    assert run.returncode == 2 and "cannot read trace" in run.stderr


# An allocator written outside the repo: its free list is a Python set popped
# in hash order and it dedups nothing the harness would notice, so only a
# harness that predicts sets, never order, lets it pass.
CUSTOM = textwrap.dedent(
    '''
    import torch

    class ShuffledPool:
        def __init__(self, size, page_size, device, need_sort):
            self.page_size = page_size
            self.free_set = set(range(1, size // page_size + 1))
            self.queue = None
            self.device = device

        def alloc(self, n):
            k = n // self.page_size
            if k > len(self.free_set):
                return None
            pages = sorted(self.free_set, key=lambda p: (p * 7919) % 31)[:k]
            self.free_set -= set(pages)
            t = torch.tensor(pages, dtype=torch.int64)
            return (t[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

        def free(self, index):
            if self.queue is not None:
                self.queue.append(index.clone())
                return
            self.free_set |= set((index // self.page_size).tolist())

        def free_group_begin(self):
            self.queue = []

        def free_group_end(self):
            queue, self.queue = self.queue, None
            for index in queue or ():
                self.free(index)

        def available_size(self):
            return len(self.free_set) * self.page_size

        def get_all_free_pages(self):
            return torch.tensor(sorted(self.free_set, reverse=True), dtype=torch.int64)

    def make(size, page_size, device, need_sort):
        return ShuffledPool(size, page_size, device, need_sort)
    '''
)


@pytest.mark.parametrize("page_size", [1, 4])
def test_custom_target_outside_the_repo_has_no_false_alarm(tmp_path, page_size):
    """A correct allocator with its own free-list order passes, found through PYTHONPATH."""
    (tmp_path / "my_pool.py").write_text(CUSTOM)
    run = kv_lockstep(
        "fuzz", "--target", "my_pool:make", "--page-size", str(page_size), "--seed", "1", "--max-examples", "150",
        cwd=tmp_path, env_extra={"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "no failure" in run.stdout


def test_targets_lists_every_mutant(tmp_path):
    """`targets` names each built-in target and mutant."""
    import allocators

    run = kv_lockstep("targets", cwd=tmp_path)
    assert run.returncode == 0
    for name, (_, mutants) in allocators.BUILTINS.items():
        assert f"builtin:{name}" in run.stdout
        for mutant in mutants:
            assert mutant in run.stdout
