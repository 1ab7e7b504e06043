"""The trace minimiser deletes steps a failure does not need, and only those."""

import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from allocators.paged import PagedAllocator
from allocators.token import TokenAllocator
from bench.targets import unavailable
from state_machines.config import Config
from state_machines.harness import Step
from state_machines.harness.family import machine_for
from state_machines.runs import minimize as minimize_module
from state_machines.runs.minimize import _merged, _scaled, minimize, shrink_configs
from state_machines.runs.runner import replay
from state_machines.runs.trace import Trace

REPO = Path(__file__).resolve().parent.parent
TOKEN_ALIAS = Config(target="builtin:token", mutant="alias")

# The aliasing story on the token pool: a view of row 0 is queued in a
# group, the row is zeroed, and end() frees the padding slot.
ALIAS = (
    Step("begin", {}),
    Step("alloc", {"n": 1}, "req_0"),
    Step("finish", {"req": "req_0"}),
    Step("overwrite_row", {"row": 0}),
    Step("end", {}),
)

# The same story with steps it does not need: a no-op end, an alloc and
# finish that leave row 0 free again, a request nobody frees, an overwrite
# of a row nobody uses, and an alloc after the failing end.
PADDED = (
    Step("end", {}),
    Step("alloc", {"n": 3}, "req_0"),
    Step("finish", {"req": "req_0"}),
    Step("begin", {}),
    Step("alloc", {"n": 1}, "req_1"),
    Step("alloc", {"n": 2}, "req_2"),
    Step("finish", {"req": "req_1"}),
    Step("overwrite_row", {"row": 3}),
    Step("overwrite_row", {"row": 0}),
    Step("end", {}),
    Step("alloc", {"n": 1}, "req_3"),
)

# Two frees of the same row view in one group: end() frees slot 2 twice.
# Without the second finish the trace fails sooner, on another invariant.
FREED_TWICE = (
    Step("begin", {}),
    Step("alloc", {"n": 1}, "req_0"),
    Step("finish", {"req": "req_0"}),
    Step("alloc", {"n": 1}, "req_1"),
    Step("finish", {"req": "req_1"}),
    Step("end", {}),
)


def _fails(steps) -> tuple[str, int] | None:
    """(invariant, steps run) where the steps fail on the token alias mutant, or None."""
    failure = replay(Trace(TOKEN_ALIAS, steps))
    return None if failure is None else (failure.invariant, len(failure.steps))


def _shrinks_to(config: Config, steps: tuple, invariant: str, length: int) -> Trace:
    """``steps`` fail on ``invariant`` and the minimiser takes them to ``length`` steps failing on it; that trace."""
    assert replay(Trace(config, steps)).invariant == invariant
    shortest = minimize(Trace(config, steps, invariant))
    assert (shortest.invariant, len(shortest.steps)) == (invariant, length)
    return shortest


def test_padded_trace_still_fails_the_same_way():
    """The padding is harmless: the padded trace fails at its failing end, on free_sets_agree."""
    assert _fails(PADDED) == ("free_sets_agree", len(PADDED) - 1)


def test_minimize_deletes_every_step_the_failure_does_not_need():
    """A padded aliasing trace comes back as the five-step story, failing on the same invariant."""
    shortest = minimize(Trace(TOKEN_ALIAS, PADDED, "free_sets_agree"))
    assert (shortest.invariant, shortest.steps) == ("free_sets_agree", ALIAS)


def test_minimize_keeps_a_trace_whose_every_step_is_needed():
    """The five-step aliasing trace is already minimal: it comes back unchanged."""
    assert _fails(ALIAS) == ("free_sets_agree", len(ALIAS))
    shortest = minimize(Trace(TOKEN_ALIAS, ALIAS, "free_sets_agree"))
    assert (shortest.invariant, shortest.steps) == ("free_sets_agree", ALIAS)


def test_minimize_does_not_trade_the_invariant_for_a_shorter_failure():
    """Deleting the second finish fails sooner on free_sets_agree; the minimiser keeps no_page_freed_twice."""
    assert _fails(FREED_TWICE) == ("no_page_freed_twice", len(FREED_TWICE))
    assert _fails(FREED_TWICE[:4] + FREED_TWICE[5:]) == ("free_sets_agree", len(FREED_TWICE) - 1)
    shortest = minimize(Trace(TOKEN_ALIAS, FREED_TWICE, "no_page_freed_twice"))
    assert (shortest.invariant, shortest.steps) == ("no_page_freed_twice", FREED_TWICE)


def test_minimize_puts_one_step_in_place_of_two():
    """On the paged pool, ``admit`` then an ``extend`` of one token is one
    ``alloc`` of a page: the six-step aliasing story comes back as five."""
    config = Config(target="builtin:paged", mutant="alias", page_size=4)
    six = (
        Step("begin", {}),
        Step("admit", {}, "req_0"),
        Step("extend", {"reqs": ["req_0"], "tokens": [1]}),
        Step("free", {"req": "req_0", "n": 4}),
        Step("alloc", {"n": 4, "req": "req_0"}),
        Step("end", {}),
    )
    _shrinks_to(config, six, "free_sets_agree", 5)


def test_minimize_carries_a_deleted_requests_slots_onto_other_allocs():
    """hisparse short-leaks needs the pool short: of allocs of 12, 12, 8 and
    12 slots, the 8 is carried onto the first two (16 each, one draw's most)
    and three steps remain."""
    config = Config(target="builtin:hisparse", mutant="short-leaks", page_size=4)
    four = tuple(Step("alloc", {"n": n}, f"req_{i}") for i, n in enumerate((12, 12, 8))) + (Step("alloc", {"n": 12}),)
    shortest = minimize(Trace(config, four, "free_sets_agree"))
    assert (shortest.invariant, [s.args["n"] for s in shortest.steps]) == ("free_sets_agree", [16, 16, 12])


def test_minimize_merges_two_requests_into_one():
    """BigFree drops a slot of a free of 9 or more: three requests of 4, 2
    and 3 slots freed in one group become one request, its growth taken
    at its alloc of 9, and finished, with no group (two steps, the known
    shortest; four while a fold took at most one of the walk's draws)."""
    config = Config(target="bench.bugs:BigFree")
    eight = (
        Step("alloc", {"n": 4}, "req_0"),
        Step("begin", {}),
        Step("finish", {"req": "req_0"}),
        Step("alloc", {"n": 2}, "req_1"),
        Step("finish", {"req": "req_1"}),
        Step("alloc", {"n": 3}, "req_2"),
        Step("finish", {"req": "req_2"}),
        Step("end", {}),
    )
    shortest = _shrinks_to(config, eight, "free_sets_agree", 2)
    assert shortest.steps == (Step("alloc", {"n": 9}, "req_0"), Step("finish", {"req": "req_0"}))


def test_a_request_merges_into_one_a_finish_segments_ended_before_it():
    """``_merged``: TenthAlloc needs ten calls that allocate, and
    req_to_token's 4 rows hold 4 requests.  The bench's shrink seed 1 met it
    with five requests, req_0 ended by a ``finish_segments`` so that the
    fifth had a row, and stopped there at 11 steps (known 10: only a
    ``finish`` went with a merge).  Made part of req_0, the fifth needs no
    row, and that ``finish_segments`` goes as a ``finish`` does: 10 steps
    that fail the same way."""
    def decode(req: str) -> Step:
        return Step("decode", {"reqs": [req]})

    head = (Step("alloc", {"n": 1}, "req_0"), decode("req_0"), decode("req_0"), Step("alloc", {"n": 1}, "req_1"),
            Step("alloc", {"n": 1}, "req_2"), Step("alloc", {"n": 1}, "req_3"), decode("req_1"), decode("req_1"))
    eleven = (*head, Step("finish_segments", {"req": "req_0", "cut": 0}), Step("alloc", {"n": 1}, "req_4"), decode("req_4"))
    merged = _merged(eleven, "req_0", "req_4")
    assert merged == (*head, Step("alloc", {"n": 1, "req": "req_0"}), decode("req_0"))
    config = Config(target="bench.bugs:TenthAlloc")
    assert replay(Trace(config, eleven)).invariant == "free_sets_agree"
    failure = replay(Trace(config, merged))
    assert (failure.invariant, len(failure.steps)) == ("free_sets_agree", 10)


def test_minimize_moves_to_a_smaller_pool_where_a_step_fewer_fails():
    """On unified-swa admission-ignores-swa, an alloc of the whole row then a
    reserve fails on the default pool; on a 16-slot pool the reserve alone
    does, and the minimiser finds it among its configurations."""
    config = Config(target="builtin:unified-swa", mutant="admission-ignores-swa", page_size=4)
    reserve = Step("reserve", {"full": 3, "swa": 3, "evict_full": 0, "evict_swa": 0, "prefer_swa": False})
    two = (Step("alloc", {"n": 16}, "req_0"), reserve)
    assert replay(Trace(config, two)).invariant == "unified_reclaim_plan_agrees"
    assert replay(Trace(config, (reserve,))) is None
    small = attrs.evolve(config, size=16)
    shortest = minimize(Trace(config, two, "unified_reclaim_plan_agrees"), configs=(config, small))
    assert (shortest.config, shortest.steps) == (small, (reserve,))


def test_minimize_halves_the_pool_below_the_smallest_an_example_draws():
    """page-interleave merge-on-total needs 2 pages a class: the five steps
    found on a 16-slot pool (the smallest drawn) fail in three on 8 slots,
    a pool ``shrink_configs`` offers by halving."""
    config = Config(target="builtin:page-interleave", mutant="merge-on-total", page_size=4, need_sort=True, size=16)
    five = (
        Step("alloc", {"n": 4}, "req_0"),
        Step("finish", {"req": "req_0"}),
        Step("alloc", {"n": 16}, "req_1"),
        Step("load_back", {"n": 4, "start": 0}, "req_2"),
        Step("load_back", {"n": 4, "start": 0}, "req_3"),
    )
    trace = Trace(config, five, "allocator_raised")
    # The run's own pool is the default one; 16 slots is the smallest it draws.
    configs = shrink_configs(trace, attrs.evolve(config, size=None), (None, 16, 96, 256))
    shortest = minimize(trace, configs=configs)
    assert (shortest.invariant, shortest.config.size, len(shortest.steps)) == ("allocator_raised", 8, 3)


def test_minimize_moves_a_trace_at_its_length_onto_the_pool_midway_between_a_half_and_the_pool_it_halved():
    """page-interleave merge-on-total as the bench's shrink seed 0 met it,
    on the default 10 pages a class: six steps of two requests and a
    load-back.  Scaled onto 4 pages a class (16 slots, the smallest drawn)
    they no longer apply, and onto 2 (8, its half) they no longer apply or
    pass; rounded down onto 3 (12, midway) they fail as long, and from
    there the minimiser reaches the known 3 steps on 8."""
    run = Config(target="builtin:page-interleave", mutant="merge-on-total", page_size=4, need_sort=True)
    six = (
        Step("alloc", {"n": 12}, "req_0"),
        Step("alloc", {"n": 8}, "req_1"),
        Step("extend", {"reqs": ["req_0", "req_1"], "tokens": [1, 16]}),
        Step("load_back", {"n": 16, "start": 0}, "req_2"),
        Step("free", {"req": "req_0", "n": 4}),
        Step("extend", {"reqs": ["req_2", "req_1", "req_0"], "tokens": [9, 13, 13]}),
    )
    assert replay(Trace(run, six)).invariant == "allocator_raised"
    trace = Trace(run, six, "allocator_raised")
    configs = shrink_configs(trace, run, (None, 16, 96, 256))
    assert [c.size for c in configs if c.size] == [8, 12, 16]
    shortest = minimize(trace, configs=configs)
    assert (shortest.invariant, shortest.config.size, len(shortest.steps)) == ("allocator_raised", 8, 3)


class RefusesSmallPools(TokenAllocator):
    """A token allocator that will not be built with fewer than 8 slots."""

    def __init__(self, size: int, page_size: int = 1, device: str = "cpu", need_sort: bool = False):
        if size < 8:
            raise ValueError(f"RefusesSmallPools needs 8 slots, got {size}")
        super().__init__(size, page_size, device, need_sort)


def test_shrinking_offers_no_halved_pool_the_target_refuses():
    """Halving 16 slots offers 8 and 12 midway, not 6, 4, 3 or 2, to a
    target that refuses fewer than 8 (a refusal is not the bug)."""
    config = Config(target="tests.test_minimize:RefusesSmallPools", size=64)
    trace = Trace(config, (Step("alloc", {"n": 1}, "req_0"),), "free_sets_agree")
    sizes = {c.size for c in shrink_configs(trace, config, (None, 16, 256))}
    assert sizes == {64, 16, 12, 8}


def test_shrinking_a_trace_on_a_pool_larger_than_the_runs_offers_the_drawn_sizes_between():
    """A trace met on 64 pages of a run on the default 10 is offered 24
    pages, which an example draws too, before its own 64, in the run's
    shape first and then the trace's (rows 1): a fresh pool wrong from 24
    pages on, met at 64, shrinks to 24 (tests/test_custom_census.py)."""
    run = Config(target="builtin:token", mutant="alias")
    trace = Trace(attrs.evolve(run, size=64, rows=1), ALIAS, "free_sets_agree")
    configs = shrink_configs(trace, run, (None, 4, 24, 64))
    assert [(c.size, c.rows) for c in configs if c.size and c.size > 10] == [(24, run.rows), (24, 1), (64, run.rows)]


def test_minimize_ends_a_trace_on_the_smallest_pool_it_fails_on_as_long():
    """Token alias as ``kv-lockstep fuzz --target builtin:token --mutant
    alias --seed 4`` meets it, on 4 slots and one row: a segment freed in a group, the row zeroed, the request
    finished.  Its five shrunk steps fail on every shape, and end on the
    smallest pool in the run's own shape, 2 slots of 4 rows
    (``settled``).  The passes move a trace between shapes at one length
    both ways (onto the run's own pool, and onto a smaller one), never
    back onto one it left; without ``settled`` this one ends where that
    walk stopped, on 4 slots and one row."""
    run = Config(target="builtin:token", mutant="alias")
    seven = (
        Step("begin", {}),
        Step("admit", {}, "req_0"),
        Step("extend", {"reqs": ["req_0"], "tokens": [2]}),
        Step("free_segment", {"req": "req_0", "start": 1, "n": 1}),
        Step("overwrite_row", {"row": 0}),
        Step("finish", {"req": "req_0"}),
        Step("end", {}),
    )
    trace = Trace(attrs.evolve(run, size=4, rows=1), seven, "free_sets_agree")
    shortest = minimize(trace, configs=shrink_configs(trace, run, machine_for(run).shapes().sizes))
    assert (shortest.config, shortest.steps) == (attrs.evolve(run, size=2), ALIAS)


def test_shrinking_keeps_a_pinned_pool():
    """A run whose pool size is pinned (it draws none) is shrunk on that pool only, never a halved one."""
    config = Config(target="builtin:token", mutant="alias", size=64)
    trace = Trace(config, ALIAS, "free_sets_agree")
    assert {c.size for c in shrink_configs(trace, config, (None,))} == {64}


def test_minimize_puts_one_step_in_place_of_two_taking_what_both_took():
    """dsv4-hisparse last-loc-floor needs an extend ending mid-page then one
    filling it: extends of 18 and 3 tokens (page 8) become one of 21."""
    config = Config(target="builtin:dsv4-hisparse", mutant="last-loc-floor", page_size=8)
    four = (
        Step("admit", {}, "req_0"),
        Step("extend", {"reqs": ["req_0"], "tokens": [18]}),
        Step("extend", {"reqs": ["req_0"], "tokens": [3]}),
        Step("extend", {"reqs": ["req_0"], "tokens": [3]}),
    )
    shortest = minimize(Trace(config, four, "compressed_mapping_consistent"))
    assert (shortest.invariant, len(shortest.steps)) == ("compressed_mapping_consistent", 3)


def _groups(*bodies):
    return tuple(s for body in bodies for s in (Step("begin", {}), *body, Step("end", {})))


def test_minimize_hoists_a_later_request_into_the_first_alloc():
    """ThirdGroup needs three groups that each free: three groups of alloc,
    finish become one alloc of 3 and three groups of a one-slot free (ten
    steps, the known shortest)."""
    config = Config(target="bench.bugs:ThirdGroup")
    twelve = _groups(*[(Step("alloc", {"n": 1}, f"req_{i}"), Step("finish", {"req": f"req_{i}"})) for i in range(3)])
    _shrinks_to(config, twelve, "free_sets_agree", 10)


def test_minimize_hoists_a_later_request_into_the_first_alloc_with_its_segment_moved_past_the_firsts():
    """multi-ended segment-view (rows int64) on a pool of two pages: two
    one-page requests, each with a one-slot segment freed as a view in a
    group and its row overwritten (eight steps).  Hoisted into the first
    alloc, the second's segment starts past the first's slots, where its
    slots now lie; the known five steps follow (one segment over both)."""
    config = Config(target="builtin:multi-ended", mutant="segment-view", page_size=4, size=8, row_dtype="int64")
    eight = (
        Step("alloc", {"n": 4}, "req_0"),
        Step("begin", {}),
        Step("alloc", {"n": 4}, "req_1"),
        Step("free_segment", {"req": "req_1", "start": 0, "n": 1}),
        Step("free_segment", {"req": "req_0", "start": 0, "n": 1}),
        Step("overwrite_row", {"row": 1}),
        Step("overwrite_row", {"row": 0}),
        Step("end", {}),
    )
    _shrinks_to(config, eight, "no_page_freed_twice", 5)


def test_minimize_makes_a_request_big_enough_at_its_alloc():
    """ThirdGroup again: a request grown by an extend between groups is
    allocated a slot more at once instead (eleven steps to ten)."""
    config = Config(target="bench.bugs:ThirdGroup")
    free_one = Step("free", {"req": "req_0", "n": 1})
    eleven = (
        *_groups((Step("alloc", {"n": 2}, "req_0"), free_one), (free_one,)),
        Step("extend", {"reqs": ["req_0"], "tokens": [1]}),
        *_groups((Step("finish", {"req": "req_0"}),)),
    )
    _shrinks_to(config, eleven, "free_sets_agree", 10)


def test_minimize_drops_a_prefix_and_refits_the_segment_after_it():
    """OffsetThree needs a segment ending 3 slots into a page: one freed
    behind a cached prefix, refitted to the request once the prefix is
    left out, and the prefix's request and rematch go (four steps to two)."""
    config = Config(target="bench.bugs:OffsetThree", page_size=4)
    four = (
        Step("alloc", {"n": 16}, "req_0"),
        Step("rematch", {"req": "req_0", "dup": 0}, "cache_0"),
        Step("alloc", {"n": 12, "prefix": "cache_0"}, "req_1"),
        Step("free_segment", {"req": "req_1", "start": 16, "n": 11}),
    )
    _shrinks_to(config, four, "free_sets_agree", 2)


def test_minimize_splits_a_step_that_does_two_things():
    """A rematch over a cached page frees a view and rewrites the row at
    once: in place of it a finish and an overwrite of the row, and the
    request that made the cache entry goes (six steps to the five-step
    aliasing story)."""
    six = (
        Step("alloc", {"n": 1}, "req_0"),
        Step("rematch", {"req": "req_0", "dup": 0}, "cache_0"),
        Step("alloc", {"n": 1}, "req_1"),
        Step("begin", {}),
        Step("rematch", {"req": "req_1", "dup": 1, "entry": "cache_0"}),
        Step("end", {}),
    )
    assert _fails(six) == ("free_sets_agree", 6)
    shortest = minimize(Trace(TOKEN_ALIAS, six, "free_sets_agree"))
    assert (shortest.invariant, len(shortest.steps)) == ("free_sets_agree", 5)


def test_minimize_splits_a_step_and_deletes_the_steps_that_acted_on_what_it_named():
    """Paged reps-alias as the walk's shrink seed 1 met it (STEER 0.3): a
    rematch over the request's own cached prefix, in a group after an
    extend.  Split into a ``finish_segments`` and an overwrite of the row,
    it still fails (seven steps), but deleting the extend alone makes it
    pass, and the entry alone fail another way: both must go at once
    (``_unneeded``), and then it is five steps, the known length."""
    six = (
        Step("alloc", {"n": 4}, "req_0"),
        Step("rematch", {"req": "req_0", "dup": 0}, "cache_0"),
        Step("begin", {}),
        Step("extend", {"reqs": ["req_0"], "tokens": [1]}),
        Step("rematch", {"req": "req_0", "dup": 1, "entry": "cache_0"}),
        Step("end", {}),
    )
    config = Config(target="builtin:paged", mutant="reps-alias", page_size=4, size=8)
    split = (*six[:4], Step("finish_segments", {"req": "req_0", "cut": 0}), Step("overwrite_row", {"row": 0}), six[5])
    assert replay(Trace(config, split)).invariant == "free_sets_agree"
    assert replay(Trace(config, split[:3] + split[4:])) is None  # the extend alone gone
    # The entry alone gone: another invariant, which the minimiser does not take.
    assert replay(Trace(config, split[:1] + split[2:])).invariant == "no_page_freed_twice"
    shortest = _shrinks_to(config, six, "free_sets_agree", 5)
    assert [s.rule for s in shortest.steps] == ["alloc", "begin", "finish_segments", "overwrite_row", "end"]


def test_minimize_folds_a_prefix_into_one_alloc_and_deletes_what_made_the_prefix():
    """hisparse buffer-drops-surplus on a pool of 8 slots, as a walk with a
    longer first example met it: an alloc of 4, a rematch caching it, an
    alloc of 4 on that prefix, then the device buffer.  The request made
    plain and as big (an alloc of 8) finds the pool full, so it fails no
    more; with the rematch and the first alloc deleted too (``_pruned``:
    the rematch gone, the first alloc is named by nothing) it is the known
    two steps."""
    four = (
        Step("alloc", {"n": 4}, "req_0"),
        Step("rematch", {"req": "req_0", "dup": 0}, "cache_0"),
        Step("alloc", {"n": 4, "prefix": "cache_0"}, "req_1"),
        Step("device_buffer", {"req": "req_1", "n": 4}),
    )
    config = Config(target="builtin:hisparse", mutant="buffer-drops-surplus", page_size=4, size=8)
    plain = (*four[:2], Step("alloc", {"n": 8}, "req_1"), four[3])
    # The fold alone: the pool is full, the alloc of 8 makes nothing, and the device buffer names no request.
    assert minimize_module._fails_like(Trace(config, plain), "device_free_sets_agree") is None
    pruned = (plain[2], plain[3])
    assert minimize_module._pruned(plain, 2, {"cache_0", "req_0"}) == pruned
    assert minimize_module._fails_like(Trace(config, pruned), "device_free_sets_agree") is not None
    assert minimize_module._unneeded(plain, 2, {"cache_0", "req_0"}) == (plain[0], *pruned)  # one pass leaves req_0
    shortest = _shrinks_to(config, four, "device_free_sets_agree", 2)
    assert [s.rule for s in shortest.steps] == ["alloc", "device_buffer"] and shortest.steps[0].args == {"n": 8}


def test_minimize_defers_a_finish_to_where_its_cached_prefix_was_evicted(monkeypatch):
    """unified-mamba prepare-closes-group on a pool of 8 slots, as a walk
    with an 80-step first example met it: a request cached by a rematch,
    grown in a group and finished there (its tail queued), the group closed
    by ``prepare_mamba``, then the entry evicted (freed at once).  The
    finish made a free of the tail and the eviction the finish, with the
    rematch deleted (``_finish_deferred``), frees the same slots at the
    same steps; the growth then goes into the alloc: the known five steps.
    Without the move the minimiser stays at seven."""
    seven = (
        Step("alloc", {"n": 4}, "req_0"),
        Step("rematch", {"req": "req_0", "dup": 0}, "cache_0"),
        Step("begin", {}),
        Step("alloc", {"n": 4, "req": "req_0"}),
        Step("finish", {"req": "req_0"}),
        Step("prepare_mamba", {"n": 1}),
        Step("evict", {"entry": "cache_0"}),
    )
    config = Config(target="builtin:unified-mamba", mutant="prepare-closes-group", page_size=4, size=8)
    rules = minimize_module._runnable_rules(config)
    recast = (seven[0], *seven[2:4], Step("free", {"req": "req_0", "n": 4}), seven[5], Step("finish", {"req": "req_0"}))
    assert recast in list(minimize_module._finish_deferred(seven, rules, config))
    # With the entry kept, the finish frees nothing the cache holds: the rematch must go too.
    kept = (*seven[:4], *recast[3:])
    assert minimize_module._fails_like(Trace(config, kept), "free_sets_agree") is None
    assert minimize_module._fails_like(Trace(config, recast), "free_sets_agree") is not None
    shortest = _shrinks_to(config, seven, "free_sets_agree", 5)
    assert [s.rule for s in shortest.steps] == ["alloc", "begin", "free", "prepare_mamba", "finish"]
    monkeypatch.setattr(minimize_module, "_finish_deferred", lambda steps, rules, config: iter(()))
    _shrinks_to(config, seven, "free_sets_agree", 7)


def test_minimize_defers_a_finish_that_frees_nothing_the_entry_did_not_hold():
    """ThirdGroup as the walk's seed 1 met it (2026-12-07, the tour with a
    free_segment after the alloc): the second group frees a slot, caches
    the request's last one by a rematch and finishes it, and the third
    evicts the entry.  The finish frees nothing the entry did not hold, so
    no free can take its place: ``_finish_deferred`` tries it deleted
    first, the eviction made the finish and the rematch gone (twelve steps
    to the known ten)."""
    twelve = (
        *(Step("begin", {}), Step("alloc", {"n": 3}, "req_0"), Step("free", {"req": "req_0", "n": 1}), Step("end", {})),
        *(Step("begin", {}), Step("free", {"req": "req_0", "n": 1}),
          Step("rematch", {"req": "req_0", "dup": 0}, "cache_0"), Step("finish", {"req": "req_0"}), Step("end", {})),
        *(Step("begin", {}), Step("evict", {"entry": "cache_0"}), Step("end", {})),
    )
    rules = minimize_module._runnable_rules(THIRD_GROUP)
    deferred = (*twelve[:6], twelve[8], twelve[9], Step("finish", {"req": "req_0"}), twelve[11])
    assert next(minimize_module._finish_deferred(twelve, rules, THIRD_GROUP)) == deferred
    assert minimize_module._fails_like(Trace(THIRD_GROUP, deferred), "free_sets_agree") is not None
    shortest = _shrinks_to(THIRD_GROUP, twelve, "free_sets_agree", 10)
    assert [s.rule for s in shortest.steps].count("begin") == 3


def test_minimize_recasts_a_rematch_as_a_segment_free_and_an_overwrite():
    """multi-ended segment-view as bench shrink seed 0 met it (2026-12-07):
    two requests of a page each rematch onto one entry in a group, and the
    group's end frees the entry's page twice (eight steps).  The known
    trace frees a segment over two pages of one request and overwrites its
    row (five).  No rematch frees more than the 1-page span it duplicates:
    ``_rematches_recast`` makes the second rematch a ``free_segment`` and
    an ``overwrite_row`` of the request grown by a page, and deletions
    then reach the known five."""
    config = Config(target="builtin:multi-ended", mutant="segment-view", page_size=4, size=16, row_dtype="int64")
    eight = (
        Step("alloc", {"n": 4}, "req_0"), Step("rematch", {"req": "req_0", "dup": 0}, "cache_0"),
        Step("alloc", {"n": 4}, "req_1"), Step("begin", {}),
        Step("rematch", {"req": "req_1", "dup": 1, "entry": "cache_0"}), Step("alloc", {"n": 4}, "req_2"),
        Step("rematch", {"req": "req_2", "dup": 1, "entry": "cache_0"}), Step("end", {}),
    )
    recast = list(minimize_module._rematches_recast(eight, config))
    grown = (*eight[:5], Step("alloc", {"n": 8}, "req_2"), Step("free_segment", {"req": "req_2", "start": 0, "n": 8}),
             Step("overwrite_row", {"row": 2}), eight[7])
    assert grown in recast
    assert minimize_module._fails_like(Trace(config, grown), "no_page_freed_twice") is not None
    shortest = _shrinks_to(config, eight, "no_page_freed_twice", 5)
    assert [s.rule for s in shortest.steps] == ["alloc", "begin", "free_segment", "overwrite_row", "end"]


def test_minimize_merges_two_requests_where_the_first_ones_finish_becomes_a_free():
    """ThirdGroup as shrink seed 4 met it (2026-12-07): a request and an
    admitted one, grown by one extend, the first's tail freed in the first
    group, the first finished in the second and the second in the third
    (twelve steps on a 4-slot pool).  The known trace has one request
    freeing in each group (ten).  A plain merge drops the first's finish,
    and with it the second group's free; ``_merged(freeing=True)`` makes
    that finish a free of what the first held there, and the minimiser
    reaches the known ten (among its dearer moves)."""
    config = attrs.evolve(THIRD_GROUP, size=4)
    twelve = (
        Step("alloc", {"n": 1}, "req_0"), Step("admit", {}, "req_1"),
        Step("extend", {"reqs": ["req_0", "req_1"], "tokens": [1, 1]}),
        *_groups([Step("free", {"req": "req_0", "n": 1})], [Step("finish", {"req": "req_0"})],
                 [Step("finish", {"req": "req_1"})]),
    )
    merged = minimize_module._merged(twelve, "req_0", "req_1", freeing=True)
    assert merged[1] == Step("extend", {"reqs": ["req_0"], "tokens": [2]})
    assert merged[6] == Step("free", {"req": "req_0", "n": 1})
    assert minimize_module._merged(twelve, "req_0", "req_1")[6] == Step("end", {})
    # A second request made by an alloc keeps it (as the first's): no shorter, not offered.
    allocated = (twelve[0], Step("alloc", {"n": 1}, "req_1"), *twelve[2:])
    assert minimize_module._merged(allocated, "req_0", "req_1") is not None
    assert minimize_module._merged(allocated, "req_0", "req_1", freeing=True) is None
    shortest = _shrinks_to(config, twelve, "free_sets_agree", 10)
    assert [s.rule for s in shortest.steps].count("begin") == 3


def test_minimize_does_not_trade_a_crash_for_a_wrong_answer():
    """npu decode-one-past on a 4-page pool: an alloc of 3 pages then a
    decode crashes the allocator; with an alloc of one page the decode
    gives a wrong free set instead.  The crash stays a crash."""
    config = Config(target="builtin:npu", mutant="decode-one-past", page_size=4, size=16)
    crash = (Step("alloc", {"n": 12}, "req_0"), Step("decode", {"reqs": ["req_0"]}))
    simpler = (Step("alloc", {"n": 4}, "req_0"), crash[1])
    assert replay(Trace(config, crash)).invariant == "allocator_raised"
    assert replay(Trace(config, simpler)).invariant == "free_sets_agree"
    shortest = minimize(Trace(config, crash, "allocator_raised"))
    assert (shortest.invariant, shortest.steps) == ("allocator_raised", crash)


def test_minimize_moves_to_a_smaller_pool_with_the_amounts_scaled():
    """ExactlyFull fails once one call takes the whole pool: an alloc of 3
    and extends of 4 and 3 fill the default 10-slot pool in three steps;
    scaled to a 2-slot pool (1, 1, 1) the first extend fills it, and then
    one alloc of both does (one step)."""
    config = Config(target="bench.bugs:ExactlyFull")
    three = (
        Step("alloc", {"n": 3}, "req_0"),
        Step("extend", {"reqs": ["req_0"], "tokens": [4]}),
        Step("extend", {"reqs": ["req_0"], "tokens": [3]}),
    )
    assert replay(Trace(config, three)).invariant == "free_sets_agree"
    shortest = minimize(Trace(config, three, "free_sets_agree"), configs=(config, attrs.evolve(config, size=2)))
    assert (shortest.config.size, len(shortest.steps)) == (2, 1)


def test_a_resize_is_scaled_with_the_pool_as_amounts_are():
    """On a pool half the size a resize to 8 of 16 pages is a resize to 4
    of 8 (a resize to 8 there would be past the pool and refused at
    replay); an alloc's slots scale alike."""
    config = Config(target="builtin:paged", page_size=4, size=64)
    steps = (Step("resize", {"pages": 8}), Step("alloc", {"n": 16}, "req_0"))
    scaled = _scaled(steps, config, attrs.evolve(config, size=32))
    assert [s.args for s in scaled] == [{"pages": 4}, {"n": 8}]


def test_minimize_refits_a_segment_to_a_request_made_smaller():
    """multi-ended reps-drift: a segment freed in a group, then end twice.
    Its request grown by 8 then 16 slots and freed from 0 to slot 21 is
    grown by 4 instead, the segment refitted to end on its last page
    (0 to 9), and then made in one alloc of 12 (six steps to five)."""
    config = Config(target="builtin:multi-ended", mutant="reps-drift", page_size=4)
    six = (
        Step("begin", {}),
        Step("alloc", {"n": 8}, "req_0"),
        Step("alloc", {"n": 16, "req": "req_0"}),
        Step("free_segment", {"req": "req_0", "start": 0, "n": 21}),
        Step("end", {}),
        Step("end", {}),
    )
    _shrinks_to(config, six, "no_page_freed_twice", 5)


def test_minimize_merges_two_steps_into_one_of_their_own_rule_first():
    """unified-swa segment-queues-view: two one-slot segment frees queued in
    a group, the row zeroed, end frees page 0 twice; one segment free of
    both pages does it in five steps (found before the budget goes on the
    thousands of other rules' steps the pair could become)."""
    config = Config(target="builtin:unified-swa", mutant="segment-queues-view", page_size=4)
    six = (
        Step("begin", {}),
        Step("alloc", {"n": 8}, "req_0"),
        Step("free_segment", {"req": "req_0", "start": 4, "n": 1}),
        Step("free_segment", {"req": "req_0", "start": 0, "n": 1}),
        Step("overwrite_row", {"row": 0}),
        Step("end", {}),
    )
    _shrinks_to(config, six, "no_page_freed_twice", 5)


def test_minimize_makes_an_admitted_request_an_alloc_of_what_it_grew_by():
    """dsv4-hisparse group-queues-view: a request admitted, then grown by one
    token inside the group, is an alloc of a page at once (six steps to the
    five-step aliasing story)."""
    config = Config(target="builtin:dsv4-hisparse", mutant="group-queues-view", page_size=4)
    six = (
        Step("admit", {}, "req_0"),
        Step("begin", {}),
        Step("extend", {"reqs": ["req_0"], "tokens": [1]}),
        Step("finish", {"req": "req_0"}),
        Step("overwrite_row", {"row": 0}),
        Step("end", {}),
    )
    _shrinks_to(config, six, "free_sets_agree", 5)


def test_minimize_makes_a_request_on_a_prefix_a_plain_alloc_as_big():
    """hisparse buffer-drops-surplus needs a request of two pages and a
    one-page buffer: one made of a cached page and one more is made by an
    alloc of both, and the cached page's request and rematch go (four steps
    to two)."""
    config = Config(target="builtin:hisparse", mutant="buffer-drops-surplus", page_size=4)
    four = (
        Step("alloc", {"n": 4}, "req_0"),
        Step("rematch", {"req": "req_0", "dup": 0}, "cache_0"),
        Step("alloc", {"n": 4, "prefix": "cache_0"}, "req_1"),
        Step("device_buffer", {"req": "req_1", "n": 4}),
    )
    _shrinks_to(config, four, "device_free_sets_agree", 2)


def test_minimize_swaps_two_steps_where_deletions_then_go_further():
    """token flag-drift: a cached slot evicted inside a group, then end
    twice.  With the finish moved into the group, its queued free does
    what the eviction did, and the cache entry's rematch and evict go
    (seven steps to the five-step drift story)."""
    config = Config(target="builtin:token", mutant="flag-drift")
    seven = (
        Step("alloc", {"n": 1}, "req_0"),
        Step("rematch", {"req": "req_0", "dup": 0}, "cache_0"),
        Step("finish", {"req": "req_0"}),
        Step("begin", {}),
        Step("evict", {"entry": "cache_0"}),
        Step("end", {}),
        Step("end", {}),
    )
    _shrinks_to(config, seven, "no_page_freed_twice", 5)


def test_minimize_deletes_a_request_and_raises_an_amount_to_make_up_for_it():
    """page-interleave merge-on-total needs a chain drawing class 0 twice
    after a released class-0 page: the second request, which only held
    room, goes while the first load-back grows to one draw's most (16
    slots), neither of which fails alone (four steps to three).  Both
    load-backs' starts lowered at once, they come back as plain allocs."""
    config = Config(target="builtin:page-interleave", mutant="merge-on-total", page_size=4, need_sort=True, size=8)
    four = (
        Step("load_back", {"n": 4, "start": 2}, "req_0"),
        Step("load_back", {"n": 4, "start": 2}, "req_1"),
        Step("finish", {"req": "req_0"}),
        Step("load_back", {"n": 4, "start": 2}),
    )
    three = _shrinks_to(config, four, "allocator_raised", 3)
    assert [(s.rule, s.args.get("n")) for s in three.steps] == [("alloc", 16), ("finish", None), ("alloc", 4)]


def test_minimize_deletes_a_step_and_raises_an_earlier_amount_to_take_on_what_it_did(monkeypatch):
    """merge-on-total met through a load-back (bench shrink seed 1): a
    request emptied by a free and grown into a page by an extend, then a
    load-back of a page.  The extend goes while the alloc grows to one
    draw's most (16 slots), neither of which fails alone (four steps to
    three)."""
    config = Config(target="builtin:page-interleave", mutant="merge-on-total", page_size=4, need_sort=True, size=8)
    four = (
        Step("alloc", {"n": 4}, "req_0"),
        Step("free", {"req": "req_0", "n": 4}),
        Step("extend", {"reqs": ["req_0"], "tokens": [1]}),
        Step("load_back", {"n": 4, "start": 0}),
    )
    three = _shrinks_to(config, four, "allocator_raised", 3)
    assert three.steps[0] == Step("alloc", {"n": 16}, "req_0")
    # No other move reaches it.
    monkeypatch.setattr(minimize_module, "_deleted_raised", lambda steps, config: iter(()))
    _shrinks_to(config, four, "allocator_raised", 4)


# sglang 0.5.18's NPU decode bug (bench.bugs:npu_without_free_groups), met
# on a pool resized to 5 pages: the resize's 5 pages go to the two allocs.
NPU_DECODE = Config(target="bench.bugs:npu_without_free_groups", page_size=4, sglang_path=".sglang/0.5.18")
NPU_RESIZED = (
    Step("resize", {"pages": 5}),
    Step("alloc", {"n": 8}, "req_0"),
    Step("decode", {"reqs": ["req_0"]}),
    Step("alloc", {"n": 4}, "req_1"),
    Step("decode", {"reqs": ["req_1", "req_0"]}),
)


@pytest.mark.sglang
def test_minimize_undoes_a_resize_and_lets_the_allocs_hold_its_pages():
    """The NPU decode bug needs the pool down to one free page: a resize to
    5 of 10 pages is undone and the allocs take its 5 pages (8 and 4 slots
    become 16 and 16), five steps to four (the known shortest).  In a
    process of its own: one process can import only one sglang release."""
    if (reason := unavailable(NPU_DECODE)) is not None:
        pytest.skip(reason)
    run = subprocess.run(
        [sys.executable, "-c", "from tests.test_minimize import _shrinks_to, NPU_DECODE, NPU_RESIZED; "
         "t = _shrinks_to(NPU_DECODE, NPU_RESIZED, 'allocator_raised', 4); "
         "assert [(s.rule, s.args.get('n')) for s in t.steps] == "
         "[('alloc', 16), ('decode', None), ('alloc', 16), ('decode', None)], t.steps"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert run.returncode == 0, run.stdout + run.stderr


# The NPU decode bug as the bench's walk met it and shrank it to six steps:
# req_0's tail free folded into its alloc, then the resize undone.
NPU_FREED = (
    Step("resize", {"pages": 6}),
    Step("alloc", {"n": 8}, "req_0"),
    Step("alloc", {"n": 12}, "req_1"),
    Step("free", {"req": "req_0", "n": 4}),
    Step("decode", {"reqs": ["req_1"]}),
    Step("decode", {"reqs": ["req_0", "req_1"]}),
)


@pytest.mark.sglang
def test_minimize_folds_a_tail_free_into_the_requests_alloc():
    """The NPU decode bug with req_0 allocated 8 slots and 4 freed: the free
    goes and the alloc takes 4, after which the resize is undone, six steps
    to four (the known shortest's length).  In a process of its own."""
    if (reason := unavailable(NPU_DECODE)) is not None:
        pytest.skip(reason)
    run = subprocess.run(
        [sys.executable, "-c", "from tests.test_minimize import _shrinks_to, NPU_DECODE, NPU_FREED; "
         "t = _shrinks_to(NPU_DECODE, NPU_FREED, 'allocator_raised', 4); "
         "assert 'free' not in [s.rule for s in t.steps], t.steps"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert run.returncode == 0, run.stdout + run.stderr


# The NPU decode bug as the bench's seed 1 shrank it, on a 4-page pool:
# req_1 shares req_0's two cached pages, its own page freed.
NPU_PREFIXED = (
    Step("alloc", {"n": 8}, "req_0"),
    Step("rematch", {"req": "req_0", "dup": 0}, "cache_0"),
    Step("alloc", {"n": 4, "prefix": "cache_0"}, "req_1"),
    Step("free", {"req": "req_1", "n": 4}),
    Step("decode", {"reqs": ["req_1"]}),
    Step("decode", {"reqs": ["req_0", "req_1"]}),
)


@pytest.mark.sglang
def test_minimize_folds_a_prefix_and_takes_its_pages_off_the_entrys_request():
    """The NPU decode bug needs one page free at the last decode.  req_1
    made a plain alloc (8 slots) holds the two pages it shared with req_0
    on its own, so req_0's alloc gives up as much (8 to 4): the pool is as
    full, and the rematch, then the free, go (six steps to four, the known
    shortest's length).  In a process of its own."""
    if (reason := unavailable(NPU_DECODE)) is not None:
        pytest.skip(reason)
    run = subprocess.run(
        [sys.executable, "-c", "import attrs; from tests.test_minimize import _shrinks_to, NPU_DECODE, NPU_PREFIXED; "
         "_shrinks_to(attrs.evolve(NPU_DECODE, size=16), NPU_PREFIXED, 'allocator_raised', 4)"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_minimize_moves_to_a_smaller_pool_with_the_amounts_rounded_up():
    """token merge-drops-release needs the free pages short and released
    pages to merge: two allocs of 4 of the default 10 slots, the second
    finished, and an extend of 3.  Scaled to a 4-slot pool and rounded up
    (2, 2, 2) they fill it as before (rounded down, 1, 1, 1, they do not);
    there the two requests merge into one (four steps to three)."""
    config = Config(target="builtin:token", mutant="merge-drops-release", need_sort=True)
    four = (
        Step("alloc", {"n": 4}, "req_0"),
        Step("alloc", {"n": 4}, "req_1"),
        Step("finish", {"req": "req_1"}),
        Step("extend", {"reqs": ["req_0"], "tokens": [3]}),
    )
    assert replay(Trace(config, four)).invariant == "alloc_none_iff_short"
    shortest = minimize(Trace(config, four, "alloc_none_iff_short"), configs=(config, attrs.evolve(config, size=4)))
    assert (shortest.config.size, len(shortest.steps)) == (4, 3)


def test_minimize_moves_to_a_smaller_pool_with_the_amounts_rounded_to_the_nearest():
    """token merge-drops-release as the bench's seed 0 shrank it: allocs of
    4 and 6 of the default 10 slots fill the pool, the first is finished and
    the second decodes.  On a 4-slot pool, rounded down (1, 2) they leave
    room and rounded up (2, 3) the second does not fit; to the nearest
    (2, 2) they fill it as before, and the two requests then merge (four
    steps to three)."""
    config = Config(target="builtin:token", mutant="merge-drops-release", need_sort=True)
    four = (
        Step("alloc", {"n": 4}, "req_0"),
        Step("alloc", {"n": 6}, "req_1"),
        Step("finish", {"req": "req_0"}),
        Step("decode", {"reqs": ["req_1"]}),
    )
    assert replay(Trace(config, four)).invariant == "alloc_none_iff_short"
    shortest = minimize(Trace(config, four, "alloc_none_iff_short"), configs=(config, attrs.evolve(config, size=4)))
    assert (shortest.config.size, len(shortest.steps)) == (4, 3)


THIRD_GROUP = Config(target="bench.bugs:ThirdGroup")


def test_minimize_merges_two_requests_one_extend_grows_together():
    """bench.bugs ThirdGroup needs three groups that each free something.
    Two admitted requests grown by one extend of both are one request
    grown by the sum (the extend keeps one entry of 2 tokens): the merged
    request then gives each group its free (thirteen steps to the known
    shortest's ten)."""
    thirteen = (
        Step("begin", {}),
        Step("admit", {}, "req_0"),
        Step("admit", {}, "req_1"),
        Step("extend", {"reqs": ["req_1", "req_0"], "tokens": [1, 1]}),
        Step("free", {"req": "req_0", "n": 1}),
        Step("end", {}),
        Step("begin", {}),
        Step("finish", {"req": "req_1"}),
        Step("end", {}),
        Step("alloc", {"n": 1}, "req_2"),
        Step("begin", {}),
        Step("free_segment", {"req": "req_2", "start": 0, "n": 1}),
        Step("end", {}),
    )
    _shrinks_to(THIRD_GROUP, thirteen, "free_sets_agree", 10)


def test_minimize_puts_a_step_on_the_same_request_in_place_of_one_first():
    """ThirdGroup as the bench's seed 0 met it: the second group frees by a
    rematch over a cache entry.  A finish of the same request in its place
    (a rule the trace has, naming what the rematch named) is tried before
    the dearer moves run out of budget; the cache entry and its request go
    after it (fifteen steps to ten)."""
    fifteen = (
        Step("admit", {}, "req_0"),
        Step("admit", {}, "req_1"),
        Step("extend", {"reqs": ["req_1", "req_0"], "tokens": [1, 1]}),
        Step("rematch", {"req": "req_1", "dup": 0}, "cache_0"),
        Step("alloc", {"n": 1}, "req_2"),
        Step("begin", {}),
        Step("alloc", {"n": 1}, "req_3"),
        Step("free_segment", {"req": "req_0", "start": 0, "n": 1}),
        Step("end", {}),
        Step("begin", {}),
        Step("rematch", {"req": "req_3", "dup": 1, "entry": "cache_0"}),
        Step("end", {}),
        Step("begin", {}),
        Step("finish", {"req": "req_2"}),
        Step("end", {}),
    )
    _shrinks_to(attrs.evolve(THIRD_GROUP, need_sort=True), fifteen, "free_sets_agree", 10)


def test_minimize_makes_an_eviction_a_free_of_a_request_that_holds_more():
    """ThirdGroup as the walk's seed 0 met it (2026-12-06): the first of
    three groups evicts a cache entry.  No deletion or single step helps:
    a free of the other request in its place leaves the third group with
    nothing to free, until that request's alloc takes a draw's most
    (``_evictions_recast``); the entry and its request then go (thirteen
    steps to the known ten, on one request)."""
    thirteen = (
        Step("alloc", {"n": 1}, "req_0"),
        Step("rematch", {"req": "req_0", "dup": 0}, "cache_0"),
        Step("finish", {"req": "req_0"}),
        Step("alloc", {"n": 2}, "req_1"),
        *(Step("begin", {}), Step("evict", {"entry": "cache_0"}), Step("end", {})),
        *(Step("begin", {}), Step("free", {"req": "req_1", "n": 1}), Step("end", {})),
        *(Step("begin", {}), Step("finish", {"req": "req_1"}), Step("end", {})),
    )
    shortest = _shrinks_to(THIRD_GROUP, thirteen, "free_sets_agree", 10)
    assert [s.rule for s in shortest.steps] == ["alloc", *["begin", "free", "end"] * 2, "begin", "finish", "end"]


def test_minimize_puts_a_free_of_a_rule_the_trace_lacks_in_place_of_a_rematch():
    """Unified-swa segment-queues-view as the bench's seed 0 met it: the
    group frees the request's tail by a rematch over its cached prefix.
    A free_segment of that tail (a rule the trace lacks; its slots those
    the allocs that grew the request took) is tried in its place before
    the dearer moves run out of budget, and the cache entry then goes:
    nine steps to the known five."""
    nine = (
        Step("alloc", {"n": 8}, "req_0"),
        Step("rematch", {"req": "req_0", "dup": 0}, "cache_0"),
        Step("alloc", {"n": 4, "req": "req_0"}),
        Step("begin", {}),
        Step("alloc", {"n": 4, "req": "req_0"}),
        Step("rematch", {"req": "req_0", "dup": 2, "entry": "cache_0"}),
        Step("finish", {"req": "req_0"}),
        Step("overwrite_row", {"row": 0}),
        Step("end", {}),
    )
    config = Config(target="builtin:unified-swa", mutant="segment-queues-view", page_size=4)
    shortest = _shrinks_to(config, nine, "no_page_freed_twice", 5)
    assert [s.rule for s in shortest.steps] == ["alloc", "begin", "free_segment", "overwrite_row", "end"]


def test_minimize_moves_a_step_and_puts_a_new_one_after_it_where_no_single_move_helps():
    """swa end-resolves-swa as the bench's seed 0 left it before the pass of
    two moves (``paired``): the begin moved before the rematch still fails;
    a slide put after it leaves the evict_swa nothing to drop, so that goes,
    and then the finish (seven steps to the six-step story of
    bench/known_shortest.py)."""
    config = Config(target="builtin:swa", mutant="end-resolves-swa", page_size=4, size=16, rows=1)
    seven = (
        Step("alloc", {"n": 4}, "req_0"),
        Step("rematch", {"req": "req_0", "dup": 0}, "cache_0"),
        Step("finish", {"req": "req_0"}),
        Step("begin", {}),
        Step("evict_swa", {"entry": "cache_0"}),
        Step("remap", {"entry": "cache_0"}),
        Step("end", {}),
    )
    shortest = _shrinks_to(config, seven, "swa_free_sets_agree", 6)
    assert [s.rule for s in shortest.steps] == ["alloc", "begin", "slide", "rematch", "remap", "end"]


def test_minimize_folds_a_growth_and_makes_the_step_that_then_breaks_simpler():
    """unified-swa segment-queues-view as the bench's seed 0 left it before
    the pass of two moves (``paired``): the second alloc folded into the
    first (the segment refitted to the larger request) leaves the free
    nothing of its own to free; an overwrite of the row in its place fails
    as before (six steps to five)."""
    config = Config(target="builtin:unified-swa", mutant="segment-queues-view", page_size=4, rows=4)
    six = (
        Step("begin", {}),
        Step("alloc", {"n": 4}, "req_0"),
        Step("free_segment", {"req": "req_0", "start": 0, "n": 1}),
        Step("alloc", {"n": 4, "req": "req_0"}),
        Step("free", {"req": "req_0", "n": 4}),
        Step("end", {}),
    )
    shortest = _shrinks_to(config, six, "no_page_freed_twice", 5)
    assert "overwrite_row" in [s.rule for s in shortest.steps]


# A request grown and finished inside a group after a segment free of it:
# six steps, where the known shortest trace overwrites the row instead.
GROWN_AND_FINISHED = (
    Step("begin", {}),
    Step("alloc", {"n": 4}, "req_0"),
    Step("free_segment", {"req": "req_0", "start": 0, "n": 1}),
    Step("alloc", {"n": 4, "req": "req_0"}),
    Step("finish", {"req": "req_0"}),
    Step("end", {}),
)


def _overwrite_in_place_of_the_finish(config: Config) -> None:
    """``GROWN_AND_FINISHED`` shrinks to five steps on ``config``, the finish made an overwrite of the row."""
    shortest = _shrinks_to(config, GROWN_AND_FINISHED, "no_page_freed_twice", 5)
    assert [s.rule for s in shortest.steps] == ["begin", "alloc", "free_segment", "overwrite_row", "end"]


@pytest.mark.parametrize("pair_steps", [None, 0], ids=["pair-budget", "pair-budget-spent"])
def test_minimize_folds_a_growth_and_makes_a_later_finish_an_overwrite_within_its_budget(pair_steps, monkeypatch):
    """The same bug as the bench's seeds 0 and 1 leave it once unified-swa
    draws free_nothing: a grow and a finish in the group (6 steps).  The
    fold passes; a finish made an overwrite of the row fails, and the
    moves, tried first, had taken PAIR_STEPS before it was tried.  It has
    a budget of its own, which PAIR_STEPS spent does not take (helper-83)."""
    from state_machines.runs import minimize as minimizer

    if pair_steps is not None:
        monkeypatch.setattr(minimizer, "PAIR_STEPS", pair_steps)
    config = Config(target="builtin:unified-swa", mutant="segment-queues-view", page_size=4, rows=1)
    _overwrite_in_place_of_the_finish(config)


def test_a_prompt_is_lowered_to_prompts_only():
    """A prompt's smaller candidates are its first pages, a page's token lowered by one or to 1, and the
    lowest, each a prompt (no 0 digit); ``_smaller_ints`` offered 321 only 1, 160 and 320."""
    from state_machines.runs.minimize import _smaller_prompts

    assert _smaller_prompts(321, 1) == [1, 3, 32, 121, 221, 311]
    assert _smaller_prompts(3, 1) == [1, 2]
    assert _smaller_prompts(1, 1) == []


def test_a_prompt_steps_share_is_lowered_in_all_of_them_at_once():
    """Two arrivals of one prompt come back with it lowered in both, smallest first; a prompt one step alone has,
    and an amount two steps share (two allocs of 4), are left to the one-step passes."""
    import state_machines.callers  # noqa: F401 - registers the caller's steps (no sglang imported)
    from state_machines.runs.minimize import _lowered_together

    config = Config(target="sglang:token", caller="radix")
    steps = (
        Step("arrive", {"prompt": 321, "out": 1}, "req_0"),
        Step("arrive", {"prompt": 321, "out": 2}, "req_1"),
        Step("prefill", {}),
    )
    got = [[s.args.get("prompt") for s in candidate] for candidate in _lowered_together(steps, config)]
    assert got == [[p, p, None] for p in (1, 3, 32, 121, 221, 311)]
    assert list(_lowered_together(steps[1:], config)) == []
    allocs = (Step("alloc", {"n": 4}, "req_0"), Step("alloc", {"n": 4}, "req_1"))
    assert list(_lowered_together(allocs, Config())) == []


SHARED_PROMPT = (
    Step("arrive", {"prompt": 321, "out": 1}, "req_0"),
    Step("arrive", {"prompt": 321, "out": 2}, "req_1"),
    Step("prefill", {}),
)


@pytest.mark.sglang
def test_minimize_lowers_a_prompt_two_requests_share_in_both():
    """sglang 0.5.17's latent duplicate (``--caller radix --groups all``) as
    seed 0 shrank it: two requests of prompt 321.  One alone at 1 passes
    (they no longer share a prefix), so the prompt is lowered in both at
    once, to the README's ``prompt=1``.  In a process of its own."""
    from tests.test_sglang import release_dir

    config = Config(target="sglang:token", sglang_path=str(release_dir("0.5.17")), caller="radix", groups="all")
    run = subprocess.run(
        [sys.executable, "-c", "import state_machines.callers; from state_machines.config import Config; "
         "from tests.test_minimize import _shrinks_to, SHARED_PROMPT; "
         f"t = _shrinks_to(Config.from_dict({config.to_dict()!r}), SHARED_PROMPT, 'census_covers_pool', 3); "
         "assert [s.args.get('prompt') for s in t.steps] == [1, 1, None], t.steps"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_minimize_folds_a_growth_and_puts_another_path_in_place_of_a_step_that_then_passes():
    """multi-ended segment-view as the bench's shrinking seed 0 left it:
    the grow folded into the alloc (the segment refitted to the larger
    request) passes, every step still applying; the finish after it made
    an overwrite of the row fails as before, by the known shortest path
    (six steps to five).  No single move shortened the six."""
    config = Config(target="builtin:multi-ended", mutant="segment-view", page_size=4, row_dtype="int64", size=8)
    _overwrite_in_place_of_the_finish(config)


class SameSizeTwice(TokenAllocator):
    """Mutant: an alloc of the size the one before it asked, 2 slots or
    more, hands its first slot out again as its last."""

    def alloc(self, need_size: int):
        out = super().alloc(need_size)
        last, self.last_size = getattr(self, "last_size", None), need_size
        if out is not None and need_size == last >= 2:
            out = out.clone()
            out[-1] = out[0]
        return out


def test_two_arguments_are_lowered_at_once_where_either_alone_passes():
    """Two allocs of 4 fail where the sizes are equal: lowering either alone
    passes, so each stayed at 4 (0.5.23's dsv4-hisparse at page size 16 kept
    an extend of 24 and 2 pages where 8 and 1 fail, helper-80); lowered
    together they come down to the smallest that fails, 2 and 2 (without
    the pass, 4 and 4)."""
    config = Config(target="tests.test_minimize:SameSizeTwice")
    four = (Step("alloc", {"n": 4}, "req_0"), Step("alloc", {"n": 4}, "req_1"))
    invariant = replay(Trace(config, four)).invariant
    shortest = minimize(Trace(config, four, invariant))
    assert shortest.invariant == invariant
    # The second alloc comes back as an extend of the first request (it allocs as much).
    assert [(s.rule, s.args) for s in shortest.steps] == [
        ("alloc", {"n": 2}), ("extend", {"reqs": ["req_0"], "tokens": [2]})]


def test_two_lowered_offers_each_pair_of_integers_both_lowest_first():
    """Each pair of integer arguments, a list's elements included, each lowered as ``_smaller_args`` lowers one;
    every pair's two lowest come before any pair's others, so that the budget reaches every pair (helper-83)."""
    from state_machines.runs.minimize import _two_lowered

    config = Config(target="builtin:dsv4-hisparse", page_size=16)
    steps = (
        Step("admit", {}, "req_0"),
        Step("extend", {"reqs": ["req_0"], "tokens": [24]}),
        Step("device_buffer_pages", {"req": "req_0", "pages": 2}),
    )
    got = [(c[1].args["tokens"], c[2].args["pages"]) for c in _two_lowered(steps, config)]
    assert got == [([1], 1), ([12], 1), ([23], 1)]
    allocs = tuple(Step("alloc", {"n": 6}, f"req_{i}") for i in range(3))
    got = [tuple(s.args["n"] for s in c) for c in _two_lowered(allocs, Config())]
    assert got[:3] == [(1, 1, 6), (1, 6, 1), (6, 1, 1)]
    assert len(got) == 3 * 9 and len(set(got)) == 27


class BigSegmentFreedTwice(PagedAllocator):
    """After an alloc of two pages or more, a segment free of more than a
    page releases its first page twice: the failure needs the alloc as big,
    and the segment longer than a page."""

    def alloc(self, need_size: int):
        self.big = need_size >= 2 * self.page_size
        return super().alloc(need_size)

    def free_segment(self, free_index, *, start_pos: int) -> None:
        super().free_segment(free_index, start_pos=start_pos)
        if getattr(self, "big", False) and free_index.numel() > self.page_size:
            self._release_pages(self._pages_of(free_index[:1]))

    def free_segments(self, segments) -> None:  # correct: the failure stays a free_segment's
        for free_index, start_pos in segments:
            PagedAllocator.free_segment(self, free_index, start_pos=start_pos)


def test_a_segment_lowered_is_not_refitted_back_above_where_it_was():
    """A segment free lowered below its request's last page was refitted to
    end there again, at the lowered value's slot of that page: 17 lowered to
    8 came back as 24, as long a trace and as failing, and the minimiser
    walked 17, 24, 28, 30, 31, ... and stopped at 18 (0.5.23's unified-mamba
    at page size 16 kept 31, helper-87).  It ends at 17, the least."""
    config = Config(target="tests.test_minimize:BigSegmentFreedTwice", page_size=16)
    steps = (Step("alloc", {"n": 32}, "req_0"), Step("free_segment", {"req": "req_0", "start": 0, "n": 31}))
    invariant = replay(Trace(config, steps)).invariant
    shortest = minimize(Trace(config, steps, invariant))
    assert shortest.invariant == invariant
    assert [(s.rule, s.args) for s in shortest.steps] == [
        ("alloc", {"n": 32}), ("free_segment", {"req": "req_0", "start": 0, "n": 17})]


def test_minimize_runs_its_passes_again_from_where_a_simpler_pool_fails_sooner(monkeypatch):
    """``settled``'s other ending.  A trace stuck at four steps on 4 slots
    fails on 2 slots, replayed as it is, after its second step.  No pass
    tries it there: ``cheap`` moves a trace unscaled only onto a shape
    listed before its own in ``configs`` (none here: 4 slots comes first),
    its other moves onto a smaller pool scale the amounts, and ``dear``'s
    deletes a step as it moves.  ``settled`` does, and takes the shorter
    failure; the passes then run again from there and delete its first
    step.  A fake ``_fails_like`` (which traces fail, and how soon) stands
    in for an allocator's replay, so the ending is reached on purpose: no
    shrink of the bench's bugs reaches it.  The assertions pin the order
    of the replays: the passes had worked on 4 slots (a deletion), and no
    candidate but the trace itself had failed, before the 4-step trace was
    tried on 2 slots.  Returning ``settled``'s answer without
    the passes again ends at two steps; without ``settled``, at four on 4
    slots."""
    big, small = (Config(target="builtin:token", size=size) for size in (4, 2))

    def allocs(*amounts):
        return tuple(Step("alloc", {"n": n}, f"req_{i}") for i, n in enumerate(amounts))

    # (pool size, amounts) -> the amounts of the steps its replay fails
    # after.  ``settled`` asks the second, the rerun's deletion the last;
    # the first and third keep the fake true to a replay (the trace given
    # fails; a failure returned fails again, the same).
    fails_after = {(4, (1, 2, 3, 4)): (1, 2, 3, 4), (2, (1, 2, 3, 4)): (1, 2), (2, (1, 2)): (1, 2), (2, (2,)): (2,)}
    asked = []

    def fails_like(candidate, invariant):
        amounts = tuple(step.args.get("n") for step in candidate.steps)
        asked.append((candidate.config.size, amounts))
        if any(step.rule != "alloc" for step in candidate.steps) or (candidate.config.size, amounts) not in fails_after:
            return None
        return attrs.evolve(candidate, steps=allocs(*fails_after[candidate.config.size, amounts]))

    monkeypatch.setattr(minimize_module, "_fails_like", fails_like)
    # The passes that replay a candidate only to see that it runs (``split``,
    # ``paired``) see every one run and pass: no allocator is driven.
    monkeypatch.setattr(minimize_module, "replay", lambda trace: None)
    shortest = minimize(Trace(big, allocs(1, 2, 3, 4), "free_sets_agree"), configs=(big, small))
    assert (shortest.config, shortest.steps) == (small, allocs(2))
    # The passes worked on 4 slots (a deletion) and met no failure but the
    # trace's own before the 4-step trace was tried on 2 slots, as
    # ``settled`` tries it once they are stuck.
    settling = asked.index((2, (1, 2, 3, 4)))
    assert (4, (1, 2, 3)) in asked[:settling]
    assert {query for query in asked[:settling] if query in fails_after} <= {(4, (1, 2, 3, 4))}
