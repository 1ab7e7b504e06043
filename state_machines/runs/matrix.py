"""The gate across sglang releases: one row per release and target.

``python -m state_machines.runs.matrix 0.5.8 0.5.17 0.5.23`` runs each release
in a fresh process (one process can import only one sglang), fuzzes every
sglang kind it has (``sglang.gate_kinds()``), then the real caller
(``--callers``: each cache at both placements and the gate's page sizes),
and prints the table.  A release that is not installed, or cannot be
imported, is one row saying why.  ``--json FILE`` keeps the rows.

The ``reachability`` column labels each failure: *reachable* when a
``--caller`` run with the release's own free-group placement fails (the
caller run re-runs a forced placement's failure under it to tell), *latent*
when only ``--groups all`` shows it, or only the simulated caller (a kind's
row, ``--caller harness``) does.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from state_machines.config import Config
from state_machines.targets import TargetError

SGLANG_ROOT = Path(".sglang")
COLUMNS = ("release", "target", "result", "examples", "seconds", "s to first failure", "shrunk length", "failing invariant",
           "reachability", "disabled")
# The caches a matrix drives as the release's own caller, by default.
CALLERS = ("radix",)
# What a kind's failure is: the simulated caller's steps, not the release's scheduler.
HARNESS_LATENT = "latent (simulated caller only)"


def run_release(release_dir: str, max_examples: int, seed: int, trace_dir: str | None, kinds=None) -> list[dict]:
    """Fuzz every kind of one release (or those in ``kinds``), in this
    process; a release that cannot be imported is one row saying why."""
    from state_machines.harness import build
    from state_machines.runs.runner import fuzz
    from state_machines.runs.trace import trace_fields, write_or_why
    from state_machines.targets import sglang

    release = Path(release_dir).name
    try:
        sglang.load_sglang(release_dir)
    except TargetError as exc:
        return [{"release": release, "target": "all", "result": f"cannot import: {exc}"}]
    rows = []
    for kind, page_size in sglang.gate_kinds():
        if kinds and kind not in kinds:
            continue
        row = {"release": release, "target": f"sglang:{kind} page_size={page_size}"}
        config = Config(target=f"sglang:{kind}", page_size=page_size, sglang_path=release_dir)
        started = time.monotonic()
        try:
            row["disabled"] = _disabled(build, config)
            outcome = fuzz(config, max_examples=max_examples, seed=seed, database=None, derandomize=False)
        except TargetError as exc:
            rows.append({**row, "result": f"unavailable: {exc}"})
            continue
        rec = outcome.record
        row.update(examples=rec.examples, seconds=round(time.monotonic() - started, 1))
        if outcome.ok:
            row["result"] = "pass"
        else:
            row.update(
                result="FAIL",
                first_failure_s=round(rec.first_failure_s, 2),
                failures=[
                    {
                        "invariant": t.invariant,
                        "length": len(t.steps),
                        "rules": [s.rule for s in t.steps],
                        **trace_fields(write_or_why(t, trace_dir) if trace_dir else None),
                    }
                    for t in outcome.failures
                ],
            )
        rows.append(row)
    return rows


def caller_runs(callers) -> list[str]:
    """The real caller's runs of a release (``state_machines.callers.gate``):
    each cache at the release's placement and ``--groups all``, page sizes 1 and 4."""
    return [f"{c}:{g}:{ps}" for c in callers for g in ("release", "all") for ps in (1, 4)]


def caller_row(r: dict) -> dict:
    """A row of ``state_machines.callers.gate`` as a matrix row; each failure keeps its reachability label."""
    row = {"release": r["release"], **{k: r[k] for k in ("result", "examples", "seconds", "first_failure_s") if k in r}}
    row["target"] = (f"--caller {r['caller']} --groups {r['groups']} page_size={r['page_size']}" if "caller" in r
                     else "--caller")
    if "failures" in r:
        row["failures"] = [{"invariant": f["invariant"], "length": len(f["rules"]), "rules": f["rules"],
                            "trace": f["trace"], "trace_error": f.get("trace_error"), "label": f["label"]}
                           for f in r["failures"]]
    return row


def reachability(row: dict, rows: list[dict]) -> str:
    """How reachable a row's failures are: a caller row's own label; a
    kind's failure is latent (only the simulated caller shows it), noting a
    reachable caller failure on the same release."""
    failures = row.get("failures", [])
    if not failures:
        return "-"
    if any("label" in f for f in failures):
        return ", ".join(f.get("label", "?") for f in failures)
    reached = [r["target"] for r in rows if r["release"] == row["release"]
               and any(f.get("label") == "reachable" for f in r.get("failures", []))]
    return HARNESS_LATENT + (f"; reachable failure under {reached[0]}" if reached else "")


def _disabled(build, config) -> dict[str, str]:
    """Rules (and checks) the target cannot run here, with reasons; a fresh
    pool that already fails its checks is left for the run to report."""
    from state_machines.harness import InvariantViolation
    from state_machines.harness.steps import disabled_steps

    try:
        state = build(config)
    except InvariantViolation:
        return {}
    skipped = {f"check {name}": why for name, why in getattr(state, "skipped_checks", {}).items()}
    return {**disabled_steps(state), **skipped}


def _cell(row: dict, column: str, rows: list[dict] = ()) -> str:
    failures = row.get("failures", [])
    if column == "reachability":
        return reachability(row, list(rows))
    if column == "release":
        return row["release"]
    if column == "target":
        return row["target"]
    if column == "result":
        # Why a release or kind did not run is the row's point: kept whole.
        return row["result"].replace("|", "\\|")
    if column == "examples":
        return str(row.get("examples", "-"))
    if column == "seconds":
        return str(row.get("seconds", "-"))
    if column == "s to first failure":
        return str(row.get("first_failure_s", "-"))
    if column == "shrunk length":
        return ", ".join(str(f["length"]) for f in failures) or "-"
    if column == "disabled":
        return "; ".join(f"{rule} ({_short(reason)})" for rule, reason in row.get("disabled", {}).items()) or "-"
    return ", ".join(f["invariant"] for f in failures) or "-"


def _short(reason: str, width: int = 60) -> str:
    """A reason cut at a word to about ``width`` characters."""
    if len(reason) <= width:
        return reason
    return reason[:width].rsplit(" ", 1)[0] + " ..."


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r, c, rows) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def rows_of_children(module: str, releases, child_args: list[str], blank: dict) -> list[dict]:
    """``python -m MODULE --one FOLDER CHILD_ARGS`` for each release, each in
    a fresh process (one process imports one sglang), and the JSON rows each
    prints on its last line.  A release not installed, or a child that
    prints no rows, is one row saying so, ``blank`` filling its columns."""
    rows = []
    for release in releases:
        folder = Path(release) if Path(release, "sglang").is_dir() else SGLANG_ROOT / release
        if not (folder / "sglang").is_dir():
            rows.append({"release": release, **blank, "result": f"not installed: run `make sglang V={release}`"})
            continue
        print(f"{module.rsplit('.', 1)[-1]}: {release} ...", file=sys.stderr, flush=True)
        child = subprocess.run([sys.executable, "-m", module, "--one", str(folder), *child_args],
                               capture_output=True, text=True)
        try:
            rows += json.loads(child.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            reason = (child.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append({"release": release, **blank, "result": f"error: {reason}"})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m state_machines.runs.matrix", description=__doc__.splitlines()[0])
    parser.add_argument("releases", nargs="+", help="release versions under .sglang/, or folders holding sglang")
    parser.add_argument("--max-examples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace-dir", default=".kv-lockstep/traces/matrix")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--kinds", help="comma-separated subset of the sglang kinds (token,paged,swa,npu,...)")
    parser.add_argument("--callers", default=None,
                        help=f"comma-separated caches to drive as each release's own caller (default {','.join(CALLERS)};"
                             " '' for none)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.one:  # the child: one release, rows as JSON on the last line
        kinds = args.kinds.split(",") if args.kinds else None
        print(json.dumps(run_release(args.releases[0], args.max_examples, args.seed, args.trace_dir, kinds)))
        return 0

    rows = rows_of_children(
        "state_machines.runs.matrix", args.releases,
        ["--max-examples", str(args.max_examples), "--seed", str(args.seed), "--trace-dir", args.trace_dir,
         *(["--kinds", args.kinds] if args.kinds else [])],
        blank={"target": "all"},
    )
    callers = [c for c in (",".join(CALLERS) if args.callers is None else args.callers).split(",") if c]
    # A release whose kinds did not run (not installed, cannot import) is one row already.
    broken = {r["release"] for r in rows if r["target"] == "all"}
    releases = [r for r in args.releases if r not in broken and Path(r).name not in broken]
    if callers and releases:  # the real caller's rows, from its own gate's children (one sglang each)
        rows += [caller_row(r) for r in rows_of_children(
            "state_machines.callers.gate", releases,
            ["--runs", ",".join(caller_runs(callers)), "--max-examples", str(args.max_examples), "--seed", str(args.seed),
             "--trace-dir", args.trace_dir],
            blank={},
        )]
        order = {release: i for i, release in enumerate(args.releases)}
        rows.sort(key=lambda r: order.get(r["release"], len(order)))
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
