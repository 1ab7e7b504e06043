"""Long runs: workers, progress, coverage, Ctrl-C, a shared example database,
and reproducers a developer can commit."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import attrs
import pytest

from state_machines.config import Config
from state_machines.harness import Step
from state_machines.runs.coverage import INTERLEAVINGS
from state_machines.runs.options import BadOption, parse_duration
from state_machines.runs.trace import Trace

REPO = Path(__file__).resolve().parent.parent
PAGED_ALIAS = ["--target", "builtin:paged", "--mutant", "alias", "--page-size", "4"]


def cli(*args, cwd, **kw):
    return subprocess.run([sys.executable, "-m", "state_machines.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300, **kw)


def test_durations_read_like_a_person_writes_them():
    """20s, 10m, 2h and plain seconds parse; nonsense is bad input."""
    assert [parse_duration(t) for t in ("20s", "10m", "2h", "1.5h", "90")] == [20, 600, 7200, 5400, 90]
    for bad in ("soon", "-5s", "0", "10d"):
        with pytest.raises(BadOption):
            parse_duration(bad)


@pytest.mark.parametrize("args, message", [
    (["--duration", "soon"], "--duration"),
    (["-j", "2"], "-j goes with --duration"),
    (["--stats-json", "s.json"], "--stats-json goes with --duration"),  # it named -j too, which was not given (helper-90)
    (["-j", "2", "--stats-json", "s.json"], "-j and --stats-json go with --duration"),
    (["--duration", "5s", "--db", "redis://127.0.0.1:1"], "redis"),
    (["--duration", "2s", "--max-examples", "20"], "--duration and --max-examples are two budgets: give one"),
    (["--duration", "2s", "-j", "100000"], "-j 100000: at most"),
])
def test_bad_long_run_options_are_one_line_and_exit_2(args, message, tmp_path):
    """A bad duration, -j without --duration, or an unusable Redis URL: one line, exit 2."""
    run = cli("fuzz", *args, cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.count("\n") == 1 and message in run.stderr and "Traceback" not in run.stderr


def test_the_progress_line_says_starting_only_while_workers_start():
    """A failure replayed from the database is found before any worker's
    figures arrive: the line after its 'found' said 'starting 2 worker(s)';
    after a refused start, 'starting 0 worker(s)'."""
    from state_machines.runs.coverage import merge
    from state_machines.runs.longrun import _progress_line

    none = merge([])
    assert _progress_line(0, 5, none, 0, 2) == "[    0s/5s] starting 2 worker(s)"
    assert _progress_line(0, 5, none, 1, 2) == "[    0s/5s] 1 failure(s), 2 worker(s)"
    assert _progress_line(0, 5, none, 0, 0) == "[    0s/5s] 0 failure(s), 0 worker(s)"


def test_a_run_stopped_before_any_worker_reported_says_nothing_was_counted():
    """Ctrl-C while the workers still start: the summary's table listed every
    interleaving n/a, "(needs ?)", as if the target could not reach them."""
    import io

    from state_machines.runs.coverage import merge
    from state_machines.runs.longrun import _summary

    out = io.StringIO()
    _summary(out, Config(), 2, 1.5, merge([]), [], [], [], True, signum=signal.SIGINT, fuzzing_s=0.0)
    assert out.getvalue().splitlines()[1:] == [
        "summary: builtin:token page_size=1, 2 worker(s), 1.5 s, interrupted (SIGINT)",
        "  0 examples, 0 steps, 0 failure(s)",
        "  nothing counted: no worker reported what it ran before the stop",
    ]


def test_the_interleaving_counts_line_up():
    """extend_continues_partial_page ran into its count column."""
    from state_machines.runs.coverage import INTERLEAVINGS, merge, summary_table

    total = merge([{"examples": 1, "steps": 1, "checks": 1, "rules": {"alloc": {"ran": 1, "blocked": 0}},
                    "interleavings": {i.name: 0 for i in INTERLEAVINGS[::2]}}])
    rows = summary_table(total, Config()).splitlines()
    start = next(i for i, row in enumerate(rows) if row.lstrip().startswith("interleaving"))
    ends = {re.match(r" +\S+ +\S+", row).end() for row in rows[start:start + 1 + len(INTERLEAVINGS)]}
    assert len(ends) == 1, rows  # each count ends in one column, the header's "count" too


def _open_files(soft: int, hard: int):
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_workers_past_the_open_file_limit_are_one_line_and_exit_2(tmp_path):
    """Each worker holds open files in the command (its pipe, its process):
    under `ulimit -n 40`, -j 8 was a traceback (OSError: Too many open
    files, from a worker's start) or an EOFError from the server workers
    fork from.  Where the hard limit allows, the soft one is raised and
    the run goes ahead."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    run = cli("fuzz", "--duration", "1", "-j", "8", "--db", "none", cwd=tmp_path, preexec_fn=_open_files(40, 40))
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.startswith("kv-lockstep: error: -j 8 needs about ") and run.stderr.count("\n") == 1, run.stderr
    assert "(ulimit -n)" in run.stderr and "kv-lockstep fuzz:" not in run.stdout
    if hard == resource.RLIM_INFINITY or hard >= 256:
        run = cli("fuzz", "--duration", "1", "-j", "8", "--db", "none", cwd=tmp_path, preexec_fn=_open_files(40, hard))
        assert (run.returncode, run.stderr) == (0, ""), run.stdout + run.stderr
        assert "8 worker(s)" in run.stdout


def test_a_worker_that_cannot_start_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """A fork refused part-way through the workers' starts (EAGAIN: the
    process limit; ENOMEM) ends the workers already started and the run,
    one line, exit 2; it was a traceback with the started workers left to
    the interpreter's exit."""
    import io

    from state_machines.runs import longrun, watchdog

    started = []
    real = watchdog.start_blocked

    def start(process):
        if len(started) == 2:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        real(process)
        started.append(process)

    monkeypatch.setattr(watchdog, "start_blocked", start)
    out, err = io.StringIO(), io.StringIO()
    code = longrun.run(Config(target="builtin:token"), duration_s=30, jobs=4, db_spec=None, seed=0,
                       trace_dir=str(tmp_path / "traces"), stats_json=None, out=out, err=err)
    assert code == 2, out.getvalue() + err.getvalue()
    assert err.getvalue() == ("kv-lockstep: error: -j 4: worker 2 could not start (Resource temporarily unavailable):"
                              " give fewer workers\n")
    assert len(started) == 2 and not any(p.is_alive() for p in started)


def test_timed_run_ends_clean_with_progress_and_coverage(tmp_path):
    """A clean target runs until time is up, exit 0, with progress lines, a
    summary table and the same figures in --stats-json; every applicable
    interleaving it never reached is named, and only those."""
    stats = tmp_path / "stats.json"
    run = cli("fuzz", "--target", "builtin:paged", "--page-size", "4", "--duration", "3s", "-j", "2",
              "--stats-json", str(stats), "--trace-dir", str(tmp_path / "traces"), cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "kv-lockstep fuzz: builtin:paged page_size=4, 2 worker(s) for 3 s, no database"
    assert any(re.fullmatch(r"\[ *\d+s/3s\] .+", line) for line in lines), run.stdout
    assert any(re.fullmatch(r"summary: builtin:paged page_size=4, 2 worker\(s\), [\d.]+ s, time is up", line)
               for line in lines), run.stdout
    # The rate is of the fuzzing, which the workers' start does not count in.
    counted = [re.fullmatch(r"  [\d,]+ examples, [\d,]+ steps in ([\d.]+) s of fuzzing \([\d,]+/s\), 0 failure\(s\)", line)
               for line in lines]
    fuzzing_s = [float(m.group(1)) for m in counted if m]
    elapsed_s = [float(m.group(1)) for m in (re.search(r"worker\(s\), ([\d.]+) s, time is up", line) for line in lines) if m]
    assert len(fuzzing_s) == 1 and 2.9 <= fuzzing_s[0] <= elapsed_s[0], run.stdout
    data = json.loads(stats.read_text())
    assert data["jobs"] == 2 and data["failures"] == [] and data["examples"] > 0
    assert {"alloc", "begin", "end", "free", "rematch"} <= set(data["rules"])
    assert all({"ran", "blocked", "disabled"} == set(c) for c in data["rules"].values())
    # A rule the probe disabled says so and why, in both: not "blocked 100%" of the checks.
    said = dict(re.findall(r"^rule (\w+) disabled for builtin:paged: (.+)$", run.stdout, re.M))
    assert "offload" in said, run.stdout
    assert {rule for rule, c in data["rules"].items() if c["disabled"]} == set(said)
    for rule, why in said.items():
        assert data["rules"][rule] == {"ran": 0, "blocked": 0, "disabled": why}
        assert re.search(rf"^  {rule} +disabled  \({re.escape(why)}\)$", run.stdout, re.M), run.stdout
    # Examples draw need_sort on too (builtin:paged takes it): the merge order applies.
    config = Config(target="builtin:paged", page_size=4)
    applicable = [i.name for i in INTERLEAVINGS if i.applies_to(attrs.evolve(config, need_sort=True))]
    assert "alloc_merged_release" in applicable
    assert {name: c["applicable"] for name, c in data["interleavings"].items()} == {
        i.name: i.name in applicable for i in INTERLEAVINGS
    }
    counts = {name: data["interleavings"][name]["count"] for name in applicable}
    assert all(isinstance(count, int) and count >= 0 for count in counts.values()), counts
    unreached = sorted(name for name, count in counts.items() if count == 0)
    assert sorted(data["never_reached"]) == unreached
    named = [re.fullmatch(r"  NEVER REACHED: (.+) \(this run proves nothing about them\)", line)
             for line in lines if "NEVER REACHED" in line]
    assert [sorted(m.group(1).split(", ")) for m in named] == ([unreached] if unreached else []), run.stdout


SLOW_START = textwrap.dedent(
    """
    import os, time
    from allocators.token import TokenAllocator

    _STARTED = set()

    def make(size, page_size, device, need_sort):
        \"\"\"Correct; its first build in each process takes 3 s (a release's import, a device coming up).\"\"\"
        if os.getpid() not in _STARTED:
            _STARTED.add(os.getpid())
            time.sleep(3)
        return TokenAllocator(size, page_size, device, need_sort)
    """
)


def test_the_duration_counts_fuzzing_not_a_workers_start(tmp_path):
    """A worker that takes 3 s to build its target: --duration 1 ended
    before it was ready, with 0 examples and exit 0, a pass that checked
    nothing (an sglang caller's workers take ~10 s to start on 2 cores)."""
    (tmp_path / "kvl_slow.py").write_text(SLOW_START)
    stats = tmp_path / "stats.json"
    run = cli("fuzz", "--target", "kvl_slow:make", "--duration", "1", "-j", "1", "--stats-json", str(stats),
              "--trace-dir", str(tmp_path / "traces"), cwd=tmp_path, env=dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert json.loads(stats.read_text())["examples"] > 0, run.stdout


def test_an_order_applies_once_an_example_draws_the_shape_it_needs():
    """A run without --need-sort whose example draws need_sort on counts the
    merge order there, rather than calling it n/a (needs --need-sort)."""
    from state_machines.harness import build
    from state_machines.runs.coverage import Coverage

    config = Config(target="builtin:paged", page_size=4)
    coverage = Coverage(config, use_hypothesis=False)
    coverage._new_example(build(config))
    assert "alloc_merged_release" not in coverage.applicable
    coverage._new_example(build(attrs.evolve(config, need_sort=True)))
    assert coverage.applicable == [i.name for i in INTERLEAVINGS if i.name in coverage.applicable]
    assert "alloc_merged_release" in coverage.applicable


def test_ctrl_c_keeps_the_trace_and_the_next_run_replays_it_first(tmp_path):
    """SIGINT while a failure shrinks: exit 130, no traceback, the unshrunk
    trace replays; a second run on the same --db fails on its first example,
    exit 1, with a shrunk trace."""
    db, traces = tmp_path / "db", tmp_path / "traces"
    proc = subprocess.Popen(
        [sys.executable, "-m", "state_machines.cli", "fuzz", *PAGED_ALIAS, "--duration", "5m", "-j", "2",
         "--db", str(db), "--trace-dir", str(traces)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("found "):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    out = "".join(lines) + out
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and "interrupted" in out
    kept = list((traces / "unshrunk").glob("*.json"))
    assert kept, out
    assert cli("replay", str(kept[0]), cwd=tmp_path).returncode == 1
    assert any(db.iterdir()), "the failure was not saved to the example database"

    stats = tmp_path / "again.json"
    again = cli("fuzz", *PAGED_ALIAS, "--duration", "5m", "-j", "2", "--db", str(db),
                "--trace-dir", str(traces), "--stats-json", str(stats), cwd=tmp_path)
    assert again.returncode == 1, again.stdout + again.stderr
    data = json.loads(stats.read_text())
    assert data["first_failure_after_examples"] == 1
    shrunk = data["failures"][0]
    assert shrunk["shrunk"] and Trace.load(shrunk["trace"]).invariant == shrunk["invariant"]
    assert "stopped at a failure" in again.stdout


def test_database_key_is_stable_across_processes_and_distinct_across_configs():
    """Hypothesis keys the database by the machine's digest: the same in a
    fresh process, different for another configuration."""
    from hypothesis.internal.reflection import function_digest

    from state_machines.harness import machine_for

    code = ("from state_machines.config import Config; from state_machines.harness import machine_for;"
            "from hypothesis.internal.reflection import function_digest;"
            "print(function_digest(machine_for(Config(target='builtin:paged', page_size=4))).hex())")
    there = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    here = function_digest(machine_for(Config(target="builtin:paged", page_size=4))).hex()
    assert there.stdout.strip() == here
    other = function_digest(machine_for(Config(target="builtin:paged", page_size=4, mutant="alias"))).hex()
    assert other != here


@pytest.fixture
def redis_url(tmp_path):
    """A redis-server on loopback, started and stopped here."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("no redis-server binary (apt-get install redis-server)")
    pytest.importorskip("redis", reason="the redis package is missing (pip install 'kv-lockstep[redis]')")
    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)


def test_a_failure_in_redis_is_replayed_first_by_the_next_run(redis_url, tmp_path):
    """Two runs share a Redis database: the second fails on its first example."""
    args = ["fuzz", "--target", "builtin:token", "--mutant", "flag-drift", "--db", redis_url,
            "--trace-dir", str(tmp_path)]
    first = cli(*args, cwd=tmp_path)
    assert first.returncode == 1, first.stdout + first.stderr
    again = cli(*args, cwd=tmp_path)
    assert again.returncode == 1, again.stdout + again.stderr
    assert "(1 example)" in again.stdout, again.stdout


def test_emitted_pytest_fails_on_the_bug_and_passes_on_the_fix(tmp_path):
    """replay --emit-pytest writes valid Python that fails on the mutant and
    passes on the target without it."""
    steps = (Step("alloc", {"n": 4}, "req_0"), Step("begin", {}), Step("free", {"req": "req_0", "n": 4}),
             Step("overwrite_row", {"row": 0}), Step("end", {}))
    trace = Trace(Config(target="builtin:paged", mutant="alias", page_size=4), steps, "free_sets_agree", "recorded")
    path = tmp_path / "alias.json"
    path.write_text(trace.to_json())
    suite = tmp_path / "suite"
    suite.mkdir()  # --emit-pytest writes into an existing folder
    assert cli("replay", str(path), "--emit-pytest", str(suite / "test_bug.py"), cwd=tmp_path).returncode == 1
    assert cli("replay", str(path), "--target", "builtin:paged", "--emit-pytest", str(suite / "test_fixed.py"),
               cwd=tmp_path).returncode == 0
    text = (suite / "test_bug.py").read_text()
    assert "torch.tensor([" in text and "free_sets_agree" in text
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", str(suite)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert "1 failed, 1 passed" in run.stdout, run.stdout + run.stderr
    assert "FAILED suite/test_bug.py" in run.stdout and "free_sets_agree" in run.stdout


def test_the_header_names_a_database_folder_by_its_full_path(tmp_path):
    """The header said "database none" for a run with no --db, and the same
    for ``--db none``, which keeps the examples in a folder named none."""
    run = cli("fuzz", "--target", "builtin:token", "--duration", "1s", "-j", "1", "--db", "none",
              "--trace-dir", str(tmp_path / "traces"), cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines()[0].endswith(f", 1 worker(s) for 1 s, database folder {tmp_path / 'none'}"), run.stdout
    assert (tmp_path / "none").is_dir()
