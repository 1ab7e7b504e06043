"""The real caller (``--caller``): sglang's own cache and scheduler helpers
driving its allocator, checked by the census.

The first tests need no sglang: the census predicates, the placement reader
and the adapter choice on stand-in modules.  Those marked ``sglang`` drive
the installed releases, each in a fresh process (one process imports one
sglang), and skip when a release is missing.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from reference_model import caller as census
from state_machines.callers import adapters, placement
from state_machines.runs.trace import TraceError, check_config
from state_machines.targets import TargetError
from tests.test_sglang import release_dir

REPO = Path(__file__).resolve().parent.parent
POOL = frozenset(range(1, 7))


def holders(**named):
    return [census.Holder(name.replace("_", " "), tuple(pages)) for name, pages in named.items()]


# -- the census, on plain values --


def test_census_passes_when_the_holders_split_the_pool():
    """Tree, rows, free list and queue that hold each page once pass."""
    got = census.census_covers_pool(holders(tree=[1, 2], row=[3], free=[4, 5], queue=[6]), POOL, 1, "step 0")
    assert got is None


def test_census_names_a_page_held_twice_with_both_holders_and_the_action():
    """A slot in the tree and in the open group is named with both holders."""
    got = census.census_covers_pool(holders(the_tree=[1, 2], row=[3], free=[4, 5, 6], the_queue=[1]), POOL, 1,
                                    "step 2, prefill()")
    assert got == "after step 2, prefill(): slot 1 is held by the tree and by the queue / one holder each"


def test_census_names_a_leaked_page():
    """A page nobody holds is a leak, in pages at page size > 1."""
    got = census.census_covers_pool(holders(tree=[1, 2], free=[3, 4, 5]), POOL, 4, "step 1, decode()")
    assert got.startswith("after step 1, decode(): pages [6] are held by nobody")


def test_census_names_a_page_outside_the_pool():
    """A holder with a page the pool never had fails."""
    got = census.census_covers_pool(holders(tree=[1, 2, 3], free=[4, 5, 6, 0]), POOL, 1, "step 0")
    assert got.startswith("after step 0: free holds slot 0 / the pool is slots")


def test_a_repeat_in_the_free_list_is_a_double_free():
    """The same page twice in the free list is reported."""
    assert census.free_list_has_no_repeats([4, 5, 4], 4, "step 3") == (
        "after step 3: pages [4] are in the free list more than once / each belongs there once at most"
    )


def test_a_slot_in_two_tree_nodes_is_reported():
    """A slot the tree holds twice is reported."""
    assert census.tree_holds_each_slot_once([1, 2, 2], "step 0").startswith("after step 0: slots [2] appear in the tree")


def test_a_protected_prefix_off_its_locked_path_shows_both_sides():
    """A row whose protected prefix differs from the locked path names where."""
    got = census.protected_prefix_is_locked_path("req_1", [5, 1], [1, 2], "step 4")
    assert got == ("after step 4: req_1's row holds [5, 1] in its protected prefix (0..2) / the tree path it locks"
                   " holds [1, 2] (first difference at position 0)")


def test_tree_sizes_must_add_up_to_the_tree():
    """evictable + protected against the tree's token count."""
    assert census.tree_sizes_balance(2, 1, 3, "step 0") is None
    assert census.tree_sizes_balance(2, 2, 3, "step 0") == (
        "after step 0: evictable_size() 2 + protected_size() 2 = 4 / the tree holds 3 tokens"
    )


def test_swa_peers_that_pair_one_full_slot_each_pass():
    """Distinct SWA peers (and full slots without one) form a partial bijection."""
    assert census.swa_peers_are_a_partial_bijection({1: 3, 2: 4, 5: 1}, "step 0") is None


def test_an_swa_slot_that_peers_two_full_slots_names_both():
    """Two full slots mapped to one SWA slot are named with it."""
    assert census.swa_peers_are_a_partial_bijection({1: 3, 2: 3, 4: 5}, "step 6, slide_windows()") == (
        "after step 6, slide_windows(): SWA slot 3 is the peer of full slots [1, 2] / one full slot at most"
        " (1 SWA slots shared)"
    )


def test_a_free_full_slot_that_keeps_its_swa_peer_is_reported():
    """A full slot on the free list with a peer left behind is reported with the peer."""
    assert census.free_full_slots_have_no_peer([4, 5, 6], {1: 2, 7: 3}, "step 0") is None
    assert census.free_full_slots_have_no_peer([4, 5, 6], {5: 2, 7: 3}, "step 3, decode(reqs=[req_0])") == (
        "after step 3, decode(reqs=[req_0]): full slot 5 is free and still has SWA peer 2 / a free full slot has none"
    )


# -- where a release opens free groups --


def _scheduler(tmp_path, prefill_body: str) -> Path:
    source = tmp_path / "sglang/srt/managers/scheduler_components/batch_result_processor.py"
    source.parent.mkdir(parents=True)
    source.write_text(textwrap.dedent(f"""\
        class BatchResultProcessor:
            def process_batch_result_prefill(self, batch, result):
                {prefill_body}

            def process_batch_result_decode(self, batch, result):
                self.token_to_kv_pool_allocator.free_group_begin()
                self.token_to_kv_pool_allocator.free_group_end()
        """))
    return tmp_path


def test_placement_is_read_from_the_result_processors(tmp_path):
    """A prefill processor without free_group_begin is ungrouped, with its line."""
    release = placement.read_release(_scheduler(tmp_path, "pass"))
    assert release.placement == placement.Placement(prefill=False, decode=True)
    assert release.prefill.where == "sglang/srt/managers/scheduler_components/batch_result_processor.py:2"


def test_groups_all_forces_a_group_the_release_lacks(tmp_path):
    """--groups all groups prefill results even where the release does not."""
    release = placement.read_release(_scheduler(tmp_path, "pass"))
    assert placement.chosen("all", release) == placement.Placement(True, True)
    assert placement.chosen("release", release) == placement.Placement(False, True)


def test_a_release_without_result_processors_is_bad_input(tmp_path):
    """No scheduler source to read: one line, naming --groups."""
    with pytest.raises(TargetError, match="pass --groups all or --groups none"):
        placement.read_release(tmp_path)


@pytest.mark.parametrize(("version", "prefill"), [("0.5.17", False), ("0.5.18", True), ("0.5.23", True)])
def test_installed_releases_group_prefill_results_from_0_5_18(version, prefill):
    """sglang PR 33475: prefill results in a group from 0.5.18; decode always."""
    folder = REPO / ".sglang" / version
    if not (folder / "sglang").is_dir():
        pytest.skip(f"sglang {version} not installed: run `make sglang V={version}`")
    assert placement.read_release(folder).placement == placement.Placement(prefill=prefill, decode=True)


# -- one adapter per API generation, chosen by probing --


def _release_kv_cache_with(param):
    namespace = {}
    exec(f"def release_kv_cache(req, tree_cache, {param}=True): pass", namespace)  # noqa: S102 - a stand-in signature
    return namespace["release_kv_cache"]


def _modules(**common):
    # Every generation's harness calls update_finish_state (adapters.REQ_NEEDS).
    req = type("Req", (), {"update_finish_state": lambda self, new_accepted_len=1: None})
    return SimpleNamespace(version="test", common=SimpleNamespace(**common), Req=req,
                           BasePrefixCache=type("BasePrefixCache", (), {}))


def test_a_release_with_checkpoint_gets_the_kv_record_adapter():
    """checkpoint_kv_cache, release_kv_cache(checkpoint=) and lock(): the newer generation."""
    m = _modules(checkpoint_kv_cache=object(), release_kv_cache=_release_kv_cache_with("checkpoint"))
    m.BasePrefixCache.lock = lambda self, node: None
    assert adapters.generation_of(m).name == "kv_record"


def test_a_release_with_cache_unfinished_req_gets_the_prefix_indices_adapter():
    """maybe_cache_unfinished_req, is_insert= and set_extend_range: the older generation."""
    m = _modules(maybe_cache_unfinished_req=object(), release_kv_cache=_release_kv_cache_with("is_insert"))
    m.Req.set_extend_range = lambda self, start, end: None
    assert adapters.generation_of(m).name == "prefix_indices"


def test_a_release_keeping_request_state_under_kv_gets_the_prefix_indices_kv_adapter():
    """The older generation's helpers with ReqKvInfo.req_pool_idx: state under req.kv (0.5.19, 0.5.20)."""
    m = _modules(maybe_cache_unfinished_req=object(), release_kv_cache=_release_kv_cache_with("is_insert"))
    m.Req.set_extend_range = lambda self, start, end: None
    m.ReqKvInfo = type("ReqKvInfo", (), {"req_pool_idx": None})
    assert adapters.generation_of(m).name == "prefix_indices_kv"


def test_a_release_with_set_extend_input_len_only_gets_the_extend_input_len_adapter():
    """The older generation's helpers without set_extend_range: 0.5.13's extend_input_len."""
    m = _modules(maybe_cache_unfinished_req=object(), release_kv_cache=_release_kv_cache_with("is_insert"))
    m.Req.set_extend_input_len = lambda self, n: None
    assert adapters.generation_of(m).name == "extend_input_len"


def test_a_release_of_neither_generation_says_what_each_lacks():
    """A mix of both generations is bad input, naming what is missing."""
    m = _modules(checkpoint_kv_cache=object(), release_kv_cache=_release_kv_cache_with("is_insert"))
    with pytest.raises(TargetError, match=r"kv_record lacks release_kv_cache\(checkpoint=...\), BasePrefixCache.lock"):
        adapters.generation_of(m)


# -- the matrix's reachability column --


def _matrix_rows():
    kind = {"release": "0.5.17", "target": "sglang:token page_size=1", "result": "FAIL",
            "failures": [{"invariant": "free_sets_agree", "length": 5, "rules": []}]}
    forced = {"release": "0.5.17", "target": "--caller radix --groups all page_size=1", "result": "FAIL",
              "failures": [{"invariant": "census_covers_pool", "length": 3, "rules": [], "label": "latent"}]}
    own = {"release": "0.5.17", "target": "--caller radix --groups release page_size=1", "result": "pass"}
    return kind, forced, own


def test_a_kinds_failure_is_latent_and_a_forced_placements_keeps_its_label():
    """Only the simulated caller (a kind's row) or only --groups all: latent; a pass shows no label."""
    from state_machines.runs import matrix

    kind, forced, own = rows = _matrix_rows()
    assert matrix.reachability(kind, list(rows)) == "latent (simulated caller only)"
    assert matrix.reachability(forced, list(rows)) == "latent"
    assert matrix.reachability(own, list(rows)) == "-"
    assert "| latent (simulated caller only) |" in matrix.table(list(rows))


def test_a_kinds_failure_names_a_reachable_caller_failure_of_its_release():
    """A release whose own-placement caller run fails: the kind's row points at it."""
    from state_machines.runs import matrix

    kind, forced, own = _matrix_rows()
    own = {**own, "result": "FAIL", "failures": [{"invariant": "census_covers_pool", "length": 3, "rules": [],
                                                  "label": "reachable"}]}
    assert matrix.reachability(kind, [kind, forced, own]) == (
        "latent (simulated caller only); reachable failure under --caller radix --groups release page_size=1"
    )
    assert matrix.reachability(own, [kind, forced, own]) == "reachable"


# -- configuration and command line --


def test_a_trace_keeps_the_caller_and_refuses_an_unknown_placement():
    """caller and groups travel in a trace's config, checked like every field."""
    config = check_config({"target": "sglang:paged", "page_size": 4, "caller": "radix", "groups": "all"})
    assert (config.caller, config.groups) == ("radix", "all")
    assert "caller=radix groups=all" in config.label()
    with pytest.raises(TraceError, match='config.groups is "some", not release, all or none'):
        check_config({"target": "sglang:paged", "groups": "some"})


def test_groups_without_a_caller_is_bad_input(capsys):
    """The harness's own steps open groups: --groups goes with --caller."""
    from state_machines.cli import main

    assert main(["fuzz", "--groups", "all"]) == 2
    assert "--groups goes with --caller" in capsys.readouterr().err


# -- the installed releases (marked sglang) --


def _env():
    return dict(os.environ, PYTHONPATH=str(REPO))


_GATES: dict[tuple, list[dict]] = {}


def gate(version: str, runs: tuple[str, ...], *, max_examples: int, shrink: bool = False) -> dict[str, dict]:
    """The rows of ``runs`` (caller:groups:page_size) on one release, by run; cached per module."""
    key = (version, runs, max_examples, shrink)
    if key not in _GATES:
        child = subprocess.run(
            [sys.executable, "-m", "state_machines.callers.gate", "--one", str(release_dir(version)), "--runs",
             ",".join(runs), "--max-examples", str(max_examples), "--seed", "0", "--trace-dir", "",
             *([] if shrink else ["--no-shrink"])],
            cwd=REPO, capture_output=True, text=True, timeout=900, env=_env(),
        )
        assert child.returncode == 0, child.stderr[-3000:]
        _GATES[key] = json.loads(child.stdout.strip().splitlines()[-1])
    return {f"{r['caller']}:{r['groups']}:{r['page_size']}": r for r in _GATES[key]}


def first_failures(cache: str, *, max_examples: int, target: str = "") -> list[dict]:
    """The first failure of ``cache`` (MODULE:ATTR) on 0.5.23 at page sizes 1
    and 4, its own placement; each run must fail."""
    runs = (f"{cache}:release:1", f"{cache}:release:4")
    rows = gate("0.5.23", tuple(f"{run}@{target}" if target else run for run in runs), max_examples=max_examples)
    for run in runs:
        assert rows[run]["result"] == "FAIL", rows[run]
    return [rows[run]["failures"][0] for run in runs]


OLD_RUNS = ("radix:all:4", "radix:release:1", "radix:release:4")
FIXED_RUNS = ("radix:release:1", "radix:release:4", "unified:release:1", "unified:release:4")
MUTANT = "tests.sglang_caller_mutants:FreesOnePast"
UNIFIED_MUTANT = "tests.sglang_caller_mutants:UnifiedFreesOnePast"
SWA_RUNS = ("unified-swa:release:1", "unified-swa:release:4")
SWA_MUTANT = "tests.sglang_caller_mutants:SlidesIntoTheTree"


@pytest.mark.sglang
def test_0_5_17_fails_with_prefill_forced_into_a_group_and_calls_it_latent(tmp_path):
    """0.5.17's radix cache frees a duplicate as a row view and overwrites the
    row; inside a group the queued view becomes the tree's slot.  The fuzz
    names its stand-ins, shrinks to two requests of one prompt and a prefill,
    and labels it latent: 0.5.17's scheduler processes prefill results
    outside any group."""
    run = subprocess.run(
        [sys.executable, "-m", "state_machines.cli", "fuzz", "--caller", "radix", "--groups", "all", "--sglang-path",
         str(release_dir("0.5.17")), "--seed", "0", "--max-examples", "100", "--trace-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=900, env=_env(),
    )
    assert run.returncode == 1, run.stdout + run.stderr
    out = run.stdout
    assert out.splitlines()[0] == ("caller: RadixCache over TokenToKVPoolAllocator, sglang 0.5.17,"
                                   " API generation prefix_indices")
    assert "stand-in: runtime config: a dummy ServerArgs through the release's own test hook" in out
    assert "\n    latent: only with --groups all (prefill grouped, decode grouped);" in out
    assert "is held by the tree and by the open free group" in out
    story = [line.strip() for line in out.split("shrunk to ")[1].splitlines()[2:5]]
    assert [line.split(" = ")[-1].split("(")[0] for line in story] == ["state.arrive", "state.arrive", "state.prefill"]
    assert story[0].split("prompt=")[1].split(",")[0] == story[1].split("prompt=")[1].split(",")[0]


@pytest.mark.sglang
def test_0_5_17_fails_at_page_size_4_with_groups_all_and_passes_with_its_own_placement():
    """The same bug at page size 4, latent; the release's own placement runs clean."""
    rows = gate("0.5.17", OLD_RUNS, max_examples=100)
    assert rows["radix:all:4"]["result"] == "FAIL"
    assert {f["label"] for f in rows["radix:all:4"]["failures"]} == {"latent"}
    for run in ("radix:release:1", "radix:release:4"):
        assert rows[run]["result"] == "pass", rows[run]


@pytest.mark.sglang
@pytest.mark.parametrize("version", ["0.5.18", "0.5.23"])
def test_fixed_releases_pass_under_both_caches(version):
    """From 0.5.18 prefill results are grouped (so release = all) and the
    duplicate is cloned before queuing: radix and unified run clean."""
    rows = gate(version, FIXED_RUNS, max_examples=60)
    for run in FIXED_RUNS:
        assert rows[run]["result"] == "pass", rows[run]
        assert rows[run]["examples"] >= 60
        assert {"arrive", "prefill", "decode"} <= set(rows[run]["rules"]), rows[run]["rules"]


@pytest.mark.sglang
@pytest.mark.parametrize("version", ["0.5.13", "0.5.18", "0.5.23"])
def test_chunked_prefill_runs_on_every_generation(version):
    """Chunked prefill (stash the last chunk: cache_unfinished_req(chunked=True)
    or checkpoint_kv_cache; resume at the request's own prefix) is drawn, and
    passes, on 0.5.13's, 0.5.18's and 0.5.23's generations."""
    runs = ("radix:release:1", "radix:release:4")
    rows = gate(version, runs, max_examples=60)
    for run in runs:
        assert rows[run]["result"] == "pass", rows[run]
        assert "chunked_prefill" in rows[run]["rules"], rows[run]["rules"]


@pytest.mark.sglang
def test_0_5_13_runs_through_its_own_generation_and_a_global_server_args_stand_in():
    """0.5.13 (no runtime_context, no set_extend_range, alloc_for_extend in
    common.py) runs clean under radix at page sizes 1 and 4, naming the
    generation and the server-args stand-in."""
    runs = ("radix:release:1", "radix:release:4")
    rows = gate("0.5.13", runs, max_examples=60)
    for run in runs:
        assert rows[run]["result"] == "pass", rows[run]
        assert {"prefill", "decode", "retract"} <= set(rows[run]["rules"]), rows[run]["rules"]
    (header,) = _headers("0.5.13", "radix")
    assert "API generation extend_input_len" in header[0]
    assert any(line.startswith("stand-in: runtime config: a ServerArgs of the dataclass defaults") for line in header)


def _latent_trace(folder: Path) -> Path:
    """0.5.17's shrunk latent failure (radix, --groups all): two requests of one prompt and a prefill."""
    trace = {
        "format": "kv-lockstep-trace/1",
        "config": {"target": "sglang:token", "mutant": None, "page_size": 1, "need_sort": False, "device": "cpu",
                   "size": None, "rows": 4, "row_pages": 12, "sglang_path": str(release_dir("0.5.17")),
                   "call_timeout_s": 10.0, "row_dtype": "int32", "latent": False, "caller": "radix", "groups": "all"},
        "steps": [{"rule": "arrive", "args": {"prompt": 1, "out": 1}, "returns": "req_0"},
                  {"rule": "arrive", "args": {"prompt": 1, "out": 2}, "returns": "req_1"},
                  {"rule": "prefill", "args": {}, "returns": None}],
        "failure": {"step": 2, "invariant": "census_covers_pool", "detail": "recorded"},
    }
    path = folder / "latent.json"
    path.write_text(json.dumps(trace))
    return path


@pytest.mark.sglang
@pytest.mark.parametrize(("groups", "fails"), [("all", True), ("release", False)])
def test_an_emitted_pytest_of_a_caller_trace_fails_under_its_placement_only(tmp_path, groups, fails):
    """replay --emit-pytest writes a caller trace as a test that builds the
    real caller: it fails with --groups all and passes with 0.5.17's own placement."""
    emitted = tmp_path / f"test_emitted_{groups}.py"
    run = subprocess.run(
        [sys.executable, "-m", "state_machines.cli", "replay", str(_latent_trace(tmp_path)), "--groups", groups,
         "--sglang-path", str(release_dir("0.5.17")), "--emit-pytest", str(emitted)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=_env(),
    )
    assert run.returncode == (1 if fails else 0), run.stdout + run.stderr
    assert "import state_machines.callers" in emitted.read_text()
    test = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(emitted)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env=_env())
    assert test.returncode == (1 if fails else 0), test.stdout[-3000:]
    if fails:
        assert "census_covers_pool at step 2" in test.stdout


@pytest.mark.sglang
def test_a_duration_run_under_caller_finds_and_shrinks_the_latent_failure(tmp_path):
    """fuzz --duration takes --caller: its workers build the real caller, the
    run stops at 0.5.17's latent failure, labelled, shrunk and written; the
    simulated caller's interleavings are shown as not applicable."""
    run = subprocess.run(
        [sys.executable, "-m", "state_machines.cli", "fuzz", "--caller", "radix", "--groups", "all", "--page-size", "4",
         "--sglang-path", str(release_dir("0.5.17")), "--duration", "5m", "-j", "1", "--trace-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=_env(),
    )
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "stopped at a failure" in run.stdout
    assert "FAILED: census_covers_pool\n    latent: only with --groups all" in run.stdout
    assert "n/a  (needs --caller harness: an order of its steps)" in run.stdout
    assert list(tmp_path.glob("*census_covers_pool*.json"))


@pytest.mark.sglang
def test_a_cache_subclass_that_frees_one_past_a_duplicate_is_caught_as_reachable():
    """--caller MODULE:ATTR: a 0.5.23 RadixCache subclass that frees the
    request's next slot with a dropped duplicate fails, at page sizes 1 and 4."""
    for failure in first_failures(MUTANT, max_examples=200):
        assert failure["label"] == "reachable"
        assert failure["invariant"] == "census_covers_pool"
        assert " is held by " in failure["detail"], failure["detail"]


@pytest.mark.sglang
def test_a_unified_cache_subclass_that_frees_one_past_a_duplicate_is_caught_as_reachable():
    """--caller MODULE:ATTR on 0.5.23's default cache (UnifiedRadixCache): an
    insert that frees the slot past the duplicated span fails at page sizes 1
    and 4, the slot held by the tree and by the free list or open group."""
    for failure in first_failures(UNIFIED_MUTANT, max_examples=200):
        assert failure["label"] == "reachable"
        assert " is held by the tree and by " in failure["detail"], failure["detail"]


def _headers(version: str, *callers: str, page_size: int = 1) -> list[list[str]]:
    """Each caller's run header on one release, built in a fresh process."""
    script = textwrap.dedent(f"""\
        import json, state_machines.callers as c
        from state_machines.callers.release import default_target
        from state_machines.config import Config
        print(json.dumps([c.build(Config(target=default_target(k, {page_size}), page_size={page_size},
                                         sglang_path={str(release_dir(version))!r}, caller=k)).header()
                          for k in {list(callers)!r}]))
        """)
    child = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600,
                           env=_env())
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.mark.sglang
def test_a_module_attr_cache_is_probed_as_its_named_kind_is():
    """A MODULE:ATTR subclass of UnifiedRadixCache gets the named kind's
    probes: the same stand-ins (CPU kernels included), placement and checks,
    only its class name differs in the header."""
    for page_size in (1, 4):
        named, custom = _headers("0.5.23", "unified", UNIFIED_MUTANT, page_size=page_size)
        assert custom[0] == named[0].replace("UnifiedRadixCache over", "UnifiedFreesOnePast over")
        assert custom[1:] == named[1:]


@pytest.mark.sglang
def test_unified_swa_passes_on_0_5_23_and_slides_windows():
    """0.5.23's UnifiedRadixCache with the FULL and SWA components over the
    hybrid SWA allocator runs clean at page sizes 1 and 4, with window slides."""
    rows = gate("0.5.23", SWA_RUNS, max_examples=60)
    for run in SWA_RUNS:
        assert rows[run]["result"] == "pass", rows[run]
        assert {"arrive", "prefill", "decode", "slide_windows"} <= set(rows[run]["rules"]), rows[run]["rules"]


@pytest.mark.sglang
def test_a_window_slide_that_frees_the_trees_swa_is_caught():
    """An SWA cache subclass whose slide frees the SWA peers of the tree's
    first page fails swa_tree_sizes_balance at page sizes 1 and 4: the tree
    still counts that SWA live."""
    for failure in first_failures(SWA_MUTANT, max_examples=100, target="sglang:swa"):
        assert failure["invariant"] == "swa_tree_sizes_balance", failure


SWA_RADIX_RUNS = ("swa-radix:release:1", "swa-radix:all:4")
SWA_RADIX_MUTANT = "tests.sglang_caller_swa_mutants:FreesTheTreesWindow"


@pytest.mark.sglang
@pytest.mark.parametrize("version", ["0.5.17", "0.5.18"])
def test_swa_radix_runs_clean_and_slides_windows(version):
    """The release's SWARadixCache over the hybrid SWA allocator runs clean at
    page sizes 1 and 4, with window slides."""
    rows = gate(version, SWA_RADIX_RUNS, max_examples=60)
    for run in SWA_RADIX_RUNS:
        assert rows[run]["result"] == "pass", rows[run]
        assert {"arrive", "prefill", "decode", "slide_windows"} <= set(rows[run]["rules"]), rows[run]["rules"]


@pytest.mark.sglang
def test_an_swa_radix_subclass_that_frees_the_trees_window_is_caught_as_reachable():
    """An SWARadixCache subclass that frees the SWA of the tree's first page
    when it publishes a prefill fails swa_tree_sizes_balance at page sizes 1
    and 4, reachable under 0.5.17's own placement."""
    runs = tuple(f"{SWA_RADIX_MUTANT}:release:{ps}@sglang:swa" for ps in (1, 4))
    rows = gate("0.5.17", runs, max_examples=100)
    for ps in (1, 4):
        row = rows[f"{SWA_RADIX_MUTANT}:release:{ps}"]
        assert row["result"] == "FAIL", row
        assert (row["failures"][0]["invariant"], row["failures"][0]["label"]) == ("swa_tree_sizes_balance", "reachable")


@pytest.mark.sglang
def test_an_swa_cache_names_its_window_and_swa_stand_ins():
    """The header of --caller unified-swa says the window and the SWA pool's stand-in."""
    (header,) = _headers("0.5.23", "unified-swa", page_size=4)
    assert header[0] == ("caller: UnifiedRadixCache over SWATokenToKVPoolAllocator, sglang 0.5.23,"
                         " API generation kv_record, SWA window 4 tokens")
    assert any(line.startswith("stand-in: SWA kvcache: a BaseSWAKVPool stand-in") for line in header)


@pytest.mark.sglang
def test_an_swa_cache_over_a_plain_allocator_or_a_release_without_it_is_bad_input():
    """unified-swa needs the hybrid allocator; swa-radix is gone from 0.5.23."""
    rows = gate("0.5.23", ("swa-radix:release:1",), max_examples=1)
    assert rows["swa-radix:release:1"]["result"].startswith("unavailable: sglang 0.5.23 has no SWARadixCache")
    run = subprocess.run(
        [sys.executable, "-m", "state_machines.cli", "fuzz", "--caller", "unified-swa", "--target", "sglang:token",
         "--sglang-path", str(release_dir("0.5.23")), "--max-examples", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=_env(),
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert "--caller unified-swa pairs full slots with SWA peers" in run.stderr


@pytest.mark.sglang
def test_a_cache_class_module_that_exits_at_import_is_bad_input(tmp_path):
    """--caller MODULE:ATTR whose module calls os._exit at its top level:
    checked in a fork before the command imports it, one line and exit 2
    (the command ended silently, with the module's code)."""
    (tmp_path / "kvl_exits_at_import.py").write_text("import os\nos._exit(7)\n")
    run = subprocess.run(
        [sys.executable, "-m", "state_machines.cli", "fuzz", "--caller", "kvl_exits_at_import:Cache",
         "--sglang-path", str(release_dir("0.5.23")), "--trace-dir", str(tmp_path / "traces")],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(_env(), PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}"),
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr == ("kv-lockstep: error: --caller kvl_exits_at_import:Cache: cannot load it:"
                          " importing its module exited with code 7\n")


# A factory and a cache class of the user's that end the process building
# them, and a factory that never returns (deaf to SIGTERM; it leaves its pid
# in hung.pid, where the test looks).  The cache class's module imports the
# release: it loads only once --caller has put it on sys.path.
BUILDS = textwrap.dedent("""\
    import os, signal, time

    def exits(size, page_size, device, need_sort):
        os._exit(5)

    def hangs(size, page_size, device, need_sort):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with open("hung.pid", "w") as f:
            f.write(str(os.getpid()))
        time.sleep(3600)
    """)
CACHES = textwrap.dedent("""\
    import os
    from sglang.srt.mem_cache.radix_cache import RadixCache

    class ExitsAtInit(RadixCache):
        def __init__(self, params):
            os._exit(5)
    """)


def _ends_while_built(tmp_path, *args) -> subprocess.CompletedProcess:
    """``kv-lockstep ARGS`` on 0.5.23 with BUILDS and CACHES importable; a
    worker left hung (hung.pid) is killed after."""
    (tmp_path / "kvl_builds.py").write_text(BUILDS)
    (tmp_path / "kvl_caches.py").write_text(CACHES)
    try:
        return subprocess.run(
            [sys.executable, "-m", "state_machines.cli", *args, "--sglang-path", str(release_dir("0.5.23")),
             "--build-timeout", "1"],
            cwd=tmp_path, capture_output=True, text=True, timeout=180, env=dict(_env(), PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}"),
        )
    finally:
        from tests.test_run_ends import kill_hung

        kill_hung(tmp_path)


ENDS_WHILE_BUILT = {
    "factory exits": (["--target", "kvl_builds:exits"], "cannot build kvl_builds:exits: its factory exited with code 5"),
    "factory hangs": (["--target", "kvl_builds:hangs"], "cannot build kvl_builds:hangs: its factory did not return within 1 s"),
    "cache exits": (["--caller", "kvl_caches:ExitsAtInit"],
                    "cannot build sglang:token: its cache (ExitsAtInit, --caller kvl_caches:ExitsAtInit) exited with code 5"),
}


@pytest.mark.sglang
@pytest.mark.parametrize("how", list(ENDS_WHILE_BUILT))
def test_fuzz_under_caller_with_a_factory_or_cache_that_ends_while_built_is_bad_input(tmp_path, how):
    """fuzz --caller builds the caller for its header before any worker: a
    MODULE:ATTR factory or cache class that exits or never returns there is
    bad input, one line and exit 2 (a factory's exit ended the command
    silently with code 5, its hang hung it; the cache's exit, in a build
    with no building phase, was worker_died)."""
    options, line = ENDS_WHILE_BUILT[how]
    caller = [] if "--caller" in options else ["--caller", "radix"]
    run = _ends_while_built(tmp_path, "fuzz", *caller, *options, "--max-examples", "1", "--trace-dir", str(tmp_path / "traces"))
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stdout == "" and run.stderr == f"kv-lockstep: error: {line}\n"


@pytest.mark.sglang
@pytest.mark.parametrize("how", list(ENDS_WHILE_BUILT))
def test_replay_under_caller_with_a_factory_or_cache_that_ends_while_built_is_bad_input(tmp_path, how):
    """replay --caller builds the caller in its watched worker alone: the
    factory and the cache class run in building phases there (a factory's
    exit was worker_died 'between allocator calls', exit 1; its hang had no
    limit)."""
    from state_machines.config import Config
    from state_machines.runs.trace import Trace, write

    options, line = ENDS_WHILE_BUILT[how]
    caller = [] if "--caller" in options else ["--caller", "radix"]
    target = options[1] if "--target" in options else "sglang:token"
    trace = write(Trace(Config(target=target, caller=options[1] if "--caller" in options else "radix",
                               sglang_path=str(release_dir("0.5.23"))), ()), tmp_path / "in")
    run = _ends_while_built(tmp_path, "replay", str(trace), *caller, *options)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr == f"kv-lockstep: error: {line}\n"


@pytest.mark.sglang
def test_sigterm_while_the_caller_header_builds_a_factory_kills_its_worker_and_says_so(tmp_path):
    """fuzz --caller builds the caller for its header in a watched worker:
    SIGTERM there kills the worker, deaf to SIGTERM as this one is, and
    ends the command with 143 and one line."""
    from tests.test_run_ends import gone, hung_build

    (tmp_path / "kvl_builds.py").write_text(BUILDS)
    with hung_build(tmp_path, "fuzz", "--caller", "radix", "--target", "kvl_builds:hangs",
                    "--sglang-path", str(release_dir("0.5.23")), "--trace-dir", str(tmp_path / "traces"),
                    within=300,  # the release's import comes first
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as (proc, worker):
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 143, stdout + stderr
        assert stderr == "kv-lockstep: interrupted (SIGTERM)\n"
        assert gone(worker), "the header's worker outlived the command"


def test_cover_of_a_caller_run_counts_the_cache_modules_too():
    """fuzz --cover under --caller measures the release's prefix caches and
    scheduler helpers besides its allocator package."""
    from state_machines.config import Config
    from state_machines.runs import cover

    folder = release_dir("0.5.23").resolve()
    plain = cover.measured_files(Config(target="sglang:token", sglang_path=str(folder)))
    caller = cover.measured_files(Config(target="sglang:token", sglang_path=str(folder), caller="unified"))
    added = {str(p.relative_to(folder / "sglang/srt/mem_cache")) for p in set(caller) - set(plain)}
    assert set(caller) > set(plain)
    assert {"radix_cache.py", "unified_radix_cache.py", "common.py", "allocation.py",
            "unified_cache/components/swa.py"} <= added


@pytest.mark.sglang
def test_bad_input_on_a_caller_run_is_one_line_on_stderr(tmp_path):
    """sglang's import of torch.utils.cpp_extension logged torch's `No CUDA
    runtime is found` on a GPU-less host, through torch's own handler: a
    second line on stderr before the bad-input line."""
    run = subprocess.run(
        [sys.executable, "-m", "state_machines.cli", "fuzz", "--caller", "radix", "--sglang-path",
         str(release_dir("0.5.17")), "--trace-dir", "/proc/kv-lockstep-traces"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=_env(),
    )
    assert (run.returncode, run.stdout) == (2, ""), run.stdout + run.stderr
    assert run.stderr == "kv-lockstep: error: --trace-dir /proc/kv-lockstep-traces: cannot write there: No such file or directory\n"


LOOKUPS = textwrap.dedent(
    '''
    from allocators.token import TokenAllocator

    class OwnLookupFails(TokenAllocator):
        """Has the method 0.5.23 looks up; its own body reads what it lacks."""
        def evict_to_free_tokens(self, tree_cache, num_tokens):
            return self.eviction_budget
    '''
)

LACKING = "has no evict_to_free_tokens, which sglang 0.5.23 looks up on it (sglang/srt/mem_cache/common.py:287)"


@pytest.mark.sglang
@pytest.mark.parametrize("command", [["fuzz", "--max-examples", "20"], ["fuzz", "--duration", "60", "--jobs", "1"], ["replay"]])
def test_a_custom_target_lacking_what_the_release_looks_up_is_bad_input(tmp_path, command):
    """0.5.23's alloc_for_extend asks the allocator's evict_to_free_tokens,
    which sglang's base class has: a MODULE:ATTR target that does not
    subclass it failed every run as *reachable* sglang_raised, on the
    release's account.  One line naming the attribute and the release's
    line, exit 2, in each command; a lookup the target's own code makes
    stays its failure."""
    from state_machines.config import Config
    from state_machines.runs.trace import Step, Trace, write

    (tmp_path / "kvl_lookups.py").write_text(LOOKUPS)
    target = "allocators.token:TokenAllocator"
    args = ["--caller", "radix", "--target", target, "--sglang-path", str(release_dir("0.5.23")),
            "--trace-dir", str(tmp_path / "traces"), "--db", str(tmp_path / "db")]
    if command == ["replay"]:
        config = Config(target=target, caller="radix", sglang_path=str(release_dir("0.5.23")))
        steps = (Step("arrive", {"prompt": 1, "out": 1}, "req_0"), Step("prefill", {}))
        command = ["replay", str(write(Trace(config, steps, "sglang_raised"), tmp_path / "in"))]
        args = args[:6]
    env = dict(_env(), PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    run = subprocess.run([sys.executable, "-m", "state_machines.cli", *command, *args],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr == f"kv-lockstep: error: {target} (TokenAllocator) {LACKING}: give it one, or subclass the release's class that has it\n"
    assert not list((tmp_path / "traces").glob("*.json"))
    if command[0] == "fuzz" and "--duration" not in command:
        own = subprocess.run([sys.executable, "-m", "state_machines.cli", *command, *args[:3], "kvl_lookups:OwnLookupFails",
                              *args[4:]], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
        assert own.returncode == 1, own.stdout + own.stderr
        assert "failure 1: sglang_raised" in own.stdout
        assert "'OwnLookupFails' object has no attribute 'eviction_budget'" in own.stdout


DROPS_STATE = textwrap.dedent(
    '''
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    class DropsState(TokenToKVPoolAllocator):
        """Its free drops the free list, which the release's own alloc then reads."""
        def free(self, free_index):
            del self.free_pages
    '''
)


@pytest.mark.sglang
def test_an_inherited_method_reading_state_the_allocator_dropped_is_its_failure(tmp_path):
    """The release's alloc, inherited, read free_pages that the subclass's
    free deleted: that is the allocator's bug, with a trace, not bad input
    ('has no free_pages, which sglang 0.5.23 looks up on it ...: subclass
    the release's class', to a class that does)."""
    (tmp_path / "kvl_drops.py").write_text(DROPS_STATE)
    env = dict(_env(), PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    run = subprocess.run(
        [sys.executable, "-m", "state_machines.cli", "fuzz", "--caller", "radix", "--target", "kvl_drops:DropsState",
         "--sglang-path", str(release_dir("0.5.23")), "--max-examples", "50", "--seed", "0", "--db", str(tmp_path / "db"),
         "--trace-dir", str(tmp_path / "traces")], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "'DropsState' object has no attribute 'free_pages'" in run.stdout
    assert list((tmp_path / "traces").glob("*.json"))


SUBCLASSES = textwrap.dedent(
    '''
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    class MyPaged(PagedTokenToKVPoolAllocator):
        """The release's class, subclassed and nothing changed."""

    class MyExtend(PagedTokenToKVPoolAllocator):
        """Its own alloc_extend, which runs the release's (Triton before 0.5.21)."""
        def alloc_extend(self, *args, **kwargs):
            return super().alloc_extend(*args, **kwargs)
    '''
)


@pytest.mark.sglang
@pytest.mark.parametrize("version", ["0.5.18", "0.5.23"])
def test_a_subclass_of_the_releases_paged_allocator_gets_its_cpu_stand_ins(tmp_path, version):
    """The CPU stand-ins for the Triton paths are built from helpers in the
    release's module (alloc_extend_naive, get_num_new_pages); they were
    looked up in the subclass's own module, so a subclass of sglang's paged
    allocator that changes nothing was refused on 0.5.18 ('the release has
    no alloc_extend_naive / get_num_new_pages'), where sglang's own class
    runs."""
    (tmp_path / "kvl_subclasses.py").write_text(SUBCLASSES)
    env = dict(_env(), PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    runs = {}
    for target in ("kvl_subclasses:MyPaged", "sglang:paged"):
        runs[target] = subprocess.run(
            [sys.executable, "-m", "state_machines.cli", "fuzz", "--caller", "radix", "--page-size", "4", "--target", target,
             "--sglang-path", str(release_dir(version)), "--max-examples", "10", "--seed", "0", "--db", str(tmp_path / "db"),
             "--trace-dir", str(tmp_path / "traces")], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    mine, theirs = runs["kvl_subclasses:MyPaged"], runs["sglang:paged"]
    assert mine.returncode != 2 and theirs.returncode != 2, mine.stderr + theirs.stderr
    assert mine.stderr.replace("MyPaged", "PagedTokenToKVPoolAllocator") == theirs.stderr
    if version == "0.5.18":  # no CPU path: a method the subclass writes itself is not swapped for the release's
        own = subprocess.run(
            [sys.executable, "-m", "state_machines.cli", "fuzz", "--caller", "radix", "--page-size", "4", "--target",
             "kvl_subclasses:MyExtend", "--sglang-path", str(release_dir(version)), "--max-examples", "10"],
            cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
        assert own.returncode == 2, own.stdout + own.stderr
        assert own.stderr.startswith("kv-lockstep: error: MyExtend.alloc_extend (kvl_subclasses) cannot run on CPU ("), own.stderr
        assert own.stderr.endswith("it is not the release's, so no stand-in is built from the release's"
                                   " (it would leave yours untested)\n"), own.stderr


@pytest.mark.sglang
@pytest.mark.parametrize("page_size, size", [(1, 2), (4, 8)])
def test_a_pool_too_small_for_any_request_runs_clean(tmp_path, page_size, size):
    """Where no step applies (no request can prefill, the waiting list is
    full), the walk ends its example and Hypothesis's step does nothing: it
    was a harness error's traceback (IndexError: cannot choose from an
    empty sequence; then randrange's ValueError from the step choice)."""
    run = subprocess.run(
        [sys.executable, "-m", "state_machines.cli", "fuzz", "--caller", "radix", "--sglang-path", str(release_dir("0.5.23")),
         "--page-size", str(page_size), "--size", str(size), "--max-examples", "30", "--seed", "1", "--db", str(tmp_path / "db"),
         "--trace-dir", str(tmp_path / "traces")], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=_env())
    assert (run.returncode, run.stderr) == (0, ""), run.stdout + run.stderr
    assert run.stdout.splitlines()[-1].startswith("no failure: 30 examples")


@pytest.mark.sglang
def test_sglang_0_5_18_hybrid_queues_full_slots_and_its_unified_swa_cache_remaps_them():
    """0.5.18's free_swa in a free group queues full slots, resolved through
    the mapping at the group's end (allocator/swa.py:352-353, :370-375);
    0.5.23 queues the SWA slots, resolved at once (:516-519).  The census
    read 0.5.18's queue as SWA slots: 'page 1 is held by full slots' SWA
    peers and by the open free group's SWA queue', a false alarm.  Read
    right, the run finds what 0.5.23 fixed: the SWA component remaps the
    queued full slots onto the incoming request's SWA in the same group
    (unified_cache/components/swa_component.py:1122-1124), so the group's
    end frees the new peers and the old page is held by nobody."""
    rows = gate("0.5.18", ("unified-swa:release:4",), max_examples=40)
    [failure] = rows["unified-swa:release:4"]["failures"]
    assert failure["invariant"] == "census_covers_pool", failure
    assert re.search(r"\(SWA pool\): pages \[\d+(, \d+)*\] are held by nobody", failure["detail"]), failure["detail"]
    assert "and by the open free group's SWA queue" not in failure["detail"]
    assert failure["label"] == "reachable"
    for version, queues in (("0.5.18", True), ("0.5.23", False)):
        out = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(f"""
                import state_machines.callers
                from state_machines.config import Config
                from state_machines.harness import build
                for ps in (1, 4):
                    state = build(Config(target="sglang:swa", caller="unified-swa", page_size=ps,
                                         sglang_path={str(release_dir(version))!r}))
                    print(state.swa_queues_full_slots)
            """)], capture_output=True, text=True, timeout=300, env=_env())
        assert out.stdout.split() == [str(queues)] * 2, out.stdout + out.stderr


@pytest.mark.sglang
def test_a_replayed_eviction_the_rules_could_not_draw_is_refused(tmp_path):
    """evict_tokens is drawn only while the tree holds an evictable token,
    as 1 to 4 pages; a trace evicting from an empty tree (a shrunk one was
    seen doing it) replayed without a word."""
    from state_machines.config import Config
    from state_machines.runs.trace import Step, Trace, write

    config = Config(target="sglang:token", caller="radix", sglang_path=str(release_dir("0.5.23")))
    for n, said in ((1, "the tree holds no evictable token"), (5, "n 5 is not 1 to 4 pages of 1 tokens")):
        path = write(Trace(config, (Step("arrive", {"prompt": 1, "out": 1}, "req_0"), Step("evict_tokens", {"n": n}))),
                     tmp_path / str(n))
        run = subprocess.run([sys.executable, "-m", "state_machines.cli", "replay", str(path), "--sglang-path",
                              str(release_dir("0.5.23"))], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                             env=_env())
        assert run.returncode == 2, run.stdout + run.stderr
        assert said in run.stderr and run.stderr.count("\n") == 1, run.stderr


@pytest.mark.sglang
def test_a_replayed_request_longer_than_a_row_is_refused(tmp_path):
    """A request's prompt and new tokens but the last fill
    ``prompt + out - 1`` slots of its req_to_token row.  A trace whose
    row_pages was edited below that failed in the release (sglang_raised:
    an IndexError in alloc_for_decode; helper-79), where the rules could
    not have drawn it; one that just fits runs clean."""
    from state_machines.config import Config
    from state_machines.runs.trace import Step, Trace, write

    release = str(release_dir("0.5.23"))
    for row_pages, page_size, prompt, out, code, said in (
        (4, 1, 111, 3, 2, "prompt 111 and out 3 fill 5 slots of a row, which holds 4 (row_pages 4 at page size 1)"),
        (4, 1, 111, 2, 0, "trace passes"),
        (2, 4, 11, 2, 2, "prompt 11 and out 2 fill 9 slots of a row, which holds 8 (row_pages 2 at page size 4)"),
        (2, 4, 11, 1, 0, "trace passes"),
    ):
        config = Config(target="sglang:token" if page_size == 1 else "sglang:paged", page_size=page_size,
                        caller="radix", sglang_path=release, row_pages=row_pages)
        steps = (Step("arrive", {"prompt": prompt, "out": out}, "req_0"), Step("prefill", {}),
                 *[Step("decode", {"reqs": ["req_0"]})] * (out - 1))
        path = write(Trace(config, steps), tmp_path / f"{row_pages}-{out}")
        run = subprocess.run([sys.executable, "-m", "state_machines.cli", "replay", str(path), "--sglang-path", release],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300, env=_env())
        assert run.returncode == code, run.stdout + run.stderr
        assert said in (run.stderr if code else run.stdout), run.stdout + run.stderr
        assert not code or run.stderr.count("\n") == 1, run.stderr


@pytest.mark.sglang
def test_a_release_whose_req_predates_the_callers_api_is_bad_input(tmp_path):
    """0.5.12 met every need of the 0.5.13 generation, and its run failed
    as a reachable sglang_raised in 2 steps (its Req keeps lists where the
    harness hands it arrays; it has no update_finish_state): a false alarm
    (helper-80).  It is one line, exit 2, naming what it lacks."""
    run = subprocess.run([sys.executable, "-m", "state_machines.cli", "fuzz", "--caller", "radix", "--sglang-path",
                          str(release_dir("0.5.12")), "--max-examples", "3", "--seed", "0", "--trace-dir", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env=_env())
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.count("\n") == 1 and "Req.update_finish_state" in run.stderr, run.stderr
    assert run.stdout == ""


HYBRID_POOLS = textwrap.dedent(
    """
    def hybrid(size, page_size, device, need_sort):
        from state_machines.targets.sglang import make_swa
        return make_swa(size, page_size, device, need_sort)

    def hisparse(size, page_size, device, need_sort):
        from state_machines.targets.sglang import make_hisparse
        return make_hisparse(size, page_size, device, need_sort)
    """)


@pytest.mark.sglang
@pytest.mark.parametrize("args, said", [
    (["--caller", "radix", "--target", "sglang:mamba"], "--caller radix drives sglang:token, sglang:paged, sglang:npu,"
                                                          " sglang:swa or a MODULE:ATTR allocator of those, not sglang:mamba"),
    (["--caller", "radix", "--target", "hybrid_pools:hisparse", "--page-size", "4"],
     "not hybrid_pools:hisparse (a HiSparseTokenToKVPoolAllocator, sglang:hisparse)"),
    (["--caller", "radix", "--target", "sglang:hisparse", "--page-size", "4"], "not sglang:hisparse"),
    (["--caller", "radix", "--target", "sglang:swa"], "--caller radix (RadixCache) keeps no SWA peers: it drives a plain"
                                                        " allocator, not the hybrid sglang:swa"),
    (["--caller", "radix", "--target", "hybrid_pools:hybrid"], "keeps no SWA peers: it drives a plain allocator,"
                                                                 " not the hybrid hybrid_pools:hybrid"),
    (["--caller", "unified", "--target", "sglang:pure-swa"], "not sglang:pure-swa"),
    (["--caller", "unified-swa", "--target", "sglang:paged", "--page-size", "4"],
     "--caller unified-swa pairs full slots with SWA peers: it drives the hybrid allocator (--target sglang:swa), not sglang:paged"),
    (["--caller", "radix", "--latent"], "--latent: --caller drives the release's own caller code, which has no latent"),
    (["--caller", "radix", "--row-dtype", "int64"], "--row-dtype int64: --caller drives the release's own ReqToTokenPool"),
], ids=["mamba", "custom-hisparse", "hisparse", "swa-under-radix", "custom-hybrid-under-radix", "pure-swa", "paged-under-unified-swa",
        "latent", "int64"])
def test_what_a_caller_cannot_drive_is_bad_input(tmp_path, args, said):
    """Each ran and failed as a reachable finding of the release (a
    census_covers_pool, swa_tree_sizes_balance or sglang_raised in a few
    steps, or before any step), or labelled a reachable failure latent, or
    ran int32 rows under a header saying int64 (helper-80).  Whether an
    allocator is hybrid is judged on the allocator built, not its name
    (a factory of the hybrid one was a false alarm under radix too)."""
    (tmp_path / "hybrid_pools.py").write_text(HYBRID_POOLS)
    run = subprocess.run([sys.executable, "-m", "state_machines.cli", "fuzz", *args, "--sglang-path",
                          str(release_dir("0.5.23")), "--max-examples", "5", "--seed", "0", "--trace-dir", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=dict(_env(), PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)])))
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.count("\n") == 1 and said in run.stderr, run.stderr


@pytest.mark.sglang
@pytest.mark.parametrize("args, code", [
    (["--caller", "radix", "--target", "sglang:npu", "--page-size", "4"], 0),
    (["--caller", "unified", "--target", "sglang:swa"], 0),
    # A cache that frees the tree's window: its finding, as before the check.
    (["--caller", "tests.sglang_caller_mutants:SlidesIntoTheTree", "--target", "sglang:swa", "--max-examples", "100"], 1),
], ids=["npu-under-radix", "swa-under-unified", "custom-swa-cache"])
def test_what_a_caller_drives_runs(tmp_path, args, code):
    """The kinds the release's caches run over, judged hybrid or not on the
    allocator: the first cut of the check refused sglang:npu under radix
    and every custom cache class over sglang:swa (helper-81)."""
    examples = [] if "--max-examples" in args else ["--max-examples", "20"]
    run = subprocess.run([sys.executable, "-m", "state_machines.cli", "fuzz", *args, "--sglang-path",
                          str(release_dir("0.5.23")), *examples, "--seed", "0", "--trace-dir", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env=_env())
    assert run.returncode == code, run.stdout + run.stderr
    assert "Traceback" not in run.stderr and run.stdout.startswith("caller: "), run.stdout + run.stderr
    if code:
        assert "FAILED" in run.stdout and "swa_tree_sizes_balance" in run.stdout, run.stdout


@pytest.mark.sglang
def test_a_caller_runs_allocator_whose_fresh_pool_lists_the_padding_page_fails_with_a_trace(tmp_path):
    """The caller's census took the fresh pool's census for the pool: an
    allocator that hands out the padding slot 0 ran 100 examples clean
    (helper-80), where the harness's own run fails before any step.  It
    fails so under --caller too, and writes its trace as the harness's does
    (a failure before any step under --caller wrote none)."""
    (tmp_path / "padding_pools.py").write_text(textwrap.dedent(
        """
        import torch
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

        class HandsOutPadding(TokenToKVPoolAllocator):
            def clear(self):
                super().clear()
                self.free_pages = torch.arange(0, self.size + 1, dtype=torch.int64, device=self.device)
        """))
    release = str(release_dir("0.5.23"))
    run = subprocess.run([sys.executable, "-m", "state_machines.cli", "fuzz", "--caller", "radix", "--target",
                          "padding_pools:HandsOutPadding", "--sglang-path", release, "--max-examples", "20", "--seed", "0",
                          "--trace-dir", str(tmp_path / "traces")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=dict(_env(), PYTHONPATH=os.pathsep.join([str(tmp_path), _env()["PYTHONPATH"]])))
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stdout.startswith("FAILED before any step: fresh_pool_lists_every_page"), run.stdout
    assert "not pages of the pool: [0]" in run.stdout
    [trace] = (tmp_path / "traces").glob("*fresh_pool_lists_every_page*.json")
    assert f"  trace: {trace}" in run.stdout.splitlines()


def test_a_release_whose_req_lacks_what_every_generation_calls_says_so_once():
    """0.5.12's message named Req.update_finish_state once per generation, four times."""
    m = _modules(checkpoint_kv_cache=object(), release_kv_cache=_release_kv_cache_with("checkpoint"))
    del m.Req.update_finish_state
    with pytest.raises(TargetError) as refused:
        adapters.generation_of(m)
    assert str(refused.value) == "sglang test: its Req predates the API --caller drives (it lacks Req.update_finish_state)"


@pytest.mark.sglang
def test_arrive_long_is_counted_as_itself():
    """``arrive_long`` runs the ``arrive`` step with a longer prompt: the
    coverage counted it as ``arrive``, so every SWA-cache run said
    "arrive_long ran 0" and "rules 8/9" while it ran (helper-87)."""
    from state_machines.config import Config
    from state_machines.harness.machines import RunRecord
    from state_machines.runs.coverage import Coverage
    from state_machines.runs.runner import fuzz

    config = Config(target="sglang:swa", page_size=4, caller="unified-swa", sglang_path=str(release_dir("0.5.23")))
    coverage = Coverage(config, use_hypothesis=False)
    record = RunRecord(probe=coverage)
    outcome = fuzz(config, max_examples=10, seed=0, database=None, record=record)
    assert outcome.ok, outcome.failures
    assert coverage.ran["arrive_long"] > 0 and record.rule_counts["arrive_long"] == coverage.ran["arrive_long"]
    assert coverage.ran["arrive"] == record.rule_counts["arrive"] > 0
