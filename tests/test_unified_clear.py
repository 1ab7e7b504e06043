"""The scheduler's ``flush_cache`` on the unified families: the ``clear``
step (``harness/unified.py`` ``Clears``), on the built-in twins with and
without their clear mutants, and on 0.5.20-0.5.23 (a fresh process per
release; skipped without it)."""

import os
import subprocess
import sys

import pytest

from reference_model import OwnershipModel
from reference_model.model import OwnerMap
from state_machines.harness import Step, build
from state_machines.harness.lockstep import InvariantViolation
from state_machines.runs.trace import TraceError, run_steps
from tests.test_sglang import REPO, release_dir

TWINS = ["builtin:multi-ended", "builtin:unified-swa", "builtin:unified-mamba"]


def cached_then_idle(state):
    """A request whose pages went to the cache, then finished: idle, with a cache entry."""
    req = state.alloc(n=2 * state.page_size)
    state.rematch(req=req, dup=0)
    state.finish(req=req)
    return state


def test_a_clear_drops_the_cache_and_frees_every_page_in_the_model():
    """OwnershipModel.clear: the cache's entries are gone and every page is free, the counts started again."""
    model = OwnershipModel.from_census([1, 2, 3])
    req = model.new_request(0, [1, 2])
    model.rematch(req.rid, 0, None)
    model.finish(req.rid)
    owner = model.owner
    model.clear()
    assert (model.cache, model.free_pages, model.ledger.allocated) == ({}, {1, 2, 3}, 0)
    # An owner map afresh, with its mirrors (the field's converter made it from the dict the rebuild hands it).
    assert type(model.owner) is OwnerMap and model.owner is not owner and list(model.owner.flags) == [0, 1, 1, 1]


@pytest.mark.parametrize("target", TWINS)
def test_after_a_clear_every_page_is_free_and_serves_again(target):
    """On each twin a clear after the cache held pages leaves the model as built, and the checks agree."""
    state = cached_then_idle(build(target=target, page_size=4))
    state.clear()
    assert state.model.free_pages == set(state.model.owner)
    assert state.alloc(n=4) is not None


@pytest.mark.parametrize("target", TWINS)
def test_a_clear_waits_for_the_scheduler_to_be_idle(target):
    """clear is drawn only with no request live and no group open."""
    state = build(target=target, page_size=4)
    req = state.alloc(n=4)
    assert not state.clearable()
    state.finish(req=req)
    state.begin()
    assert not state.clearable()
    state.end()
    assert state.clearable()


def test_replay_refuses_a_clear_while_a_request_is_live():
    """A trace that clears with a request live is refused, not run: the scheduler flushes only when idle."""
    steps = (Step("alloc", {"n": 4}, "req_0"), Step("clear", {}))
    with pytest.raises(TraceError, match="flushes only when idle"):
        run_steps(build(target="builtin:unified-swa", page_size=4), steps)


def test_a_clear_waits_for_the_loans_to_come_back():
    """A HiCache loan out means a load in flight: no clear until it is returned."""
    state = build(target="builtin:multi-ended", page_size=4)
    state.alloc_physical(n=4)
    assert not state.clearable()
    state.free_physical(loan=0)
    assert state.clearable()


@pytest.mark.parametrize(("target", "mutant", "invariant"), [
    ("builtin:multi-ended", "clear-keeps-free-ids", "free_sets_agree"),
    ("builtin:unified-swa", "clear-keeps-swa", "swa_free_sets_agree"),
])
def test_a_clear_that_forgets_what_the_cache_held_is_caught(target, mutant, invariant):
    """A clear that keeps the old free ids, or the SWA side's bindings, disagrees with the model at once."""
    state = cached_then_idle(build(target=target, mutant=mutant, page_size=4))
    with pytest.raises(InvariantViolation, match=invariant):
        state.clear()


def test_a_clear_that_forgets_the_mamba_end_is_caught():
    """The clear-keeps-mamba mutant leaves a cached Mamba state taken: mamba_free_sets_agree."""
    state = build(target="builtin:unified-mamba", mutant="clear-keeps-mamba", page_size=4)
    state.mamba_alloc(n=1)
    with pytest.raises(InvariantViolation, match="mamba_free_sets_agree"):
        state.clear()


SCRIPT = """
import sys
from state_machines.config import Config
from state_machines.harness import build
state = build(Config(target=f"sglang:{sys.argv[2]}", page_size=4, sglang_path=sys.argv[1]))
assert state.runs("clear"), state.why_not("clear")
req = state.alloc(n=8)
state.rematch(req=req, dup=0)
state.finish(req=req)
if hasattr(state, "mamba_alloc"):
    state.mamba_alloc(n=1)
state.clear()
print("clean", state.alloc(n=12) is not None)
"""


@pytest.mark.sglang
@pytest.mark.parametrize("version", ["0.5.20", "0.5.22", "0.5.23"])
@pytest.mark.parametrize("kind", ["multi-ended", "unified-swa", "unified-mamba", "unified-mamba-swa"])
def test_a_release_clear_frees_what_the_cache_held(version, kind):
    """Each release's unified allocator, cleared after the cache held pages (and a Mamba state), checks out and serves again."""
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(release_dir(version)), kind], cwd=REPO, capture_output=True,
                         text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-2:] == ["clean", "True"]
