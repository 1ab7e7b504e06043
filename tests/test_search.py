"""How the harness searches: one rule that picks among the applicable ones,
a pool size drawn per example, and a trace minimiser that shrinks on the
run's own pool and makes arguments smaller."""

import functools
import gc
import json
import os
import random
import subprocess
import sys
import weakref
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import attrs
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from allocators.base import AliasMixin, FlagDriftMixin
from allocators.token import TokenAllocator
from bench.bugs import HARD
from state_machines.config import Config
from state_machines.harness import RunRecord, Step, build, family, machine_for
from state_machines.harness.machines import (
    POOL_PAGES,
    POOL_ROWS,
    BudgetSpent,
    FreeGroupMachine,
    MachineRule,
    draws,
    machine_rules,
)
from state_machines.runs import walk as walk_module
from state_machines.runs.minimize import _without, minimize
from state_machines.runs.runner import _walk_key, fuzz, fuzz_settings, replay
from state_machines.runs.trace import Trace
from state_machines.runs.walk import _applicable, _at_edge, _by_chance, _decoded, _filling, _populating, _Steer, _steered, walk
from state_machines.targets import TargetError
from state_machines.targets.catalogue import clean_configs
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


def test_the_step_rule_draws_nothing_through_st_data_and_still_reaches_the_core_rules(monkeypatch):
    """The ``step`` rule's choice and the pool shape draw straight from the engine, never through ``st.data()``'s wrapper; the core rules still all run."""
    from hypothesis.strategies._internal.core import DataObject

    monkeypatch.setattr(DataObject, "draw", lambda *a, **k: pytest.fail("a draw went through st.data()"))
    record = RunRecord()
    chosen = settings(fuzz_settings(max_examples=60, database=None, derandomize=True), stateful_step_count=10)
    run_state_machine_as_test(machine_for(Config(), record), settings=chosen)
    assert {"alloc", "begin", "free", "free_segment", "overwrite_row", "rematch", "evict", "finish", "end"} <= set(record.rule_counts)


def _step_choices(config: Config, monkeypatch) -> tuple[dict, dict]:
    """The values each (rule, argument) took in 150 Hypothesis examples of
    ``config``, and each one's declared range ((False, True) for a flag)."""
    from state_machines.harness import machines

    seen: dict = {}
    draw = machines._StepChoice.do_draw

    def recording(self, data):
        chosen, args = draw(self, data)
        for name, value in args.items():
            seen.setdefault((chosen.name, name), set()).add(value)
        return chosen, args

    monkeypatch.setattr(machines._StepChoice, "do_draw", recording)
    machine = machine_for(config)
    run_state_machine_as_test(machine, settings=fuzz_settings(max_examples=150, database=None, derandomize=True))
    return seen, {(r.name, k): (False, True) if v is bool else v for r in machine_rules(machine) for k, v in r.draws.items()}


@pytest.mark.parametrize("config", [Config(), Config(target="builtin:unified-swa", page_size=4)], ids=["token", "unified-swa"])
def test_the_step_choice_draws_each_argument_within_its_declared_range(config, monkeypatch):
    """Under Hypothesis (whichever profile), every argument stays within its declared range and each flag drawn takes
    both values; that the choices are the declared strategies' own is pinned by the test below."""
    seen, declared = _step_choices(config, monkeypatch)
    for key, values in seen.items():
        low, high = declared[key]
        assert low <= min(values) and max(values) <= high, key
    flags = [values for key, values in seen.items() if declared[key] == (False, True)]
    assert all(values == {False, True} for values in flags)
    assert bool(flags) == (config.target == "builtin:unified-swa")
    assert {("alloc", "pages"), ("free", "pages"), ("overwrite_row", "row")} <= set(seen)


def test_a_range_hypothesis_would_weight_is_drawn_through_its_strategy():
    """From 129 values ``st.integers`` weights a range's ends: such a range draws through the strategy, a narrower
    one straight from the engine."""
    from state_machines.harness.machines import _drawer

    class Engine:
        def draw_integer(self, low, high):
            return ("plain", low, high)

        def draw(self, strategy):
            return ("strategy", repr(strategy))

    assert _drawer((0, 127))(Engine()) == ("plain", 0, 127)
    assert _drawer((0, 128))(Engine()) == ("strategy", repr(st.integers(0, 128)))


def _composite_choice(declared):
    """The step choice as it was drawn before ``_StepChoice``: a composite
    over the declared strategies, one span each."""

    @st.composite
    def choices(draw):
        machine = draw(st.runner())
        applicable = [r for r in declared if r.applies(machine)]
        chosen = applicable[draw(st.integers(0, len(applicable) - 1))]
        return chosen, {k: draw(v) for k, v in chosen.strategies().items()}

    return choices()


@pytest.mark.parametrize("config", [Config(), Config(target="builtin:unified-swa", page_size=4)], ids=["token", "unified-swa"])
def test_the_step_choice_makes_the_choices_the_declared_strategies_make(config):
    """Replayed from the choices the declared strategies made (as an example database keeps them), the step choice
    draws the same rule and arguments, and consumes exactly those choices; over 300 steps of a walk through states."""
    from hypothesis.internal.conjecture.data import ConjectureData

    from state_machines.harness.machines import _StepChoice

    if not hasattr(ConjectureData, "for_choices"):
        pytest.skip("this Hypothesis cannot replay a choice sequence (ConjectureData.for_choices)")

    machine_class = machine_for(config)
    declared = machine_rules(machine_class)
    step_choice, reference, rng = _StepChoice(declared), _composite_choice(declared), random.Random(0)
    rules = set()
    for step in range(300):
        if step % 30 == 0:
            machine = machine_class()
            machine.state = machine_class.build(config)
        made = ConjectureData(random=rng)
        made.hypothesis_runner = machine
        chosen, args = made.draw(reference)
        again = ConjectureData.for_choices(made.choices)
        again.hypothesis_runner = machine
        assert again.draw(step_choice) == (chosen, args)
        assert again.choices == made.choices
        chosen.body(machine, **args)
        rules.add(chosen.name)
    assert {"alloc", "begin", "free", "free_segment", "overwrite_row", "finish", "end"} <= rules


def test_an_unpinned_run_draws_its_pool_size_among_the_sizes_that_build():
    """Without --size an example runs on the default pool or one of POOL_PAGES; with it, on that size only."""
    assert machine_for(Config()).shapes().sizes == (None, *(p for p in POOL_PAGES if p is not None))
    assert machine_for(Config(size=16)).shapes().sizes == (None,)
    assert machine_for(Config(), draw_size=False).shapes().sizes == (None,)


def test_an_unpinned_run_draws_need_sort_and_rows_too():
    """Without them in the configuration an example also draws need_sort and a row count; asked for, they are pinned; --size pins only the size."""
    shapes = machine_for(Config()).shapes()
    assert (shapes.sorts, shapes.row_counts) == ((None, True), (None, *(r for r in POOL_ROWS if r is not None)))
    pinned = machine_for(Config(need_sort=True, rows=8)).shapes(), machine_for(Config(rows=8)).shapes()
    assert (pinned[0].sorts, pinned[1].row_counts) == ((None,), (None,))
    assert machine_for(Config(size=16)).shapes().sorts == (None, True)


def _shapes_built(drive) -> set[tuple]:
    """The (size, need_sort, rows) of each state ``drive(machine)`` builds on the default configuration."""
    seen = set()

    def spy(config):
        seen.add((config.size, config.need_sort, config.rows))
        return build(config)

    drive(type("Spy", (machine_for(Config()),), {"build": staticmethod(spy)}))
    return seen


def _caches_of_its_own(monkeypatch) -> None:
    """Fresh shape caches for one test: shapes another test probed would
    hide a probe here, and a verdict faked here must not reach another."""
    monkeypatch.setattr(family, "_shapes", functools.cache(family._shapes.__wrapped__))
    monkeypatch.setattr(family, "_VERDICTS", {})


def test_the_walk_reaches_every_pool_shape():
    """A hundred one-step walk examples build the pool in each size, need_sort and row count."""
    seen = _shapes_built(lambda m: walk(m, random.Random(0), 100, steps=1))
    assert {s[0] for s in seen} == {None, *(p * 1 for p in POOL_PAGES if p)}
    assert {s[1] for s in seen} == {False, True}
    assert {s[2] for s in seen} == {4, *(r for r in POOL_ROWS if r)}


def test_the_first_walk_example_runs_on_the_runs_own_pool_and_probes_no_other_shape(monkeypatch):
    """A walk's first example builds only the run's own pool shape, and nothing probes the others before a second example."""
    probed = []
    _caches_of_its_own(monkeypatch)
    monkeypatch.setattr(family, "may_draw", lambda config: probed.append(config) or True)
    monkeypatch.setattr(family, "_sorts", lambda config: probed.append(config) or True)
    assert _shapes_built(lambda m: walk(m, random.Random(0), 1, steps=3)) == {(None, False, 4)}
    assert probed == []


def test_the_walks_shape_draw_probes_nothing_and_is_uniform_over_the_offered_shapes(monkeypatch):
    """Before any shape is refused the walk's draw builds nothing to probe,
    and lands on each size about as often."""
    _caches_of_its_own(monkeypatch)
    probed = []
    monkeypatch.setattr(family, "may_draw", lambda config: probed.append(config) or True)
    monkeypatch.setattr(family, "_sorts", lambda config: probed.append(config) or True)
    rng = random.Random(0)
    drawn = [family.drawn_shape(Config(), rng) for _ in range(4000)]
    assert probed == []
    sizes = Counter(c.size for c in drawn)
    assert set(sizes) == {None, *(p for p in POOL_PAGES if p)} and all(900 < n < 1100 for n in sizes.values())
    assert Counter(c.need_sort for c in drawn).keys() == {False, True}
    assert Counter(c.rows for c in drawn).keys() == {4, *(r for r in POOL_ROWS if r)}


def test_a_refused_shapes_redraw_is_uniform_among_the_shapes_that_build(monkeypatch):
    """With the 24-slot pool refused and no verdict kept yet (each trial a
    fresh process's), a draw that lands there and its redraw together land
    on each other size about as often."""
    _caches_of_its_own(monkeypatch)
    monkeypatch.setattr(family, "may_draw", lambda config: config.size != 24)
    monkeypatch.setattr(family, "_sorts", lambda config: True)
    rng, sizes = random.Random(0), Counter()
    for _ in range(3000):
        family._VERDICTS.clear()
        drawn = family.drawn_shape(Config(), rng)
        sizes[(family.drawn_shape(Config(), rng, drawn) if drawn.size == 24 else drawn).size] += 1
    assert set(sizes) == {None, 4, 64} and all(900 < n < 1100 for n in sizes.values()), sizes


def test_a_seed_draws_the_same_shapes_whatever_verdicts_the_process_holds(monkeypatch):
    """Verdicts another run left (every shape probed, the 24-slot pool refused) change no draw of a seed's."""
    _caches_of_its_own(monkeypatch)
    monkeypatch.setattr(family, "may_draw", lambda config: config.size != 24)
    monkeypatch.setattr(family, "_sorts", lambda config: True)

    def draws() -> list:
        rng, out = random.Random(7), []
        for _ in range(300):
            drawn = family.drawn_shape(Config(), rng)
            out.append(family.drawn_shape(Config(), rng, drawn) if drawn.size == 24 else drawn)
        return out

    family._VERDICTS.clear()
    fresh = draws()
    family._shapes(Config())
    assert draws() == fresh


def test_a_shape_the_target_refuses_is_built_at_most_twice_and_never_drawn_again(monkeypatch):
    """Where the target refuses a 24-slot pool and drops need_sort, the
    walk builds each shape with them at most twice (the example, then its
    value's probe where the example's shape was off on more axes), keeps
    their verdicts, and then draws only the shapes that build, each size
    about as often; Hypothesis's shapes agree, taking no verdict again."""
    _caches_of_its_own(monkeypatch)
    built = Counter()

    def spy(config):
        built[(config.size, config.need_sort, config.rows)] += 1
        if config.size == 24:
            raise TargetError("no 24-slot pools")
        state = build(attrs.evolve(config, need_sort=False))
        state.allocator.need_sort = False  # as a class that ignores the setting
        return state

    monkeypatch.setattr(family, "build", spy)
    walk(type("Spy", (machine_for(Config()),), {"build": staticmethod(spy)}), random.Random(0), 600, steps=1)
    assert 1 <= sum(n for (size, _, _), n in built.items() if size == 24) <= 2
    assert 1 <= sum(n for (_, need_sort, _), n in built.items() if need_sort) <= 2
    refused = [config for (config, _), builds in family._VERDICTS.items() if not builds]
    assert {c.size for c in refused if c.size} == {24} and any(c.need_sort for c in refused)
    sizes = Counter()
    for (size, need_sort, _), n in built.items():
        sizes[size] += n if size != 24 and not need_sort else 0
    assert set(sizes) >= {None, 4, 64} and all(160 < sizes[s] < 240 for s in (None, 4, 64)), sizes
    # Hypothesis's shapes take the verdicts the walk left unprobed (sizes 4 and 64, rows 1 and 16), no refused one again.
    before = +built
    assert family._shapes(Config()).sizes == (None, 4, 64) and family._shapes(Config()).sorts == (None,)
    added = built - before
    assert sum(added.values()) <= 4 and not any(size == 24 or need_sort for size, need_sort, _ in added)


def test_a_shape_refused_only_as_a_whole_ends_the_walk_with_its_error(monkeypatch):
    """A 64-slot pool of 16 rows is refused where each of its values
    builds alone: no redraw hides it, the walk raises what the build did,
    at the first example that draws it."""
    _caches_of_its_own(monkeypatch)
    built = Counter()

    def spy(config):
        built[(config.size, config.rows)] += 1
        if (config.size, config.rows) == (64, 16):
            raise TargetError("no 64-slot pools of 16 rows")
        return build(config)

    monkeypatch.setattr(family, "build", spy)
    with pytest.raises(TargetError, match="16 rows"):
        walk(type("Spy", (machine_for(Config()),), {"build": staticmethod(spy)}), random.Random(0), 200, steps=1)
    assert built[(64, 16)] == 1


def test_hypothesis_draws_need_sort_and_rows_per_example():
    """Under Hypothesis too, examples build the pool with need_sort on and off and in every row count."""
    chosen = settings(fuzz_settings(max_examples=100, database=None, derandomize=True), stateful_step_count=2)
    seen = _shapes_built(lambda m: run_state_machine_as_test(m, settings=chosen))
    assert {s[1] for s in seen} == {False, True}
    assert {s[2] for s in seen} == {4, *(r for r in POOL_ROWS if r)}


class SortedLeak(TokenAllocator):
    """With need_sort on, an alloc leaves its last slot on the free list: a
    bug no example of the default configuration (need_sort off) could show
    before need_sort was drawn."""

    def alloc(self, need_size):
        taken = super().alloc(need_size)
        if self.need_sort and taken is not None and len(taken):
            self.free_pages = taken[-1:].clone()
        return taken


def test_a_bug_that_needs_need_sort_is_found_and_its_trace_keeps_the_shape():
    """The failure shows only with need_sort; the trace records need_sort, so its replay fails the same way."""
    outcome = fuzz(Config(target="tests.test_search:SortedLeak"), max_examples=200, database=None, derandomize=True)
    (failure,) = outcome.failures
    assert failure.config.need_sort
    assert replay(failure).invariant == failure.invariant
    assert replay(failure, attrs.evolve(failure.config, need_sort=False)) is None


def test_a_bug_only_need_sort_shows_is_found_without_the_flag():
    """A merge that forgets release_pages (a custom target, no declared needs) fails a run without --need-sort, every failure on need_sort."""
    outcome = fuzz(Config(target="allocators.token:MergeDropsReleaseTokenAllocator"), max_examples=200, database=None,
                   derandomize=True)
    # The bug breaks more than one invariant; the walk reports each it met.
    assert outcome.failures and all(f.config.need_sort is True for f in outcome.failures)
    assert all(replay(f).invariant == f.invariant for f in outcome.failures)


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


class AliasAndFlagDrift(AliasMixin, FlagDriftMixin, TokenAllocator):
    """sglang 0.5.17's pair of bugs in one allocator: the queue keeps row
    views, and a repeated end frees again."""


def test_a_walk_reports_each_distinct_failure_it_meets():
    """After its first failure the walk runs on a while: an allocator with both seed bugs fails a run on both invariants."""
    outcome = fuzz(Config(target="tests.test_search:AliasAndFlagDrift"), max_examples=300, seed=0, database=None)
    assert {t.invariant for t in outcome.failures} >= {"free_sets_agree", "no_page_freed_twice"}


@pytest.mark.parametrize("seed", [0, 3])
def test_a_clean_run_starts_exactly_max_examples_examples(seed):
    """Hypothesis's max_examples counts only the examples it calls valid: on these seeds its part of a 160-example
    run overran its size limit on some (165 and 164 examples ran), each a machine with steps all the same."""
    assert fuzz(Config(), max_examples=160, seed=seed, database=None).record.examples == 160


def test_the_cap_lets_the_failing_example_replay_once_a_failure_is_seen():
    """Past its cap a record starts no example, but after a failure it does: Hypothesis replays the failing example
    once more to report it, and a failure met at the budget's last example must still be reported."""
    record = RunRecord(cap=1)
    record.start_example()
    with pytest.raises(BudgetSpent):
        record.start_example()
    record.saw_failure()
    record.start_example()
    assert record.examples == 2


class _RaisingProbe:
    """A harness bug: ``before`` raises at every step."""

    reads_call = False

    def before(self, machine, name, args):
        raise RuntimeError("harness bug")

    def after(self, machine, name):
        pass

    def failed(self, machine, exc):
        pass


def test_an_error_at_the_budgets_last_example_is_reported_as_itself():
    """An example that raises something other than an invariant violation (a harness bug) at the budget's last
    example: Hypothesis replays it once more to report it, and that replay must start (it raised BudgetSpent, and
    Hypothesis reported FlakyStrategyDefinition, 'Inconsistent data generation!', instead of the error)."""
    from hypothesis import settings

    from state_machines.runs.runner import _hypothesis_capped

    record = RunRecord(probe=_RaisingProbe())
    machine = machine_for(Config(), record)
    with pytest.raises(RuntimeError, match="harness bug"):
        _hypothesis_capped(machine, settings(fuzz_settings(5, None, True, shrink=False)), 5, record, 1)
    assert record.examples == 2


def test_a_second_run_on_the_database_replays_every_failure_the_walk_saved():
    """The alias mutant's walk meets two invariants (examples 1 and 8 on seed 2) and saves both; a second run on the
    same database replays both saved examples, reports both failures and runs nothing else."""
    from hypothesis.database import InMemoryExampleDatabase

    db = InMemoryExampleDatabase()
    first = fuzz(TOKEN_ALIAS, max_examples=40, seed=2, database=db, shrink=False)
    invariants = {"free_sets_agree", "no_page_freed_twice"}
    assert {t.invariant for t in first.failures} == invariants
    again = fuzz(TOKEN_ALIAS, max_examples=40, seed=3, database=db, shrink=False)
    assert [t.invariant for t in again.failures] == [t.invariant for t in first.failures]  # in the order found
    saved = [Trace.from_dict(json.loads(v)["trace"]) for v in db.fetch(_walk_key(machine_for(TOKEN_ALIAS)))]
    assert all(t in saved for t in again.failures)
    assert (again.record.examples, again.record.examples_to_failure) == (2, 1)


def test_hypothesis_replays_its_saved_failure_whatever_the_budget_left(monkeypatch):
    """A failure Hypothesis saved is replayed next run even where the walk's saved failures (one that passes now)
    took the budget: --max-examples 1 left Hypothesis no example, and the run came back clean."""
    from hypothesis.database import InMemoryExampleDatabase

    from state_machines.harness import Step
    from state_machines.runs import runner

    db = InMemoryExampleDatabase()
    with monkeypatch.context() as m:
        m.setattr(runner, "walked_examples", lambda n: 0)  # Hypothesis's run alone, so it finds and saves the failure
        assert fuzz(TOKEN_ALIAS, max_examples=40, seed=0, database=db, shrink=False).failures
    assert not list(db.fetch(_walk_key(machine_for(TOKEN_ALIAS))))
    passing = Trace(TOKEN_ALIAS, (Step("alloc", {"n": 1}, "req_0"),))
    db.save(_walk_key(machine_for(TOKEN_ALIAS)), passing.to_json().encode())
    again = fuzz(TOKEN_ALIAS, max_examples=1, seed=0, database=db, shrink=False)
    assert again.failures and again.record.examples_to_failure == 2


def _alias_walk_failures() -> dict[str, Trace]:
    """The alias mutant's two walk failures on seed 2, unshrunk, by invariant."""
    return {t.invariant: t for t in fuzz(TOKEN_ALIAS, max_examples=40, seed=2, database=None, shrink=False).failures}


def test_a_saved_walk_failure_that_still_fails_leaves_hypothesiss_saved_failure_reported_too(monkeypatch):
    """A database holding a walk failure of one invariant and a Hypothesis failure of another: one run reports
    both (it reported only the walk's, since a saved walk failure ended the run before Hypothesis replayed)."""
    from hypothesis.database import InMemoryExampleDatabase

    from state_machines.runs import runner

    db = InMemoryExampleDatabase()
    with monkeypatch.context() as m:
        m.setattr(runner, "walked_examples", lambda n: 0)  # Hypothesis's run alone, so it finds and saves the failure
        hypothesis_found = fuzz(TOKEN_ALIAS, max_examples=40, seed=0, database=db, shrink=False)
    assert [t.invariant for t in hypothesis_found.failures] == ["free_sets_agree"]
    walk_found = _alias_walk_failures()["no_page_freed_twice"]
    db.save(_walk_key(machine_for(TOKEN_ALIAS)), runner._walk_value(walk_found))
    again = fuzz(TOKEN_ALIAS, max_examples=40, seed=0, database=db)
    assert [t.invariant for t in again.failures] == ["no_page_freed_twice", "free_sets_agree"]
    assert len(again.failures[0].steps) < len(walk_found.steps)  # each shrunk
    # No walk and no generation: the walk's saved failure, Hypothesis's saved example and its replay to report it.
    assert again.record.examples == 3


def test_a_new_walk_failure_leaves_hypothesiss_saved_failure_reported_too(monkeypatch):
    """A database holding a Hypothesis failure of one invariant, and a walk that meets another (seed 21 meets only
    no_page_freed_twice, in its first example of 80 steps; of seeds 0-39 only 38 does too, the others meet both):
    one run reports both (it reported only the walk's, since the walk's failure ended the run before Hypothesis's
    reuse phase)."""
    from hypothesis.database import InMemoryExampleDatabase

    from state_machines.runs import runner

    db = InMemoryExampleDatabase()
    with monkeypatch.context() as m:
        m.setattr(runner, "walked_examples", lambda n: 0)  # Hypothesis's run alone, so it finds and saves the failure
        hypothesis_found = fuzz(TOKEN_ALIAS, max_examples=40, seed=0, database=db, shrink=False)
    assert [t.invariant for t in hypothesis_found.failures] == ["free_sets_agree"]
    walk_found = fuzz(TOKEN_ALIAS, max_examples=8, seed=21, database=None, shrink=False)
    assert [t.invariant for t in walk_found.failures] == ["no_page_freed_twice"]
    assert walk_found.record.examples_to_failure == 1
    again = fuzz(TOKEN_ALIAS, max_examples=8, seed=21, database=db, shrink=False)
    assert [t.invariant for t in again.failures] == ["no_page_freed_twice", "free_sets_agree"]


def test_saved_walk_failures_replay_in_the_order_found_not_the_order_of_their_bytes():
    """Two walk failures, the one whose bytes sort first found second: they replay, and are reported, in the
    order found."""
    from hypothesis.database import InMemoryExampleDatabase

    from state_machines.runs.runner import _walk_value

    db = InMemoryExampleDatabase()
    # The trace whose own bytes sort last is found first, so neither the values' bytes nor the traces' give
    # the order found.
    small, big = sorted(_alias_walk_failures().values(), key=lambda t: _walk_value(t, found=0))
    db.save(_walk_key(machine_for(TOKEN_ALIAS)), _walk_value(small, found=10))
    db.save(_walk_key(machine_for(TOKEN_ALIAS)), _walk_value(big, found=9))
    assert _walk_value(big, found=9) > _walk_value(small, found=10)
    again = fuzz(TOKEN_ALIAS, max_examples=40, seed=0, database=db, shrink=False)
    assert again.failures == (big, small)


def test_a_walk_failure_an_older_version_saved_still_replays_after_those_saved_with_when_found():
    """A value an older version kept, a trace's JSON alone under the key it
    reads, still replays, after those that say when they were found, though
    its bytes sort first; what this version saves goes under its own key,
    where an older run, which forgets what it cannot run, never reads it."""
    from hypothesis.database import InMemoryExampleDatabase

    from state_machines.runs.runner import _walk_key_before_v2, _walk_value

    db = InMemoryExampleDatabase()
    failures = _alias_walk_failures()
    old, new = failures["no_page_freed_twice"].to_json().encode(), _walk_value(failures["free_sets_agree"])
    assert old < new
    older_key, key = _walk_key_before_v2(machine_for(TOKEN_ALIAS)), _walk_key(machine_for(TOKEN_ALIAS))
    assert older_key != key
    db.save(older_key, old)
    db.save(key, new)
    again = fuzz(TOKEN_ALIAS, max_examples=40, seed=0, database=db, shrink=False)
    assert again.failures == (failures["free_sets_agree"], failures["no_page_freed_twice"])
    assert (set(db.fetch(older_key)), set(db.fetch(key))) == ({old}, {new})
    fresh = InMemoryExampleDatabase()
    assert fuzz(TOKEN_ALIAS, max_examples=40, seed=2, database=fresh, shrink=False).failures
    assert len(list(fresh.fetch(key))) == 2 and not list(fresh.fetch(older_key))


def test_a_walk_failure_saved_twice_replays_once_and_is_kept_once_under_each_key():
    """Two runs sharing a database that each found the same failure keep it
    twice, found at different times, the later under another per-call
    limit and detail: the next run replays it once, the first found, and
    forgets the other (it replayed, and kept, both).  A copy under an
    older version's key is not replayed again but kept there, for that
    version; one found first there leaves today's copy kept too."""
    from hypothesis.database import InMemoryExampleDatabase

    from state_machines.runs.runner import _walk_key_before_v2, _walk_value

    trace = _alias_walk_failures()["no_page_freed_twice"]
    other = attrs.evolve(trace, config=attrs.evolve(trace.config, call_timeout_s=0.5), detail="another text")
    key, older_key = _walk_key(machine_for(TOKEN_ALIAS)), _walk_key_before_v2(machine_for(TOKEN_ALIAS))
    db = InMemoryExampleDatabase()
    db.save(key, _walk_value(other, found=2))
    db.save(key, _walk_value(trace, found=1))
    db.save(older_key, trace.to_json().encode())
    again = fuzz(TOKEN_ALIAS, max_examples=40, seed=0, database=db, shrink=False)
    assert again.failures == (trace,)
    assert again.record.examples == 1  # the saved walk failure, once (Hypothesis saved nothing to replay)
    assert (set(db.fetch(key)), set(db.fetch(older_key))) == ({_walk_value(trace, found=1)}, {trace.to_json().encode()})
    db = InMemoryExampleDatabase()
    db.save(older_key, _walk_value(trace, found=1))  # the form a version kept there for a while
    db.save(key, _walk_value(trace, found=2))
    assert fuzz(TOKEN_ALIAS, max_examples=40, seed=0, database=db, shrink=False).failures == (trace,)
    assert (set(db.fetch(key)), set(db.fetch(older_key))) == ({_walk_value(trace, found=2)}, {_walk_value(trace, found=1)})


def test_a_saved_walk_failure_this_version_cannot_run_is_kept_for_one_that_can():
    """A trace of a form this version does not know (a configuration field
    of a later one) or of a target not here is kept, not replayed, where it
    was forgotten: a version or machine that can run it would have lost
    it.  A value that is no trace at all is still forgotten."""
    from hypothesis.database import InMemoryExampleDatabase

    from state_machines.runs.runner import _walk_value

    trace = _alias_walk_failures()["no_page_freed_twice"]
    later = json.loads(_walk_value(trace, found=1))
    later["trace"]["config"]["a_later_field"] = 1
    elsewhere = json.loads(_walk_value(trace, found=2))
    elsewhere["trace"]["config"]["target"] = "kvl_not_here:make"
    junk = json.dumps({"found": 3, "trace": {"not": "a trace"}}).encode()
    key = _walk_key(machine_for(TOKEN_ALIAS))
    db = InMemoryExampleDatabase()
    kept = {json.dumps(later).encode(), json.dumps(elsewhere).encode()}
    for value in (*kept, junk):
        db.save(key, value)
    again = fuzz(TOKEN_ALIAS, max_examples=40, seed=1, database=db, shrink=False)
    assert again.failures  # the walk ran, none of the saved ones failing here
    # An example spent on the target not here (it is built to know), none on the form not read.
    alone = fuzz(TOKEN_ALIAS, max_examples=40, seed=1, database=None, shrink=False)
    assert again.record.examples_to_failure == alone.record.examples_to_failure + 1
    assert kept <= set(db.fetch(key)) and junk not in set(db.fetch(key))


class _CallProbe:
    """Records the arguments each step's ``before`` is handed."""

    def __init__(self, reads_call: bool):
        self.reads_call = reads_call
        self.calls = []

    def before(self, machine, name, call):
        self.calls.append((name, call))

    def after(self, machine, name):
        pass

    def failed(self, machine, exc):
        pass


def test_a_probe_is_handed_each_steps_arguments_only_where_it_reads_them():
    """A probe whose ``reads_call`` is false gets ``{}`` for every step; one that reads them gets an alloc's ``n`` by name."""
    quiet, reading = _CallProbe(False), _CallProbe(True)
    for probe in (quiet, reading):
        walk(machine_for(Config(), RunRecord(probe=probe)), random.Random(0), 3, steps=10)
    assert quiet.calls and all(call == {} for _, call in quiet.calls)
    assert any(name == "alloc" and "n" in call for name, call in reading.calls)


class _Held:
    """A stand-in machine whose state is the set of rule names whose guard holds."""

    def __init__(self, holds: set[str]):
        self.state = holds


def _rules(names: str) -> list[MachineRule]:
    return [MachineRule(name, {}, lambda held, name=name: name in held) for name in names]


def test_the_walk_draws_uniformly_among_the_rules_whose_guard_holds():
    """Over 6,000 draws with three of six guards holding, each of the three comes a third of the time and no other ever."""
    rng = random.Random(0)
    drawn = [_applicable(_rules("abcdef"), _Held({"b", "d", "f"}), rng).name for _ in range(6000)]
    assert set(drawn) == {"b", "d", "f"}
    assert all(1800 < drawn.count(name) < 2200 for name in "bdf")


def test_the_walk_finds_the_one_rule_whose_guard_holds_among_many():
    """With one guard of twelve holding, every draw returns that rule (after its misses, a choice among those that hold)."""
    rng = random.Random(0)
    assert {_applicable(_rules("abcdefghijkl"), _Held({"k"}), rng).name for _ in range(200)} == {"k"}


def test_machines_of_like_targets_share_one_rules_class_and_each_run_its_own_subclass():
    """Two runs' machines are distinct classes over one shared step-rule class (made once, not once a run)."""
    first, second = machine_for(Config()), machine_for(Config(mutant="alias"))
    assert first is not second
    assert first.__bases__[-1] is second.__bases__[-1]


def test_a_configurations_pool_shapes_are_probed_once_a_process(monkeypatch):
    """A second run of one configuration probes no shape again: its shapes are kept."""
    probed = []
    _caches_of_its_own(monkeypatch)
    monkeypatch.setattr(family, "may_draw", lambda config: probed.append(config) or True)
    first = machine_for(Config()).shapes()
    count = len(probed)
    assert count and machine_for(Config()).shapes() == first and len(probed) == count


def test_the_walk_steers_a_group_with_a_freed_view_toward_a_write_of_it(monkeypatch):
    """With every step steered, a group open and a view freed in it, each
    draw is the row's overwrite, never an alloc, a decode or an extend (a
    write of its own request's row), a free or the end; and one of those
    writes run in the group leaves the overwrite wanted."""
    monkeypatch.setattr(walk_module, "STEER", 1.0)
    steer = _Steer()
    steer.saw("free", in_group=True)
    names = ("alloc", "free", "end", "overwrite_row", "decode", "extend")
    rules, held, rng = _rules(names), _Held(set(names)), random.Random(0)
    for write in ("alloc", "decode", "extend"):
        drawn = {_steered(rules, held, rng, steer.wanted(True)).name for _ in range(200)}
        assert drawn == {"overwrite_row"}
        steer.saw(write, in_group=True)
    steer.saw("overwrite_row", in_group=True)
    assert {_steered(rules, held, rng, steer.wanted(True)).name for _ in range(200)} == {"end"}


def test_a_steered_walk_opens_a_group_whenever_none_is_open(monkeypatch):
    """With every step steered, begin is over an eighth of a walk's steps (a cycle is begin, free, write, end; a fifth seen); unsteered, about a thirteenth."""
    monkeypatch.setattr(walk_module, "STEER", 1.0)
    record = RunRecord()
    walk(machine_for(Config(), record), random.Random(0), 5, steps=40)
    assert record.rule_counts["begin"] > record.steps / 8


def test_the_steering_opens_an_allocation_group_ends_it_and_ends_it_again():
    """An allocation group's order, with no free group open: its begin where
    none is open, its end while one is, a second end after an end that
    closed one, then a begin again (the free group's begin wanted throughout)."""
    steer, seen = _Steer(), []
    for name, in_alloc in (("alloc_group_begin", False), ("alloc_group_end", True), ("alloc_group_end", False)):
        seen.append(steer.wanted(False, in_alloc))
        steer.saw(name, False, in_alloc)
    seen.append(steer.wanted(False, False))
    assert [sorted(w) for w in seen] == [["alloc_group_begin", "begin", "mamba_group_begin"],
                                         ["alloc_group_end", "begin", "mamba_group_end"],
                                         ["alloc_group_end", "begin", "mamba_group_end"],
                                         ["alloc_group_begin", "begin", "mamba_group_begin"]]


def test_a_steered_walk_on_a_mamba_pool_opens_and_ends_allocation_groups(monkeypatch):
    """builtin:mamba (no free groups), every step steered: about two steps in
    five end an allocation group (an order is begin, end, end; the alloc
    while few requests are live takes some); unsteered, about one in five."""
    monkeypatch.setattr(walk_module, "STEER", 1.0)
    record = RunRecord()
    walk(machine_for(Config(target="builtin:mamba"), record), random.Random(0), 5, steps=40)
    assert record.rule_counts["alloc_group_end"] > record.steps / 3
    assert record.rule_counts["alloc_group_begin"] > record.steps / 5


def test_the_walk_clears_an_idle_pool_and_nothing_else():
    """``_by_chance`` at share 1: the clear rule on a fresh unified pool, None
    once a request is live, and None at share 0 whatever the state."""
    machine = _fresh(Config(target="builtin:unified-mamba", page_size=4))
    clear = next(r for r in machine_rules(type(machine)) if r.name == "clear")
    rng = random.Random(0)
    assert _by_chance(clear, machine, rng, 1.0) is clear
    assert _by_chance(clear, machine, rng, 0.0) is None
    machine.alloc(pages=1, who=0)
    assert _by_chance(clear, machine, rng, 1.0) is None
    assert _by_chance(None, machine, rng, 1.0) is None


def _starts(machine) -> list[MachineRule]:
    return [r for r in machine_rules(type(machine)) if r.name in walk_module._STARTS]


def test_while_few_requests_are_live_the_walk_starts_one_by_an_alloc_or_an_extend():
    """``_populating`` at share 1 on builtin:paged, where an extend admits
    fresh requests too: an alloc or an extend, about evenly over 200 draws,
    with none and with one request live; None with two live."""
    machine = _fresh(Config(target="builtin:paged", page_size=4))
    rng = random.Random(0)
    for live in range(2):
        drawn = Counter(_populating(_starts(machine), machine, rng, 1.0).name for _ in range(200))
        assert set(drawn) == {"alloc", "extend"} and min(drawn.values()) > 70, drawn
        machine.alloc(pages=1, who=0)
    assert _populating(_starts(machine), machine, rng, 1.0) is None


def test_where_only_an_alloc_starts_a_request_the_walk_takes_one_draw_for_it():
    """builtin:mamba has no extend: ``_populating`` takes its one draw of
    the share and no other (the walk's draws there are as they were before
    an extend could start a request)."""
    machine = _fresh(Config(target="builtin:mamba"))
    rng, twin = random.Random(0), random.Random(0)
    assert [r.name for r in _starts(machine)] == ["alloc"]
    assert _populating(_starts(machine), machine, rng, 1.0).name == "alloc"
    twin.random()
    assert rng.getstate() == twin.getstate()
    assert _populating([], machine, rng, 1.0) is None and rng.getstate() == twin.getstate()


def test_a_family_with_an_allocation_group_rule_but_no_in_alloc_group_is_walked_as_if_none_were_open():
    """A family of its own may name a rule ``alloc_group_begin`` on a state
    without ``in_alloc_group``: the walk reads it as False (no group open)
    and steers as if none ever opened, where reading it would raise
    AttributeError out of the run."""
    base = machine_for(Config(target="builtin:token"))
    began = []

    class OwnGroups(base):
        @draws()
        def alloc_group_begin(self):
            began.append(True)

    assert not hasattr(_fresh(Config(target="builtin:token")).state, "in_alloc_group")
    walk(OwnGroups, random.Random(0), 5, steps=40)
    assert began


def test_the_walk_clears_only_a_pool_a_step_has_touched(monkeypatch):
    """At share 1 the lever clears wherever the pool is idle once a step
    has run since the example's build or its last clear: over 10 examples
    of builtin:unified-mamba, seed 3, clears come (15 of the 445 rules run;
    seeds 0-5 8 to 37), and only the uniform draw puts one first in an
    example or right after a clear (1 time).  Clearing an untouched pool too, nearly every step
    was a clear: a fresh pool is idle, and so is a cleared one."""
    monkeypatch.setattr(walk_module, "CLEAR", 1.0)
    runs: dict = {}
    base = machine_for(Config(target="builtin:unified-mamba", page_size=4))

    class Spy(base):
        def _do(self, name, *args, **kwargs):
            runs.setdefault(self, []).append(name)
            return super()._do(name, *args, **kwargs)

    walk(Spy, random.Random(3), 10, steps=40)
    names = list(runs.values())
    clears = sum(n.count("clear") for n in names)
    untouched = sum(n[0] == "clear" for n in names) + sum(pair == ("clear", "clear") for n in names for pair in zip(n, n[1:]))
    assert 10 < clears < sum(map(len, names)) / 5
    assert untouched <= clears / 4, (untouched, clears)


class _Logged(random.Random):
    """A ``random.Random`` that logs every draw the walk takes (``random()``,
    and ``_randbelow``, which ``randrange``, ``choice`` and the walk's own
    argument draws end in), with its bound: the same values a plain one
    draws."""

    def __init__(self, seed: int):
        super().__init__(seed)
        self.draws: list[float | tuple[int, int]] = []

    def random(self) -> float:
        self.draws.append(value := super().random())
        return value

    def _randbelow(self, n: int) -> int:
        self.draws.append((n, value := super()._randbelow(n)))
        return value


def _lever_acts(monkeypatch, seen: SimpleNamespace) -> dict[str, list[int]]:
    """Spy on the walk's levers: for each (``LEVERS``), the draws the walk's
    rng (``seen.rng``, a ``_Logged``) had taken before each call of the
    lever's helper where it acted: where the edge, the steering, the
    populating, the clear or the tour chose the step (and, for the tour,
    each step where it took a begin out of the steering's want, whether or
    not the steering then drew: the earliest the tour can part the
    draws), each step the first
    example runs past ``steps`` (``_longer``), each fill (``_filling`` runs
    only with the fill on, and takes a draw whatever it returns) and each
    pool shape drawn after the first example (with the lever off, the same
    draws build the run's own)."""
    acts: dict[str, list[int]] = {lever: [] for lever in walk_module.LEVERS}

    def spy(name: str, lever):
        real = getattr(walk_module, name)

        def spied(*args, **kwargs):
            before = len(seen.rng.draws)
            result = real(*args, **kwargs)
            if (which := lever(args, result)) is not None:
                acts[which].append(before)
            return result

        monkeypatch.setattr(walk_module, name, spied)

    def chose(lever):
        return lambda args, rule: lever if rule is not None else None

    spy("_at_edge", chose("edge"))
    spy("_steered", chose("steer"))
    spy("_populating", chose("populate"))
    spy("_by_chance", lambda args, rule: "clear" if rule is not None and rule.name == "clear" else None)
    spy("_touring", chose("tour"))
    spy("_longer", lambda args, more: "long" if more else None)
    spy("_filling", lambda args, pages: "fill")
    spy("_shaped", lambda args, result: None if args[2] else "shape")
    # The tour acts on the steering too: while it holds a begin, the
    # steering wants none (``_Steer.wanted``'s ``begin``).
    wanted = walk_module._Steer.wanted

    def steering(steer, in_group, in_alloc=False, begin=True):
        before, result = len(seen.rng.draws), wanted(steer, in_group, in_alloc, begin)
        if result != wanted(steer, in_group, in_alloc):
            acts["tour"].append(before)
        return result

    monkeypatch.setattr(walk_module._Steer, "wanted", steering)
    return acts


# Levers whose helper takes its first draw with the lever off too (the
# chance of acting; the pool shape's): the draws agree through it at least.
_DRAWN_OFF_TOO = frozenset({"steer", "populate", "clear", "shape"})


@pytest.mark.parametrize("lever", walk_module.LEVERS)
def test_a_lever_switched_off_leaves_the_draws_as_they_were_up_to_its_first_change(lever, monkeypatch):
    """``walk(off={lever})`` takes the very draws the walk with every lever
    on takes, up to the first step that lever acted on there, and all of
    them on a walk it never acted on: the bench's lever table compares the
    same walks.  Over targets that have every lever between them, the
    lever acts somewhere (else this checks nothing)."""
    seen = SimpleNamespace(rng=None)
    acts = _lever_acts(monkeypatch, seen)
    acted = 0
    for config in (NPU, Config(target="builtin:mamba"), Config(target="builtin:unified-mamba", page_size=4),
                   Config(target="builtin:multi-ended", page_size=4)):
        for seed in range(6):
            streams = []
            for off in (frozenset(), frozenset({lever})):
                for spied in acts.values():
                    spied.clear()
                seen.rng = _Logged(seed)
                walk(machine_for(config), seen.rng, 4, steps=40, off=off)
                streams.append((seen.rng.draws, list(acts[lever])))
            (on, first), (off_draws, acts_off) = streams
            assert acts_off == [], f"{lever} off still acted at draws {acts_off}"
            same = next((i for i, (a, b) in enumerate(zip(on, off_draws)) if a != b), min(len(on), len(off_draws)))
            where = f"{config.target} seed {seed}: the draws part at {same}"
            if not first:
                assert on == off_draws, f"{where}, yet {lever} acted on no step"
                continue
            acted += 1
            assert same > first[0] if lever in _DRAWN_OFF_TOO else same >= first[0], \
                f"{where}, {lever} first acted after draw {first[0]}"
    assert acted, f"{lever} acted on no step of any target"


def _touring_picks(monkeypatch) -> list[tuple[int, str]]:
    """Each rule the tour chooses (``walk._touring``) from now on, as (the
    example it ran in, by the record's count; its name)."""
    picks: list[tuple[int, str]] = []
    real = walk_module._touring

    def spied(left, machine, waits=None):
        rule = real(left, machine, waits)
        if rule is not None:
            picks.append((machine.record.examples, rule.name))
        return rule

    monkeypatch.setattr(walk_module, "_touring", spied)
    return picks


def test_the_first_examples_tour_takes_each_rule_at_most_as_often_as_it_holds_it_and_no_later_example_tours(monkeypatch):
    """``walk.TOUR``: the rules the tour chooses (``_touring``) are each
    chosen at most as often as the tour holds them (``_tour``: begin, the
    overwrite and end once for each of its two groups, the free_segment
    once out of any group and once in the second, every other rule once),
    all in the run's first example, and the first is the first rule
    of the tour's order (the example's shuffle, the walk's first draw, by
    part) whose guard holds on the fresh pool, the alloc; with every
    other lever off, so that the tour chooses every
    step it can.  With the tour off too, it chooses none."""
    picks = _touring_picks(monkeypatch)
    config = Config(target="builtin:paged", page_size=4)
    machine_class = machine_for(config)
    rules = machine_rules(machine_class)
    others = frozenset(walk_module.LEVERS) - {"tour"}
    for seed in range(5):
        picks.clear()
        before = machine_class.record.examples
        walk(machine_class, random.Random(seed), 3, steps=40, off=others)
        names = [name for _, name in picks]
        order = walk_module._tour(rules, random.Random(seed), True)
        held = Counter(r.name for r in order)
        assert len(names) >= 3 and not Counter(names) - held, (names, held)
        assert {example - before for example, _ in picks} == {1}, (before, picks)
        assert names[0] == next(r.name for r in order if r.applies(_fresh(config))), (names, [r.name for r in order])
        assert names[0] == "alloc", names
        picks.clear()
        walk(machine_class, random.Random(seed), 3, steps=40, off=frozenset(walk_module.LEVERS))
        assert picks == []


@pytest.mark.parametrize("config", list(clean_configs()), ids=lambda c: c.label())
def test_a_tour_runs_a_requests_life_in_order(config):
    """``walk._tour``: part by part (``_TOUR_PARTS``: a Mamba state
    allocated and a clear, the alloc, a ``free_segment``, the HiSparse
    families' device buffer, the rest, the buffer again, the extend, then
    two free groups, the buffer a third time between them, each group its
    begin, its frees, the row's overwrite and its end, the first freeing
    with ``free`` alone and the second with the other rules that free or
    end a request, the free_segment again among them; the HiSparse families' abort after), each part in the
    order the shuffle drew, a rule once for each part that names it; with
    the tour off none, after the same draw.  Every built-in family has an
    alloc and ``free``, and only the HiSparse families a device buffer and
    an abort."""
    rules = machine_rules(machine_for(config))
    names = {r.name for r in rules}
    frees = names & walk_module._FREES
    handover, abort = names & {"device_buffer", "device_buffer_pages"}, names & {"free_hisparse"}
    assert "alloc" in names and "free" in frees, sorted(names)
    assert bool(handover) == bool(abort) == config.target.endswith("hisparse"), sorted(names)
    singles = names & {"mamba_alloc", "clear", "alloc", "free_segment", "extend"}
    rest = names - singles - frees - handover - abort - {"begin", "overwrite_row", "end"}

    def group(freeing: list[str]) -> list[str]:
        return [n for n in ("begin", *freeing, "overwrite_row", "end") if n in names]

    for seed in range(10):
        rng, rng_off, shuffled = random.Random(seed), random.Random(seed), list(rules)
        random.Random(seed).shuffle(shuffled)
        tour = [r.name for r in walk_module._tour(rules, rng, True)]
        ordered = {part: [r.name for r in shuffled if r.name in names_] for part, names_ in
                   (("rest", rest), ("frees", frees - {"free"}), ("handover", handover))}
        life = (sorted(names & {"mamba_alloc"}) + sorted(names & {"clear"}) + ["alloc"]
                + sorted(names & {"free_segment"}) + ordered["handover"] + ordered["rest"] + ordered["handover"] + sorted(names & {"extend"})
                + group(["free"]) + ordered["handover"] + group(ordered["frees"]) + sorted(abort))
        assert tour == life, tour
        assert walk_module._tour(rules, rng_off, False) == [] and rng_off.random() == rng.random()


def test_the_tours_clear_waits_for_a_step_that_is_not_a_clear(monkeypatch):
    """``walk._touring``'s ``waits``: on a fresh pool the tour's first rule
    whose guard holds is its clear (``_TOUR_PARTS``: after a Mamba state's
    alloc, which unified-swa lacks), which clears nothing there; the walk
    passes it as ``waits`` until a step other than a clear has run, so the
    tour takes its alloc first, and its clear, if at all, after some other
    step (every lever but the tour off, so that the tour chooses every step
    it can)."""
    config = Config(target="builtin:unified-swa", page_size=4)
    machine_class = machine_for(config)
    rules = machine_rules(machine_class)
    clear = next(r for r in rules if r.name == "clear")
    tour = walk_module._tour(rules, random.Random(0), True)
    machine = _fresh(config)
    assert walk_module._touring(tour, machine) is clear
    assert walk_module._touring(tour, machine, clear).name == "alloc"
    picks = _touring_picks(monkeypatch)
    for seed in range(5):
        picks.clear()
        walk(machine_class, random.Random(seed), 1, steps=40, off=frozenset(walk_module.LEVERS) - {"tour"})
        assert picks[0][1] == "alloc", picks


def test_while_the_tour_holds_a_begin_the_steering_opens_no_group(monkeypatch):
    """``_Steer.wanted``'s ``begin``: with every step steered, the run's
    first example opens no free group before its tour's two begins have
    run (the tour takes each where the steering finds no rule); then the
    steering opens groups as ever.  Without ``begin``, no begin is wanted."""
    monkeypatch.setattr(walk_module, "STEER", 1.0)
    assert "begin" in _Steer().wanted(False) and "begin" not in _Steer().wanted(False, begin=False)
    chosen: list[tuple[str, str]] = []
    real_touring, real_steered = walk_module._touring, walk_module._steered

    def spy(who: str, real):
        def chooses(*args, **kwargs):
            rule = real(*args, **kwargs)
            if rule is not None:
                chosen.append((who, rule.name))
            return rule
        return chooses

    monkeypatch.setattr(walk_module, "_touring", spy("tour", real_touring))
    monkeypatch.setattr(walk_module, "_steered", spy("steer", real_steered))
    machine_class = machine_for(Config(target="builtin:paged", page_size=4))
    for seed in range(5):
        chosen.clear()
        walk(machine_class, random.Random(seed), 1, steps=40, off=frozenset({"populate", "clear", "edge", "fill"}))
        begins = [who for who, name in chosen if name == "begin"]
        assert begins[:2] == ["tour", "tour"] and "steer" in begins[2:], chosen


def test_the_first_example_runs_first_times_as_many_steps_and_the_rest_steps(monkeypatch):
    """``walk.FIRST_TIMES``: on a clean pool, where no example ends early,
    the run's first example takes ``FIRST_TIMES * steps`` steps and each
    later one ``steps``; with ``long`` off, every example ``steps``."""
    counts: list[int] = []

    class Counting(walk_module._Steer):
        def __init__(self) -> None:
            super().__init__()
            counts.append(0)

        def saw(self, *args) -> None:
            counts[-1] += 1
            super().saw(*args)

    monkeypatch.setattr(walk_module, "_Steer", Counting)
    machine_class = machine_for(Config(target="builtin:token"))
    walk(machine_class, random.Random(0), 3, steps=10)
    assert walk_module.FIRST_TIMES > 1 and counts == [10 * walk_module.FIRST_TIMES, 10, 10]
    counts.clear()
    walk(machine_class, random.Random(0), 3, steps=10, off=frozenset({"long"}))
    assert counts == [10, 10, 10]


class _FirstStep(BaseException):
    """Raised at a run's first step: how far the run got, unhidden by its handlers."""


def test_a_run_builds_its_pool_once_before_its_first_step(monkeypatch):
    """The build that checks a run's configuration is the one ``machine_for``
    reads the machine off and the one its first example runs on: the
    harness's run and the baseline's each build the pool once before their
    first step, not three times, and the state they step is that build,
    freed when that example's teardown returns.  It goes to the first
    example on the configuration itself only: one on a shape drawn, or on
    a copy of the configuration, builds its own, and so does a replay of a
    saved walk failure.  A later example builds its own; a machine made
    without a build at hand builds one, which its first example runs on."""
    from hypothesis.database import InMemoryExampleDatabase

    from bench import baseline as baseline_module
    from state_machines.runs import runner as runner_module

    token = Config(target="builtin:token")
    # Every shape axis pinned: each example builds in ``__init__``.
    pinned = Config(target="builtin:token", size=16, rows=3, need_sort=True)
    assert not machine_for(pinned).draws_shape
    db = InMemoryExampleDatabase()
    db.save(_walk_key(machine_for(pinned)), Trace(pinned, (Step("alloc", {"n": 1}, "req_0"),)).to_json().encode())
    made = []

    def spy(config):
        made.append(build(config))
        return made[-1]

    for module in (family, runner_module, baseline_module):
        monkeypatch.setattr(module, "build", spy)
    first = []

    class Probe:
        reads_call = False

        def before(self, machine, rule, args):
            if rule != "teardown":  # not the replay of a saved failure: a step
                first.append((len(made), machine.state))
                raise _FirstStep

    for config, database, builds in ((token, None, 1), (pinned, db, 2)):
        made.clear()
        with pytest.raises(_FirstStep):
            fuzz(config, max_examples=8, seed=0, database=database, shrink=False, record=RunRecord(probe=Probe()))
        (built, state), = first
        assert built == len(made) == builds and state is made[0]
        first.clear()

    def stop(name):
        first.append(len(made))
        raise _FirstStep

    made.clear()
    with pytest.raises(_FirstStep):
        baseline_module.random_fuzz(token, seed=0, max_examples=1, around_step=stop)
    assert first == [1]

    def on(machine_class, config=None):
        machine = machine_class(engine=False)
        machine.shape_as(config or machine_class.config)
        return machine.state

    # Served once, and only on the configuration itself.
    made.clear()
    machine_class = machine_for(token, built=spy(token))
    states = [on(machine_class, attrs.evolve(token, size=64)), on(machine_class, attrs.evolve(token)),
              on(machine_class), on(machine_class)]
    assert len(made) == 4 and all(a is b for a, b in zip(states, [made[1], made[2], made[0], made[3]]))
    made.clear()
    assert on(machine_for(token)) is made[0] and len(made) == 1

    # Freed at its teardown: fuzz keeps no reference to the build it handed over.
    monkeypatch.undo()
    teardown, alive = FreeGroupMachine.teardown, []

    def watched(self):
        state = weakref.ref(self.state)
        teardown(self)
        alive.append(state() is not None)

    monkeypatch.setattr(FreeGroupMachine, "teardown", watched)
    gc.disable()
    try:
        assert not fuzz(token, max_examples=8, seed=0, database=None, shrink=False).failures
    finally:
        gc.enable()
    assert alive and not any(alive)


def test_the_walk_and_the_baseline_leave_hypothesis_s_set_up_to_its_engine(monkeypatch):
    """An example the walk or the bench baseline runs skips Hypothesis's
    ``RuleBasedStateMachine.__init__`` (its rules, bundles and printer, which
    only its engine reads: ``FreeGroupMachine(engine=False)``); one Hypothesis runs
    still makes it, and a walk example still shows as a machine."""
    from hypothesis.stateful import RuleBasedStateMachine

    from bench.baseline import random_fuzz

    made = Counter()
    hypothesis_init = RuleBasedStateMachine.__init__

    def spy(self):
        made[type(self).__name__] += 1
        hypothesis_init(self)

    monkeypatch.setattr(RuleBasedStateMachine, "__init__", spy)
    machine_class = machine_for(Config(target="builtin:token"))
    examples = []
    walk(type("Seen", (machine_class,), {"teardown": lambda self: examples.append(repr(self))}), random.Random(0), 3,
         steps=5)
    assert random_fuzz(Config(target="builtin:token"), seed=0, max_examples=3).ok
    assert not made and len(examples) == 3 and all(e.startswith("Seen(") for e in examples)
    run_state_machine_as_test(machine_class, settings=settings(
        fuzz_settings(max_examples=2, database=None, derandomize=True), stateful_step_count=2))
    assert made[machine_class.__name__] >= 2


NPU = Config(target="builtin:npu", page_size=4)


def _fresh(config: Config):
    """A machine of ``config`` built on its own pool shape."""
    machine = machine_for(config)()
    if machine.draws_shape:
        machine.shape(0, 0, 0)
    return machine


def _npu_machine_with_one_request(pages: int):
    """A machine on NPU's 10-page pool holding one new request of ``pages`` pages (at a page's end)."""
    machine = _fresh(NPU)
    machine.alloc(pages=pages, who=0)
    return machine


def _decode_rule(machine):
    return next(r for r in machine_rules(type(machine)) if r.name == "decode")


def test_the_walk_decodes_where_a_decode_takes_the_pools_last_free_page():
    """One request at a page's end and one page free: the edge names the decode rule."""
    machine = _npu_machine_with_one_request(9)
    assert machine.state.model.num_free == 1
    assert _at_edge(_decode_rule(machine), machine).name == "decode"


def test_the_walk_leaves_the_rule_to_chance_where_a_decode_would_leave_pages_free():
    """One request at a page's end and two pages free: no edge, the rule is drawn as ever."""
    machine = _npu_machine_with_one_request(8)
    assert _at_edge(_decode_rule(machine), machine) is None


def test_a_fill_draw_leaves_the_pool_with_exactly_one_page_free_or_none():
    """Over twenty fresh machines a new request of the fill's pages leaves exactly 0 or 1 page free, each seen."""
    rng, left = random.Random(0), set()
    for _ in range(20):
        machine = _npu_machine_with_one_request(2)
        machine.alloc(pages=_filling(machine, rng), who=0)
        left.add(machine.state.model.num_free)
    assert left == {0, 1}


def test_a_fill_draw_takes_at_most_a_rows_pages():
    """On a 64-page pool the fill asks for a row's pages (row_pages), not the 63 or 64 free."""
    machine = _fresh(attrs.evolve(NPU, size=256))
    assert _filling(machine, random.Random(0)) == machine.state.config.row_pages


def _edge_spy(config: Config, seen: list):
    """``config``'s machine class, appending to ``seen`` the example's
    machine (kept alive, so no two examples share it) for each decode it
    sends at the pool's edge that leaves the model as it was (refused)."""
    base = machine_for(config)

    class Spy(base):
        def _do(self, name, *args, **kwargs):
            if name != "decode" or _at_edge(_decode_rule(self), self) is None:
                return super()._do(name, *args, **kwargs)
            before = _decoded(self)
            result = super()._do(name, *args, **kwargs)
            if _decoded(self) == before:
                seen.append(self)
            return result

    return Spy


def test_an_edge_decode_the_target_refuses_is_not_sent_on_every_step_left():
    """builtin:hisparse at page size 1, whose device pool may refuse a
    decode the model's pool takes, walk seed 15, 300 examples: refusals are
    seen (in 2 examples), and no example sends one more than twice (the
    walk stops steering to the edge; a uniform draw may pick the decode
    again; with the edge kept on, 18).  The seed is one that meets
    refusals, which moves with every change to the walk's draws: seed 5,
    used here until the steering's write became the overwrite alone, meets
    none, and seed 2, used until STEER became 0.3, meets them in 1
    example (seeds 0-15 at STEER 0.3: 9 meet some)."""
    seen: list = []
    walk(_edge_spy(Config(target="builtin:hisparse", page_size=1), seen), random.Random(15), 300)
    refused = Counter(seen)
    assert refused and max(refused.values()) <= 2, sorted(refused.values())


REPO = Path(__file__).resolve().parents[1]
_WALK_NPU = """
import random, sys
from bench.targets import SGLANG_DEEP
from state_machines.harness import RunRecord, machine_for
from state_machines.harness.lockstep import InvariantViolation
from state_machines.runs.walk import walk
record = RunRecord()
try:
    walk(machine_for(SGLANG_DEEP[0], record), random.Random(7), 100)
except InvariantViolation as exc:
    print(exc.invariant, record.examples_to_failure)
"""


@pytest.mark.sglang
def test_the_walk_meets_sglang_0518s_npu_decode_bug_within_a_hundred_examples():
    """sglang 0.5.18's NPU alloc_decode bug (free groups kept out), on walk seed 7: met within 100 examples (walk.py's comment: without the edge and the fill, 2 examples of 3,000 met it)."""
    from bench.targets import SGLANG_DEEP, unavailable

    if (reason := unavailable(SGLANG_DEEP[0])) is not None:
        pytest.skip(reason)
    # A process of its own: one process can import only one sglang release.
    run = subprocess.run([sys.executable, "-c", _WALK_NPU], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("allocator_raised"), run.stdout


def test_the_walk_takes_seven_eighths_of_a_runs_examples_and_hypothesis_the_rest(monkeypatch):
    """fuzz with 16 examples on a clean target: the walk is asked for 14, Hypothesis for 2."""
    from state_machines.runs import runner

    asked = {}
    monkeypatch.setattr(runner, "walk", lambda machine, rng, examples, **kw: asked.setdefault("walk", examples))
    monkeypatch.setattr(runner, "run_state_machine_as_test",
                        lambda machine, settings: asked.setdefault("hypothesis", settings.max_examples))
    assert runner.fuzz(Config(), max_examples=16, seed=0, database=None, shrink=False).ok
    assert asked == {"walk": 14, "hypothesis": 2}


def test_a_saved_walk_value_nested_past_the_json_parser_is_forgotten_not_a_crash():
    """A database value json cannot parse for its depth (RecursionError, not
    ValueError) is forgotten as other junk is; the run goes on."""
    from hypothesis.database import InMemoryExampleDatabase

    db = InMemoryExampleDatabase()
    key = _walk_key(machine_for(TOKEN_ALIAS))
    db.save(key, b"[" * 100_000)
    again = fuzz(TOKEN_ALIAS, max_examples=40, seed=0, database=db, shrink=False)
    assert again.failures and b"[" * 100_000 not in set(db.fetch(key))
