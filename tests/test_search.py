"""How the harness searches: one rule that picks among the applicable ones,
a pool size drawn per example, and a trace minimiser that shrinks on the
run's own pool and makes arguments smaller."""

import attrs

from bench.bugs import HARD
from state_machines.config import Config
from state_machines.harness import Step, machine_for
from state_machines.harness.machines import POOL_PAGES, machine_rules
from state_machines.runs.runner import _without, fuzz, minimize, replay
from state_machines.runs.trace import Trace
from tests.test_minimize import ALIAS, TOKEN_ALIAS

BIG_POOL = next(c for c in HARD if c.target.endswith("BigPool"))


def _hypothesis_rules(machine_class) -> set[str]:
    return {name for name in dir(machine_class) if hasattr(getattr(machine_class, name), "hypothesis_stateful_rule")}


def test_hypothesis_sees_one_step_rule_and_the_machine_keeps_every_declared_rule():
    """Hypothesis draws one rule, ``step``; the declared rules are all still there for it to pick."""
    machine = machine_for(Config())
    assert _hypothesis_rules(machine) == {"step"}
    core = {"alloc", "begin", "free", "free_segment", "overwrite_row", "rematch", "evict", "finish", "end"}
    assert core <= {r.name for r in machine_rules(machine)}


def test_an_unpinned_run_draws_its_pool_size_among_the_sizes_that_build():
    """Without --size an example runs on the default pool or one of POOL_PAGES; with it, on that size only."""
    assert machine_for(Config()).sizes == (None, *(p for p in POOL_PAGES if p is not None))
    assert machine_for(Config(size=16)).sizes == (None,)
    assert machine_for(Config(), draw_size=False).sizes == (None,)


def test_an_unpinned_run_draws_need_sort_where_the_allocator_keeps_it():
    """Without --need-sort an example runs with need_sort off or on; with it, on only; unshaped runs keep their own."""
    assert machine_for(Config()).sorts == (False, True)
    assert machine_for(Config(need_sort=True)).sorts == (True,)
    assert machine_for(Config(), draw_size=False).sorts == (False,)


def test_an_example_that_draws_need_sort_builds_its_allocator_with_it():
    """The first step's second draw picks need_sort: the allocator and the example's config both carry it."""
    machine = machine_for(Config())()
    machine.shape(0, 1)
    assert (machine.state.allocator.need_sort, machine.state.config.need_sort) == (True, True)


def test_a_bug_only_need_sort_shows_is_found_without_the_flag():
    """A merge that forgets release_pages (a custom target, no declared needs) fails a run without --need-sort, on need_sort."""
    outcome = fuzz(Config(target="allocators.token:MergeDropsReleaseTokenAllocator"), max_examples=200, database=None,
                   derandomize=True)
    (failure,) = outcome.failures
    assert failure.config.need_sort is True
    assert replay(failure).invariant == failure.invariant


def test_a_bug_that_needs_a_big_pool_is_found_and_shrunk_onto_it():
    """BigPool (more than 48 free slots) shows on no default pool; the harness finds it and reports one alloc at 64 slots."""
    outcome = fuzz(BIG_POOL, max_examples=200, database=None, derandomize=True)
    (failure,) = outcome.failures
    assert (failure.config.size, [s.rule for s in failure.steps]) == (64, ["alloc"])
    assert replay(failure).invariant == failure.invariant


def test_minimize_moves_a_failure_onto_the_runs_own_pool():
    """A failure recorded at 64 slots that shows on the default pool too comes back at the default pool."""
    trace = Trace(attrs.evolve(TOKEN_ALIAS, size=64), ALIAS, "free_sets_agree")
    assert replay(trace).invariant == "free_sets_agree"
    shrunk = minimize(trace, configs=(TOKEN_ALIAS,))
    assert (shrunk.config, shrunk.steps) == (TOKEN_ALIAS, ALIAS)


def _with_alloc(n: int) -> tuple[Step, ...]:
    return (ALIAS[0], Step("alloc", {"n": n}, "req_0"), *ALIAS[2:])


def test_minimize_makes_an_argument_as_small_as_the_failure_allows():
    """Aliasing an alloc of 4 slots frees a slot twice; it comes back as 2 slots, the fewest that still do."""
    assert replay(Trace(TOKEN_ALIAS, _with_alloc(4))).invariant == "no_page_freed_twice"
    assert replay(Trace(TOKEN_ALIAS, _with_alloc(1))).invariant == "free_sets_agree"
    assert minimize(Trace(TOKEN_ALIAS, _with_alloc(4), "no_page_freed_twice")).steps == _with_alloc(2)


def test_without_a_request_drops_every_step_naming_it_and_its_place_in_a_batch():
    """Deleting req_1 drops its admit, its decode and its member of the extend batch (with its tokens)."""
    steps = (
        Step("admit", {}, "req_0"),
        Step("admit", {}, "req_1"),
        Step("extend", {"reqs": ["req_0", "req_1"], "tokens": [3, 5]}),
        Step("decode", {"reqs": ["req_1"]}),
        Step("finish", {"req": "req_1"}),
    )
    assert _without(steps, "req_1") == (steps[0], Step("extend", {"reqs": ["req_0"], "tokens": [3]}))


def test_the_same_seed_finds_the_same_failure():
    """Two runs with one seed (walk, then Hypothesis) report the same unshrunk trace."""
    first, again = (fuzz(TOKEN_ALIAS, max_examples=40, seed=5, database=None, shrink=False) for _ in range(2))
    assert first.failures and first.failures == again.failures
