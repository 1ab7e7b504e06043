"""RESULTS.md says where the harness still loses to the baseline, and why."""

from bench.report import _raw_losses


def _bug(name, ratio_seconds, ratio_steps):
    return {"name": name, "ratio_seconds": ratio_seconds, "ratio_steps": ratio_steps}


def test_raw_losses_split_search_losses_from_dearer_steps():
    """A bug slower in seconds is a search loss when it also took more steps, else a dearer step; wins are not listed."""
    text = "\n".join(_raw_losses({"bugs": [_bug("more", 2.0, 1.5), _bug("dear", 1.2, 1.0), _bug("won", 0.5, 0.4)]}))
    search, dearer = (line for line in text.splitlines() if line.startswith("- "))
    assert "(2 of 3" in text
    assert "more (2.00" in search and "dear" not in search
    assert "dear (1.20" in dearer and "more (2.00" not in dearer
    assert "won" not in text


def test_raw_losses_say_so_when_there_are_none():
    """With no bug slower in raw seconds the section says the harness is nowhere slower."""
    assert "nowhere slower" in "\n".join(_raw_losses({"bugs": [_bug("won", 0.5, 0.4)]}))


def test_the_lever_table_names_each_lever_whose_absence_cuts_the_steps():
    """A lever whose absence leaves 0.8 of the steps or fewer is named as a cause; none such: 'none'."""
    from bench.report import _ablation_table

    def ablated(name, **ratios):
        off = {lever: {"steps": 10 * r, "ratio": r} for lever, r in ratios.items()}
        return {**_bug(name, 2.0, 1.5), "ablation": {"seeds": 5, "steps_all_on": 10, "off": off}}

    rows = [ablated("fills", steer=1.0, edge=0.9, fill=0.5, shape=1.2), ablated("noise", steer=0.9, edge=1.0, fill=1.1, shape=0.85)]
    text = "\n".join(_ablation_table({"bugs": rows + [_bug("won", 0.5, 0.4)]}))
    fills, noise = (line for line in text.splitlines() if line.startswith("| fills") or line.startswith("| noise"))
    assert fills.endswith("| fill |") and noise.endswith("| none |")
    assert "won" not in text and "harness's 5 seeds" in text


def test_the_harness_runs_each_bug_within_the_ci_budget_on_20_seeds_and_the_bar_names_the_misses():
    """Runs of the ``ci`` profile's budget alone (its walk takes 7/8 of 200 examples, not of the cap): ``collect``
    counts the seeds each bug was found on; the bar's line counts the bugs found on all and names the rest."""
    from bench.report import _within_ci
    from bench.run import CI_BUDGET, CI_SEEDS, collect, plan
    from state_machines.config import Config

    config = Config()
    ci = [j for j in plan([config], [], seeds=3, shrink_seeds=0) if j["kind"] == "ci"]
    assert CI_SEEDS == 20 and sorted(j["seed"] for j in ci) == list(range(20))
    assert {j["max_examples"] for j in ci} == {CI_BUDGET}
    results = [{**j, "found": j["seed"] not in (4, 9), "examples": 3 + j["seed"], "steps": 1, "seconds": 0.1,
                "invariant": "x", "length": 1, "elapsed_s": 0.1}
               for j in plan([config], [], seeds=1, shrink_seeds=0)]
    (row,), _ = collect([config], [], results)
    assert row["ci"] == {"seeds": 20, "found": 18, "examples": {"median": 14.5, "min": 3, "max": None}, "missed_seeds": [4, 9]}

    def bug(name, found, most):
        return {"name": name, "ci": {"seeds": 20, "found": found, "examples": {"max": most},
                                     "missed_seeds": list(range(20 - found))}}

    data = {"settings": {"ci_budget_examples": 200}, "bugs": [bug("a", 20, 7), bug("b", 20, 115)]}
    (line,) = _within_ci(data)
    assert "on every one of 20 seeds: **2 of 2** bugs; the most examples any took: 115 (b)" in line
    data["bugs"].append(bug("c", 18, None))
    (line,) = _within_ci(data)
    assert "**2 of 3** bugs (not: c (missed on seeds 0, 1))" in line
    assert _within_ci({"settings": {}, "bugs": [{"name": "old", "shrink": {}}]}) == []  # a results.json from before


def test_the_bar_counts_the_bugs_every_shrink_took_to_the_known_shortest():
    """A bug counts only where its longest shrunk trace is no longer than the known shortest; the others are named."""
    from bench.report import _shortest_reached

    def shrunk(name, longest, known, seeds=2):
        return {"name": name, "shrink": {"seeds": seeds, "length": {"max": longest}}, "known_shortest": {"length": known}}

    (line,) = _shortest_reached({"bugs": [shrunk("a", 4, 4), shrunk("b", 7, 6), shrunk("c", 3, 4)]})
    assert "**2 of 3**" in line and "(longer: b)" in line
    # A shrinking seed that found nothing (max None) has not reached it; no shrinking runs: not counted.
    (line,) = _shortest_reached({"bugs": [shrunk("a", 4, 4), shrunk("m", None, 4), shrunk("n", None, 4, seeds=0)]})
    assert "**1 of 2**" in line and "(longer: m)" in line
    (line,) = _shortest_reached({"bugs": [shrunk("a", 4, 4)]})
    assert "**1 of 1**" in line and "longer" not in line


def test_the_noise_line_counts_the_bugs_the_baseline_is_slower_than_itself_on():
    """The baseline's other seeds against its own: in steps and in seconds, the count above 1 and the range of
    ratios; the geometric means; one seed is named as one; unmeasured: no line."""
    from bench.report import _noise

    def again(name, ratio_seconds, ratio_steps=1.0):
        return {**_bug(name, 1.0, 1.0), "baseline_again": {"seeds": 5, "ratio_seconds": ratio_seconds, "ratio_steps": ratio_steps}}

    headline = {"baseline_again_geomean_ratio_seconds": 1.05, "baseline_again_geomean_ratio_steps": 0.98}
    bugs = [again("a", 2.5, 3.0), again("b", 0.4, 0.5), again("c", 1.1), again("m", None, None), _bug("d", 1.0, 1.0)]
    (_, line) = _noise({"settings": {"seeds": 5}, "headline": headline, "bugs": bugs})
    assert "on seeds 5–9 over its median on seeds 0–4" in line
    assert "**1.05** in seconds and **0.98** in steps" in line
    assert "In steps, which only the seeds move, it is above 1 on **1 of 3** bugs (ratios 0.50–3.00)" in line
    assert "in seconds, which the machine's load moves too, above 1 on **2 of 3** bugs (ratios 0.40–2.50)" in line
    (_, line) = _noise({"settings": {"seeds": 1}, "headline": headline, "bugs": [again("a", 0.7)]})
    assert "on seed 1 over its median on seed 0" in line and "**0 of 1**" in line
    assert _noise({"settings": {"seeds": 5}, "headline": {}, "bugs": [_bug("a", 1.0, 1.0), again("m", None, None)]}) == []


def test_the_baseline_runs_again_on_as_many_other_seeds_and_its_ratios_are_collected():
    """``plan`` gives the baseline as many runs again per bug, on the seeds after its own; ``collect`` keeps those
    runs and their medians over the baseline's own."""
    from bench.run import collect, plan
    from state_machines.config import Config

    config = Config()
    jobs = plan([config], [], seeds=3, shrink_seeds=0)
    seeds = {kind: {j["seed"] for j in jobs if j["kind"] == kind} for kind in ("harness", "baseline", "baseline_again")}
    assert seeds == {"harness": {0, 1, 2}, "baseline": {0, 1, 2}, "baseline_again": {3, 4, 5}}

    def ran(job, steps):
        return {**job, "found": True, "seconds": steps / 100, "examples": 1, "steps": steps, "invariant": "x",
                "length": steps, "elapsed_s": steps / 100}

    steps = {"harness": [10, 20, 30], "baseline": [10, 20, 30], "baseline_again": [20, 40, 60]}
    results = [ran(j, steps[j["kind"]][j["seed"] % 3]) for j in jobs if j["kind"] in steps]
    (row,), _ = collect([config], [], results)
    assert row["baseline_again"]["ratio_steps"] == 2.0 and row["baseline_again"]["ratio_seconds"] == 2.0
    assert [r["seed"] for r in row["baseline_again"]["runs"]] == [3, 4, 5]


def test_the_rank_sum_p_is_the_share_of_splits_ranking_as_high():
    """Harness above every baseline seed: 1 split in C(15, 5); all tied or below: 1; a miss ranks last."""
    import math

    from bench.report import rank_sum_p

    assert rank_sum_p([11, 12, 13, 14, 15], list(range(1, 11))) == 1 / math.comb(15, 5)
    assert rank_sum_p([1, 2, 3, 4, 5], list(range(6, 16))) == 1.0
    assert rank_sum_p([3] * 5, [3] * 10) == 1.0
    assert rank_sum_p([math.inf] * 5, [1] * 10) == 1 / math.comb(15, 5)
    # One swap at the boundary: the observed sum and the one split above it.
    assert rank_sum_p([10, 12, 13, 14, 15], [1, 2, 3, 4, 5, 6, 7, 8, 9, 11]) == 2 / math.comb(15, 5)


def test_the_rank_sum_p_with_ties_is_the_mann_whitney_u_p():
    """With ties (mean ranks), the share of splits whose U (pairs above, half a pair per tie) is as high."""
    import itertools

    from bench.report import rank_sum_p

    def u(above, below):
        return sum((x > y) + 0.5 * (x == y) for x in above for y in below)

    harness, baseline = [2, 1, 3, 1, 4], [2, 2, 3, 2, 1, 1, 2, 1, 2, 2]
    pooled = harness + baseline
    splits = [set(c) for c in itertools.combinations(range(15), 5)]
    us = [u([pooled[i] for i in c], [pooled[i] for i in range(15) if i not in c]) for c in splits]
    expected = sum(x >= u(harness, baseline) for x in us) / len(splits)
    assert abs(rank_sum_p(harness, baseline) - expected) < 1e-12


def test_the_noise_test_names_the_bugs_slower_beyond_the_seeds_noise():
    """A bug whose harness seeds all come after the baseline's is named in steps; one mixed in is not."""
    from bench.report import _beyond_noise

    def runs(steps):
        return [{"found": True, "steps": n, "seconds": n / 100} for n in steps]

    def bug(name, harness, baseline, again):
        return {"name": name, "harness": {"runs": runs(harness)}, "baseline": {"runs": runs(baseline)},
                "baseline_again": {"runs": runs(again)}}

    late = bug("late", [50, 60, 70, 80, 90], [1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    mixed = bug("mixed", [1, 5, 9, 20, 3], [2, 4, 6, 8, 10], [1, 3, 5, 7, 9])
    (_, line) = _beyond_noise({"bugs": [late, mixed]})
    assert "in steps on **1 of 2**: late (p = 0.000333)" in line
    assert "in seconds on **1 of 2**: late" in line and "mixed" not in line
    # 1 of 2 below 0.05 comes by chance in 9.75% of runs (1 - 0.95 ** 2), but late's p is below 0.05 / 2.
    assert "1 or more in steps in 10% of bench runs" in line and "but late is slower beyond the seeds' noise even so" in line
    assert "the harness sooner, p is below 0.05 on **0 of 2** bugs in steps and **0 of 2** in seconds." in line
    # One bug that late among 71 is still named; one among 1,000 (p above 0.05 / 1,000) is not.
    (_, line) = _beyond_noise({"bugs": [late] + [mixed] * 70})
    assert "1 or more in steps in 97% of bench runs" in line and "but late is slower" in line
    (_, line) = _beyond_noise({"bugs": [late] + [mixed] * 999})
    assert "late is slower" not in line and "so these seeds show no one bug slower beyond their noise" in line
    early = bug("early", [1, 2, 3, 4, 5], [50, 60, 70, 80, 90], [51, 61, 71, 81, 91])
    (_, line) = _beyond_noise({"bugs": [early]})
    assert "in steps on **0 of 1**;" in line and "on **1 of 1** bugs in steps and **1 of 1** in seconds" in line
    assert "(1 or more in steps by chance alone in 5% of runs)" in line
    # With none slower, no "0 or more in 100% of bench runs".
    assert "0 or more" not in line and "about 0.1 of 1 on average (counting the bugs" in line
    # p = 0.020 each: not below 0.05 / 3, but 3 of 3 comes by chance in 0.0125% of runs (0.05 ** 3).
    fairly_late = bug("fairly late", [7, 9, 12, 14, 15], [1, 2, 3, 4, 5], [6, 8, 10, 11, 13])
    (_, line) = _beyond_noise({"bugs": [fairly_late] * 3})
    assert "fairly late (p = 0.02)" in line and "3 or more in steps in under 0.1% of bench runs" in line
    assert "more than chance gives, so some of these bugs are slower" in line
    # 2 of 5 at p = 0.020 comes by chance in 2.3% of runs: still more than chance gives.
    (_, line) = _beyond_noise({"bugs": [fairly_late] * 2 + [mixed] * 3})
    assert "2 or more in steps in 2% of bench runs" in line and "more than chance gives" in line
    # The verdict reads steps: a bug later in seconds alone (a dearer step) is counted there, not judged.
    dear = bug("dear", [5] * 5, [5] * 5, [5] * 5)
    for side, seconds in (("harness", 1.0), ("baseline", 0.01), ("baseline_again", 0.02)):
        dear[side]["runs"] = [{**r, "seconds": seconds} for r in dear[side]["runs"]]
    (_, line) = _beyond_noise({"bugs": [dear] * 3})
    assert "in seconds on **3 of 3**: dear" in line and "so these seeds show no one bug slower" in line
    assert _beyond_noise({"bugs": [{"name": "unmeasured", "harness": {}}]}) == []
    # A miss ranks last whatever its steps; bench/run.py writes None where the baseline did not run again.
    missed = bug("missed", [1] * 5, [50] * 5, [60] * 5)
    missed["harness"]["runs"] = [{**r, "found": False} for r in missed["harness"]["runs"]]
    missed["baseline_again"] = None
    (_, line) = _beyond_noise({"bugs": [missed]})
    assert "in steps on **1 of 1**: missed (p = 0.00397)" in line


def test_the_rank_sum_p_of_many_seeds_is_the_normal_approximation():
    """Past the exact count (20 seeds against 40): an exact p of 10 against 10 the approximation comes near,
    a clear loss is small, an even mix near a half, all tied 1."""
    import math

    from bench import report

    harness, baseline = [3, 5, 6, 8, 9, 11, 12, 14, 15, 16], [1, 2, 4, 7, 10, 13, 17, 18, 19, 20]
    exact = report.rank_sum_p(harness, baseline)
    report_exact, report._EXACT_SPLITS = report._EXACT_SPLITS, 0
    try:
        assert abs(report.rank_sum_p(harness, baseline) - exact) < 0.005  # 0.0037; 0.0098 without the continuity correction
    finally:
        report._EXACT_SPLITS = report_exact
    assert report.rank_sum_p(list(range(41, 61)), list(range(1, 41))) < 1e-9
    assert 0.3 < report.rank_sum_p(list(range(1, 60, 3)), [v for v in range(1, 61) if v % 3 != 1]) < 0.7
    assert report.rank_sum_p([7] * 20, [7] * 40) == 1.0
    assert math.comb(60, 20) > report._EXACT_SPLITS


def test_chance_is_the_binomial_tail():
    """Hits or more of n tests at 0.05 where nothing differs: all of it for 0, 0.05 for 1 of 1, about 0.14 for 6 of 71."""
    from bench.report import _chance

    assert abs(_chance(71, 0) - 1.0) < 1e-9
    assert abs(_chance(1, 1) - 0.05) < 1e-12
    assert 0.13 < _chance(71, 6) < 0.15


def test_the_headline_is_split_by_where_the_baseline_meets_each_bug():
    """Bugs the baseline meets in its first example (median) against the rest, each group's geometric means;
    the headline with the first group at parity, what the rest would need for 0.5; a bug with no median ratio
    is left out and counted apart, a miss as its whole search (the bar's figure)."""
    from bench.report import _by_depth

    def rated(name, examples, seconds, steps):
        return {**_bug(name, seconds, steps), "baseline": {"examples": {"median": examples}}}

    missed = {**_bug("missed", None, None), "harness": {"seconds": {"median": 0.05}},
              "baseline": {"examples": {"median": None}, "seconds": {"median": None}}, "bar": {"harness_s": 0.25, "baseline_s": 10.0}}
    bugs = [rated("a", 1, 2.0, 4.0), rated("b", 1, 0.5, 1.0), rated("c", 3, 0.25, 0.5), rated("d", 9, 0.25, 0.125),
            rated("e", 2, 0.25, 0.25), missed]
    (line,) = [t for t in _by_depth({"bugs": bugs}) if t]
    assert "Of these 5 bugs, the baseline meets **2** in its first example" in line
    assert "**1.00** in seconds and **2.00** in steps" in line  # sqrt(2.0 * 0.5), sqrt(4.0 * 1.0)
    assert "other **3** it comes to **0.25** in seconds and **0.25** in steps" in line
    assert "would be 0.44; 0.5 would need the other 3 at 0.31 or below" in line  # 0.25 ** (3 / 5); 0.5 ** (5 / 3)
    # The missed bug: 0.05 / 10.0; the headline with it: (2.0 * 0.5 * 0.25 ** 3 * 0.005) ** (1 / 6).
    assert "missed (0.005: each side's unfloored median" in line and "would be 0.21." in line
    # The first kind's cost and the "even" only where its figures are above 1 (here steps 2.00, seconds 1.00).
    tour = "; the first example's tour of the rules (`walk.TOUR`) is there for the first."
    assert f"for the second kind and cost the first a share of steps{tour} At parity" in line
    (line,) = [t for t in _by_depth({"bugs": [rated("a", 1, 4.0, 4.0), *bugs[1:]]}) if t]
    assert f"for the second kind and cost the first a share of steps{tour} Even at parity" in line
    (line,) = [t for t in _by_depth({"bugs": [rated("a", 1, 0.5, 0.5), *bugs[1:]]}) if t]
    assert f"for the second kind{tour} At parity" in line
    # Without bugs of both kinds there is nothing to split.
    assert _by_depth({"bugs": bugs[2:]}) == []


def _clean_only_results():
    """results.json as `python -m bench --clean-only '^builtin:token page_size=1$'` writes it: no bugs, one clean target."""
    costs = {"steps": 10, "step_us": 100.0, "error": None,
             "us_per_step": {"allocator calls": 20.0, "census (get_all_free_pages, available_size)": 20.0,
                             "model_consistent": 30.0, "model and harness (the rest)": 30.0}}
    from bench.run import SEEDS

    settings = {"seeds": SEEDS, "processes": 2, "ci_budget_examples": 200, "floor_s": 0.25, "quick": False, "only": None,
                "clean_only": "^builtin:token page_size=1$", "cap_examples": 3000, "shrink_seeds": 2,
                "throughput_examples": 100, "costs_examples": 100, "scaling_examples": {"64": 60, "1024": 30}}
    return {
        "machine": {"date": "2026-12-01 06:34 UTC", "platform": "Linux", "cpu": "AMD EPYC", "cores": 2, "python": "3.11.7",
                    "torch": "2.13.0+cpu", "hypothesis": "6.170.17", "load_average_1min": 1.3},
        "settings": settings,
        "headline": {"bar_geomean_ratio": None, "bar_found_every_seed": 0, "bar_median_shrink_s": None,
                     "geomean_ratio_seconds": None, "geomean_ratio_steps": None,
                     "baseline_again_geomean_ratio_seconds": None, "baseline_again_geomean_ratio_steps": None},
        "skipped": [],
        "bugs": [],
        "clean": [{"name": "builtin:token page_size=1", "config": {},
                   "throughput": {"harness_steps_per_s": 6800.0, "baseline_steps_per_s": 7900.0},
                   "costs": costs, "scaling": {"64": costs, "1024": {**costs, "step_us": 200.0}}}],
        "wall_s": 13.0,
    }


def test_a_clean_only_report_claims_nothing_of_bugs_and_names_its_own_command():
    """With no bugs measured, RESULTS.md has no bar, ratio, 'nowhere slower' or shrinking text (each would be
    over zero bugs), and names the command that wrote it, not `make bench`; the clean tables stay."""
    from bench.report import markdown

    text = markdown(_clean_only_results())
    for claim in ("nowhere slower", "The bar", "geometric mean ratio", "ratio s |", "Headline", "## Shrinking", "## Time to failure", "0 of 0",
                  "## Shortest traces", "make bench"):
        assert claim not in text, claim
    assert "`python -m bench --clean-only '^builtin:token page_size=1$'` took 13 s" in text
    assert "No bugs in this run" in text
    assert "| builtin:token page_size=1 | 6800 | 7900 |" in text and "## Scaling with pool size" in text


def test_the_report_names_make_bench_only_for_a_run_at_every_default():
    """`make bench` for a run with the defaults (2 processes on 2 cores or more); otherwise `python -m bench` with the options set."""
    from bench.report import command

    data = _clean_only_results()
    full = {**data, "settings": {**data["settings"], "clean_only": None}}
    assert command(full) == "make bench"
    assert command({**full, "machine": {"cores": 1}, "settings": {**full["settings"], "processes": 1}}) == "make bench"
    assert command({**full, "settings": {**full["settings"], "quick": True, "seeds": 3}}) == "python -m bench --quick --seeds 3"
    assert command({**full, "settings": {**full["settings"], "only": "token"}}) == "python -m bench --only token"
