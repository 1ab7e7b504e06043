"""The real caller (``--caller``): sglang's own cache and scheduler helpers
driving its allocator, checked by the census.

The first tests need no sglang: the census predicates, the placement reader
and the adapter choice on stand-in modules.  Those marked ``sglang`` drive
the installed releases, each in a fresh process (one process imports one
sglang), and skip when a release is missing.
"""

import json
import os
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
    return SimpleNamespace(version="test", common=SimpleNamespace(**common), Req=type("Req", (), {}),
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


def test_a_release_of_neither_generation_says_what_each_lacks():
    """A mix of both generations is bad input, naming what is missing."""
    m = _modules(checkpoint_kv_cache=object(), release_kv_cache=_release_kv_cache_with("is_insert"))
    with pytest.raises(TargetError, match=r"kv_record lacks release_kv_cache\(checkpoint=...\), BasePrefixCache.lock"):
        adapters.generation_of(m)


# -- configuration and command line --


def test_a_trace_keeps_the_caller_and_refuses_an_unknown_placement():
    """caller and groups travel in a trace's config, checked like every field."""
    config = check_config({"target": "sglang:paged", "page_size": 4, "caller": "radix", "groups": "all"})
    assert (config.caller, config.groups) == ("radix", "all")
    assert "caller=radix groups=all" in config.label()
    with pytest.raises(TraceError, match="config.groups is 'some', not release, all or none"):
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


OLD_RUNS = ("radix:all:4", "radix:release:1", "radix:release:4")
FIXED_RUNS = ("radix:release:1", "radix:release:4", "unified:release:1", "unified:release:4")
MUTANT = "tests.sglang_caller_mutants:FreesOnePast"


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
def test_a_cache_subclass_that_frees_one_past_a_duplicate_is_caught_as_reachable():
    """--caller MODULE:ATTR: a 0.5.23 RadixCache subclass that frees the
    request's next slot with a dropped duplicate fails, at page sizes 1 and 4."""
    runs = (f"{MUTANT}:release:1", f"{MUTANT}:release:4")
    rows = gate("0.5.23", runs, max_examples=200)
    for run in runs:
        assert rows[run]["result"] == "FAIL", rows[run]
        failure = rows[run]["failures"][0]
        assert failure["label"] == "reachable"
        assert failure["invariant"] == "census_covers_pool"
        assert " is held by " in failure["detail"], failure["detail"]
