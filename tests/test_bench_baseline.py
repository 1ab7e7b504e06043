"""The bench's random baseline drives the harness's own machine."""

import statistics

import pytest

from bench.baseline import random_fuzz, random_rules
from state_machines.config import Config
from state_machines.harness import STEPS, machine_for


def test_baseline_draws_every_rule_of_the_machine():
    """Each machine rule has a range the baseline can draw, and each is a trace step."""
    rules = random_rules(machine_for(Config())())
    core = {"alloc", "begin", "free", "free_segment", "overwrite_row", "rematch", "evict", "finish", "end"}
    assert core <= {r.name for r in rules} <= set(STEPS)
    assert all(low <= high for r in rules for low, high in r.ranges.values())


def test_baseline_finds_a_mutant_and_passes_its_fixed_target():
    """The random fuzzer catches token aliasing and raises no alarm on the fixed allocator."""
    caught = random_fuzz(Config(mutant="alias"), seed=0, max_examples=200)
    assert caught.failure is not None
    assert caught.record.examples_to_failure <= 200
    assert random_fuzz(Config(), seed=0, max_examples=20).ok


@pytest.mark.parametrize("seed", [0, 1])
def test_baseline_is_repeatable(seed):
    """The same seed runs the same steps and finds the same failure."""
    first = random_fuzz(Config(mutant="flag-drift"), seed=seed, max_examples=200)
    again = random_fuzz(Config(mutant="flag-drift"), seed=seed, max_examples=200)
    assert first.failure is not None and first.failure == again.failure


def test_baseline_seeds_are_not_the_harness_walks_seeds(monkeypatch):
    """A bench seed gives the baseline a random stream other than ``random.Random(seed)``, which the harness's walk uses."""
    import random

    from bench import baseline

    streams = []

    class Recorded(random.Random):
        def __init__(self, x=None):
            streams.append(x)
            super().__init__(x)

    monkeypatch.setattr(baseline.random, "Random", Recorded)
    random_fuzz(Config(), seed=3, max_examples=1)
    assert streams and 3 not in streams


def test_clean_only_picks_the_clean_targets_its_pattern_names():
    """`python -m bench --clean-only REGEX` benches exactly the clean targets whose name matches."""
    from bench.known_shortest import bug_name
    from bench.targets import clean

    ready, skipped = clean("^builtin:token page_size=1$")
    assert [bug_name(c) for c in ready] == ["builtin:token page_size=1"] and skipped == []


@pytest.mark.parametrize("side", ["harness", "baseline"])
def test_both_clocks_cover_making_the_machine(monkeypatch, side):
    """Time to first failure includes ``machine_for`` (building and probing the target) on either side alike."""
    import time

    from bench import baseline
    from state_machines.runs import runner

    module = runner if side == "harness" else baseline

    def slow(*args, **kwargs):
        time.sleep(0.2)
        return machine_for(*args, **kwargs)

    monkeypatch.setattr(module, "machine_for", slow)
    config = Config(mutant="alloc-off-by-one")
    if side == "harness":
        record = runner.fuzz(config, max_examples=20, seed=0, shrink=False, database=None).record
    else:
        record = random_fuzz(config, seed=0, max_examples=20).record
    assert record.first_failure_s is not None and record.first_failure_s >= 0.2


def test_a_shrink_is_timed_from_the_failure_however_long_the_first_build_took(monkeypatch):
    """``jobs._shrink``'s shrink time runs from the first failure to the
    run's end: a first build that takes long (an sglang release's import)
    counts in the time to the failure, not against the shrink (it made
    the sglang bugs' shrink times about -11 s)."""
    import time

    from bench import jobs
    from state_machines.runs import runner

    def slow(*args, **kwargs):
        time.sleep(0.5)
        return machine_for(*args, **kwargs)

    monkeypatch.setattr(runner, "machine_for", slow)
    result = jobs.run({"kind": "shrink", "config": Config(mutant="alias").to_dict(), "seed": 0, "max_examples": 20})
    assert result["found"] and result["seconds"] >= 0.5
    # The time to the failure and the shrink together make the whole job (its set-up aside).
    assert 0 < result["shrink_s"] and abs(result["seconds"] + result["shrink_s"] - result["job_s"]) < 0.25


@pytest.mark.parametrize("side", ["harness", "baseline"])
def test_each_timed_run_probes_its_pool_shapes_as_a_fresh_process_would(monkeypatch, side):
    """A timed job after another of the same bug (a shrink, an earlier seed) still pays machine_for's shape probe."""
    from bench import jobs
    from state_machines.harness import family

    probed = []
    monkeypatch.setattr(family, "may_draw", lambda config: probed.append(config) or True)
    config = Config(mutant="alloc-off-by-one")
    machine_for(config).shapes()  # an earlier job of the same configuration, in the same process
    before = len(probed)
    jobs.run({"kind": side, "config": config.to_dict(), "seed": 0, "max_examples": 5})
    machine_for(config).shapes()
    assert len(probed) > before


def test_the_ablation_with_every_lever_on_is_the_harnesss_own_walk():
    """bench's ablation job with nothing off meets the first failure on the
    very step the harness's run does (same seed, same walk); with the fill
    off, ExactlyFull (which needs the pool exactly full) takes more steps."""
    from bench import jobs

    config = Config(target="bench.bugs:ExactlyFull")
    for seed in range(3):
        harness = jobs.run({"kind": "harness", "config": config.to_dict(), "seed": seed, "max_examples": 200})
        ablated = jobs.run({"kind": "ablation", "config": config.to_dict(), "seed": seed, "max_examples": 200, "off": []})
        assert (ablated["steps"], ablated["examples"]) == (harness["steps"], harness["examples"])
    steps = {off: sum(jobs.run({"kind": "ablation", "config": config.to_dict(), "seed": s, "max_examples": 200,
                                "off": list(off)})["steps"] for s in range(5)) for off in ((), ("fill",))}
    assert steps[("fill",)] > steps[()], steps


def test_without_the_requests_started_while_few_are_live_a_bug_that_needs_one_kept_live_takes_more_steps():
    """The walk's ``populate`` lever (``walk.POPULATE``): multi-ended's
    move-keeps-mapping needs a logical page live behind a physical loan
    when the loan is freed and an urgent flush moves the page; a uniform
    rule draw keeps few requests live, each a short while.  Over seeds 0-9
    with it on the walk took 3,210 steps, with it off 4,897; over seeds
    0-29 a median of 147 steps a seed on and 404 off (with the first
    example's tour of two free groups, ``walk._TOUR_PARTS``; with its tour
    of one, 2,112 and 5,355, and medians 121 and 378; when this test was
    written, 1,873 and 3,542, and medians 111.5 and 350).  This test ran unified-swa's segment-queues-view before the
    first example's tour (``walk.TOUR``): 403 steps on and 1,658 off over
    seeds 0-9.  The tour's shuffle moved every walk's draws, even with the
    tour off (392 and 861 then), and with it on the same seeds took 1,555
    and 1,421; over seeds 0-59 that bug took a median of about 80 steps a
    seed on and off, with the tour on or off: its seeds 0-9 had been luck."""
    from bench import jobs

    config = Config(target="builtin:multi-ended", mutant="move-keeps-mapping", page_size=4)
    steps = {off: sum(jobs.run({"kind": "ablation", "config": config.to_dict(), "seed": s, "max_examples": 200,
                                "off": list(off)})["steps"] for s in range(10)) for off in ((), ("populate",))}
    assert steps[("populate",)] > steps[()], steps


def test_with_the_extend_among_the_rules_that_start_a_request_an_extend_bug_takes_fewer_steps(monkeypatch):
    """The walk's ``populate`` lever draws an extend too (``walk._STARTS``):
    paged extend-floor needs an extend from a page's end, and the lever's
    allocs alone fill the pool an extend needs room in.  With the first
    example's tour of an alloc first and the extend after the rest
    (``walk._TOUR_PARTS``, which patching ``_STARTS`` leaves as it is),
    seeds 0-19 took 253 steps and 556 with allocs alone (medians 5 and 6
    steps a seed).  With the tour's starts an alloc or an extend first
    (28591cd), 187 and 502, and over seeds 0-59 a median of 3.5 steps a
    seed against 18 (sums 681 and 1,481).  With the tour's earlier orders
    the gain was in a few long seeds, and a sum over fewer seeds went
    either way (seeds 0-9 205 and 193 with its first order; with one free
    group, seeds 0-19 335 and 468)."""
    from bench import jobs
    from state_machines.runs import walk as walk_module

    config = Config(target="builtin:paged", mutant="extend-floor", page_size=4)

    def steps() -> int:
        return sum(jobs.run({"kind": "ablation", "config": config.to_dict(), "seed": s, "max_examples": 200,
                             "off": []})["steps"] for s in range(20))

    with_extend = steps()
    monkeypatch.setattr(walk_module, "_STARTS", frozenset({"alloc"}))
    assert steps() > with_extend


def test_without_the_clear_at_an_idle_pool_a_clear_bug_takes_more_steps():
    """The walk's ``clear`` lever (``walk.CLEAR``): unified-mamba's
    clear-keeps-mamba needs a clear while the cache holds a Mamba state, and
    a clear runs only at an idle pool, which the walk's allocs make rare."""
    from bench import jobs

    config = Config(target="builtin:unified-mamba", mutant="clear-keeps-mamba", page_size=4)
    steps = {off: sum(jobs.run({"kind": "ablation", "config": config.to_dict(), "seed": s, "max_examples": 200,
                                "off": list(off)})["steps"] or 10**6 for s in range(5)) for off in ((), ("clear",))}
    assert steps[("clear",)] > steps[()], steps


def _tour_steps(config: Config, seeds: int = 20) -> float:
    """The walk's median steps to a first failure on ``config`` over walk
    seeds 0 to ``seeds`` - 1 (the bench's ablation job, every lever on)."""
    from bench import jobs

    return statistics.median(jobs.run({"kind": "ablation", "config": config.to_dict(), "seed": s, "max_examples": 200,
                                       "off": []})["steps"] or 10**6 for s in range(seeds))


def test_with_a_mamba_state_and_a_clear_first_a_clear_that_keeps_the_state_takes_fewer_steps(monkeypatch):
    """The first example's tour opens with a Mamba state's alloc and a
    clear (``walk._MAMBA_ALLOC``, ``walk._CLEAR``), while the pool is
    still idle: unified-mamba clear-keeps-mamba needs a clear while the
    cache holds a Mamba state, and a clear waits for an idle pool, which
    the tour's requests seldom leave.  Over seeds 0-19 a median of 37
    steps a seed, against 195.5 without those two parts (sums 1,572 and
    6,139)."""
    from state_machines.runs import walk as walk_module

    config = Config(target="builtin:unified-mamba", mutant="clear-keeps-mamba", page_size=4)
    first = _tour_steps(config)
    without = tuple(p for p in walk_module._TOUR_PARTS if p not in (walk_module._MAMBA_ALLOC, walk_module._CLEAR))
    monkeypatch.setattr(walk_module, "_TOUR_PARTS", without)
    assert first < _tour_steps(config), first


def test_with_a_free_segment_out_of_any_group_after_the_first_alloc_a_segment_bug_takes_fewer_steps(monkeypatch):
    """The first example's tour runs a ``free_segment`` out of any group
    right after its alloc (``walk._TOUR_PARTS``): pure-swa
    segment-frees-twice needs an alloc and then a segment freed, which a
    segment freed in a free group does not show.  Over seeds 0-19 a median
    of 2 steps a seed, against 19 with the free_segment in the second
    group alone (sums 50 and 389)."""
    from state_machines.runs import walk as walk_module

    config = Config(target="builtin:pure-swa", mutant="segment-frees-twice", page_size=1)
    out_of_group = _tour_steps(config)
    in_the_group_alone = tuple(p for p in walk_module._TOUR_PARTS if p is not walk_module._SEGMENT)
    monkeypatch.setattr(walk_module, "_TOUR_PARTS", in_the_group_alone)
    assert out_of_group < _tour_steps(config), out_of_group


def test_with_the_extend_after_the_rest_an_extend_of_a_held_chain_takes_fewer_steps(monkeypatch):
    """The first example's tour runs its extend after the rest
    (``walk._TOUR_PARTS``), where a request holds pages again:
    page-interleave rotation-from-extend needs a chain that holds a page
    when an extend grows it, and an extend drawn with the alloc, before the
    free_segment, came first in about half the examples, on a fresh pool,
    where it has no chain to grow.  Over seeds 0-19 a median of 7 steps a
    seed, against 22.5 with an alloc or an extend first, as the tour's
    starts were drawn before (sums 294 and 496)."""
    from state_machines.runs import walk as walk_module

    config = Config(target="builtin:page-interleave", mutant="rotation-from-extend", page_size=4)
    after_the_rest = _tour_steps(config)
    parts = walk_module._TOUR_PARTS
    drawn_first = tuple(walk_module._STARTS if p is walk_module._ALLOC else p
                        for p in parts if p is not walk_module._EXTEND)
    monkeypatch.setattr(walk_module, "_TOUR_PARTS", drawn_first)
    assert after_the_rest < _tour_steps(config), after_the_rest


@pytest.mark.parametrize("mutant", ["buffer-keeps-mapping", "buffer-drops-surplus"])
def test_with_the_device_buffer_at_three_points_of_the_tour_a_buffer_bug_takes_fewer_steps(mutant, monkeypatch):
    """The first example's tour runs the HiSparse families' device buffer
    three times (``walk._TOUR_PARTS``): right after its free_segment,
    after the rest, and between the free groups, each on the request as
    it then stands.  hisparse buffer-keeps-mapping needs a buffer of a
    request that still holds its pages, buffer-drops-surplus one smaller
    than the device pages a request holds.  Over seeds 0-19, medians of 7
    and 57 steps a seed, against 25 and 90 with the buffer right after the
    free_segment alone (sums 205 and 665, 1,988 and 2,239), and 34.5 and
    81.5 with it between the groups alone."""
    from state_machines.runs import walk as walk_module

    config = Config(target="builtin:hisparse", mutant=mutant, page_size=4)
    three = _tour_steps(config)
    parts = [p for p in walk_module._TOUR_PARTS if p is not walk_module._HANDOVER]
    after = parts.index(walk_module._SEGMENT) + 1
    monkeypatch.setattr(walk_module, "_TOUR_PARTS", (*parts[:after], walk_module._HANDOVER, *parts[after:]))
    assert three < _tour_steps(config), three


def test_the_scaling_job_keeps_each_size_s_cheapest_run_taking_the_sizes_in_turn(monkeypatch):
    """``jobs._scaling``: every size once per round, rounds in turn, and at
    each size the run whose step cost least; an error at a size stays."""
    from bench import jobs

    order, costs = [], iter([300.0, 900.0, 200.0, 1000.0, 250.0, 800.0])

    def fake(config, job):
        order.append((config.size, job["max_examples"]))
        us = next(costs)
        return {"error": "clean target failed"} if (config.size, us) == (16, 1000.0) else {"step_us": us}

    monkeypatch.setattr(jobs, "_costs", fake)
    got = jobs.run({"kind": "scaling", "config": Config().to_dict(), "sizes": {8: 60, 16: 10}, "repeats": 3})["sizes"]
    assert order == [(8, 60), (16, 10)] * 3
    assert got == {8: {"step_us": 200.0}, 16: {"error": "clean target failed"}}


def test_the_bench_plans_one_scaling_job_per_clean_target():
    """Growth with the pool is measured by its own jobs, one per clean target (``plan_scaling``), not among the others."""
    from bench.run import SCALING, SCALING_REPEATS, plan, plan_scaling

    config = Config()
    assert [j["kind"] for j in plan([], [config], seeds=1, shrink_seeds=0)] == ["throughput", "costs"]
    assert plan_scaling([config]) == [{"kind": "scaling", "config": config.to_dict(), "sizes": SCALING, "repeats": SCALING_REPEATS}]


def test_the_bench_reads_growth_off_the_scaling_job():
    """``collect``: a clean target's scaling is its scaling job's, size by size, beside its throughput and costs."""
    from bench.run import collect

    config = Config()
    c = config.to_dict()
    costs = {"steps": 10, "step_us": 100.0, "us_per_step": {}}
    results = [{"kind": "throughput", "config": c, "harness_steps_per_s": 1.0, "baseline_steps_per_s": 2.0},
               {"kind": "costs", "config": c, **costs},
               {"kind": "scaling", "config": c, "sizes": {64: costs, 16384: {**costs, "step_us": 250.0}}}]
    (row,) = collect([], [config], results)[1]
    assert {size: r["step_us"] for size, r in row["scaling"].items()} == {"64": 100.0, "16384": 250.0}
