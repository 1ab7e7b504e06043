"""Statement coverage of a target's allocator code (``fuzz --cover``).

Which code: for ``sglang:`` targets, every file of the release's allocator
package ``sglang/srt/mem_cache/allocator/`` (or its one file
``mem_cache/allocator.py``) plus ``hardware_backend/npu/allocator_npu.py``;
for built-in targets, ``allocators/``; for a custom ``MODULE:ATTR``, the file
that defines it.  A ``--caller`` run also counts the release's prefix caches
and scheduler helpers (``CACHE_SOURCES``).  A file the run never imported counts, at 0%.

The allocator runs in a watched worker (``watchdog.fuzz_watched``), so the
lines are recorded there: a ``Recorder`` is handed to the worker, which
starts it before it imports anything of the target (a fresh interpreter, so
import-time lines count too) and sends back the lines it saw.  Statements
are counted by coverage.py's own parser (``Coverage.analysis2``).

``python -m state_machines.runs.cover`` (``make sglang-coverage``) runs
every kind of one release in turn, each in its own worker, and prints one
table of the union of their lines.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import sysconfig
import time
from pathlib import Path

from attrs import frozen

from state_machines.config import Config

REPO_ROOT = Path(__file__).resolve().parents[2]
SGLANG_ROOT = REPO_ROOT / ".sglang"
INSTALL = "pip install 'kv-lockstep[cover]' (into this venv: .venv/bin/python -m pip install 'coverage>=7')"


def missing() -> str | None:
    """Why ``--cover`` cannot run here (coverage.py is not installed), or None."""
    try:
        import coverage  # noqa: F401
    except ImportError:
        return f"--cover needs coverage.py, which is not installed: {INSTALL}"
    return None


def measured_files(config: Config) -> list[Path]:
    """The allocator code of ``config``'s target, found without importing it."""
    from state_machines.targets import sglang

    kind, _, name = config.target.partition(":")
    if kind == "sglang":
        files = sglang.release_files(config.sglang_path)
        return files + cache_files(files[0]) if config.caller != "harness" and files else files
    if kind == "builtin":
        return sorted((REPO_ROOT / "allocators").glob("*.py"))
    from state_machines.targets import resolve

    factory = resolve(config.target).factory
    # A class's own module and those of the classes it inherits from: an
    # empty subclass of TokenAllocator ran allocators/token.py and base.py,
    # and the table counted its own file alone (helper-90).
    owners = [c for c in factory.__mro__ if c is not object] if isinstance(factory, type) else [factory]
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()  # abc.ABC's abc.py is no allocator code
    files = []
    for owner in owners:
        path = getattr(sys.modules.get(getattr(owner, "__module__", ""), None), "__file__", None)
        if path and Path(path).suffix == ".py" and (file := Path(path).resolve()) not in files and stdlib not in file.parents:
            files.append(file)
    return files


# What a ``--caller`` run drives besides the allocator: the prefix caches and the
# scheduler helpers, under sglang/srt/mem_cache/ (a release has those it has).
CACHE_SOURCES = ("radix_cache.py", "unified_radix_cache.py", "swa_radix_cache.py", "base_prefix_cache.py",
                 "common.py", "allocation.py", "unified_cache/*.py", "unified_cache/components/*.py")


def cache_files(allocator_file: Path) -> list[Path]:
    """The cache and scheduler-helper files of the release that holds
    ``allocator_file`` (a file under its ``mem_cache/``)."""
    mem_cache = next(p for p in allocator_file.parents if p.name == "mem_cache")
    return sorted({f for pattern in CACHE_SOURCES for f in mem_cache.glob(pattern)})


def root_of(config: Config, files: list[Path]) -> Path:
    """The folder a table's file names are shown relative to."""
    if config.target.startswith("sglang:") and files:
        # .../ROOT/sglang/srt/mem_cache/...: shown from sglang/ on.
        return next(p for p in files[0].parents if p.name == "sglang").parent
    if config.target.startswith("builtin:") or not files:
        return REPO_ROOT
    # A custom target's own folder: it named this repository (helper-90).  The
    # files it inherits from elsewhere are shown whole.
    return files[0].parent


def heading(config: Config, files: list[Path]) -> str:
    """The line over ``fuzz --cover``'s table: what its files are, and where."""
    code = f"{config.target}'s allocator code"
    if config.caller != "harness" and config.target.startswith("sglang:") and files:
        code += " and of the release's caches and scheduler helpers that drive it,"
    count = f"{len(files)} file{'s' if len(files) != 1 else ''}"
    return f"statement coverage of {code} under {root_of(config, files)} ({count}; a file never imported counts at 0%):"


class Recorder:
    """Statement coverage of ``files`` in the process that calls ``start``;
    picklable until then, so a worker can be handed one."""

    def __init__(self, files: list[Path]) -> None:
        self.files = [str(f) for f in files]
        self._cov = None

    def start(self) -> None:
        import coverage

        self._cov = coverage.Coverage(data_file=None, include=self.files, config_file=False)
        self._cov.start()

    def stop(self) -> dict[str, list[int]]:
        """The lines executed since ``start``, by file (those never run are absent)."""
        if self._cov is None:
            return {}
        self._cov.stop()
        data = self._cov.get_data()
        return {f: sorted(data.lines(f) or ()) for f in data.measured_files()}


@frozen
class FileCoverage:
    name: str  # shown relative to the table's root
    statements: int
    executed: int
    missed: str = ""  # the statements never run, as ranges of line numbers ("" when none)

    @property
    def percent(self) -> float:
        return 100.0 * self.executed / self.statements if self.statements else 100.0


def tally(files: list[Path], lines: dict[str, list[int]], root: Path) -> list[FileCoverage]:
    """Per file of ``files``: its statements, and how many of them ``lines``
    (file -> executed line numbers) ran; a file absent from ``lines`` ran none."""
    import coverage
    from coverage.results import format_lines

    cov = coverage.Coverage(data_file=None, config_file=False)
    data = cov.get_data()
    known = {str(Path(f).resolve()): f for f in lines}
    data.add_lines({str(f): lines[known[str(f.resolve())]] for f in files if str(f.resolve()) in known})
    out = []
    for f in files:
        _, statements, _, missed, _ = cov.analysis2(str(f))
        try:
            name = str(f.relative_to(root))
        except ValueError:
            name = str(f)
        out.append(FileCoverage(name, len(statements), len(statements) - len(missed), format_lines(statements, missed)))
    return out


def missed_ranges(rows: list[FileCoverage]) -> str:
    """One line per file with a statement that never ran: its name, then those
    statements as coverage.py writes them (``12-15``: every statement from
    line 12 to 15 missed, none between them run)."""
    return "\n".join(f"{r.name}: {r.missed}" for r in rows if r.missed)


def table(rows: list[FileCoverage]) -> str:
    """A Markdown table: one row per file, then the total."""
    statements, executed = sum(r.statements for r in rows), sum(r.executed for r in rows)
    total = FileCoverage("total", statements, executed)
    lines = ["| file | statements | executed | % |", "|---|---:|---:|---:|"]
    for r in [*rows, total]:
        name = f"**{r.name}**" if r is total else f"`{r.name}`"
        lines.append(f"| {name} | {r.statements} | {r.executed} | {r.percent:.1f} |")
    return "\n".join(lines)


def union(into: dict[str, set[int]], lines: dict[str, list[int]]) -> None:
    for f, got in lines.items():
        into.setdefault(str(Path(f).resolve()), set()).update(got)


# -- make sglang-coverage: every kind of one release, one table --


def newest_release(root: Path = SGLANG_ROOT) -> Path | None:
    """The installed release under ``root`` with the highest version."""

    def key(p: Path):
        return tuple(int(n) for n in re.findall(r"\d+", p.name))

    found = [p for p in root.glob("*") if (p / "sglang").is_dir() and re.match(r"\d", p.name)]
    return max(found, key=key) if found else None


def _summary(text: str, code: int) -> str:
    """The line of a run's output that says how it ended."""
    if code == 2:
        return "unavailable: " + (text.strip().splitlines() or ["?"])[-1].removeprefix("kv-lockstep: error: ")
    for line in text.splitlines():
        if line.startswith(("no failure:", "FAILED")):
            return line
    return f"exit {code}"


def cover_release(release: Path, *, max_examples: int, seed: int, trace_dir: str, out=None, kinds: str | None = None,
                  show_missed: bool = False, lines_json: str | None = None) -> int:
    """Fuzz every kind of ``release`` (or those ``kinds`` names: ``KIND`` or
    ``KIND:PAGE_SIZE``, comma-separated) with coverage, each in its own
    worker, and print the per-kind results and one table of the union (then,
    with ``show_missed``, the statements no kind ran, per file).  With
    ``lines_json``, each kind's executed lines per file go to that file as
    ``{"KIND:PAGE_SIZE": {file: [line, ...]}}``, so the union of any subset
    of kinds can be tallied after one run."""
    from state_machines.runs.watchdog import fuzz_watched
    from state_machines.targets import sglang

    out = out or sys.stdout
    files = sglang.release_files(str(release))
    per_kind: dict[str, dict[str, set[int]]] = {}
    print(f"statement coverage of sglang {release.name}'s allocator code, {max_examples} examples per kind, seed {seed}",
          file=out)
    wanted = [k.strip() for k in kinds.split(",")] if kinds else None
    failed = []
    for kind, page_size in sglang.gate_kinds():
        if wanted is not None and kind not in wanted and f"{kind}:{page_size}" not in wanted:
            continue
        config = Config(target=f"sglang:{kind}", page_size=page_size, sglang_path=str(release))
        buffer = io.StringIO()
        started = time.monotonic()
        code = fuzz_watched(config, max_examples=max_examples, seed=seed, db_spec=None, trace_dir=trace_dir,
                            out=buffer, err=buffer, cover=Recorder(files),
                            on_cover=lambda got, key=f"{kind}:{page_size}": union(per_kind.setdefault(key, {}), got))
        print(f"  {config.label()}: {_summary(buffer.getvalue(), code)} ({time.monotonic() - started:.0f} s)", file=out)
        if code == 1:  # a failure, or a harness error: where its trace is, and the run's exit 1
            failed.append(config.label())
            for line in buffer.getvalue().splitlines():
                if line.lstrip().startswith(("trace:", "replay:", "kv-lockstep: harness error")):
                    print(f"    {line.strip()}", file=out)
    seen: dict[str, set[int]] = {}
    for lines in per_kind.values():
        union(seen, lines)
    rows = tally(files, {f: sorted(s) for f, s in seen.items()}, release)
    print(table(rows), file=out)
    if show_missed:
        print("statements never run:", file=out)
        print(missed_ranges(rows), file=out)
    if lines_json:
        try:
            from state_machines.runs.trace import write_atomic

            write_atomic(os.path.realpath(lines_json), json.dumps({k: {f: sorted(v) for f, v in d.items()} for k, d in per_kind.items()}))
        except OSError as exc:  # the table above stands
            print(f"kv-lockstep: --lines-json {lines_json} not written: {exc.strerror or type(exc).__name__}", file=sys.stderr)
            return 2
    if failed:
        print(f"FAILED: {', '.join(failed)} (a failure on a release is a finding: its trace above)", file=out)
        return 1
    return 0


def bad_input(kinds: str | None, max_examples: int, lines_json: str | None) -> str | None:
    """What the command line asks that no run can do, in one line; None if
    nothing: an unknown kind or page size, no examples, a --lines-json that
    cannot be written (found after the whole run, 25 minutes)."""
    from state_machines.targets import sglang

    if max_examples < 1:
        return f"--max-examples {max_examples}: give at least 1"
    gated = sglang.gate_kinds()
    names = {k for k, _ in gated} | {f"{k}:{ps}" for k, ps in gated}
    for wanted in (k.strip() for k in (kinds or "").split(",") if kinds is not None):
        if wanted not in names:
            return (f"--kinds: no kind {wanted!r}: give KIND or KIND:PAGE_SIZE among "
                    + ", ".join(f"{k}:{ps}" for k, ps in gated))
    from state_machines.runs.options import BadOption, check_output_paths

    try:
        check_output_paths(lines_json=lines_json)
    except BadOption as exc:
        return str(exc)
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m state_machines.runs.cover", description=__doc__.splitlines()[0])
    parser.add_argument("--sglang-path", help="a folder holding sglang (default: the newest release under .sglang/)")
    parser.add_argument("--max-examples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace-dir", default=".kv-lockstep/traces/coverage")
    parser.add_argument("--kinds", help="only these kinds, comma-separated: KIND (each gated page size) or KIND:PAGE_SIZE")
    parser.add_argument("--missed", action="store_true", help="after the table, the statements no kind ran, per file")
    parser.add_argument("--lines-json", help="write each kind's executed lines per file here (to tally any subset)")
    args = parser.parse_args(argv)
    if reason := missing():
        print(f"kv-lockstep: error: {reason}", file=sys.stderr)
        return 2
    if reason := bad_input(args.kinds, args.max_examples, args.lines_json):
        print(f"kv-lockstep: error: {reason}", file=sys.stderr)
        return 2
    release = Path(args.sglang_path) if args.sglang_path else newest_release()
    if release is None or not (release / "sglang").is_dir():
        print(f"kv-lockstep: error: no sglang release at {release or SGLANG_ROOT}: run `make sglang V=<version>`",
              file=sys.stderr)
        return 2
    return cover_release(release.resolve(), max_examples=args.max_examples, seed=args.seed, trace_dir=args.trace_dir,
                         kinds=args.kinds, show_missed=args.missed, lines_json=args.lines_json)


if __name__ == "__main__":
    sys.exit(main())
