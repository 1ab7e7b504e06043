"""`python -m bench`: measure, summarize, write results.json and RESULTS.md."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

from bench import report, targets
from bench.known_shortest import BY_NAME, bug_name
from state_machines.config import Config
from state_machines.runs.walk import LEVERS

HERE = Path(__file__).resolve().parent
# The `ci` profile's budget: a bug found within it is caught by `make test`.
CI_BUDGET = 200
# Seeds the harness runs each bug on within that budget alone (issue 13: every
# bug on 100% of 20 seeds): a run of CI_BUDGET examples walks 7/8 of them,
# not 7/8 of CAP_EXAMPLES, so it is a run of its own, as `make test` makes it.
CI_SEEDS = 20
# Both fuzzers stop here; past it a seed counts as not found (issue 13's bar).
CAP_EXAMPLES = 3000
# Seeds a bug for time to failure.  Issue 13's bar asks 5; with 5, the
# headline (a geometric mean of per-bug median ratios) moved by more than the
# changes it was to judge: over the walk's and the baseline's seeds 0-59 (the
# bench's ablation job, steps), twelve sets of 5 seeds gave 0.44 to 0.54,
# standard deviation 0.031; six sets of 10, 0.44 to 0.51, 0.020.  Seeds
# 0-4 are among these 10, so the bar's runs are a part of the bench's.
SEEDS = 10
# The seeds a bug issue 13's bar asks for.
BAR_SEEDS = 5
# The bar's time to failure: a time under this counts as this much, so that
# start-up noise does not decide a ratio, and a miss counts as the whole search.
FLOOR_S = 0.25
SHRINK_SEEDS = 2
THROUGHPUT_EXAMPLES = 100
THROUGHPUT_REPEATS = 3
COSTS_EXAMPLES = 100
# Pool sizes in slots, and examples at each (fewer where a step costs more).
SCALING = {64: 60, 1024: 30, 16384: 10}
# Runs at each size: the least is kept.  The sizes are taken in turn, in one
# process while no other job runs (``run_jobs`` with one process, after the
# bug and clean-target jobs, before the lever ablation), so a slow spell of
# the machine reaches every size alike; with both workers running other
# jobs beside them, growth ratios moved by half from one run to the next
# (hisparse at page size 4: 3.1 then 5.8).
SCALING_REPEATS = 3


def machine() -> dict:
    """Which machine and which date the figures come from."""
    import hypothesis
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or "unknown"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "hypothesis": hypothesis.__version__,
        # Other work on the machine slows every figure alike; ratios survive it better than times.
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def plan(bugs, clean, seeds: int, cap: int = CAP_EXAMPLES, shrink_seeds: int = SHRINK_SEEDS,
         ci_seeds: int = CI_SEEDS) -> list[dict]:
    jobs = []
    for config in bugs:
        c = config.to_dict()
        # Shrinking runs are the longest: queue them first so both cores stay busy.
        jobs += [{"kind": "shrink", "config": c, "seed": s, "max_examples": cap} for s in range(shrink_seeds)]
    for config in clean:
        c = config.to_dict()
        jobs.append({"kind": "throughput", "config": c, "max_examples": THROUGHPUT_EXAMPLES, "repeats": THROUGHPUT_REPEATS})
        jobs.append({"kind": "costs", "config": c, "max_examples": COSTS_EXAMPLES, "size": None})
    for config in bugs:
        c = config.to_dict()
        for s in range(seeds):
            jobs.append({"kind": "harness", "config": c, "seed": s, "max_examples": cap})
            jobs.append({"kind": "baseline", "config": c, "seed": s, "max_examples": cap})
            # The baseline again on as many other seeds: how far a bug's
            # median moves with no change of strategy at all.
            jobs.append({"kind": "baseline_again", "config": c, "seed": seeds + s, "max_examples": cap})
        jobs += [{"kind": "ci", "config": c, "seed": s, "max_examples": CI_BUDGET} for s in range(ci_seeds)]
    return jobs


def plan_scaling(clean) -> list[dict]:
    """One job per clean target: its step's cost at each ``SCALING`` size,
    the sizes in turn, ``SCALING_REPEATS`` times (``bench.jobs._scaling``)."""
    return [{"kind": "scaling", "config": config.to_dict(), "sizes": SCALING, "repeats": SCALING_REPEATS}
            for config in clean]


def plan_ablation(bugs, seeds: int, cap: int) -> list[dict]:
    """For each of ``bugs``, the walk on the harness's ``seeds`` with all
    its levers on (``off`` empty: the harness's own walk) and with each
    one off.  A run takes 0.01-0.5 s."""
    return [
        {"kind": "ablation", "config": config.to_dict(), "seed": s, "max_examples": cap, "off": off}
        for config in bugs
        for off in ([], *([lever] for lever in LEVERS))
        for s in range(seeds)
    ]


def summarize_ablation(runs: list[dict]) -> dict:
    """Median steps to the first failure with every lever on, and with each
    off: its steps and their ratio to all on's (below 1 that lever costs
    the bug steps); a seed that found nothing counts as beyond the cap."""
    def steps(off: list) -> float | None:
        return spread([r["steps"] if r["found"] else None for r in runs if r["off"] == off])["median"]

    on = steps([])
    return {
        "seeds": len({r["seed"] for r in runs}),
        "steps_all_on": on,
        "off": {lever: {"steps": steps([lever]), "ratio": ratio(steps([lever]), on)} for lever in LEVERS},
    }


def run_jobs(jobs: list[dict], processes: int, started: float, verbose: bool) -> list[dict]:
    """Each of ``jobs`` run in worker processes (``bench.jobs.run``), in the order they end."""
    from bench import jobs as job_module

    results = []
    ctx = multiprocessing.get_context("spawn")
    # A process can import one sglang release only, so each release's runs
    # get worker processes of their own; the built-in runs share the rest.
    by_release: dict[str | None, list[dict]] = {}
    for job in jobs:
        by_release.setdefault(job["config"].get("sglang_path"), []).append(job)
    for group in by_release.values():
        with ctx.Pool(processes, initializer=job_module.init_worker) as pool:
            for result in pool.imap_unordered(job_module.run, group):
                results.append(result)
                i = len(results)
                if verbose:
                    print(f"  {result['kind']} {bug_name(Config.from_dict(result['config']))} {result['job_s']:.1f} s", file=sys.stderr)
                if i % 50 == 0 or i == len(jobs):
                    print(f"  {i}/{len(jobs)} runs, {time.monotonic() - started:.0f} s", file=sys.stderr)
    return results


def spread(values: list[float | None]) -> dict:
    """Median, min and max over every seed; a seed that found nothing counts
    as beyond the cap (``None`` in the output)."""
    xs = sorted(math.inf if v is None else v for v in values)
    fin = lambda v: None if math.isinf(v) else v  # noqa: E731
    return {"median": fin(statistics.median(xs)), "min": fin(xs[0]), "max": fin(xs[-1])}


def summarize_fuzzer(runs: list[dict]) -> dict:
    return {
        "seeds": len(runs),
        "found_share": sum(r["found"] for r in runs) / len(runs),
        "found_within_ci_share": sum(r["found"] and r["examples"] <= CI_BUDGET for r in runs) / len(runs),
        "seconds": spread([r["seconds"] if r["found"] else None for r in runs]),
        "examples": spread([r["examples"] if r["found"] else None for r in runs]),
        "steps": spread([r["steps"] if r["found"] else None for r in runs]),
        "unshrunk_length": spread([r["length"] for r in runs]),
        "invariants": sorted({r["invariant"] for r in runs if r["invariant"]}),
        "runs": [{k: r[k] for k in ("seed", "found", "seconds", "examples", "steps", "invariant", "length")} for r in runs],
    }


def summarize_ci(runs: list[dict]) -> dict:
    """The harness's runs of the ``ci`` profile's budget: on how many seeds
    it found the bug, the examples it took, and the seeds it missed on."""
    runs = sorted(runs, key=lambda r: r["seed"])
    return {
        "seeds": len(runs),
        "found": sum(r["found"] for r in runs),
        "examples": spread([r["examples"] if r["found"] else None for r in runs]) if runs else None,
        "missed_seeds": [r["seed"] for r in runs if not r["found"]],
    }


def summarize_shrink(runs: list[dict], known) -> dict:
    if not runs:
        none = {"median": None, "min": None, "max": None}
        return {"seeds": 0, "length": none, "shrink_s": None, "invariants": [], "shortest_program": None}
    lengths, shrink_s, chosen = [], [], []
    for r in runs:
        if not r["failures"]:
            lengths.append(None)
            continue
        # Compare like with like: the failure on the known trace's invariant, if Hypothesis found it.
        same = [f for f in r["failures"] if known and f["invariant"] == known.invariant]
        best = min(same or r["failures"], key=lambda f: f["length"])
        lengths.append(best["length"])
        chosen.append(best)
        shrink_s.append(r["shrink_s"])
    return {
        "seeds": len(runs),
        "length": spread(lengths),
        "shrink_s": spread(shrink_s) if shrink_s else None,
        "invariants": sorted({f["invariant"] for r in runs for f in r["failures"]}),
        "shortest_program": min(chosen, key=lambda f: f["length"])["program"] if chosen else None,
    }


def bar_seconds(run: dict) -> float:
    """One seed's time to failure as the bar counts it: at least ``FLOOR_S``,
    and the whole search where the seed found nothing."""
    return max(FLOOR_S, run["seconds"] if run["found"] else run["elapsed_s"])


def bar_row(harness: list[dict], baseline: list[dict]) -> dict:
    """The bar's figures for one bug: median floored seconds per fuzzer, their
    ratio (harness / baseline), and whether the harness found it on every seed."""
    h = statistics.median(map(bar_seconds, harness))
    b = statistics.median(map(bar_seconds, baseline))
    return {
        "harness_s": h,
        "baseline_s": b,
        "ratio": h / b,
        "harness_found_all": all(r["found"] for r in harness),
        "baseline_found": sum(r["found"] for r in baseline),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def median_shrink(runs: list[dict]) -> float | None:
    """The median shrink time over every shrinking run that found a failure."""
    times = [r["shrink_s"] for r in runs if r.get("shrink_s") is not None]
    return statistics.median(times) if times else None


def geomean(xs) -> float | None:
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def collect(bugs, clean, results: list[dict]) -> tuple[list[dict], list[dict]]:
    by = {}
    for r in results:
        by.setdefault((r["kind"], json.dumps(r["config"], sort_keys=True)), []).append(r)
    key = lambda kind, c: (kind, json.dumps(c.to_dict(), sort_keys=True))  # noqa: E731
    bug_rows = []
    for config in bugs:
        name = bug_name(config)
        known = BY_NAME.get(name)
        harness_runs, baseline_runs = by[key("harness", config)], by[key("baseline", config)]
        harness = summarize_fuzzer(sorted(harness_runs, key=lambda r: r["seed"]))
        baseline = summarize_fuzzer(sorted(baseline_runs, key=lambda r: r["seed"]))
        again_runs = by.get(key("baseline_again", config), [])
        bug_rows.append(
            {
                "name": name,
                "config": config.to_dict(),
                "harness": harness,
                "baseline": baseline,
                "bar": bar_row(harness_runs, baseline_runs),
                "ratio_seconds": ratio(harness["seconds"]["median"], baseline["seconds"]["median"]),
                "ratio_steps": ratio(harness["steps"]["median"], baseline["steps"]["median"]),
                # The baseline on its other seeds against its own: the noise in a ratio of medians.
                "baseline_again": _against(baseline, summarize_fuzzer(sorted(again_runs, key=lambda r: r["seed"])))
                if again_runs
                else None,
                "shrink": summarize_shrink(by.get(key("shrink", config), []), known),
                "ci": summarize_ci(by.get(key("ci", config), [])),
                "known_shortest": None
                if known is None
                else {"length": len(known.steps), "invariant": known.invariant, "program": known.trace().program(), "why": known.why},
            }
        )
    clean_rows = []
    for config in clean:
        throughput = by[key("throughput", config)][0]
        costs = by[key("costs", config)][0]
        scaling = by[key("scaling", config)][0]["sizes"]
        clean_rows.append(
            {
                "name": bug_name(config),
                "config": config.to_dict(),
                "throughput": {k: v for k, v in throughput.items() if k.endswith("per_s") or k == "error"},
                "costs": {k: costs.get(k) for k in ("steps", "step_us", "us_per_step", "error")},
                "scaling": {str(s): {k: r.get(k) for k in ("steps", "step_us", "us_per_step", "error")} for s, r in scaling.items()},
            }
        )
    return bug_rows, clean_rows


def _against(baseline: dict, again: dict) -> dict:
    """The baseline's runs on its other seeds (``again``, summarized), with
    their medians over its own: the ratios a change of seeds alone makes."""
    return {
        **again,
        "ratio_seconds": ratio(again["seconds"]["median"], baseline["seconds"]["median"]),
        "ratio_steps": ratio(again["steps"]["median"], baseline["steps"]["median"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--seeds", type=int, default=SEEDS, help=f"seeds per bug for time to failure (default {SEEDS}; the bar asks {BAR_SEEDS})")
    parser.add_argument("--only", metavar="REGEX", help="only the bugs whose name matches (e.g. 'bench.bugs|token')")
    parser.add_argument("--cap", type=int, default=CAP_EXAMPLES, help=f"examples a search stops at (default {CAP_EXAMPLES}, the bar's)")
    parser.add_argument("--shrink-seeds", type=int, default=SHRINK_SEEDS, help=f"shrinking runs per bug (default {SHRINK_SEEDS}; 0: none)")
    parser.add_argument("--quick", action="store_true", help="bugs only: no clean-target throughput, costs or scaling")
    parser.add_argument(
        "--clean-only",
        metavar="REGEX",
        help="clean targets only, those whose name matches (e.g. '^builtin:token page_size=1$'): throughput, costs, scaling",
    )
    parser.add_argument("--processes", type=int, default=min(2, os.cpu_count() or 1), help="worker processes (default: 2, or 1 on one core)")
    parser.add_argument("--out", default=str(HERE), help="where results.json and RESULTS.md go (default bench/)")
    parser.add_argument("--verbose", action="store_true", help="print each run as it ends")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.processes < 1:
        parser.error("--seeds and --processes take a positive number")

    started = time.monotonic()
    if args.clean_only and args.quick:
        parser.error("--clean-only and --quick exclude each other")
    bugs, skipped_bugs = ([], []) if args.clean_only else targets.bugs()
    clean, skipped_clean = ([], []) if args.quick else targets.clean(args.clean_only)
    if args.only:
        bugs = [c for c in bugs if re.search(args.only, bug_name(c))]
    for config, reason in skipped_bugs + skipped_clean:
        print(f"skip {bug_name(config)}: {reason}", file=sys.stderr)
    jobs = plan(bugs, clean, args.seeds, args.cap, args.shrink_seeds)
    print(f"bench: {len(bugs)} bugs, {len(clean)} clean targets, {len(jobs)} runs on {args.processes} processes", file=sys.stderr)

    results = run_jobs(jobs, args.processes, started, args.verbose)
    if clean:
        print(f"bench: growth with the pool, {len(clean)} targets in one process", file=sys.stderr)
        results += run_jobs(plan_scaling(clean), 1, started, args.verbose)
    bug_rows, clean_rows = collect(bugs, clean, results)
    # Where the harness took more steps than the baseline, the walk again
    # with each lever off in turn: what each costs that bug.
    losers = [r for r in bug_rows if (r["ratio_steps"] or 0) > 1]
    ablation_jobs = plan_ablation([Config.from_dict(r["config"]) for r in losers], args.seeds, args.cap)
    if ablation_jobs:
        print(f"bench: {len(ablation_jobs)} runs of the walk with a lever off, on the {len(losers)} bugs it took more steps on",
              file=sys.stderr)
    ablated = run_jobs(ablation_jobs, args.processes, started, args.verbose)
    for row in losers:
        row["ablation"] = summarize_ablation([r for r in ablated if r["config"] == row["config"]])
    data = {
        "machine": machine(),
        "settings": {
            "seeds": args.seeds,
            "processes": args.processes,
            "ci_budget_examples": CI_BUDGET,
            "ci_seeds": CI_SEEDS,
            "floor_s": FLOOR_S,
            "quick": args.quick,
            "only": args.only,
            "clean_only": args.clean_only,
            "cap_examples": args.cap,
            "shrink_seeds": args.shrink_seeds,
            "throughput_examples": THROUGHPUT_EXAMPLES,
            "costs_examples": COSTS_EXAMPLES,
            "scaling_examples": SCALING,
            "scaling_repeats": SCALING_REPEATS,
        },
        "headline": {
            "bar_geomean_ratio": geomean(r["bar"]["ratio"] for r in bug_rows),
            "bar_found_every_seed": sum(r["bar"]["harness_found_all"] for r in bug_rows),
            "ci_found_every_seed": sum(r["ci"]["seeds"] > 0 and r["ci"]["found"] == r["ci"]["seeds"] for r in bug_rows),
            "bar_median_shrink_s": median_shrink([r for r in results if r["kind"] == "shrink"]),
            "geomean_ratio_seconds": geomean(r["ratio_seconds"] for r in bug_rows),
            "geomean_ratio_steps": geomean(r["ratio_steps"] for r in bug_rows),
            "baseline_again_geomean_ratio_seconds": geomean((r["baseline_again"] or {}).get("ratio_seconds") for r in bug_rows),
            "baseline_again_geomean_ratio_steps": geomean((r["baseline_again"] or {}).get("ratio_steps") for r in bug_rows),
        },
        "skipped": [{"name": bug_name(c), "reason": why} for c, why in skipped_bugs + skipped_clean],
        "bugs": bug_rows,
        "clean": clean_rows,
        "wall_s": time.monotonic() - started,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "RESULTS.md").write_text(report.markdown(data))
    print(f"bench: wrote {out / 'results.json'} and {out / 'RESULTS.md'} in {data['wall_s']:.0f} s", file=sys.stderr)
    return 0
