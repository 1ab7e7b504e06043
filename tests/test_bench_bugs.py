"""The bench's harder bugs fail where their docstrings say, and only there."""

import attrs
import pytest

from bench.bugs import HARD
from bench.known_shortest import bug_name
from state_machines.harness import Step
from state_machines.runs.runner import replay
from state_machines.runs.trace import Trace

BY_NAME = {c.target.split(":")[1]: c for c in HARD}


def _alloc(n, returns="req_0", req=None):
    return Step("alloc", {"n": n, **({"req": req} if req else {})}, returns)


def test_exactly_full_fails_only_when_an_alloc_fills_the_pool():
    """Allocating all 10 slots trips ExactlyFull; 9 of them does not."""
    config = BY_NAME["ExactlyFull"]
    fill = [_alloc(4), _alloc(4, None, "req_0"), _alloc(2, None, "req_0")]
    assert replay(Trace(config, tuple(fill))).invariant == "free_sets_agree"
    assert replay(Trace(config, tuple(fill[:2] + [_alloc(1, None, "req_0")]))) is None


def test_big_pool_fails_only_in_a_pool_larger_than_the_default():
    """One alloc trips BigPool in a 64-slot pool and passes in the default 10."""
    config = BY_NAME["BigPool"]
    assert replay(Trace(attrs.evolve(config, size=64), (_alloc(1),))).invariant == "free_sets_agree"
    assert replay(Trace(config, (_alloc(1),))) is None


@pytest.mark.sglang
def test_npu_decode_fails_only_with_exactly_one_page_free(tmp_path):
    """sglang 0.5.18's NPU decode (free groups kept out) raises with one page free, and not with two."""
    from bench.known_shortest import BY_NAME as KNOWN
    from bench.targets import SGLANG_DEEP
    from tests.test_known_shortest import _replay, _runnable

    config = SGLANG_DEEP[0]
    _runnable(config)
    steps = list(KNOWN[bug_name(config)].steps)
    assert _replay(Trace(config, tuple(steps)), config, tmp_path) == ("allocator_raised", 4)
    steps[2] = _alloc(12, "req_1")
    assert _replay(Trace(config, tuple(steps)), config, tmp_path) is None
