"""The trace minimiser deletes steps a failure does not need, and only those."""

import attrs

from state_machines.config import Config
from state_machines.harness import Step
from state_machines.runs.runner import minimize, replay
from state_machines.runs.trace import Trace

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
    assert replay(Trace(config, six)).invariant == "free_sets_agree"
    shortest = minimize(Trace(config, six, "free_sets_agree"))
    assert (shortest.invariant, len(shortest.steps)) == ("free_sets_agree", 5)


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
    and 3 slots freed in one group become one request grown twice and
    finished, with no group (four steps, the known shortest)."""
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
    assert replay(Trace(config, eight)).invariant == "free_sets_agree"
    shortest = minimize(Trace(config, eight, "free_sets_agree"))
    assert (shortest.invariant, len(shortest.steps)) == ("free_sets_agree", 4)


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
