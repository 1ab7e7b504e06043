"""`fuzz --cover`: statement coverage of the target's allocator code, one
row per file, measured in the watched worker."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROW = re.compile(r"\| `(?P<name>[^`]+)` \| (?P<statements>\d+) \| (?P<executed>\d+) \| (?P<percent>\d+\.\d) \|")


def kv_lockstep(*args, cwd: Path, python_prefix: str | None = None):
    """The CLI in a fresh process, as ``python -m`` runs it (the worker that
    --cover spawns re-imports that main module); ``python_prefix``, when
    given, runs first (to hide a package)."""
    if python_prefix is None:
        command = ["-m", "state_machines.cli"]
    else:
        command = ["-c", f"{python_prefix}\nimport sys\nfrom state_machines.cli import main\nsys.exit(main(sys.argv[1:]))"]
    return subprocess.run(
        [sys.executable, *command, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )


@pytest.fixture(scope="module")
def covered_run(tmp_path_factory):
    pytest.importorskip("coverage", reason="--cover needs coverage.py: pip install 'kv-lockstep[cover]'")
    tmp = tmp_path_factory.mktemp("cover")
    return kv_lockstep("fuzz", "--target", "builtin:paged", "--page-size", "4", "--cover", "--max-examples", "30",
                       "--seed", "0", "--trace-dir", str(tmp), cwd=tmp)


def table_rows(stdout: str) -> list[dict]:
    return [m.groupdict() for m in map(ROW.fullmatch, stdout.splitlines()) if m]


def test_cover_prints_one_row_per_file_of_allocators(covered_run):
    """A built-in target's table has one row per file of allocators/, in order, each imported one above 0%."""
    assert covered_run.returncode == 0, covered_run.stdout + covered_run.stderr
    rows = table_rows(covered_run.stdout)
    assert [r["name"] for r in rows] == [f"allocators/{p.name}" for p in sorted((REPO / "allocators").glob("*.py"))]
    paged = next(r for r in rows if r["name"] == "allocators/paged.py")
    # paged.py is what this run drives, its import-time lines and its methods.
    assert 0 < int(paged["executed"]) < int(paged["statements"])


def test_cover_total_is_the_sum_of_its_rows(covered_run):
    """The total row adds up the files' statements and executed statements."""
    lines = covered_run.stdout.splitlines()
    rows = table_rows(covered_run.stdout)
    statements = sum(int(r["statements"]) for r in rows)
    executed = sum(int(r["executed"]) for r in rows)
    assert lines[-1] == f"| **total** | {statements} | {executed} | {100 * executed / statements:.1f} |"
    assert lines[-len(rows) - 4].startswith("statement coverage of builtin:paged's allocator code under ")
    assert lines[-len(rows) - 3 : -len(rows) - 1] == ["| file | statements | executed | % |", "|---|---:|---:|---:|"]


def test_cover_without_coverage_installed_is_one_line_saying_how_to_install(tmp_path):
    """Without coverage.py, `fuzz --cover` exits 2 with one line naming the install command, before any run."""
    got = kv_lockstep("fuzz", "--cover", "--trace-dir", str(tmp_path), cwd=tmp_path,
                      python_prefix="import sys; sys.modules['coverage'] = None")
    assert got.returncode == 2, got.stdout + got.stderr
    assert got.stdout == ""
    assert got.stderr.splitlines() == [
        "kv-lockstep: error: --cover needs coverage.py, which is not installed: pip install 'kv-lockstep[cover]'"
        " (into this venv: .venv/bin/python -m pip install 'coverage>=7')"
    ]


def test_cover_counts_the_lines_run_at_import(covered_run):
    """The worker records from before it imports the target: allocators/__init__.py, all import-time code, is 100%."""
    init = next(r for r in table_rows(covered_run.stdout) if r["name"] == "allocators/__init__.py")
    assert int(init["statements"]) > 0
    assert init["executed"] == init["statements"]


def test_missed_ranges_name_each_file_and_the_statements_it_never_ran(tmp_path):
    """A file whose statements on lines 1 and 3 ran and 2, 4, 5 did not reads `name: 2, 4-5`; a file run whole is left out."""
    pytest.importorskip("coverage", reason="--cover needs coverage.py: pip install 'kv-lockstep[cover]'")
    from state_machines.runs.cover import missed_ranges, tally

    partly, wholly = tmp_path / "partly.py", tmp_path / "wholly.py"
    partly.write_text("a = 1\nb = 2\nc = 3\nd = 4\ne = 5\n")
    wholly.write_text("a = 1\n")
    rows = tally([partly, wholly], {str(partly): [1, 3], str(wholly): [1]}, tmp_path)
    assert missed_ranges(rows) == "partly.py: 2, 4-5"


def test_lines_json_keeps_each_kinds_lines_apart(tmp_path):
    """`cover --lines-json` writes one entry per kind run, whose lines union to the table's total."""
    pytest.importorskip("coverage", reason="--cover needs coverage.py: pip install 'kv-lockstep[cover]'")
    import io
    import json

    from state_machines.runs.cover import cover_release, newest_release, tally
    from state_machines.targets import sglang

    release = newest_release()
    if release is None:
        pytest.skip("no sglang release under .sglang/ (make sglang V=...)")
    out, path = io.StringIO(), tmp_path / "lines.json"
    cover_release(release.resolve(), max_examples=5, seed=0, trace_dir=str(tmp_path), out=out, kinds="token,mamba",
                  lines_json=str(path))
    per_kind = json.loads(path.read_text())
    assert set(per_kind) == {"token:1", "mamba:1"}
    merged: dict[str, set[int]] = {}
    for lines in per_kind.values():
        for f, got in lines.items():
            merged.setdefault(f, set()).update(got)
    rows = tally(sglang.release_files(str(release.resolve())), {f: sorted(v) for f, v in merged.items()}, release.resolve())
    total = sum(r.executed for r in rows)
    assert f"| **total** | {sum(r.statements for r in rows)} | {total} |" in out.getvalue()


AS_ROOT = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                             reason="elsewhere os.access refuses it first (cannot write in /proc, /dev)")


@pytest.mark.parametrize("args, said", [
    (["--kinds", "bogus"], "--kinds: no kind 'bogus': give KIND or KIND:PAGE_SIZE among token:1, "),
    (["--kinds", "token:4"], "--kinds: no kind 'token:4'"),
    (["--max-examples", "0"], "--max-examples 0: give at least 1"),
    (["--lines-json", "/nonexistent-kvl/x.json"], "--lines-json /nonexistent-kvl/x.json: folder /nonexistent-kvl does not exist"),
    (["--lines-json", "/tmp"], "--lines-json /tmp is a folder, not a file"),
    # os.access says yes to root there: the probe write says no (fuzz's --stats-json check, which it shares).
    pytest.param(["--lines-json", "/proc/kvl.json"], "--lines-json /proc/kvl.json: cannot write there: ", marks=AS_ROOT),
    pytest.param(["--lines-json", "/dev/null"], "--lines-json /dev/null is a device, not a plain file", marks=AS_ROOT),
    # As any user: what is there is not a plain file (helper-82).
    (["--lines-json", "FIFO"], "--lines-json FIFO is a FIFO, not a plain file"),
])
def test_the_coverage_runs_bad_input_is_one_line_before_any_run(args, said, capsys, tmp_path, monkeypatch):
    """A mistyped kind ran nothing and printed an all-zero table, exit 0; no
    examples printed 'exit 1' per kind, exit 0; an unwritable --lines-json
    was a traceback after the whole run (25 minutes)."""
    pytest.importorskip("coverage", reason="--cover needs coverage.py: pip install 'kv-lockstep[cover]'")
    from state_machines.runs.cover import main

    monkeypatch.chdir(tmp_path)
    if "FIFO" in args:
        os.mkfifo("FIFO")
    assert main(["--sglang-path", "/nonexistent-kvl", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"kv-lockstep: error: {said}") and err.count("\n") == 1, err


def test_a_kind_that_fails_makes_the_coverage_run_fail_and_names_its_trace(tmp_path, monkeypatch):
    """A failing kind printed its FAILED line and the table, and the run
    exited 0 with the trace written where no line said."""
    pytest.importorskip("coverage", reason="--cover needs coverage.py: pip install 'kv-lockstep[cover]'")
    import io

    from state_machines.runs import cover, watchdog
    from state_machines.targets import sglang

    def fails(config, out, err, **kwargs):
        print("FAILED: free_sets_agree\n  trace: t/x.json\n  replay: kv-lockstep replay t/x.json", file=out)
        return 1

    monkeypatch.setattr(watchdog, "fuzz_watched", fails)
    monkeypatch.setattr(sglang, "release_files", lambda release: [])
    out = io.StringIO()
    assert cover.cover_release(tmp_path, max_examples=5, seed=0, trace_dir=str(tmp_path), out=out, kinds="token") == 1
    text = out.getvalue()
    assert "sglang:token page_size=1" in text and "    trace: t/x.json\n" in text, text
    assert text.rstrip().endswith(f"FAILED: sglang:token page_size=1 sglang={tmp_path.name}"
                                  " (a failure on a release is a finding: its trace above)"), text


def test_a_caller_runs_table_says_it_counts_the_caches_code_too(tmp_path):
    """With --caller, the release's cache and scheduler-helper files are
    counted beside its allocator's: the heading named the allocator's code
    alone (helper-79)."""
    from state_machines.config import Config
    from state_machines.runs import cover

    allocator = tmp_path / "sglang" / "srt" / "mem_cache" / "allocator.py"
    files = [allocator, allocator.with_name("radix_cache.py"), allocator.with_name("common.py")]
    said = cover.heading(Config(target="sglang:token", caller="radix"), files)
    assert said == (f"statement coverage of sglang:token's allocator code and of the release's caches and scheduler"
                    f" helpers that drive it, under {tmp_path} (3 files; a file never imported counts at 0%):")
    assert cover.heading(Config(target="builtin:paged"), files[:1]) == (
        f"statement coverage of builtin:paged's allocator code under {cover.REPO_ROOT} (1 file;"
        " a file never imported counts at 0%):")


def test_a_custom_class_is_measured_with_the_code_it_inherits_under_its_own_folder(tmp_path, monkeypatch):
    """``--cover`` on an empty subclass of TokenAllocator counted its own
    file alone (the code that ran is allocators/token.py and base.py), and
    the heading said "under" this repository, not the target's folder
    (helper-90).  Read without coverage.py: the files and the folder."""
    from state_machines.config import Config
    from state_machines.runs.cover import measured_files, root_of

    (tmp_path / "plain_pool.py").write_text("from allocators.token import TokenAllocator\n\nclass Plain(TokenAllocator):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = Config(target="plain_pool:Plain")
    files = measured_files(config)
    assert files == [tmp_path.resolve() / "plain_pool.py", REPO / "allocators" / "token.py", REPO / "allocators" / "base.py"]
    assert root_of(config, files) == tmp_path.resolve()
