"""The real caller across sglang releases: one row per release, cache,
placement and page size.

``python -m state_machines.callers.gate 0.5.17 0.5.18 0.5.23`` runs each
release in a fresh process (one process imports one sglang) and prints the
table; ``--json FILE`` keeps the rows.  ``--one DIR --runs ...`` is the
child (and what the tests call): the runs of one release, as JSON on the
last line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from state_machines.config import Config
from state_machines.runs.matrix import rows_of_children
from state_machines.targets import TargetError

# caller:groups:page_size, the default runs of a release.
RUNS = tuple(f"{c}:{g}:{ps}" for c in ("radix", "unified") for g in ("release", "all") for ps in (1, 4))
COLUMNS = ("release", "caller", "groups", "page size", "result", "examples", "s to first failure", "steps", "label")


def _config(release_dir: str, run: str) -> Config:
    from state_machines.callers.release import default_target

    run, _, target = run.partition("@")
    caller, groups, ps = run.rsplit(":", 2)
    return Config(target=target or default_target(caller, int(ps)), page_size=int(ps), sglang_path=release_dir,
                  caller=caller, groups=groups)


def run_release(release_dir: str, runs, max_examples: int, seed: int, shrink: bool, trace_dir: str | None) -> list[dict]:
    """Fuzz each run (``caller:groups:page_size``) of one release, in this process."""
    import state_machines.callers  # noqa: F401 - registers the caller family
    from state_machines.runs.runner import fuzz
    from state_machines.runs.trace import trace_fields, write_or_why

    rows = []
    for run in runs:
        config = _config(release_dir, run)
        row = {"release": Path(release_dir).name, "caller": config.caller, "groups": config.groups,
               "page_size": config.page_size}
        started = time.monotonic()
        try:
            outcome = fuzz(config, max_examples=max_examples, seed=seed, database=None, derandomize=False, shrink=shrink)
        except TargetError as exc:
            rows.append({**row, "result": f"unavailable: {exc}"})
            continue
        rec = outcome.record
        row.update(examples=rec.examples, seconds=round(time.monotonic() - started, 1), rules=dict(rec.rule_counts))
        if outcome.ok:
            row["result"] = "pass"
        else:
            row.update(result="FAIL", first_failure_s=round(rec.first_failure_s, 2), failures=[
                {"invariant": t.invariant, "label": (t.detail or "").split(":", 1)[0], "detail": t.detail,
                 "rules": [s.rule for s in t.steps], "program": t.program(),
                 **trace_fields(write_or_why(t, trace_dir) if trace_dir else None)}
                for t in outcome.failures
            ])
        rows.append(row)
    return rows


def _cell(row: dict, column: str) -> str:
    failures = row.get("failures", [])
    value = {
        "release": row["release"], "caller": row.get("caller", "-"), "groups": row.get("groups", "-"),
        "page size": row.get("page_size", "-"), "result": row["result"][:70], "examples": row.get("examples", "-"),
        "s to first failure": row.get("first_failure_s", "-"),
        "steps": ", ".join(str(len(f["rules"])) for f in failures) or "-",
        "label": ", ".join(f"{f['label']} {f['invariant']}" for f in failures) or "-",
    }[column]
    return str(value)


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(_cell(r, c) for c in COLUMNS) + " |" for r in rows])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m state_machines.callers.gate", description=__doc__.splitlines()[0])
    parser.add_argument("releases", nargs="+", help="release versions under .sglang/, or folders holding sglang")
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated caller:groups:page_size, each with @TARGET where not the caller's default allocator")
    parser.add_argument("--max-examples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-shrink", action="store_true", help="report the first failing example as found")
    parser.add_argument("--trace-dir", default=".kv-lockstep/traces/callers")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    runs = args.runs.split(",")
    if args.one:
        rows = run_release(args.releases[0], runs, args.max_examples, args.seed, not args.no_shrink, args.trace_dir)
        print(json.dumps(rows))
        return 0
    rows = rows_of_children(
        "state_machines.callers.gate", args.releases,
        ["--runs", args.runs, "--max-examples", str(args.max_examples), "--seed", str(args.seed), "--trace-dir",
         args.trace_dir, *(["--no-shrink"] if args.no_shrink else [])],
        blank={},
    )
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
