"""The hand-written shortest traces the bench compares shrinking against."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.known_shortest import KNOWN
from bench.targets import unavailable
from state_machines.runs.runner import replay

REPO = Path(__file__).resolve().parent.parent


def _runnable(config):
    """Skip, saying why, where the configuration cannot be built here."""
    if (reason := unavailable(config)) is not None:
        pytest.skip(reason)


def _replay(trace, config, tmp_path):
    """(failing invariant, steps run) of the trace on ``config``, or None.

    An sglang release replays in a process of its own through the CLI: one
    process can import only one release, and these tests use several."""
    if not config.sglang_path:
        violation = replay(trace, config)
        return None if violation is None else (violation.invariant, len(violation.steps))
    path = tmp_path / "trace.json"
    path.write_text(trace.to_json())
    run = subprocess.run(
        [sys.executable, "-m", "state_machines.cli", "replay", str(path),
         "--target", config.target, "--sglang-path", config.sglang_path],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    if run.returncode == 0:
        return None
    failed = re.search(r"^FAILED at step (\d+), .*: (\w+)$", run.stdout, re.M)
    assert failed, run.stdout + run.stderr
    return failed.group(2), int(failed.group(1)) + 1


def _marks(known):
    # A bench target over a release (sglang_path) drives sglang too.
    return [pytest.mark.sglang] if known.config.target.startswith("sglang:") or known.config.sglang_path else []


@pytest.mark.parametrize("known", [pytest.param(k, marks=_marks(k), id=k.name) for k in KNOWN])
def test_known_shortest_trace_fails_on_its_bug(known, tmp_path):
    """The hand-written trace fails at its last step, on the invariant it names."""
    _runnable(known.config)
    failed = _replay(known.trace(), known.trace().config, tmp_path)
    assert failed is not None, f"{known.name}: the known trace passed:\n{known.trace().program()}"
    assert failed == (known.invariant, len(known.steps)), "wrong invariant, or it fails before its last step"


@pytest.mark.parametrize(
    "known, fixed",
    [pytest.param(k, f, marks=_marks(k), id=f"{k.name}-on-{f.label()}") for k in KNOWN for f in k.fixed],
)
def test_known_shortest_trace_passes_on_the_fixed_target(known, fixed, tmp_path):
    """The same steps run clean on a target without the bug."""
    _runnable(fixed)
    assert _replay(known.trace(), known.on(fixed), tmp_path) is None


def test_every_bench_bug_has_a_known_shortest_trace():
    """Each bug the bench runs (mutants, bench/bugs.py, buggy sglang releases) has a hand-written shortest trace."""
    from bench.known_shortest import BY_NAME, bug_name
    from bench.targets import every_bug

    assert [bug_name(c) for c in every_bug() if bug_name(c) not in BY_NAME] == []
