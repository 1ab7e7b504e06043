"""One measurement each: run in a worker process, return plain values."""

from __future__ import annotations

import os
import random
import statistics
import time

from hypothesis import Phase, settings

from bench import costs
from bench.baseline import random_fuzz
from state_machines.config import Config
from state_machines.harness.family import forget_machines, machine_for
from state_machines.harness.machines import RunRecord
from state_machines.runs.runner import fuzz, walked_examples
from state_machines.runs.walk import walk

# Timing runs stop at the first failure: no shrinking, no example database.
settings.register_profile(
    "bench-timing", database=None, deadline=None, derandomize=False, phases=(Phase.explicit, Phase.generate)
)
# Shrinking runs: what `kv-lockstep fuzz` does, without the database, and
# shrinking only the first distinct failure (the bench compares one length).
settings.register_profile("bench-shrink", database=None, deadline=None, derandomize=False, report_multiple_bugs=False)
# Clean runs: nothing fails, so nothing shrinks.
settings.register_profile("bench-clean", database=None, deadline=None, derandomize=False)


def init_worker() -> None:
    """One torch thread per process (the bench runs a process per core), and
    a warm-up of both fuzzers (the harness's walk and Hypothesis phases), so
    neither side's first timed run pays import or first-call costs."""
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    random_fuzz(Config(), seed=0, max_examples=3)
    fuzz(Config(), max_examples=4, seed=0, database=None)


def run(job: dict) -> dict:
    kind = job["kind"]
    config = Config.from_dict(job["config"])
    started = time.monotonic()
    result = _RUNNERS[kind](config, job)
    return {**job, **result, "job_s": time.monotonic() - started}


def _harness(config: Config, job: dict) -> dict:
    """Hypothesis up to the first failure, shrinking off."""
    settings.load_profile("bench-timing")
    # Each timed run as a fresh process's: an earlier job (a shrink of the
    # same bug) must not have paid its pool-shape probe for it.
    forget_machines()
    outcome = fuzz(config, max_examples=job["max_examples"], seed=job["seed"], shrink=False)
    return _first_failure(outcome.record, outcome.failures[0] if outcome.failures else None, outcome.elapsed_s)


class _Met(Exception):
    """The walk met its first failure: no need to run on for others."""


def _ablation(config: Config, job: dict) -> dict:
    """The harness's walk on the harness's seed and examples, with the
    levers ``job["off"]`` switched off (``walk(off=)``): steps and examples
    to its first failure."""
    forget_machines()
    record = RunRecord()

    def met(violation):
        raise _Met

    try:
        walk(machine_for(config, record), random.Random(job["seed"]), walked_examples(job["max_examples"]),
             on_failure=met, off=frozenset(job["off"]))
    except _Met:
        pass
    return {"found": record.steps_to_failure is not None, "steps": record.steps_to_failure,
            "examples": record.examples_to_failure}


def _baseline(config: Config, job: dict) -> dict:
    forget_machines()
    outcome = random_fuzz(config, seed=job["seed"], max_examples=job["max_examples"])
    return _first_failure(outcome.record, outcome.failure, outcome.elapsed_s)


def _first_failure(r, failure, elapsed_s: float) -> dict:
    """The figures both fuzzers report: where the first failure came, if
    any, and how long the whole search took (a miss costs all of it)."""
    return {
        "elapsed_s": elapsed_s,
        "found": failure is not None,
        "seconds": r.first_failure_s,
        "examples": r.examples_to_failure,
        "steps": r.steps_to_failure,
        "invariant": failure.invariant if failure else None,
        "length": len(failure.steps) if failure else None,
        "examples_run": r.examples,
    }


def _shrink(config: Config, job: dict) -> dict:
    """Hypothesis with shrinking, as `kv-lockstep fuzz` runs it."""
    settings.load_profile("bench-shrink")
    outcome = fuzz(config, max_examples=job["max_examples"], seed=job["seed"])
    ended = time.monotonic()
    r = outcome.record
    return {
        "found": not outcome.ok,
        "seconds": r.first_failure_s,
        "elapsed_s": outcome.elapsed_s,
        # From the failure to the run's end, both on the record's clock:
        # ``elapsed_s`` starts after the run's first build, which the
        # record's clock covers (an sglang release's import, about 11 s,
        # made this negative).
        "shrink_s": ended - (r.started + r.first_failure_s) if r.first_failure_s is not None else None,
        "failures": [{"invariant": t.invariant, "length": len(t.steps), "program": t.program()} for t in outcome.failures],
    }


def _throughput(config: Config, job: dict) -> dict:
    """Steps per second of a clean run, under Hypothesis and under the baseline."""
    settings.load_profile("bench-clean")
    harness, baseline = [], []
    for seed in range(job["repeats"]):
        outcome = fuzz(config, max_examples=job["max_examples"], seed=seed)
        harness.append(outcome.record.steps / outcome.elapsed_s)
        plain = random_fuzz(config, seed=seed, max_examples=job["max_examples"])
        baseline.append(plain.record.steps / plain.elapsed_s)
        if not (outcome.ok and plain.ok):
            return {"error": f"clean target failed: {(outcome.failures or (plain.failure,))[0].invariant}"}
    return {"harness_steps_per_s": statistics.median(harness), "baseline_steps_per_s": statistics.median(baseline)}


def _costs(config: Config, job: dict) -> dict:
    """Where a step's time goes, under the baseline driver with timers."""
    timer = costs.reset()
    with costs.timed_checks():
        outcome = random_fuzz(config, seed=0, max_examples=job["max_examples"], around_step=timer.step)
    if not outcome.ok:
        return {"error": f"clean target failed: {outcome.failure.invariant}: {outcome.failure.detail}"}
    us = {what: 1e6 * s / timer.steps for what, s in sorted(timer.seconds.items())}
    step_us = 1e6 * timer.step_s / timer.steps
    # Census and allocator calls are inside the step; checks are too.
    us["model and harness (the rest)"] = step_us - sum(us.values())
    return {"steps": timer.steps, "step_us": step_us, "us_per_step": us}


def _scaling(config: Config, job: dict) -> dict:
    """``_costs`` at each of ``job["sizes"]`` (slots -> examples), the sizes
    in turn, ``job["repeats"]`` times: at each size, the run whose step cost
    least (an error wherever one run met one)."""
    best: dict[int, dict] = {}
    for _ in range(job["repeats"]):
        for size, examples in job["sizes"].items():
            run = _costs(Config.from_dict({**job["config"], "size": int(size)}), {"max_examples": examples})
            was = best.get(size)
            if was is None or (not was.get("error") and (run.get("error") or run["step_us"] < was["step_us"])):
                best[size] = run
    return {"sizes": best}


_RUNNERS = {"ablation": _ablation, "harness": _harness, "ci": _harness, "baseline": _baseline, "baseline_again": _baseline, "shrink": _shrink, "throughput": _throughput, "costs": _costs, "scaling": _scaling}
