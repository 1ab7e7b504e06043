"""Hostile and bad input: a trace is data, never code; bad input is one line
on stderr and exit 2, never a traceback, and never blamed on the allocator.

Most cases call ``main()`` in-process (quick); a few run the real command in
a subprocess, where ``python -m`` puts the working folder on ``sys.path`` as
a user's shell would.
"""

import copy
import json
import os
import re
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from state_machines.cli import main
from state_machines.config import Config
from state_machines.harness.lockstep import Step
from state_machines.runs import trace as trace_mod
from state_machines.runs.emit import pytest_source
from state_machines.runs.trace import FORMAT, Trace, TraceError, file_name, write

REPO = Path(__file__).resolve().parent.parent

BASE = {
    "format": FORMAT,
    "config": {
        "target": "builtin:token", "mutant": None, "page_size": 1, "need_sort": False, "device": "cpu",
        "size": None, "rows": 4, "row_pages": 12, "sglang_path": None,
    },
    "steps": [
        {"rule": "alloc", "args": {"n": 2}, "returns": "req_0"},
        {"rule": "begin", "args": {}, "returns": None},
        {"rule": "free", "args": {"req": "req_0", "n": 1}, "returns": None},
        {"rule": "end", "args": {}, "returns": None},
    ],
    "failure": {"step": 3, "invariant": "free_sets_agree", "detail": "recorded"},
}
DELETE = object()


def hostile(*edits, base=BASE):
    """BASE with each (dotted path, value) set; DELETE removes the key."""
    data = copy.deepcopy(base)
    for path, value in edits:
        *parents, last = path.split(".")
        node = data
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            node[int(last)] = value
        elif value is DELETE:
            del node[last]
        else:
            node[last] = value
    return data


def cli(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_bad_input(code, out, err, message):
    assert code == 2, out + err
    assert err.startswith("kv-lockstep: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err + out
    assert message in err, err


def write_json(path: Path, data) -> Path:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def subprocess_cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "state_machines.cli", *map(str, args)], cwd=cwd, capture_output=True, text=True,
        timeout=120, check=False, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )


# --------------------------------------------------------------------------- #
# Hostile traces: each is refused with one line before anything runs.

NPU = hostile(("config.target", "builtin:npu"))
SWA = hostile(("config.target", "builtin:swa"))
# Mamba's harness has no decode rule; HiSparse's declares extend and does not model it.
MAMBA = hostile(("config.target", "builtin:mamba"))

HOSTILE = {
    "not an object": ([1, 2], "not a JSON object"),
    "wrong format": (hostile(("format", "kv-lockstep-trace/9")), "format is"),
    "unknown top field": (hostile(("extra", 1)), "unknown field"),
    "no steps": (hostile(("steps", DELETE)), "lacks the field 'steps'"),
    "page_size true": (hostile(("config.page_size", True)), "config.page_size is true, not a whole number"),
    # fuzz refuses --latent at page size 4; a trace carrying it was replayed, its failure called latent (helper-90).
    "latent at page 4": (hostile(("config.latent", True), ("config.page_size", 4)),
                         "config.latent is true at page size 4: latent drives alloc_decode / alloc_extend at page size 1 only"),
    # fuzz refuses --latent and --row-dtype with --caller; replay refused such a trace naming those flags (helper-90).
    "latent with a real caller": (hostile(("config.latent", True), ("config.caller", "radix")),
                                  'config.latent is true with caller "radix": only the harness\'s own caller takes it'),
    "int64 rows with a real caller": (hostile(("config.row_dtype", "int64"), ("config.caller", "radix")),
                                      'config.row_dtype is "int64" with caller "radix": only the harness\'s own caller'),
    # A growth alloc names what it made: taken, and a step naming it refused mid-replay (helper-90).
    "growth alloc returns": (hostile(("steps", [{"rule": "alloc", "args": {"n": 1}, "returns": "req_0"},
                                                {"rule": "alloc", "args": {"n": 1, "req": "req_0"}, "returns": "req_1"}])),
                             'steps[1]: alloc with req grows that request and returns nothing, but the step names "req_1"'),
    # Values as the file writes them, not as Python prints them (None, True).
    "target null": (hostile(("config.target", None)), "config.target is null, not a string"),
    "page_size 0": (hostile(("config.page_size", 0)), "config.page_size is 0, outside"),
    "page_size 1.5": (hostile(("config.page_size", 1.5)), "not a whole number"),
    "page_size string": (hostile(("config.page_size", "4")), "not a whole number"),
    "page_size huge": (hostile(("config.page_size", 10**9)), "outside"),
    "need_sort 1": (hostile(("config.need_sort", 1)), "config.need_sort is 1, not true or false"),
    "size 0": (hostile(("config.size", 0)), "config.size is 0"),
    "size 1e30": (hostile(("config.size", 1e30)), "not a whole number"),
    "size true": (hostile(("config.size", True)), "not a whole number"),
    "size not whole pages": (hostile(("config.target", "builtin:paged"), ("config.page_size", 4), ("config.size", 6)),
                             "config.size is 6, not a whole number of pages of 4 slots"),
    "size under a page": (hostile(("config.target", "builtin:paged"), ("config.page_size", 16), ("config.size", 8)),
                          "config.size is 8, not a whole number of pages of 16 slots"),
    "rows huge": (hostile(("config.rows", 10**6)), "config.rows"),
    "rows*row_pages too big": (hostile(("config.rows", 256), ("config.row_pages", 4096), ("config.page_size", 16)), "rows * row_pages"),
    "device newline": (hostile(("config.device", "cpu\nx")), "config.device"),
    "device unknown": (hostile(("config.device", "gpu")), "config.device"),
    "target shape": (hostile(("config.target", "os.system; x:y")), "not builtin:NAME"),
    "target not str": (hostile(("config.target", ["os", "system"])), "config.target is a JSON array"),
    "no target": (hostile(("config.target", DELETE)), "lacks the field 'target'"),
    "mutant int": (hostile(("config.mutant", 5)), "config.mutant"),
    "sglang_path int": (hostile(("config.sglang_path", 5)), "config.sglang_path"),
    "sglang_path newline": (hostile(("config.sglang_path", "a\nb")), "not a printable path"),
    "unknown config field": (hostile(("config.evil", 1)), 'unknown field "evil"'),
    "steps not list": (hostile(("steps", {"rule": "begin"})), "steps is a JSON object"),
    "step not object": (hostile(("steps.1", "begin")), 'steps[1] is "begin"'),
    "rule dunder": (hostile(("steps.1.rule", "__class__")), "not a known rule"),
    "rule private": (hostile(("steps.1.rule", "_call")), "not a known rule"),
    "rule teardown": (hostile(("steps.1.rule", "teardown")), "not a known rule"),
    "rule code": (hostile(("steps.1.rule", "begin()\nimport os")), "not a known rule"),
    "rule not str": (hostile(("steps.1.rule", 7)), "not a known rule"),
    "args list": (hostile(("steps.1.args", [])), "args is a JSON array"),
    "arg key code": (hostile(("steps.0.args", {"n": 2, "x=1); import os; os.system('id') #": 1})), "takes no argument"),
    "arg missing": (hostile(("steps.2.args", {"req": "req_0"})), "needs the argument 'n'"),
    "n true": (hostile(("steps.0.args.n", True)), "steps[0].args.n is true, not a whole number"),
    "n 1.5": (hostile(("steps.0.args.n", 1.5)), "not a whole number"),
    "n 1e30": (hostile(("steps.0.args.n", 1e30)), "not a whole number"),
    "n negative": (hostile(("steps.0.args.n", -4)), "outside"),
    "n zero": (hostile(("steps.0.args.n", 0)), "outside"),
    "n past a row": (hostile(("steps.0.args.n", 13)), "outside 1..12"),
    "n string": (hostile(("steps.0.args.n", "2")), "not a whole number"),
    "n not a page multiple": (hostile(("config.target", "builtin:paged"), ("config.page_size", 4), ("steps.0.args.n", 6)), "multiple of the page size"),
    "n 5000 digits": (f'{{"format": "{FORMAT}", "config": {{"target": "builtin:token"}}, "steps": [{{"rule": "alloc", "args": {{"n": {"9" * 5000}}}}}]}}',
                      "not JSON"),
    "ref newline": (hostile(("steps.2.args.req", "req_0\n")), "not a request name"),
    "ref code": (hostile(("steps.2.args.req", "req_0); import os #")), "not a request name"),
    "ref unicode digit": (hostile(("steps.2.args.req", "req_\u0663")), "not a request name"),
    "ref wrong kind": (hostile(("steps.2.args.req", "cache_0")), "not a request name"),
    "ref undefined": (hostile(("steps.2.args.req", "req_5")), "which no earlier step created"),
    "returns code": (hostile(("steps.0.returns", "req_0 = __import__('os')")), "not a request name"),
    "returns on begin": (hostile(("steps.1.returns", "req_1")), "begin returns nothing"),
    "returns twice": (hostile(("steps.1", {"rule": "alloc", "args": {"n": 1}, "returns": "req_0"})), "names req_0 again"),
    "returns wrong kind": (hostile(("steps.0.returns", "cache_0")), "not a request name"),
    "overwrite_row past rows": (hostile(("steps.1", {"rule": "overwrite_row", "args": {"row": 4}})), "outside 0..3"),
    "decode item int": (hostile(("steps.1", {"rule": "decode", "args": {"reqs": ["req_0", 1]}}), base=NPU), "not a request name"),
    "decode empty": (hostile(("steps.1", {"rule": "decode", "args": {"reqs": []}}), base=NPU), "must name 1.."),
    "decode twice": (hostile(("steps.1", {"rule": "decode", "args": {"reqs": ["req_0", "req_0"]}}), base=NPU), "names a request twice"),
    "extend tokens short": (hostile(("steps.1", {"rule": "extend", "args": {"reqs": ["req_0"], "tokens": [1, 2]}})),
                            "names 1 requests and 2 token counts"),
    "extend tokens zero": (hostile(("steps.1", {"rule": "extend", "args": {"reqs": ["req_0"], "tokens": [0]}})), "tokens[0] is 0"),
    "extend tokens float": (hostile(("steps.1", {"rule": "extend", "args": {"reqs": ["req_0"], "tokens": [1.0]}})),
                            "not a whole number"),
    "extend tokens not list": (hostile(("steps.1", {"rule": "extend", "args": {"reqs": ["req_0"], "tokens": 1}})),
                               "not a list of whole numbers"),
    "row_dtype int16": (hostile(("config.row_dtype", "int16")), 'config.row_dtype is "int16", not int32 or int64'),
    "latent int": (hostile(("config.latent", 1)), "config.latent is 1, not true or false"),
    "decode old string bad": (hostile(("steps.1", {"rule": "decode", "args": {"reqs": "req_0,,req_1"}}), base=NPU), "not a request name"),
    "slide segment int": (hostile(("steps.1", {"rule": "slide", "args": {"req": "req_0", "pages": 1, "segment": 1}}), base=SWA), "not true or false"),
    "invariant newline": (hostile(("failure.invariant", 'x"""\nimport os\n"""')), "failure.invariant"),
    "invariant caps": (hostile(("failure.invariant", "Free")), "failure.invariant"),
    "detail int": (hostile(("failure.detail", 5)), "failure.detail is 5, not a string"),
    "failure step past": (hostile(("failure.step", 99)), "failure.step is 99"),
    "nested 100000 deep": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "nested in a value": (f'{{"format": "{FORMAT}", "config": {{"target": {"[" * 100_000 + "]" * 100_000}}}}}', "nested too deeply"),
    "bad utf-8": (b"\xff\xfe{", "not JSON"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_trace_is_one_line_and_exit_2(name, tmp_path, capsys):
    data, message = HOSTILE[name]
    path = tmp_path / "t.json"
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        write_json(path, data)
    emitted = tmp_path / "test_out.py"
    code, out, err = cli(["replay", path, "--emit-pytest", emitted], capsys)
    assert_bad_input(code, out, err, message)
    assert "cannot read trace" in err
    assert not emitted.exists()


def test_a_file_name_with_a_newline_stays_one_line(tmp_path, capsys):
    path = write_json(tmp_path / "a\nb.json", hostile(("config.page_size", True)))
    code, out, err = cli(["replay", path], capsys)
    assert_bad_input(code, out, err, "a\\nb.json")
    code, out, err = cli(["replay", write_json(tmp_path / "c\nd.json", hostile(("config.target", "evilmod:make")))], capsys)
    assert_bad_input(code, out, err, "c\\nd.json")


# Steps that fit the schema but that the harness's rules could never draw
# here: refused, not run and blamed on the allocator.
NOT_APPLICABLE = {
    "free more than held": (hostile(("steps.2.args.n", 5)), "holds 2 slots of its own"),
    "begin twice": (hostile(("steps.2", {"rule": "begin", "args": {}})), "a free group is already open"),
    "finished request": (hostile(("steps.1", {"rule": "finish", "args": {"req": "req_0"}})), "req_0 has finished"),
    "segment mid-row": (hostile(("steps.2", {"rule": "free_segment", "args": {"req": "req_0", "start": 0, "n": 1}})),
                        "must end on req_0's last page"),
    "rematch entry without dup": (hostile(
        ("steps.1", {"rule": "rematch", "args": {"req": "req_0", "dup": 0}, "returns": "cache_0"}),
        ("steps.2", {"rule": "rematch", "args": {"req": "req_0", "dup": 0, "entry": "cache_0"}})), "holds no pages of its own"),
    "evict a locked entry": (hostile(
        ("steps.1", {"rule": "rematch", "args": {"req": "req_0", "dup": 0}, "returns": "cache_0"}),
        ("steps.2", {"rule": "evict", "args": {"entry": "cache_0"}})), "not evictable"),
    "alloc past the row": (hostile(("steps.1", {"rule": "alloc", "args": {"n": 12, "req": "req_0"}})), "has room for 10 more pages"),
    "decode without alloc_decode": (hostile(("config.target", "builtin:paged"), ("config.page_size", 4), ("steps.0.args.n", 4), ("steps.2.args.n", 4),
                                            ("steps.1", {"rule": "decode", "args": {"reqs": ["req_0"]}})), "has no alloc_decode"),
    "decode off its harness": (hostile(("steps.1", {"rule": "decode", "args": {"reqs": ["req_0"]}}), base=MAMBA),
                               "rule 'decode' does not exist for builtin:mamba"),
    "extend past the row": (hostile(("steps.1", {"rule": "extend", "args": {"reqs": ["req_0"], "tokens": [11]}})),
                            "11 more do not fit in a row of 12"),
    "decode before prefill": (hostile(("steps.0", {"rule": "admit", "args": {}, "returns": "req_0"}),
                                      ("steps.1", {"rule": "decode", "args": {"reqs": ["req_0"]}})), "decodes after its prefill"),
    "admit with every row taken": ({**BASE, "steps": [{"rule": "admit", "args": {}, "returns": f"req_{i}"} for i in range(5)]},
                                   "rows is in use"),
    "slide off the SWA harness": (hostile(("steps.1", {"rule": "slide", "args": {"req": "req_0", "pages": 1}})), "does not exist for"),
    # A --caller step in a harness trace "did not exist for builtin:token": it does, under --caller (helper-90).
    "a caller's step in a harness trace": (
        hostile(("steps.0", {"rule": "arrive", "args": {"prompt": 1, "out": 1}, "returns": "req_0"})),
        "step 0: rule 'arrive' is not a step of caller harness on builtin:token: it is a --caller's own;"
        " a trace replays under the caller it was recorded with"),
}


@pytest.mark.parametrize("name", list(NOT_APPLICABLE))
def test_step_outside_the_rules_is_exit_2_not_a_failure(name, tmp_path, capsys):
    data, message = NOT_APPLICABLE[name]
    code, out, err = cli(["replay", write_json(tmp_path / "t.json", data)], capsys)
    assert_bad_input(code, out, err, message)
    assert "FAILED" not in out and "allocator_raised" not in out + err


def test_decode_takes_the_list_form_and_the_older_string(tmp_path, capsys):
    """decode's reqs as a JSON list (the new form) or "req_0,req_1" (the old) replay alike."""
    for reqs in (["req_0", "req_1"], "req_0,req_1"):
        data = hostile(("steps.1", {"rule": "alloc", "args": {"n": 1}, "returns": "req_1"}),
                       ("steps.2", {"rule": "decode", "args": {"reqs": reqs}}), base=NPU)
        code, out, err = cli(["replay", write_json(tmp_path / "t.json", data)], capsys)
        assert code == 0, out + err


def test_a_resize_is_bounded_by_the_pools_pages_not_a_rows():
    """The walk's own trace on a drawn 24-page pool, resized to 15 pages (past
    a row's 12), loads back; a resize to 25 pages is refused at load."""
    config = Config(target="builtin:token", size=24)
    kept = Trace(config, (Step("resize", {"pages": 15}),))
    assert Trace.from_dict(json.loads(kept.to_json())) == kept
    with pytest.raises(TraceError, match=r"steps\[0\]\.args\.pages is 25, outside 1\.\.24"):
        Trace.from_dict(json.loads(Trace(config, (Step("resize", {"pages": 25}),)).to_json()))


# --------------------------------------------------------------------------- #
# Code a trace names never runs unless the command line names it.

EVIL = textwrap.dedent(
    """
    from pathlib import Path
    Path({marker!r}).write_text("imported")

    def make(**kwargs):
        Path({marker!r}).write_text("called")
    """
)


def test_custom_target_in_a_trace_is_not_imported(tmp_path):
    """A trace naming evilmod:make, replayed from the folder holding evilmod.py
    (python -m puts it on sys.path), imports nothing: exit 2, --target named."""
    marker = tmp_path / "MARKER"
    (tmp_path / "evilmod.py").write_text(EVIL.format(marker=str(marker)))
    path = write_json(tmp_path / "t.json", hostile(("config.target", "evilmod:make")))
    for extra in ([], ["--emit-pytest", tmp_path / "test_e.py"]):
        run = subprocess_cli("replay", path, *extra, cwd=tmp_path)
        assert run.returncode == 2, run.stdout + run.stderr
        assert run.stderr == (f"kv-lockstep: error: trace {path} names the custom target evilmod:make, and replay imports"
                              " no code a trace names: pass --target evilmod:make to run it\n")
        assert not marker.exists() and not (tmp_path / "test_e.py").exists()


def test_os_system_target_in_a_trace_is_refused(tmp_path, capsys):
    code, out, err = cli(["replay", write_json(tmp_path / "t.json", hostile(("config.target", "os:system")))], capsys)
    assert_bad_input(code, out, err, "pass --target os:system to run it")


def test_sglang_path_in_a_trace_is_not_put_on_sys_path(tmp_path, capsys):
    """A trace's sglang_path would run its sglang/__init__.py: refused unless
    --sglang-path names a folder; a built-in target ignores it."""
    marker = tmp_path / "MARKER"
    evil = tmp_path / "evil"
    (evil / "sglang").mkdir(parents=True)
    (evil / "sglang" / "__init__.py").write_text(EVIL.format(marker=str(marker)))
    sg = hostile(("config.target", "sglang:token"), ("config.sglang_path", str(evil)))
    path = write_json(tmp_path / "t.json", sg)
    code, out, err = cli(["replay", path], capsys)
    assert_bad_input(code, out, err, f"was recorded with --sglang-path '{evil}'")
    assert err.endswith("pass --sglang-path DIR to replay it (or --target to run another target)\n")
    # Given another sglang target, or under a caller, only the release's folder helps: no hint of --target.
    code, out, err = cli(["replay", path, "--target", "sglang:paged"], capsys)
    assert_bad_input(code, out, err, f"was recorded with --sglang-path '{evil}'")
    assert err.endswith("pass --sglang-path DIR to replay it\n"), err
    code, out, err = cli(["replay", path, "--emit-pytest", tmp_path / "test_e.py"], capsys)
    assert_bad_input(code, out, err, "pass --sglang-path DIR")
    assert not marker.exists() and str(evil) not in sys.path
    # A built-in target never reads the path, so the trace runs without it.
    path = write_json(tmp_path / "b.json", hostile(("config.sglang_path", str(evil))))
    code, out, err = cli(["replay", path], capsys)
    assert code == 0 and not marker.exists(), out + err


def test_custom_target_runs_when_the_command_line_names_it(tmp_path, capsys, monkeypatch):
    """--target names the code: then, and only then, it is imported."""
    (tmp_path / "kvl_named_pool.py").write_text("from allocators import TokenAllocator as make\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write_json(tmp_path / "t.json", hostile(("config.target", "kvl_named_pool:make")))
    code, out, err = cli(["replay", path, "--target", "kvl_named_pool:make"], capsys)
    assert code == 0, out + err


# --------------------------------------------------------------------------- #
# The emitter writes only checked steps; text of the trace only as literals.

INJECT = 'x"""\nimport pathlib; pathlib.Path({m!r}).write_text("ran")\n"""\\\n\\N{{x}}'


def test_emitter_checks_what_it_writes(tmp_path):
    """pytest_source re-checks a trace built in memory: a rule, argument or
    name that did not come through the schema is never written."""
    config = Config()
    marker = tmp_path / "M"
    bad = [
        Trace(config, (Step(INJECT.format(m=str(marker)), {}),), None),
        Trace(config, (Step("alloc", {"n": 1}, 'req_0 = __import__("os")'),)),
        Trace(config, (Step("alloc", {"n); import os #": 1}),)),
        Trace(config, (Step("alloc", {"n": 1}),), INJECT.format(m=str(marker))),
    ]
    for trace in bad:
        with pytest.raises(TraceError):
            pytest_source(trace, config)
    assert not marker.exists()


def test_emitted_files_compile_and_run_no_smuggled_code(tmp_path, capsys):
    """Text the trace carries (its file name, the failure's detail, with
    triple quotes, backslash-newlines and a \\N escape) lands in string
    literals: every emitted file compiles, and running them creates no marker."""
    marker = tmp_path / "MARKER"
    suite = tmp_path / "suite"
    suite.mkdir()
    # The pytest run below has tmp_path as its folder, so "touch MARKER" would make marker.
    names = ["plain.json", 'n"""\nimport os; os.system("touch MARKER")\n""".json', "b\\\nimport os #.json", "\\N{x}.json"]
    details = [INJECT.format(m=str(marker)), "'''\n# coding: bogus\n", "\\N", "\x00\u2028\ud800"]
    for i, (name, detail) in enumerate(zip(names, details)):
        folder = tmp_path / f"t{i}"
        folder.mkdir()
        path = write_json(folder / name, hostile(("failure.detail", detail)))
        out_file = suite / f"test_emitted_{i}.py"
        code, out, err = cli(["replay", path, "--emit-pytest", out_file], capsys)
        assert code == 0, out + err
        text = out_file.read_text()
        compile(text, str(out_file), "exec")
        assert detail not in text.split("RECORDED_DETAIL = ")[0]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", str(suite)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert f"{len(names)} passed" in run.stdout, run.stdout + run.stderr
    assert not marker.exists()


# --------------------------------------------------------------------------- #
# Trace files: atomic, named by a hash of what failed.

def _trace(n=2, invariant="free_sets_agree"):
    return Trace(Config(), (Step("alloc", {"n": n}, "req_0"), Step("end", {})), invariant, "detail")


def test_file_name_carries_a_hash_of_the_failure(tmp_path):
    name = file_name(_trace())
    assert re.fullmatch(r"builtin_token_page_size_1-free_sets_agree-[0-9a-f]{8}\.json", name), name
    assert file_name(_trace()) == name  # the same failure, the same name
    assert file_name(_trace(n=3)) != name  # other steps
    assert file_name(_trace(invariant="slots_conserved")) != name


def test_write_is_idempotent_and_never_overwrites_another_failure(tmp_path):
    first = write(_trace(), tmp_path)
    again = write(_trace(), tmp_path)
    other = write(_trace(n=3), tmp_path)
    assert first == again and other != first
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({first.name, other.name})  # no temp files left
    assert Trace.load(first) == _trace() and Trace.load(other) == _trace(n=3)


def test_write_is_atomic(tmp_path, monkeypatch):
    """A write that fails part way leaves the old file whole and no temp file."""
    path = write(_trace(), tmp_path)
    before = path.read_bytes()

    def broken(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trace_mod.os, "replace", broken)
    with pytest.raises(TraceError, match="cannot write a trace into .*No space left on device"):
        write(_trace(), tmp_path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


# --------------------------------------------------------------------------- #
# Bad input around the trace: factories, output paths, mutants' needs.

FACTORIES = {
    "returns None": ("def make(**kw):\n    return None\n", "returned None, not an allocator"),
    "returns an int": ("def make(**kw):\n    return 7\n", "returned an int, not an allocator"),
    "returns an object without methods": (
        "class P:\n    def alloc(self, n):\n        return None\n\ndef make(**kw):\n    return P()\n",
        "lacks free(), free_group_begin(), free_group_end(), available_size()"),
    "raises SystemExit": ("import sys\ndef make(**kw):\n    sys.exit(3)\n", "cannot build kvl_f_3:make: SystemExit: 3"),
    "raises KeyboardInterrupt": ("def make(**kw):\n    raise KeyboardInterrupt\n", "KeyboardInterrupt"),
    "exits at import": ("import sys\nsys.exit('bye\\nnow')\n", "cannot import target module 'kvl_f_5': SystemExit: bye now"),
}


@pytest.mark.parametrize("index, name", list(enumerate(FACTORIES)))
def test_bad_factory_is_one_line_and_exit_2(index, name, tmp_path, capsys, monkeypatch):
    source, message = FACTORIES[name]
    module = f"kvl_f_{index}"
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = cli(["fuzz", "--target", f"{module}:make", "--trace-dir", tmp_path / "traces"], capsys)
    assert_bad_input(code, out, err, message)
    path = write_json(tmp_path / "t.json", hostile(("config.target", f"{module}:make")))
    code, out, err = cli(["replay", path, "--target", f"{module}:make"], capsys)
    assert_bad_input(code, out, err, message)


def test_output_paths_are_checked_before_fuzzing(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    cases = [
        (["--trace-dir", afile], "is a file, not a folder"),
        (["--trace-dir", afile / "sub"], f"cannot be created: {afile} is not a folder"),
        (["--duration", "1", "--stats-json", tmp_path / "missing" / "s.json"], "does not exist"),
        (["--duration", "1", "--stats-json", tmp_path], "is a folder, not a file"),
    ]
    for extra, message in cases:
        code, out, err = cli(["fuzz", "--mutant", "flag-drift", "--seed", "0", *extra], capsys)
        assert_bad_input(code, out, err, message)
        assert "kv-lockstep fuzz:" not in out  # refused before any example ran
    code, out, err = cli(["replay", write_json(tmp_path / "t.json", BASE), "--emit-pytest", tmp_path / "nope" / "t.py"], capsys)
    assert_bad_input(code, out, err, "--emit-pytest")
    assert "does not exist" in err


def test_a_refused_run_makes_no_trace_folder(tmp_path, monkeypatch, capsys):
    """The trace folder's probe makes the folder, so it comes after every
    other check: a run refused for anything else leaves none behind."""
    monkeypatch.chdir(tmp_path)
    cases = [
        (["--mutant", "nope"], "unknown mutant"),
        (["--device", "nope"], "unknown device 'nope'"),
        (["--duration", "soon"], "--duration"),
        (["--duration", "1", "--stats-json", tmp_path / "missing" / "s.json"], "does not exist"),
    ]
    for extra, message in cases:
        for trace_dir in ([], ["--trace-dir", tmp_path / "new" / "traces"]):
            code, out, err = cli(["fuzz", "--seed", "0", *trace_dir, *extra], capsys)
            assert_bad_input(code, out, err, message)
            assert sorted(os.listdir(tmp_path)) == [], (extra, os.listdir(tmp_path))


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_output_paths_that_refuse_a_file_are_refused_before_fuzzing(tmp_path, capsys):
    """/proc takes no new file, though os.access says root may write there:
    refused before the run, not a traceback when the first trace is written."""
    cases = [
        ["--trace-dir", "/proc/kv-lockstep-traces"],
        ["--trace-dir", "/proc"],
        ["--duration", "1", "--stats-json", "/proc/kv-lockstep-stats.json"],
    ]
    for extra in cases:
        code, out, err = cli(["fuzz", "--mutant", "flag-drift", "--seed", "0", *extra], capsys)
        assert_bad_input(code, out, err, f"{extra[-2]} {extra[-1]}")
        assert "kv-lockstep fuzz:" not in out  # refused before any example ran
    code, out, err = cli(["replay", write_json(tmp_path / "t.json", BASE), "--emit-pytest", "/proc/kv_lockstep_t.py"], capsys)
    assert_bad_input(code, out, err, "--emit-pytest /proc/kv_lockstep_t.py")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--target", "builtin:paged", "--mutant", "segment-drops-tail", "--page-size", "1"],
         "mutant segment-drops-tail of builtin:paged cannot show its bug at --page-size 1: it needs --page-size 2 or more"),
        (["--target", "builtin:paged", "--mutant", "free-no-dedup"], "needs --page-size 2 or more"),
        (["--target", "builtin:npu", "--mutant", "decode-boundary"], "needs --page-size 2 or more"),
        (["--target", "builtin:token", "--mutant", "merge-drops-release"],
         "mutant merge-drops-release of builtin:token cannot show its bug without --need-sort"),
    ],
)
def test_mutant_whose_bug_cannot_show_is_refused(args, message, tmp_path, capsys):
    code, out, err = cli(["fuzz", *args, "--trace-dir", tmp_path], capsys)
    assert_bad_input(code, out, err, message)


def test_catalogue_configs_meet_their_mutants_needs():
    """Every configuration the suite runs a mutant in can show its bug."""
    from state_machines import targets
    from state_machines.targets.catalogue import mutant_configs

    for c in mutant_configs():
        target = targets.resolve(c.target, c.mutant)
        assert targets.unmet_need(target, size=c.pool_size, page_size=c.page_size, device=c.device, need_sort=c.need_sort) is None


def test_the_real_command_prints_one_line(tmp_path):
    """End to end, in a process of its own: a deep trace and a mutant that cannot show."""
    deep = write_json(tmp_path / "deep.json", "[" * 100_000 + "]" * 100_000)
    run = subprocess_cli("replay", deep, cwd=tmp_path)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "nested too deeply" in run.stderr, run.stderr
    run = subprocess_cli("fuzz", "--target", "builtin:paged", "--mutant", "segment-drops-tail", "--page-size", "1", cwd=tmp_path)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr


def test_a_trace_may_name_what_a_step_made_as_it_likes(tmp_path, capsys):
    """A step's `returns` is the trace's own variable name: `req_7` for the harness's req_0 replays the same."""
    data = hostile(("steps.0.returns", "req_7"), ("steps.2.args.req", "req_7"))
    code, out, err = cli(["replay", write_json(tmp_path / "t.json", data)], capsys)
    assert (code, err) == (0, ""), out + err
    assert out.splitlines()[-1] == "trace passes: all 4 steps and the teardown check out"


def test_a_trace_written_with_a_detail_past_the_bound_reads_back():
    """A failure's detail longer than a trace carries (``MAX_TEXT``) is cut
    as the trace is written, saying how much, so ``replay`` reads every
    trace ``fuzz`` writes (it refused one of 5 MB)."""
    from state_machines.config import Config
    from state_machines.runs.trace import MAX_TEXT, Trace

    trace = Trace(Config(target="builtin:token"), (), "allocator_raised", "y" * (3 * MAX_TEXT))
    back = Trace.from_dict(json.loads(trace.to_json()))
    assert len(back.detail) <= MAX_TEXT and back.detail.startswith("y" * (MAX_TEXT - 100))
    assert back.detail.endswith(f"... ({2 * MAX_TEXT + 100:,} characters cut)")


def test_a_trace_dir_whose_unshrunk_folder_cannot_be_made_is_refused(tmp_path, capsys):
    """A file named ``unshrunk`` in the trace folder: the run started, and
    its failure was lost with a traceback (``cannot write a trace into
    td/unshrunk: File exists``)."""
    (tmp_path / "td").mkdir()
    (tmp_path / "td" / "unshrunk").write_text("")
    assert_bad_input(*cli(["fuzz", "--mutant", "alias", "--max-examples", "5", "--trace-dir", tmp_path / "td"], capsys),
                     "td/unshrunk is a file, not a folder")


def test_an_empty_db_is_refused(tmp_path, capsys, monkeypatch):
    """``--db ""`` wrote Hypothesis's folders into the working folder."""
    monkeypatch.chdir(tmp_path)
    assert_bad_input(*cli(["fuzz", "--max-examples", "3", "--db", ""], capsys), "--db is empty")
    assert list(tmp_path.iterdir()) == []


def test_emitting_a_pytest_file_onto_the_trace_itself_is_refused(tmp_path, capsys):
    path = write_json(tmp_path / "t.json", BASE)
    before = path.read_text()
    assert_bad_input(*cli(["replay", path, "--emit-pytest", tmp_path / "." / "t.json"], capsys),
                     "is the trace itself: writing it would overwrite the trace")
    assert path.read_text() == before


@pytest.mark.parametrize("config, steps, said", [
    # A finished request in a decode batch: the SWA family read it first (KeyError, a traceback).
    ({"target": "builtin:swa", "page_size": 4},
     [{"rule": "alloc", "args": {"n": 4}, "returns": "req_0"}, {"rule": "finish", "args": {"req": "req_0"}},
      {"rule": "decode", "args": {"reqs": ["req_0"]}}],
     "step 2 (state.decode(reqs=[req_0])) does not apply here: req_0 has finished"),
    # make_room inside a free group, which the rules never draw: the group's queued pages were blamed on the pool.
    ({"target": "builtin:unified-swa", "page_size": 4},
     [{"rule": "begin", "args": {}}, {"rule": "alloc", "args": {"n": 8}, "returns": "req_0"},
      {"rule": "finish", "args": {"req": "req_0"}}, {"rule": "make_room", "args": {"full": 0, "swa": 1}}],
     "step 3 (state.make_room(full=0, swa=1)) does not apply here: the scheduler makes room outside a free group"),
], ids=["decode-finished", "make-room-in-group"])
def test_a_hand_written_step_the_rules_never_draw_is_refused(tmp_path, capsys, config, steps, said):
    path = write_json(tmp_path / "t.json", {"format": FORMAT, "config": config, "steps": steps})
    assert_bad_input(*cli(["replay", path], capsys), said)


def test_main_called_from_a_thread_runs(capsys):
    """main() holds SIGINT back while it imports, through signal.signal,
    which raises ValueError outside the main thread: a library calling it
    from a thread of its own got that traceback."""
    import threading

    got = []
    thread = threading.Thread(target=lambda: got.append(main(["targets", "--target", "builtin:token"])))
    thread.start()
    thread.join(timeout=120)
    assert got == [0], capsys.readouterr()


def test_a_failure_whose_trace_cannot_be_written_is_still_reported(tmp_path, monkeypatch, capsys):
    """A disk that fills during the run (seen on a 16 KiB tmpfs): the first
    unshrunk trace was written, the next write raised, and the run ended in
    a harness error's traceback over a report naming a trace that was never
    written.  Each failure is reported, exit 1, its steps printed, saying
    why there is no file; no traceback."""
    import errno

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trace_mod, "write_atomic", full)  # the workers are forked: they write through it too
    code, out, err = cli(["fuzz", "--mutant", "alias", "--seed", "0", "--max-examples", "200",
                          "--trace-dir", tmp_path / "traces"], capsys)
    assert (code, err) == (1, ""), out + err
    assert "Traceback" not in out and "harness error" not in out, out
    assert re.search(r"trace: \(not written: cannot write a trace into \S+: No space left on device\)$", out, re.M), out
    assert "replay: none: no trace file was written" in out
    assert "state.end()  # fails: " in out, out


def test_a_long_runs_summary_reports_a_shrunk_failure_whose_trace_was_not_written():
    """The long run's workers (forkserver's: a monkeypatch does not reach
    them) write through the same ``write_or_why``; the summary read each
    shrunk trace back from its file, an OSError where none was written."""
    import io

    from state_machines.runs import longrun
    from state_machines.runs.coverage import merge

    trace = Trace(Config(mutant="alias"), (Step("alloc", {"n": 1}, "req_0"),), "free_sets_agree", "both sides")
    path = f"{trace_mod.NOT_WRITTEN}cannot write a trace into t: No space left on device)"
    out = io.StringIO()
    longrun._summary(out, Config(mutant="alias"), 1, 1.0, merge([]), [], [(trace.to_json(), path)], [], False)
    assert f"shrunk to 1 step; trace: {path}\n  replay: none: no trace file was written" in out.getvalue()
    assert "req_0 = state.alloc(n=1)  # fails: free_sets_agree" in out.getvalue()


def test_emitting_onto_what_is_not_a_plain_file_is_refused(tmp_path, capsys):
    """The file is written through a temporary and a rename, which would put
    a plain file where a FIFO, a device or a link was (/dev/null, as root):
    a path that exists must be a plain file.  A link to a plain file is
    written through, and the link kept."""
    path = write_json(tmp_path / "t.json", BASE)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    others = [(fifo, "FIFO")]
    if os.geteuid() == 0:  # a device like /dev/null, made here rather than risk the real one
        os.mknod(tmp_path / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        others.append((tmp_path / "null", "device"))
    for other, kind in others:
        assert_bad_input(*cli(["replay", path, "--emit-pytest", other], capsys), f"is a {kind}, not a plain file")
        assert not stat.S_ISREG(os.lstat(other).st_mode)
    real = tmp_path / "test_real.py"
    real.write_text("")
    link = tmp_path / "test_link.py"
    link.symlink_to(real)
    code, out, err = cli(["replay", path, "--emit-pytest", link], capsys)
    assert (code, err) == (0, ""), err
    assert link.is_symlink() and "def test_" in real.read_text()
    dangling = tmp_path / "test_dangling.py"
    dangling.symlink_to(tmp_path / "missing" / "x.py")
    assert_bad_input(*cli(["replay", path, "--emit-pytest", dangling], capsys), "does not exist")
    assert dangling.is_symlink()
    # --stats-json alike: a FIFO hung the run's end for ever (opened to write, no reader).
    code, out, err = cli(["fuzz", "--duration", "1", "--stats-json", fifo], capsys)
    assert_bad_input(code, out, err, "--stats-json")
    assert "is a FIFO, not a plain file" in err and "kv-lockstep fuzz:" not in out


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_link_is_checked_where_it_leads(tmp_path, capsys):
    """The file goes where the link leads, so that folder is the one checked:
    a link into /proc passed the check, and the replay ran before the write
    failed."""
    link = tmp_path / "test_into_proc.py"
    link.symlink_to("/proc/kv_lockstep_t.py")
    code, out, err = cli(["replay", write_json(tmp_path / "t.json", BASE), "--emit-pytest", link], capsys)
    assert_bad_input(code, out, err, "--emit-pytest /proc/kv_lockstep_t.py")
    assert "kv-lockstep replay:" not in out


def test_a_long_run_whose_stats_cannot_be_written_keeps_its_verdict(tmp_path, monkeypatch):
    """A disk that filled during the run: the failure found is still exit 1,
    with one line for the stats (it was exit 2, 'cannot write the output',
    and a stats file of 0 bytes)."""
    import errno
    import io

    from state_machines.runs import longrun

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(longrun, "_write_stats", full)
    out, err = io.StringIO(), io.StringIO()
    code = longrun.run(Config(mutant="flag-drift"), duration_s=20, jobs=1, db_spec=None, seed=0,
                       trace_dir=str(tmp_path / "traces"), stats_json=str(tmp_path / "s.json"), out=out, err=err)
    assert code == 1, out.getvalue() + err.getvalue()
    assert "FAILED: " in out.getvalue()
    assert err.getvalue() == f"kv-lockstep: --stats-json {tmp_path / 's.json'} not written: No space left on device\n"


@pytest.mark.parametrize("seconds", [1e-9, 0.05])
def test_a_trace_whose_call_limit_no_allocator_can_meet_is_refused(tmp_path, capsys, seconds):
    """A limit of 1e-9 s failed a correct allocator as allocator_hung on its
    first call: below a tenth of a second a correct call on a loaded machine
    is taken for a hang."""
    path = write_json(tmp_path / "t.json", {**BASE, "config": {**BASE["config"], "call_timeout_s": seconds}})
    assert_bad_input(*cli(["replay", path], capsys), "config.call_timeout_s is")


def test_a_trace_not_written_is_null_in_json_with_why(tmp_path):
    """--stats-json, the gate's and the matrix's rows: "trace" is a path or
    null, and why it was not written is its own field (the text of why sat
    in "trace", which tools read as a path)."""
    from state_machines.runs import longrun
    from state_machines.runs.coverage import merge

    why = f"{trace_mod.NOT_WRITTEN}cannot write a trace into t: No space left on device)"
    assert trace_mod.trace_fields(why) == {"trace": None, "trace_error": "cannot write a trace into t: No space left on device"}
    assert trace_mod.trace_fields("t/a.json") == {"trace": "t/a.json", "trace_error": None}
    assert trace_mod.trace_fields(None) == {"trace": None, "trace_error": None}
    trace = Trace(Config(mutant="alias"), (Step("alloc", {"n": 1}, "req_0"),), "free_sets_agree", "both sides")
    stats = tmp_path / "s.json"
    longrun._write_stats(stats, Config(mutant="alias"), 1, 5.0, 1.0, merge([]), [], [(trace.to_json(), why)], False, 1,
                         [(trace, "t/b.json")])
    assert json.loads(stats.read_text())["failures"] == [
        {"invariant": "free_sets_agree", "trace": None, "trace_error": "cannot write a trace into t: No space left on device",
         "shrunk": True},
        {"invariant": "free_sets_agree", "trace": "t/b.json", "trace_error": None, "shrunk": False}]


def test_a_trace_of_many_keys_one_given_twice_is_refused_in_one_line(tmp_path, capsys):
    """The check for a key given twice compared each key with every other:
    a trace of 20,000 keys took 5.5 s, one at the 16 MiB limit hours, in
    the command's own process (helper-82); and it named every key in full."""
    from state_machines.cli import main

    keys = ", ".join(f'"{"k" * 50}{i}": 0' for i in range(200_000))
    path = tmp_path / "trace.json"
    path.write_text("{" + keys + f', "{"k" * 50}7": 1, "a": 0, "a": 1' + "}")
    assert main(["replay", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and len(err) < 300, err
    assert err.endswith(f"key 'a', '{'k' * 37}...' given twice in one object\n"), err


@pytest.mark.parametrize("field, value, said", [("latent", True, "latent"), ("row_dtype", "int64", "int64 rows")])
def test_a_harness_trace_with_latent_or_int64_rows_under_a_real_caller_says_the_trace_has_them(
        field, value, said, tmp_path, capsys):
    # The builder's refusal named --latent / --row-dtype, which came from the trace, not the command line (helper-92).
    path = write_json(tmp_path / "t.json", hostile((f"config.{field}", value)))
    code, out, err = cli(["replay", path, "--caller", "radix"], capsys)
    assert_bad_input(code, out, err, f"--caller radix: trace {path} was recorded with {said}, which only the"
                                     " harness's own caller takes")
