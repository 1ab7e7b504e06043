"""The torch twins (unified families, page-interleave): a twin that says
its predicate holds is never wrong, on any of their built-in allocators or
mutants at a pool the twins read, and the twins carry the healthy steps."""

import random
from collections import Counter

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from bench.baseline import random_fuzz
from reference_model import page_interleave as pi
from reference_model import unified as ru
from reference_model import unified_hybrid as rh
from state_machines.config import Config
from state_machines.harness import build, lockstep, twins
from state_machines.harness import unified_hybrid as hybrid
from state_machines.harness.lockstep import TENSOR_CENSUS_PAGES, ids
from tests import large_pools


def _pages(pages: torch.Tensor, mask: torch.Tensor | None = None) -> set[int]:
    return set((pages if mask is None else pages[mask]).tolist())


@pytest.mark.parametrize("config", list(large_pools.configs(
    {"unified-swa": (1, 2, 4, 8), "unified-mamba": (1, 2, 4, 8), "page-interleave": (1, 2, 4, 8), "multi-ended": (1, 2, 4, 8)})),
    ids=str)
def test_a_twin_that_says_its_predicate_holds_is_right(config, monkeypatch):
    seen = Counter()

    def checked(twin, predicate_of):
        def run(*args):
            holds = twin(*args)
            seen[f"{twin.__name__} {holds}"] += 1
            if holds:
                seen["wrong"] += predicate_of(*args) is not None
            return holds
        monkeypatch.setattr(twins, twin.__name__, run)

    checked(twins.page_table_holds, lambda pool, v2p, p2v, pages, live: rh.unified_page_table_bijective(
        pool, ids(v2p), ids(p2v), _pages(pages, live), _pages(pages)))
    checked(twins.compacted_holds, lambda pool, physical, tokens, ps: rh.unified_compacted(
        pool, physical.tolist(), tokens, ps))
    checked(twins.read_path_holds, lambda got, v2p, pages, live, ps: rh.unified_read_path_agrees(
        "side", twins.tokens_of(pages, ps).tolist(), ids(got), ids(v2p), _pages(pages, live), ps))
    checked(twins.roles_hold, lambda p2v, first, n, span, holes, pending, lent=(): ru.physical_pages_owned_once(
        ru.PageTables(v2p=(), p2v=tuple(ids(p2v)), first_page=first, num_pages=n, span=span,
                      holes=tuple(ids(holes)), pending=tuple(pending)), list(lent)))
    checked(twins.tables_hold, lambda v2p, p2v, first, n, codes: ru.tables_bijective(
        ru.PageTables(v2p=tuple(ids(v2p)), p2v=tuple(ids(p2v)), first_page=first, num_pages=n, span=(0, 0), holes=()),
        {v for v, code in enumerate(codes) if code >= 2}))
    checked(twins.classes_hold, lambda lists, n: pi.free_pages_in_own_class([ids(p) for p in lists], n))
    mask = hybrid.LiveSets.mask

    def mask_agrees(live, side):
        got = mask(live, side)
        if got is not None:
            seen["wrong"] += _pages(twins.universe_tensor(live.universe), got) != live[side]
        return got

    monkeypatch.setattr(hybrid.LiveSets, "mask", mask_agrees)
    # A mutant runs on to its failure, so states that break an invariant
    # reach the fast paths too; a target runs clean (``large_pools.fuzz``).
    large_pools.fuzz(config)
    assert seen["wrong"] == 0, seen
    carried = {"builtin:page-interleave": "classes_hold", "builtin:multi-ended": "tables_hold"}
    assert seen[carried.get(config.target, "page_table_holds") + " True"], seen


def _t(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


corruptions = st.lists(st.tuples(st.booleans(), st.integers(0, 40), st.one_of(st.sampled_from([-1, -2, 0]), st.integers(0, 40))),
                       max_size=3)


@given(st.data(), corruptions)
def test_the_page_table_twin_holds_exactly_where_its_predicate_does(data, corrupt):
    pool = rh.SubPool("full", first=1, end=20, page_bytes=1, grows="up")
    universe = sorted(data.draw(st.sets(st.integers(1, 30), min_size=1)))
    live = data.draw(st.sets(st.sampled_from(universe), max_size=min(len(universe), 19)))
    physical = data.draw(st.permutations(range(pool.first, pool.end)))
    # A p2v shorter than the pool: pages past it are bound in v2p alone.
    v2p, p2v = [-1] * 32, [-1] * data.draw(st.integers(5, pool.end + 1))
    large_pools.bijection(v2p, p2v, zip(sorted(live), physical), corrupt)
    pages = _t(universe)
    mask = _t(int(v in live) for v in universe).bool()
    want = rh.unified_page_table_bijective(pool, v2p, p2v, set(live), set(universe)) is None
    assert twins.page_table_holds(pool, _t(v2p), _t(p2v), pages, mask) == want


@given(st.sampled_from(["up", "down"]), st.lists(st.integers(0, 12), max_size=8), st.integers(0, 20), st.integers(1, 2))
def test_the_compaction_twin_holds_exactly_where_its_predicate_does(grows, physical, tokens, ps):
    pool = rh.SubPool("full", first=1, end=10, page_bytes=1, grows=grows)
    want = rh.unified_compacted(pool, physical, tokens, ps) is None
    assert twins.compacted_holds(pool, _t(physical), tokens, ps) == want


@given(st.data(), st.integers(1, 3), corruptions)
def test_the_read_path_twin_holds_exactly_where_its_predicate_does(data, ps, corrupt):
    universe = sorted(data.draw(st.sets(st.integers(0, 12), min_size=1)))
    live = data.draw(st.sets(st.sampled_from(universe)))
    v2p = data.draw(st.lists(st.integers(-1, 20), min_size=13, max_size=13))
    tokens = [v * ps + k for v in universe for k in range(ps)]
    got = [v2p[t // ps] * ps + t % ps if t // ps in live else 0 for t in tokens]
    for _, at, value in corrupt:
        got[at % len(got)] = value
    want = rh.unified_read_path_agrees("full", tokens, got, v2p, set(live), ps) is None
    pages = _t(universe)
    mask = _t(int(v in live) for v in universe).bool()
    assert twins.read_path_holds(_t(got), _t(v2p), pages, mask, ps) == want


@given(st.lists(st.integers(-1, 9), min_size=1, max_size=14), st.integers(0, 3), st.integers(0, 16),
       st.tuples(st.integers(0, 16), st.integers(0, 16)), st.lists(st.integers(-1, 17), max_size=4),
       st.lists(st.integers(0, 17), max_size=3), st.lists(st.integers(0, 17), max_size=3))
# A page listed twice, inside the table and past it, where all else holds.
@example([-1, -1, -1], 0, 3, (0, 3), [0, 0, 1], [2], [])
@example([-1, -1, 4], 0, 3, (0, 3), [0], [1], [1])
@example([-1], 0, 1, (0, 4), [0, 1], [2], [2])
def test_the_roles_twin_holds_exactly_where_its_predicate_does(p2v, first, n, span, holes, pending, lent):
    """Over spans reaching past the table, listings that repeat, fall
    outside or name a bound page, and pages lent."""
    tables = ru.PageTables(v2p=(), p2v=tuple(p2v), first_page=first, num_pages=n, span=span, holes=tuple(holes),
                           pending=tuple(pending))
    want = ru.physical_pages_owned_once(tables, lent) is None
    assert twins.roles_hold(_t(p2v), first, n, span, _t(holes), tuple(pending), list(lent)) == want


def test_the_page_table_twin_sees_two_live_pages_on_one_page_past_p2v():
    """Past the end of p2v only v2p says a page is bound: two live pages on
    one such page are caught by the twin as by its predicate."""
    pool = rh.SubPool("full", first=1, end=20, page_bytes=1, grows="up")
    v2p, p2v = [-1, 12, 12, -1], [-1] * 10
    assert rh.unified_page_table_bijective(pool, v2p, p2v, {1, 2}, {1, 2, 3}) is not None
    assert not twins.page_table_holds(pool, _t(v2p), _t(p2v), _t([1, 2, 3]), _t([1, 1, 0]).bool())


def test_the_page_table_twin_sees_a_page_not_live_yet_mapped_to_a_page_naming_none():
    """A page the model holds free, still mapped in v2p to a page whose p2v
    names no virtual page: no count tells it, the live mask does."""
    pool = rh.SubPool("full", first=1, end=20, page_bytes=1, grows="up")
    v2p, p2v = [-1] * 32, [-1] * 21
    v2p[1], p2v[5], v2p[2] = 5, 1, 7
    assert rh.unified_page_table_bijective(pool, v2p, p2v, {1}, {1, 2}) is not None
    assert not twins.page_table_holds(pool, _t(v2p), _t(p2v), _t([1, 2]), _t([1, 0]).bool())


@given(st.data(), corruptions)
def test_the_tables_twin_holds_exactly_where_its_predicate_does(data, corrupt):
    """``tables_bijective`` over tables a bijection builds, then corrupts;
    the model's held pages are its owner codes of 2 and up."""
    first, num_pages = data.draw(st.integers(0, 3)), data.draw(st.sampled_from([20, *range(23)]))
    codes = bytearray(data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=30)))
    live = {v for v, code in enumerate(codes) if code >= 2}
    # Pages up to past num_pages: a table can bind a page outside the pool.
    physical = data.draw(st.permutations(range(first, max(num_pages, first) + 3)))
    v2p, p2v = [-1] * data.draw(st.integers(1, 32)), [-1] * data.draw(st.integers(1, num_pages + 4))
    large_pools.bijection(v2p, p2v, zip(sorted(live), physical), corrupt)
    tables = ru.PageTables(v2p=tuple(v2p), p2v=tuple(p2v), first_page=first, num_pages=num_pages, span=(0, 0), holes=())
    try:
        want = ru.tables_bijective(tables, live) is None
    except IndexError:
        # A page past p2v the predicate indexes: the twin leaves it to the predicate.
        want = False
    assert twins.tables_hold(_t(v2p), _t(p2v), first, num_pages, codes) == want


def test_a_twin_given_values_not_integers_leaves_them_to_its_predicate():
    """int64 would make 0.5 a 0: every twin says False on a float tensor,
    and a float census stays the list its predicates read."""
    pool = rh.SubPool("full", first=1, end=20, page_bytes=1, grows="up")
    half = torch.tensor([1.0, 2.5])
    pages, live = _t([1, 2]), _t([1, 1]).bool()
    assert not twins.page_table_holds(pool, half, _t([-1] * 21), pages, live)
    assert not twins.compacted_holds(pool, half, 4, 2)
    assert not twins.read_path_holds(half, _t([-1, 1, 2]), pages, live, 1)
    assert not twins.roles_hold(_t([-1, 1, 2]), 1, 3, (1, 3), torch.tensor([0.5]))
    assert not twins.tables_hold(half, _t([-1] * 21), 1, 20, bytearray(3))
    assert not twins.classes_hold([torch.tensor([0.5])], 2)
    assert not twins.bound_count_is(torch.tensor([-1.0, 1.5]), 1, 2, 1)
    free = torch.arange(TENSOR_CENSUS_PAGES, dtype=torch.float32) + 1.5
    assert twins.census(free, None) == free.tolist()


def test_a_universe_is_found_by_identity_and_an_equal_one_shares_its_tensor():
    """``universe_tensor``: the same pages for an equal universe made anew
    (each example makes its own), a run of ids read as a slice and a
    universe with gaps gathered, both as ``t[pages]``."""
    run = frozenset(range(3, 3 + TENSOR_CENSUS_PAGES))
    pages = twins.universe_tensor(run)
    assert twins.universe_tensor(run) is pages
    assert twins.universe_tensor(frozenset(set(run))) is pages
    gapped = frozenset(range(0, 2 * TENSOR_CENSUS_PAGES, 2))
    other = twins.universe_tensor(gapped)
    assert other.tolist() == sorted(gapped) and pages.tolist() == sorted(run)
    t = torch.arange(4 * TENSOR_CENSUS_PAGES) * 7
    for universe in (pages, other):
        assert torch.equal(twins.at_pages(t, universe), t[universe])
    assert twins.universe_tensor(frozenset(range(5))) is None


@given(st.lists(st.lists(st.integers(0, 40), max_size=8), max_size=5), st.integers(1, 6))
def test_the_class_twin_holds_exactly_where_its_predicate_does(lists, shard_size):
    """``classes_hold`` over any lists, in one pass: True exactly where
    ``free_pages_in_own_class`` finds no stray."""
    tensors = [torch.tensor(pages, dtype=torch.int64) for pages in lists]
    assert twins.classes_hold(tensors, shard_size) is (pi.free_pages_in_own_class(lists, shard_size) is None)


@pytest.mark.parametrize("config", list(large_pools.configs(
    {"unified-swa": (1, 2, 4, 8), "unified-mamba": (1, 2, 4, 8), "page-interleave": (1, 2, 4, 8), "multi-ended": (1, 2, 4, 8)})),
    ids=str)
def test_a_twin_skipped_on_inputs_it_held_on_changes_no_verdict(config, monkeypatch):
    """A twin whose inputs are those it last held on is not run again
    (``_twin_holds``): each run, mutants included, meets the same
    failure at the same step as when every twin runs every step, and on a
    clean target the memo is hit."""
    seed = random.Random(str(config)).randrange(100)
    hits = Counter()
    same = lockstep._same_inputs

    def counted(last, inputs):
        hit = same(last, inputs)
        hits[hit] += 1
        return hit

    monkeypatch.setattr(lockstep, "_same_inputs", counted)
    remembered = random_fuzz(config, seed=seed, max_examples=10)
    monkeypatch.setattr(lockstep, "_same_inputs", lambda last, inputs: False)
    every_step = random_fuzz(config, seed=seed, max_examples=10)
    assert remembered.ok == every_step.ok
    if not remembered.ok:
        assert (remembered.failure.invariant, len(remembered.failure.steps)) == (
            every_step.failure.invariant, len(every_step.failure.steps))
    assert remembered.record.steps == every_step.record.steps
    # A clean target's run steps where a side stays as it was (a mutant may fail first).
    assert hits[True] or config.mutant, hits


def test_a_twin_s_remembered_inputs_are_copies_compared_item_by_item():
    """What ``_twin_holds`` keeps cannot change with the allocator's tensors
    or lists; a different dtype, an element, a list item, an unknown
    object, each makes the twin run again."""
    v2p, lent = torch.tensor([1, 2, 3]), [4]
    kept = tuple(map(lockstep._kept, (v2p, lent, bytearray(b"ab"), (1, (2, 3)), None)))
    assert lockstep._same_inputs(kept, (v2p, lent, bytearray(b"ab"), (1, (2, 3)), None))
    v2p[0], lent[0] = 9, 5
    assert not lockstep._same_inputs(kept[:1], (v2p,)) and not lockstep._same_inputs(kept[1:2], (lent,))
    assert not lockstep._same_inputs((lockstep._kept(torch.tensor([1])),), (torch.tensor([1], dtype=torch.int32),))
    assert not lockstep._same_inputs((lockstep._kept(object()),), (object(),))
    assert not lockstep._same_inputs((lockstep._kept([torch.tensor([1])]),), ([torch.tensor([2])],))


def test_a_table_is_read_as_ints_through_a_view_or_a_list(monkeypatch):
    """``int_view``: Python ints off the tensor's buffer; a list where the
    tensor is not of integers, or this torch has no NumPy bridge; and
    uint64 is no integer the twins compare (as int64, 2**64 - 1 reads -1)."""
    view = twins.int_view(torch.tensor([3, -1, 5], dtype=torch.int32))
    assert [type(v) for v in view] == [int] * 3 and list(view) == [3, -1, 5]
    assert twins.int_view(torch.tensor([0.5])) == [0.5]

    def no_bridge(self):
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", no_bridge)
    assert twins.int_view(torch.tensor([7, 8])) == [7, 8]
    assert not lockstep.integral(torch.tensor([2**63], dtype=torch.uint64))


def test_a_remembered_tensor_is_compared_byte_for_byte_in_its_shape():
    """``_same`` compares a tensor's bytes as words where its layout lets
    it (a bool mask as int64): a mask of other shape but the same bytes,
    one flipped entry, a mask off a word's edge (compared as it is), each
    is seen for what it is."""
    mask = torch.rand(64, generator=torch.Generator().manual_seed(0)) > 0.5
    kept = lockstep._kept(mask)
    assert lockstep._words(mask).dtype == torch.int64 and lockstep._same(kept, mask)
    assert not lockstep._same(kept, mask.reshape(8, 8))
    flipped = mask.clone()
    flipped[37] = ~flipped[37]
    assert not lockstep._same(kept, flipped)
    odd = torch.zeros(65, dtype=torch.bool)[1:]
    assert lockstep._words(odd) is odd and lockstep._same(lockstep._kept(odd), odd)
    assert not lockstep._same(lockstep._kept(odd), torch.ones(64, dtype=torch.bool))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.float32])
@pytest.mark.parametrize("n", [64, 4096, 16386])
def test_a_large_tensor_compares_by_memcmp_as_torch_equal_does(dtype, n):
    """Above ``MEMCMP_BYTES`` two plain CPU tensors compare by memcmp:
    ``equal`` (a twin's) and ``_same`` (the memo's) give ``torch.equal``'s
    answer for a copy, a change at either end or in the middle, a view at
    an offset, a transposed (not contiguous) one and another dtype; a
    float's -0.0 against 0.0 is unequal bytes, which ``_same`` reads as a
    change (the twin runs again) and ``equal`` leaves to ``torch.equal``."""
    g = torch.Generator().manual_seed(n)
    a = (torch.randint(-5, 5, (n,), generator=g) > 0) if dtype is torch.bool else torch.randint(-5, 5, (n,), generator=g).to(dtype)
    cases = [a.clone(), a.to(torch.int16) if dtype is not torch.int16 else a.to(torch.int32),
             torch.cat([a, a])[n:], torch.cat([a, a]).reshape(2, n)[1]]
    for at in (0, n // 2, n - 1):
        changed = a.clone()
        changed[at] = (~changed[at]) if dtype is torch.bool else changed[at] + 1
        cases.append(changed)
    for b in cases:
        assert lockstep.equal(a, b) == torch.equal(a, b)
        assert lockstep._same(lockstep._kept(a), b) == (a.dtype == b.dtype and torch.equal(a, b))
    square = a[: 64 * (n // 64)].reshape(64, -1)
    assert lockstep.equal(square, square.t().contiguous().t()) and lockstep._same(lockstep._kept(square), square.t().contiguous().t())
    if dtype is torch.float32:
        zeros = torch.zeros(n)
        assert lockstep.equal(zeros, -zeros) and not lockstep._same(lockstep._kept(zeros), -zeros)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_quantized_tensor_is_compared_by_value_not_by_its_bytes():
    """A quantized tensor's bytes leave out its scale: two of equal bytes
    may hold other values, so neither memcmp nor the words view takes it
    (the words view of one had crashed the interpreter)."""
    one = torch.quantize_per_tensor(torch.ones(4096), 0.1, 0, torch.qint8)
    two = torch.quantize_per_tensor(torch.full((4096,), 2.0), 0.2, 0, torch.qint8)
    assert torch.equal(one.int_repr(), two.int_repr())
    assert lockstep._plain(one, two) == 0 and not lockstep._same(lockstep._kept(one), two)
    assert lockstep._same(lockstep._kept(one), one)


def test_memcmp_reads_a_bool_byte_other_than_one_as_unequal_where_torch_equal_does_not():
    """A bool byte other than 0 or 1 (written through a uint8 view) is True
    to ``torch.equal`` and unequal bytes to memcmp: ``equal`` then says
    unequal, the safe side (the twin does not hold, its predicate judges)."""
    ones = torch.ones(4096, dtype=torch.bool)
    odd = ones.clone()
    odd.view(torch.uint8)[7] = 2
    assert torch.equal(ones, odd) and not lockstep.equal(ones, odd)


def test_an_unchanging_tensor_is_remembered_as_itself_and_no_other_is(monkeypatch):
    """A universe (``unchanging``) is kept by identity and taken for itself
    with no compare, until torch counts a write to it; an equal tensor that
    is not it is compared; any other tensor is kept as a copy, so writing
    it shows."""
    universe = twins.universe_tensor(frozenset(range(1, lockstep.TENSOR_CENSUS_PAGES + 1)))
    assert lockstep._kept(universe) is universe
    assert lockstep._same(universe, universe.clone()) and not lockstep._same(universe, universe + 1)
    table = torch.arange(8)
    kept = lockstep._kept(table)
    assert kept is not table
    table[3] = -1
    assert not lockstep._same(kept, table)
    written = lockstep.unchanging(torch.arange(8))
    equal = torch.equal

    def no_compare(a, b):
        assert a is not universe, "an unchanging tensor was compared"
        return equal(a, b)

    monkeypatch.setattr(torch, "equal", no_compare)
    assert lockstep._same(universe, universe)
    assert lockstep._kept(written) is written
    remembered = lockstep._kept((written,))
    assert lockstep._same_inputs(remembered, (written,))
    written[0] = 5
    assert lockstep._kept(written) is not written and not lockstep._is_unchanging(written)
    # One the memo held on, kept as itself, stands for nothing once written:
    # not the same as itself, nor as a tensor equal to what it now holds.
    assert not lockstep._same_inputs(remembered, (written,))
    assert not lockstep._same_inputs(remembered, (written.clone(),))


def test_what_is_derived_while_a_twin_holds_lasts_as_long_as_its_inputs():
    """``_while_held``: kept while the memo's entry stands (the twin held
    again on the same inputs), made again once they change."""
    state = build(Config(target="builtin:unified-swa", page_size=1))
    table = torch.arange(4)
    made = []

    def holds(name):
        assert state._twin_holds(lambda: None, name, lambda t: True, table)
        return state._while_held(name, lambda: made.append(table.sum().item()) or made[-1])

    assert holds("t") == 6 and holds("t") == 6 and made == [6]
    table[0] = 10
    assert holds("t") == 16 and made == [6, 16]
    assert state._while_held("never held", lambda: 1) == 1 and "never held" not in state._derived


def test_a_universe_is_sliced_where_its_ids_are_a_run_and_gathered_elsewhere():
    """``at_pages``: a run of ids reads a slice of the table (a view, no
    element of the universe read), other ids a gather; the runs are kept
    with the universes, as few as they."""
    table = torch.arange(4 * TENSOR_CENSUS_PAGES) * 10
    run = twins.universe_tensor(frozenset(range(5, 5 + TENSOR_CENSUS_PAGES)))
    spaced = twins.universe_tensor(frozenset(range(5, 5 + 2 * TENSOR_CENSUS_PAGES, 2)))
    assert twins.at_pages(table, run)._base is table and torch.equal(twins.at_pages(table, run), table[run])
    assert twins.at_pages(table, spaced)._base is None and torch.equal(twins.at_pages(table, spaced), table[spaced])
    assert torch.equal(twins.at_pages(table, run.clone()), table[run])
    for k in range(20):
        twins.universe_tensor(frozenset(range(k + 1, k + 1 + TENSOR_CENSUS_PAGES)))
    assert len(twins._UNIVERSES) <= 8


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("flags_past", [0, -6, -7, 40])
def test_a_live_mask_reads_an_id_past_the_model_s_flags_as_live(step, flags_past):
    """``live_mask`` against the flags, id by id: 1 is free, anything else
    live, and an id past the flags (never freed) live; over a run of ids
    (a slice) and spaced ids (a gather), the flags reaching past the last
    id or stopping short of it."""
    import array

    rng = random.Random(step * 100 + flags_past)
    ids = range(5, 5 + step * TENSOR_CENSUS_PAGES, step)
    flags = array.array("q", (rng.choice([0, 1, 1, 2]) for _ in range(ids[-1] + 1 + flags_past)))
    flags[-1] = 1  # the last flag free: an id there (flags_past 0 or -6) must read as free
    pages = twins.universe_tensor(frozenset(ids))
    want = [not (v < len(flags) and flags[v] == 1) for v in ids]
    assert twins.live_mask(pages, flags).tolist() == want
    assert twins.live_mask(pages.clone(), flags).tolist() == want


def _variants(t: torch.Tensor):
    """``t`` as int32, as a strided view, and with the negative bit set
    (negated values, read back as ``t``'s), the ways a table reaches a twin."""
    yield t.to(torch.int32)
    wide = torch.zeros(2 * t.numel(), dtype=t.dtype)
    wide[::2] = t
    yield wide[::2]
    yield torch._neg_view(-t)


@given(st.data(), corruptions)
def test_a_twin_answers_alike_for_int32_strided_and_negated_tables(data, corrupt):
    """The twins read their tables through ``to_numpy`` (a copy where the
    dtype or layout asks, the very memory where not): each variant of a
    table gets the answer the plain int64 one gets, and no input changes."""
    pool = rh.SubPool("full", first=1, end=20, page_bytes=1, grows="up")
    universe = sorted(data.draw(st.sets(st.integers(1, 30), min_size=1)))
    live = data.draw(st.sets(st.sampled_from(universe), max_size=min(len(universe), 19)))
    v2p, p2v = [-1] * 32, [-1] * 21
    large_pools.bijection(v2p, p2v, zip(sorted(live), data.draw(st.permutations(range(1, 20)))), corrupt)
    pages, mask = _t(universe), _t(int(v in live) for v in universe).bool()
    codes = bytearray(2 if v in live else 0 for v in range(32))
    got = _t(v2p[v] if v in live else 0 for v in universe)
    cases = [
        (twins.page_table_holds, lambda a, b: (pool, a, b, pages, mask)),
        (twins.tables_hold, lambda a, b: (a, b, 1, 20, codes)),
        (twins.roles_hold, lambda a, b: (b, 1, 20, (1, 20), _t(p for p in range(1, 20) if p2v[p] == -1))),
        (twins.read_path_holds, lambda a, b: (got, a, pages, mask, 1)),
    ]
    for twin, args in cases:
        want = twin(*args(_t(v2p), _t(p2v)))
        for a, b in zip(_variants(_t(v2p)), _variants(_t(p2v))):
            before = a.tolist(), b.tolist()
            assert twin(*args(a, b)) == want, (twin.__name__, a.dtype, a.is_neg())
            assert (a.tolist(), b.tolist()) == before


def test_a_read_path_slot_that_would_wrap_in_int64_is_left_to_the_predicate():
    """At page size 4, a page at 2**62 has slots past int64: computed in
    int64 they wrap, and a read path holding the wrapped values would match."""
    v2p = [-1, 2**62, -1]
    got = [(2**62 * 4 + k) % 2**64 - 2**64 * ((2**62 * 4 + k) % 2**64 >= 2**63) for k in range(4)]
    assert rh.unified_read_path_agrees("full", [4, 5, 6, 7], got, v2p, {1}, 4) is not None
    assert not twins.read_path_holds(_t(got), _t(v2p), _t([1]), _t([1]).bool(), 4)


def test_without_a_numpy_bridge_the_twins_leave_every_table_to_their_predicates(monkeypatch):
    """No NumPy (or a torch that hands it no tensor): every NumPy twin that
    holds on these tables with the bridge says False without it, and no
    live mask is made; the SWA census still lists the unmapped pages."""
    pool = rh.SubPool("full", first=1, end=20, page_bytes=1, grows="up")
    v2p, p2v = _t([-1, 5, -1]), _t([-1] * 5 + [1] + [-1] * 15)
    pages, mask = _t([1, 2]), _t([1, 0]).bool()
    assert rh.unified_page_table_bijective(pool, v2p.tolist(), p2v.tolist(), {1}, {1, 2}) is None
    calls = [
        lambda: twins.page_table_holds(pool, v2p, p2v, pages, mask),
        lambda: twins.tables_hold(v2p, p2v, 1, 20, bytearray([0, 2, 0])),
        lambda: twins.read_path_holds(_t([5, 0]), v2p, pages, mask, 1),
        lambda: twins.roles_hold(p2v, 1, 20, (1, 20), _t(p for p in range(1, 20) if p != 5)),
        lambda: twins.bound_count_is(p2v, 1, 20, 1),
        lambda: twins.compacted_holds(pool, _t([1]), 1, 1),
        lambda: twins.live_mask(pages, bytearray(8 * 3)) is not None,
    ]
    assert [call() for call in calls] == [True] * len(calls)
    monkeypatch.setattr(twins, "NUMPY_BRIDGE", False)
    assert [call() for call in calls] == [False] * len(calls)
    assert torch.equal(twins.unmapped(v2p, pages), _t([2]))
