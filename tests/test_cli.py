"""The command line as a user meets it: exit codes, messages, traces."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import allocators

REPO = Path(__file__).resolve().parent.parent


def kv_lockstep(*args, cwd, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "state_machines.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_mutant_run_fails_with_a_trace_that_replays(tmp_path):
    """fuzz exits 1 and names a trace; replay fails on the mutant and passes without it."""
    run = kv_lockstep("fuzz", "--target", "builtin:token", "--mutant", "flag-drift", "--seed", "1",
                      "--trace-dir", str(tmp_path), cwd=tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "kv-lockstep fuzz: builtin:token mutant=flag-drift page_size=1, up to 300 examples, seed 1"
    # Then the steps the built-in lacks (the scheduler hooks), each with its reason.
    rest = [line for line in lines[1:] if not line.startswith("rule ")]
    # Each failure's first example is written at once, before shrinking.
    assert re.fullmatch(r"found no_page_freed_twice \(example \d+\); shrinking it; unshrunk trace: "
                        r"\S+/unshrunk/builtin_token_mutant_flag-drift_page_size_1(_need_sort)?-no_page_freed_twice-[0-9a-f]{8}\.json", rest[0]), rest[0]
    failed = next(line for line in lines if line.startswith("FAILED"))
    assert re.fullmatch(r"FAILED: first failure after [\d.]+ s \((1 example|(?!1 )\d+ examples)\); \d distinct failure\(s\),"
                        r" shrunk in [\d.]+ s total", failed), failed
    assert any(re.fullmatch(r"failure \d: no_page_freed_twice", line) for line in lines), run.stdout
    assert "    state.end()  # fails: no_page_freed_twice" in lines
    # The name spells the configuration and invariant, then a hash of the failure.
    [path] = sorted(tmp_path.glob("*-no_page_freed_twice-*.json"))
    assert re.fullmatch(r"builtin_token_mutant_flag-drift_page_size_1-no_page_freed_twice-[0-9a-f]{8}\.json", path.name)
    assert f"  trace: {path}" in lines
    trace = json.loads(path.read_text())
    assert trace["failure"]["invariant"] == "no_page_freed_twice"
    steps = len(trace["steps"])
    again = kv_lockstep("replay", str(path), cwd=tmp_path)
    assert again.returncode == 1, again.stdout + again.stderr
    assert again.stdout.splitlines()[:2] == [
        f"kv-lockstep replay: {steps} steps of {path} on builtin:token mutant=flag-drift page_size=1",
        f"FAILED at step {steps - 1}, state.end(): no_page_freed_twice",
    ]
    fixed = kv_lockstep("replay", str(path), "--target", "builtin:token", cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert fixed.stdout.splitlines() == [
        f"kv-lockstep replay: {steps} steps of {path} on builtin:token page_size=1",
        f"trace passes: all {steps} steps and the teardown check out",
    ]


def test_version_names_what_a_bug_report_needs(tmp_path):
    run = kv_lockstep("--version", cwd=tmp_path)
    assert (run.returncode, run.stderr) == (0, ""), run.stdout + run.stderr
    assert re.fullmatch(r"kv-lockstep \d+\.\d+\.\d+ \(hypothesis \d\S*, torch \d\S*, Python 3\.\d+\.\d+\)\n", run.stdout), run.stdout


def _known(names) -> str:
    return ", ".join(sorted(names))


@pytest.mark.parametrize(
    "args, message",
    [
        (["fuzz", "--target", "nope"], "target 'nope' is not of the form builtin:NAME, sglang:NAME or MODULE:ATTR"),
        (["fuzz", "--target", "builtin:nope"],
         "unknown built-in target 'builtin:nope'; known: " + _known(f"builtin:{n}" for n in allocators.BUILTINS)),
        (["fuzz", "--mutant", "nope"],
         "unknown mutant 'nope' for builtin:token; known: " + _known(allocators.BUILTINS["token"][1])),
        (["fuzz", "--page-size", "0"], "argument --page-size: must be at least 1, got 0 (see `kv-lockstep fuzz --help`)"),
        (["fuzz", "--target", "no_such_module_xyz:make"],
         "cannot import target module 'no_such_module_xyz': ModuleNotFoundError: No module named 'no_such_module_xyz'"),
        # The command's own help, not the top one's (helper-90).
        (["fuzz", "--bogus"], "unrecognized arguments: --bogus (see `kv-lockstep fuzz --help`)"),
        (["replay", "missing.json"], "cannot read trace missing.json: No such file or directory"),
        # An empty --target ran the default target.
        (["fuzz", "--target", ""], "argument --target: is empty: give builtin:NAME, sglang:NAME or MODULE:ATTR"
                                   " (see `kv-lockstep fuzz --help`)"),
        # Runs whose traces replay refused: the run must refuse them first.
        (["fuzz", "--target", "builtin:paged", "--page-size", "2048"],
         "--page-size is 2048, outside 1..1024: beyond what a trace carries, so no failure found could be replayed"),
        # sglang builds whole pages; its size_full then disagreed with the model's pages (helper-87).
        (["fuzz", "--target", "builtin:paged", "--page-size", "4", "--size", "6"],
         "--size 6 is not a whole number of pages of 4 slots (--page-size): sglang builds its pools in whole pages;"
         " give a multiple of 4"),
        (["fuzz", "--target", "builtin:paged", "--page-size", "16", "--size", "8"],
         "--size 8 is not a whole number of pages of 16 slots (--page-size): sglang builds its pools in whole pages;"
         " give a multiple of 16"),
        (["fuzz", "--size", "4194305"],
         "--size is 4194305, outside 1..4194304: beyond what a trace carries, so no failure found could be replayed"),
        # It named the trace's field (config.caller), past the checks of the other options (helper-88).
        (["fuzz", "--caller", "nope"], "argument --caller: 'nope' is not harness, radix, unified, unified-swa, swa-radix"
                                       " or MODULE:ATTR (see `kv-lockstep fuzz --help`)"),
        # Hypothesis's database saves nothing there, without a word.
        (["fuzz", "--db", "/proc/kv-lockstep-db"], "--db /proc/kv-lockstep-db: cannot write there: No such file or directory"),
        # Path("") is the current folder: traces went there without a word (helper-88).
        (["fuzz", "--trace-dir", ""], "--trace-dir is empty: give a folder (created if missing)"),
        (["fuzz", "--stats-json", " ", "--duration", "1"], "--stats-json is empty: give a file"),
        # Each was taken without a word (helper-80): a built-in target's run named the release in its header,
        # its trace's name and replay's hint; the listing of every target ignored the flags.
        (["fuzz", "--target", "builtin:token", "--sglang-path", "."],
         "--sglang-path goes with an sglang: target, a MODULE:ATTR one or --caller: builtin:token runs no sglang code"),
        (["targets", "--target", "builtin:token", "--sglang-path", "."],
         "--sglang-path goes with an sglang: target, a MODULE:ATTR one or --caller: builtin:token runs no sglang code"),
        (["targets", "--mutant", "alias"], "--mutant goes with --target"),
        (["targets", "--page-size", "4"], "--page-size goes with --target or --sglang-path"),
        (["targets", "--need-sort", "--row-dtype", "int64"], "--need-sort and --row-dtype go with --target or --sglang-path"),
        # An import error of a module 'BUILTIN' (helper-80).
        (["fuzz", "--target", "BUILTIN:TOKEN"], "target 'BUILTIN:TOKEN': kinds are lower case: did you mean builtin:token?"),
        # argparse takes a value that begins with '-' for an option: its message alone hid why (helper-80).
        (["fuzz", "--trace-dir", "-traces"], "argument --trace-dir: expected one argument; '-traces' was taken for an"
                                             " option: write --trace-dir=-traces (see `kv-lockstep fuzz --help`)"),
        (["fuzz", "--trace", "-traces"], "argument --trace-dir: expected one argument; '-traces' was taken for an"
                                         " option: write --trace-dir=-traces (see `kv-lockstep fuzz --help`)"),
        (["fuzz", "--duration", "--seed", "1"], "argument --duration: expected one argument (see `kv-lockstep fuzz --help`)"),
        # One of the command's own options: the value was left out, and --duration=-j would be no help.
        (["fuzz", "--duration", "-j", "2"], "argument --duration: expected one argument (see `kv-lockstep fuzz --help`)"),
    ],
    ids=["target-form", "builtin", "mutant", "page-size", "import", "argument", "trace-missing", "target-empty",
         "page-size-past-a-trace", "size-not-whole-pages", "size-under-a-page", "size-past-a-trace", "caller-unknown", "db-unwritable", "trace-dir-empty", "stats-json-empty", "sglang-path-with-builtin",
         "targets-sglang-path-with-builtin",
         "targets-mutant-alone", "targets-page-size-alone", "targets-need-sort-alone", "kind-miscased",
         "value-like-an-option", "value-like-an-option-abbreviated", "value-forgotten", "value-forgotten-before-an-option"],
)
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
    """Bad input gets one line on stderr, no traceback, nothing on stdout, exit code 2."""
    run = kv_lockstep(*args, cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert (run.stdout, run.stderr) == ("", f"kv-lockstep: error: {message}\n")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--target", "builtin:paged", "--mutant", "nope"], "unknown mutant 'nope' for builtin:paged"),
        (["--target", "sglang:token", "--sglang-path", "no_such_folder"], "--sglang-path no_such_folder is not a directory"),
        (["--mutant", "alias", "--target", "sglang:token", "--sglang-path", "."], "--mutant applies to builtin targets only"),
        # It went into the header and an emitted file (helper-82).
        (["--sglang-path", "."], "--sglang-path goes with an sglang: target, a MODULE:ATTR one or --caller:"
                                 " builtin:token runs no sglang code"),
    ],
    ids=["mutant", "sglang-path", "mutant-of-sglang", "sglang-path-with-builtin"],
)
def test_replay_bad_input_prints_nothing_on_stdout(extra, message, tmp_path):
    """replay refuses what the command line gets wrong before its header, as fuzz does: one line, exit 2."""
    from state_machines.config import Config
    from state_machines.harness import Step
    from state_machines.runs.trace import Trace

    path = tmp_path / "trace.json"
    path.write_text(Trace(Config(), (Step("begin", {}), Step("end", {}))).to_json())
    run = kv_lockstep("replay", str(path), *extra, cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stdout == ""
    assert run.stderr.startswith("kv-lockstep: error: ") and run.stderr.count("\n") == 1, run.stderr
    assert message in run.stderr, run.stderr


def test_unreadable_trace_is_exit_2(tmp_path):
    """A file that is not a trace is bad input: one line naming the file and the parse error."""
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    run = kv_lockstep("replay", str(bad), cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert re.fullmatch(rf"kv-lockstep: error: cannot read trace {re.escape(str(bad))}: not JSON: [^\n]+\n",
                        run.stderr), run.stderr


# An allocator written outside the repo: its free list is a Python set popped
# in hash order and it dedups nothing the harness would notice, so only a
# harness that predicts sets, never order, lets it pass.
CUSTOM = textwrap.dedent(
    '''
    import torch

    class ShuffledPool:
        def __init__(self, size, page_size, device, need_sort):
            self.page_size = page_size
            self.free_set = set(range(1, size // page_size + 1))
            self.queue = None
            self.device = device

        def alloc(self, n):
            k = n // self.page_size
            if k > len(self.free_set):
                return None
            pages = sorted(self.free_set, key=lambda p: (p * 7919) % 31)[:k]
            self.free_set -= set(pages)
            t = torch.tensor(pages, dtype=torch.int64)
            return (t[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

        def free(self, index):
            if self.queue is not None:
                self.queue.append(index.clone())
                return
            self.free_set |= set((index // self.page_size).tolist())

        def free_group_begin(self):
            self.queue = []

        def free_group_end(self):
            queue, self.queue = self.queue, None
            for index in queue or ():
                self.free(index)

        def available_size(self):
            return len(self.free_set) * self.page_size

        def get_all_free_pages(self):
            return torch.tensor(sorted(self.free_set, reverse=True), dtype=torch.int64)

    def make(size, page_size, device, need_sort):
        return ShuffledPool(size, page_size, device, need_sort)
    '''
)


@pytest.mark.parametrize("page_size", [1, 4])
def test_custom_target_outside_the_repo_has_no_false_alarm(tmp_path, page_size):
    """A correct allocator with its own free-list order passes, found through PYTHONPATH."""
    (tmp_path / "my_pool.py").write_text(CUSTOM)
    run = kv_lockstep(
        "fuzz", "--target", "my_pool:make", "--page-size", str(page_size), "--seed", "1", "--max-examples", "150",
        cwd=tmp_path, env_extra={"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == f"kv-lockstep fuzz: my_pool:make page_size={page_size}, up to 150 examples, seed 1"
    assert re.fullmatch(r"no failure: \d+ examples, \d+ steps in [\d.]+ s", lines[-1]), lines[-1]


def test_printed_replay_commands_run_the_trace(tmp_path):
    """Each `replay:` line a run prints is a command that replays its trace,
    as printed, from another folder: a custom target, which replay never
    imports from a trace, is named again, with the run's PYTHONPATH, each
    folder in full (helper-80, helper-83)."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "my_mutant.py").write_text("from allocators.token import FlagDriftTokenAllocator as Mine\n")
    run = kv_lockstep("fuzz", "--target", "my_mutant:Mine", "--seed", "0", "--max-examples", "50",
                      "--trace-dir", str(tmp_path / "traces"), cwd=tmp_path,
                      env_extra={"PYTHONPATH": f"mods{os.pathsep}{REPO}"})
    assert run.returncode == 1, run.stdout + run.stderr
    commands = [line.removeprefix("  replay: ") for line in run.stdout.splitlines() if line.startswith("  replay: ")]
    assert commands, run.stdout
    (tmp_path / "elsewhere").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    for command in commands:
        assert command.startswith(f"PYTHONPATH={tmp_path / 'mods'}{os.pathsep}{REPO} kv-lockstep replay "), command
        again = subprocess.run(["bash", "-c", command], cwd=tmp_path / "elsewhere", env=env,
                               capture_output=True, text=True, timeout=300)
        assert again.returncode == 1, command + "\n" + again.stdout + again.stderr


def test_replay_command_passes_what_replay_will_not_read_from_a_trace(monkeypatch):
    """An --sglang-path and a custom cache class come back on the command line, quoted for a shell,
    and so does the PYTHONPATH a custom target or cache class was imported through."""
    from state_machines.config import Config
    from state_machines.runs.trace import replay_command

    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert replay_command("t.json", Config(target="m:make")) == "kv-lockstep replay t.json --target m:make"
    assert replay_command("t.json", Config()) == "kv-lockstep replay t.json"
    assert replay_command("t.json", Config(target="sglang:token", sglang_path="my src/python")) == (
        "kv-lockstep replay t.json --sglang-path 'my src/python'"
    )
    assert replay_command("a b.json", Config(target="sglang:token", sglang_path="p", caller="mod:Cache")) == (
        "kv-lockstep replay 'a b.json' --caller mod:Cache --sglang-path p"
    )
    monkeypatch.setenv("PYTHONPATH", "/my mods")
    assert replay_command("t.json", Config(target="sglang:token")) == "kv-lockstep replay t.json"
    assert replay_command("t.json", Config(target="m:make")) == "PYTHONPATH='/my mods' kv-lockstep replay t.json --target m:make"
    assert replay_command("t.json", Config(target="sglang:token", sglang_path="p", caller="mod:Cache")) == (
        "PYTHONPATH='/my mods' kv-lockstep replay t.json --caller mod:Cache --sglang-path p"
    )
    # Relative folders, and an empty entry (the current folder), in full.
    monkeypatch.setenv("PYTHONPATH", f"mods{os.pathsep}")
    assert replay_command("t.json", Config(target="m:make")) == (
        f"PYTHONPATH={os.path.abspath('mods')}{os.pathsep}{os.getcwd()} kv-lockstep replay t.json --target m:make"
    )


def test_targets_lists_every_mutant(tmp_path):
    """`targets` lists each built-in target once, each with exactly its own mutants."""
    run = kv_lockstep("targets", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    listed: dict[str, list[str]] = {}
    for line in run.stdout.splitlines():
        if line.startswith("  builtin:"):
            current = listed.setdefault(line.split()[0], [])
        elif line.startswith("      --mutant "):
            current.append(line.split()[1])
    assert listed == {f"builtin:{name}": list(mutants) for name, (_, mutants) in sorted(allocators.BUILTINS.items())}


def test_targets_describes_each_builtin_in_a_whole_sentence(tmp_path):
    """Each built-in's line ends its sentence (a docstring's first line may stop
    mid-sentence) and shows no reST markup."""
    run = kv_lockstep("targets", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("  builtin:")]
    assert len(lines) == len(allocators.BUILTINS)
    for line in lines:
        name, summary = line.split(maxsplit=1)
        assert summary.endswith(".") and "``" not in summary, line


# A pool whose available_size() counts one slot more than its free list
# holds: the fresh allocator already disagrees with its own census.
LIAR = textwrap.dedent(
    '''
    from allocators import TokenAllocator

    class Liar(TokenAllocator):
        def available_size(self):
            return super().available_size() + 1
    '''
)


@pytest.mark.parametrize("extra", [[], ["--duration", "5s", "-j", "1"]], ids=["max-examples", "duration"])
def test_target_broken_before_any_step_fails_with_exit_1_and_no_traceback(tmp_path, extra):
    """A target whose fresh census disagrees: exit 1, 'FAILED before any step' naming the invariant, no traceback."""
    (tmp_path / "liar.py").write_text(LIAR)
    run = kv_lockstep("fuzz", "--target", "liar:Liar", *extra, "--trace-dir", str(tmp_path), cwd=tmp_path,
                      env_extra={"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"})
    assert run.returncode == 1, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    # A long run prints its header and a progress line first.
    failed = [line for line in lines if line.startswith("FAILED")]
    assert failed == ["FAILED before any step: available_size_agrees"], run.stdout
    assert lines[lines.index(failed[0]) + 1] == "    available_size() 11 / census 10 pages x 1 = 10"
    assert run.stderr == ""


def test_replay_on_a_target_broken_before_any_step_fails_at_the_build(tmp_path):
    """replay onto a target whose fresh census disagrees: exit 1, 'FAILED at building the target'."""
    from state_machines.config import Config
    from state_machines.harness import Step
    from state_machines.runs.trace import Trace

    (tmp_path / "liar.py").write_text(LIAR)
    path = tmp_path / "trace.json"
    path.write_text(Trace(Config(), (Step("begin", {}), Step("end", {}))).to_json())
    run = kv_lockstep("replay", str(path), "--target", "liar:Liar", cwd=tmp_path,
                      env_extra={"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"})
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stdout.splitlines()[:2] == [
        f"kv-lockstep replay: 2 steps of {path} on liar:Liar page_size=1",
        "FAILED at building the target: available_size_agrees",
    ]
    assert run.stderr == ""


def test_ctrl_c_during_a_run_exits_130_without_a_traceback(tmp_path):
    """SIGINT during a plain fuzz run: exit 130, 'kv-lockstep: interrupted (SIGINT)' last, no traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "state_machines.cli", "fuzz", "--max-examples", "100000", "--seed", "0",
         "--trace-dir", str(tmp_path)],
        cwd=tmp_path, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        first = proc.stdout.readline()
        assert first == "kv-lockstep fuzz: builtin:token page_size=1, up to 100000 examples, seed 0\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, first + out + err
    assert out.splitlines()[-1] == "kv-lockstep: interrupted (SIGINT)"
    assert err == ""


def test_replay_says_where_its_failure_is_not_the_one_the_trace_recorded(tmp_path):
    """A trace edited by hand, or replayed on another target or mutant, can
    fail otherwise than it recorded: replay printed its own failure and
    nothing of the recorded one (helper-80)."""
    run = kv_lockstep("fuzz", "--target", "builtin:token", "--mutant", "flag-drift", "--seed", "1",
                      "--trace-dir", str(tmp_path), cwd=tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    [path] = sorted(tmp_path.glob("*-no_page_freed_twice-*.json"))
    same = kv_lockstep("replay", str(path), cwd=tmp_path)
    assert same.returncode == 1 and "not the failure" not in same.stdout, same.stdout
    trace = json.loads(path.read_text())
    trace["failure"]["invariant"] = "free_sets_agree"
    path.write_text(json.dumps(trace))
    other = kv_lockstep("replay", str(path), cwd=tmp_path)
    assert other.returncode == 1, other.stdout + other.stderr
    last = len(trace["steps"]) - 1
    assert other.stdout.splitlines()[-1] == (f"  (not the failure the trace recorded: free_sets_agree at step {last};"
                                             f" this replay broke no_page_freed_twice at step {last})")


def test_the_help_reads_as_text(tmp_path):
    """The top-level --help showed the docstring's reST: ``kv-lockstep``: ... (helper-80)."""
    run = kv_lockstep("--help", cwd=tmp_path)
    assert run.returncode == 0 and "\nkv-lockstep: fuzz a target, replay a trace, list targets.\n" in run.stdout, run.stdout


def test_one_step_is_a_step(tmp_path):
    """'1 steps' in replay's header and verdict (helper-80)."""
    from state_machines.config import Config
    from state_machines.harness import Step
    from state_machines.runs.trace import Trace, write

    path = write(Trace(Config(target="builtin:token"), (Step("alloc", {"n": 1}, "req_0"),)), tmp_path)
    run = kv_lockstep("replay", str(path), cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines() == [f"kv-lockstep replay: 1 step of {path} on builtin:token page_size=1",
                                       "trace passes: all 1 step and the teardown check out"]


def test_a_trace_naming_a_miscased_kind_is_refused_as_such(tmp_path):
    """A trace's 'Sglang:token' was taken for a custom target, and replay
    advised passing --target Sglang:token, an import error (helper-80)."""
    from state_machines.config import Config
    from state_machines.harness import Step
    from state_machines.runs.trace import Trace

    data = json.loads(Trace(Config(), (Step("begin", {}), Step("end", {}))).to_json())
    data["config"]["target"] = "Sglang:token"
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(data))
    run = kv_lockstep("replay", str(path), cwd=tmp_path)
    assert (run.returncode, run.stdout) == (2, ""), run.stdout + run.stderr
    assert run.stderr == f"kv-lockstep: error: trace {path}: target 'Sglang:token': kinds are lower case: did you mean sglang:token?\n"
    # Given on the command line, it is the command line's.
    run = kv_lockstep("replay", str(path), "--target", "BUILTIN:TOKEN", cwd=tmp_path)
    assert run.stderr == "kv-lockstep: error: target 'BUILTIN:TOKEN': kinds are lower case: did you mean builtin:token?\n"


def test_a_mutant_on_a_traces_sglang_target_names_where_the_target_came_from(tmp_path):
    """``replay --mutant`` of a trace of sglang:paged said the mutant applies to
    builtin targets only, "not 'sglang:paged'": a target the user never typed (helper-88)."""
    from state_machines.config import Config
    from state_machines.harness import Step
    from state_machines.runs.trace import Trace

    path = tmp_path / "trace.json"
    path.write_text(Trace(Config(target="sglang:paged", page_size=4), (Step("begin", {}),)).to_json())
    run = kv_lockstep("replay", str(path), "--mutant", "alias", cwd=tmp_path)
    assert (run.returncode, run.stdout) == (2, ""), run.stdout + run.stderr
    assert run.stderr == (f"kv-lockstep: error: --mutant applies to builtin targets only, and trace {path} runs"
                          " sglang:paged: give --target builtin:NAME with it\n")


@pytest.mark.parametrize("family", ["swa", "unified", "page_interleave"])
def test_a_custom_target_that_says_a_family_it_is_not_is_bad_input(tmp_path, family):
    """A token pool with ``family = "swa"`` ended in a harness traceback (no
    full_attn_allocator); one saying "unified" failed at its first step, as
    if the allocator had raised (helper-90).  One line, exit 2; a subclass
    of a built-in of the family is one."""
    (tmp_path / "fams.py").write_text(textwrap.dedent(f"""
        from allocators.swa import SWAAllocator
        from allocators.token import TokenAllocator

        class Says(TokenAllocator):
            family = {family!r}

        class MySWA(SWAAllocator):
            pass
    """))
    run = kv_lockstep("fuzz", "--target", "fams:Says", "--max-examples", "5", cwd=tmp_path)
    assert (run.returncode, run.stdout) == (2, ""), run.stdout + run.stderr
    assert run.stderr.startswith(f"kv-lockstep: error: fams:Says says family {family!r}, but its Says is not one: that harness"
                                 " drives "), run.stderr
    assert run.stderr.count("\n") == 1
    if family == "swa":
        run = kv_lockstep("fuzz", "--target", "fams:MySWA", "--page-size", "4", "--max-examples", "5", "--seed", "0",
                          cwd=tmp_path)
        assert run.returncode == 0, run.stdout + run.stderr


def test_targets_describes_a_target_at_what_it_and_its_mutant_take(tmp_path):
    """``targets --target`` described at page size 1, which a page-size-4
    target refuses ("takes page size 2 or more, not 1": a 1 nobody typed), and a
    mutant needing --row-dtype int64 could not be described: targets took
    no --row-dtype (helper-90)."""
    run = kv_lockstep("targets", "--target", "builtin:page-interleave", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("builtin:page-interleave page_size=2: "), run.stdout
    run = kv_lockstep("targets", "--target", "builtin:dsv4-hisparse", "--mutant", "last-loc-floor", cwd=tmp_path)
    assert run.returncode == 0 and run.stdout.startswith("builtin:dsv4-hisparse mutant=last-loc-floor page_size=8: "), run.stdout + run.stderr
    run = kv_lockstep("targets", "--target", "builtin:multi-ended", "--mutant", "segment-view", "--row-dtype", "int64", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "rows=int64" in run.stdout.splitlines()[0], run.stdout


def test_a_module_of_the_users_named_builtin_is_its_own(tmp_path):
    """The mis-cased kind check refused a module of the user's named
    ``Builtin`` (or ``SGLang``): that name is the user's, and runs."""
    (tmp_path / "Builtin.py").write_text("from allocators.token import TokenAllocator as token\n")
    run = kv_lockstep("fuzz", "--target", "Builtin:token", "--max-examples", "3", "--seed", "0", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("kv-lockstep fuzz: Builtin:token page_size=1"), run.stdout


def test_an_emitted_file_pytest_would_pass_by_is_named_so(tmp_path):
    """--emit-pytest x.txt was written without a word: pytest run on its
    folder collects nothing, and a CI gate passes (helper-80)."""
    from state_machines.config import Config
    from state_machines.harness import Step
    from state_machines.runs.trace import Trace, write

    path = write(Trace(Config(target="builtin:token"), (Step("alloc", {"n": 1}, "req_0"),)), tmp_path)
    for name, said in (
        ("test_kept.py", ""),
        ("kept.txt", "; pytest does not collect it by default: name it test_*.py"),
        ("kept.py", "; by default pytest collects it only when named on its command line (in a folder it looks for"
                    " test_*.py or *_test.py)"),
    ):
        run = kv_lockstep("replay", str(path), "--emit-pytest", str(tmp_path / name), cwd=tmp_path)
        assert run.returncode == 0, run.stdout + run.stderr
        assert f"pytest file: {tmp_path / name}{said}" in run.stdout.splitlines(), run.stdout


def test_a_trace_with_a_key_given_twice_is_refused(tmp_path):
    """json keeps the last of a key given twice: a trace edited by hand
    could say two things of one field, and the last won without a word (helper-80)."""
    from state_machines.config import Config
    from state_machines.harness import Step
    from state_machines.runs.trace import Trace

    text = Trace(Config(target="builtin:token"), (Step("alloc", {"n": 1}, "req_0"),)).to_json()
    path = tmp_path / "trace.json"
    path.write_text(text.replace('"n": 1', '"n": 1, "n": 2', 1))
    run = kv_lockstep("replay", str(path), cwd=tmp_path)
    assert (run.returncode, run.stdout) == (2, ""), run.stdout + run.stderr
    assert run.stderr == f"kv-lockstep: error: cannot read trace {path}: key 'n' given twice in one object\n"
