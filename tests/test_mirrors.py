"""The side pools' mirrors: exact at every step, and every check that reads
them gives the verdict and message the page-by-page reading gives."""

import random
from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference_model import OwnershipModel, invariants
from reference_model.census import Census
from reference_model.hisparse import DeviceSide
from reference_model.mirrors import LANE_MOST, FlagSet, PeerMap, count
from reference_model.model import FREE, REQUEST
from reference_model.swa import SWASide
from state_machines.harness import lockstep
from state_machines.harness.lockstep import TENSOR_CENSUS_PAGES, Lockstep, TensorCensus, ids, rows_to_read
from tests import large_pools


@given(st.lists(st.tuples(st.sampled_from(["add", "discard", "update", "difference_update"]),
                          st.lists(st.integers(0, 40), max_size=4))))
def test_a_flag_set_flags_exactly_its_members(ops):
    pages = FlagSet(range(1, 21))
    for op, arg in ops:
        if op in ("add", "discard"):
            for page in arg:
                getattr(pages, op)(page)
        else:
            getattr(pages, op)(arg)
        assert [i for i, f in enumerate(pages.flags) if f] == [i for i, b in enumerate(pages.bits) if b] == sorted(pages)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 30), st.integers(0, 30))))
def test_a_peer_map_mirrors_its_pages_and_peers(ops):
    peers = PeerMap(top=30, peer_top=30)
    for put, page, peer in ops:
        if put:
            peers[page] = peer
        else:
            peers.pop(page, None)
        assert [i for i, m in enumerate(peers.mapped) if m] == sorted(peers)
        assert all(peers.peers[p] == q for p, q in peers.items())
        held = Counter(peers.values())
        assert all(peers.held[i] == held[i] for i in range(len(peers.held)))


@pytest.mark.parametrize("pages", [list(range(1, 2049)), [5, 3, 9, 3], [], [0, -2, 7]])
def test_a_fresh_pool_s_models_are_copies_built_as_ever_and_each_its_own(pages, monkeypatch):
    """``mirrors.fresh`` builds a fresh pool's mirrors once and hands out
    copies: each equal to what building gives, mirrors and all, and changed
    without reaching the kept one or another copy; the kept pools are
    bounded, the last asked for kept longest."""
    from reference_model import mirrors
    from reference_model.model import FREE_OWNER, OwnerMap, owner
    from reference_model.swa import _fresh_side

    def owners(model):
        o = model.owner
        return dict(o), o.free, o.held, o.kinds, o.flags, o.codes

    def side(s):
        return set(s.free), s.free.flags, s.free.bits, s.universe, s._universe_lanes

    built = OwnershipModel(owner=OwnerMap(dict.fromkeys(pages, FREE_OWNER)), ledger=None)
    free, universe, lanes = _fresh_side(tuple(pages))
    side_built = set(free), free.flags, free.bits, universe, lanes
    first, second = OwnershipModel.from_census(pages), OwnershipModel.from_census(pages)
    assert first.owner is not second.owner and owners(first) == owners(second) == owners(built)
    one, two = SWASide.from_census(first, pages), SWASide.from_census(second, pages)
    assert one.free is not two.free and side(one) == side(two) == side_built
    if pages:
        first.owner[pages[0]] = owner(REQUEST, 0)
        one.free.discard(pages[0])
    assert owners(second) == owners(OwnershipModel.from_census(pages)) == owners(built)
    assert side(two) == side(SWASide.from_census(second, pages)) == side_built
    first.clear()
    assert owners(first) == owners(OwnershipModel(owner=OwnerMap(dict.fromkeys(sorted(set(pages)), FREE_OWNER)), ledger=None))
    kept: dict = {}
    monkeypatch.setattr(mirrors, "FRESH_KEPT", 2)
    for n in (1, 2, 1, 3):
        assert mirrors.fresh(kept, range(n), list, list) == list(range(n))
    assert list(kept) == [(0,), (0, 1, 2)]
    # At most FRESH_KEPT_PAGES pages in all: the oldest go first, and a pool past it is never kept.
    monkeypatch.setattr(mirrors, "FRESH_KEPT_PAGES", 4)
    assert mirrors.fresh(kept, range(5), list, list) == list(range(5)) and list(kept) == [(0,), (0, 1, 2)]
    mirrors.fresh(kept, range(2), list, list)
    assert list(kept) == [(0, 1)]


def test_a_fresh_pool_of_ids_not_all_ints_is_not_kept_and_equal_ones_get_the_ints_copy():
    """Ids equal to ints but of another type (a float census) hash and
    compare as the ints do.  A pool of such ids is built each time, never
    kept: were it kept, int ids would be handed its float keys, which
    reach the allocator as floats, and no mirrors.  Once the ints' pool is
    kept, equal floats are handed its copy: ints, mirrors and all."""
    from reference_model import mirrors
    from reference_model.model import _FRESH_OWNERS, OwnerMap

    pages = [1001, 1003]  # ids no other test keeps
    floats = OwnerMap.all_free([float(p) for p in pages])
    assert [type(p) for p in floats] == [float] * 2 and floats.flags is None
    assert tuple(pages) not in _FRESH_OWNERS
    ints = OwnerMap.all_free(pages)
    assert [type(p) for p in ints] == [int] * 2 and ints.flags is not None
    assert [type(p) for p in OwnerMap.all_free([float(p) for p in pages])] == [int] * 2
    side = SWASide.from_census(OwnershipModel.from_census([0.5, 1.5]), [0.5, 1.5])
    assert set(side.free) == {0.5, 1.5} and side.free.flags is None
    assert mirrors.fresh({}, [1.0], list, list) == [1.0]


def test_a_fresh_pool_s_ids_are_sorted_distinct_and_the_same_objects_each_example():
    """``pool_ids``: a census as ``sorted(set(census))`` and its set; the
    same census again (a new list, as each example reads it) gets the very
    same tuple and set, so a universe is found by identity; a census of
    floats is never kept."""
    census = [7, 3, 3, 5000, 9, 7]
    ids, universe = lockstep.pool_ids(census)
    assert ids == tuple(sorted(set(census))) and universe == frozenset(census)
    again = lockstep.pool_ids(list(census))
    assert again[0] is ids and again[1] is universe
    assert lockstep.pool_ids([9, 3, 7, 5000])[0] == ids
    floats = [2.5, 1.5, 2.5]
    assert lockstep.pool_ids(floats)[0] == (1.5, 2.5) and lockstep.pool_ids(floats)[1] is not lockstep.pool_ids(floats)[1]


def test_the_mirrored_containers_refuse_changes_their_mirrors_would_miss():
    with pytest.raises(TypeError):
        FlagSet({1, 2}).clear()
    with pytest.raises(TypeError):
        PeerMap().update({1: 2})


@pytest.mark.parametrize("config", list(large_pools.configs({"swa": (1, 2), "hisparse": (1, 2), "dsv4-hisparse": (4, 8)})),
                         ids=str)
def test_at_a_large_pool_the_mirrors_give_the_page_by_page_verdicts(config, monkeypatch):
    """At a pool the tensor census reads (mutants included): each mapping
    check gives the verdict and message reading every page gives, and the
    side pools' counts and self-check equal those built page by page; the
    fast paths are taken, and skip every page on some step."""
    seen = Counter()
    judge_mapping = Lockstep._judge_mapping

    def both(self, predicate, mapping, page_size, side, *more, sentinel=False, free_census=None):
        pages = lockstep.rows_to_read(mapping, page_size, self.model, side, sentinel=sentinel, free_census=free_census)
        full = predicate(ids(mapping), page_size, self.model, side, *more)
        fast = None if pages == [] else predicate(ids(mapping), page_size, self.model, side, *more, pages=pages)
        seen["skipped" if pages == [] else "read" if pages is None else "pending"] += 1
        seen["differ"] += fast != full
        judge_mapping(self, predicate, mapping, page_size, side, *more, sentinel=sentinel, free_census=free_census)

    real_counts = SWASide.counts
    real_violations = {side: side.violations for side in (SWASide, DeviceSide)}

    def counts(side):
        fast = side._partition_counts()
        seen["counts fast"] += fast is not None
        seen["differ"] += fast is not None and fast != Counter(o.kind for o in side.owner_map().values())
        return real_counts(side)

    def violations(side):
        fast = real_violations[type(side)](side)
        seen["differ"] += (fast == []) != (side.violations_found() == [])
        return fast

    monkeypatch.setattr(Lockstep, "_judge_mapping", both)
    monkeypatch.setattr(SWASide, "counts", counts)
    for side in real_violations:
        monkeypatch.setattr(side, "violations", violations)
    # A mutant runs on to its failure, so states that break an invariant
    # reach the fast paths too; a target runs clean (``large_pools.fuzz``).
    large_pools.fuzz(config)
    assert seen["differ"] == 0, seen
    assert seen["skipped"] and seen["counts fast"], seen


def _pair(pages: int = TENSOR_CENSUS_PAGES):
    """A full pool and its SWA side of ``pages`` pages each; full pages 1..8
    belong to a request, each mapped to an SWA page; the mapping, as the
    allocator would keep it at page size 2."""
    full = OwnershipModel.from_census(list(range(1, pages + 1)))
    full.new_request(row=0, pages=list(range(1, 9)))
    side = SWASide.from_census(full, list(range(1, pages + 1)))
    side.take(list(range(1, 9)), list(range(11, 19)))
    mapping = torch.zeros((pages + 1) * 2, dtype=torch.int32)
    for page, peer in side.mapping.items():
        mapping[page * 2 : page * 2 + 2] = torch.tensor([peer * 2, peer * 2 + 1])
    return full, side, mapping


def _census(side) -> TensorCensus:
    return TensorCensus(torch.tensor(sorted(side.free), dtype=torch.int64), side)


def test_the_mapping_rows_the_mirrors_vouch_for_are_not_read():
    """Every row as the model says: none is read.  A row off: only it.  A
    small pool, or a census not exact: every row.  A peer the (exact)
    census lists free, which the rows cannot show: every row."""
    full, side, mapping = _pair()
    assert rows_to_read(mapping, 2, full, side, sentinel=False, free_census=_census(side)) == []
    mapping[5 * 2] = 0
    assert rows_to_read(mapping, 2, full, side, sentinel=False, free_census=_census(side)) == [5]
    small = _pair(TENSOR_CENSUS_PAGES - 1)
    assert rows_to_read(small[2], 2, small[0], small[1], sentinel=False) is None
    full, side, mapping = _pair()
    assert rows_to_read(mapping, 2, full, side, sentinel=False, free_census=Census(sorted(side.free))) is None
    side.free.add(13)
    assert rows_to_read(mapping, 2, full, side, sentinel=False, free_census=_census(side)) is None
    assert invariants.swa_mapping_consistent(ids(mapping), 2, full, side, side.free) is not None


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("fill", [0, -1])
def test_a_page_filled_to_nothing_must_map_to_nothing_at_every_page_size(page_size, fill):
    """A live page whose filled count is 0 or less maps every slot to
    nothing: a mapping still naming its peer is read (page size 1 too), and
    the predicate finds it; mapped to nothing, no page is read, and the
    predicate agrees."""
    pages = TENSOR_CENSUS_PAGES
    full = OwnershipModel.from_census(list(range(1, pages + 1)))
    full.new_request(row=0, pages=[1, 2])
    side = SWASide.from_census(full, list(range(1, pages + 1)))
    side.take([1, 2], [101, 102], filled=[page_size, fill])
    mapping = torch.zeros((pages + 1) * page_size, dtype=torch.int64)
    mapping[page_size : 2 * page_size] = torch.arange(page_size) + 101 * page_size
    assert rows_to_read(mapping, page_size, full, side, sentinel=False, free_census=_census(side)) == []
    assert invariants.swa_mapping_consistent(ids(mapping), page_size, full, side, side.free) is None
    mapping[2 * page_size] = 102 * page_size
    assert rows_to_read(mapping, page_size, full, side, sentinel=False, free_census=_census(side)) == [2]
    assert invariants.swa_mapping_consistent(ids(mapping), page_size, full, side, side.free) is not None


def test_without_a_numpy_bridge_a_mapping_is_read_page_by_page(monkeypatch):
    full, side, mapping = _pair()
    assert rows_to_read(mapping, 2, full, side, sentinel=False, free_census=_census(side)) == []
    monkeypatch.setattr(lockstep, "NUMPY_BRIDGE", False)
    assert rows_to_read(mapping, 2, full, side, sentinel=False, free_census=_census(side)) is None


def test_a_count_past_what_a_lane_holds_drops_the_mirrors():
    """Sums of byte lanes stay exact only below 256: a peer held more than
    LANE_MOST times (a broken model) drops the map's mirrors, and the
    checks read the dict."""
    peers = PeerMap(top=200, peer_top=10)
    for page in range(LANE_MOST):
        peers[page] = 5
    assert peers.held[5] == LANE_MOST
    peers[LANE_MOST] = 5
    assert peers.mapped is None and peers.held is None
    assert count(bytearray(), [3] * (LANE_MOST + 1), 1, 100) is None


def test_a_mapping_not_of_integers_is_read_page_by_page():
    """Cast to int64, 30.5 would pass for 30: a float mapping is left to the
    predicate, which sees the half."""
    full, side, mapping = _pair()
    mapping = mapping.to(torch.float32)
    mapping[5 * 2] += 0.5
    assert rows_to_read(mapping, 2, full, side, sentinel=False, free_census=_census(side)) is None
    assert invariants.swa_mapping_consistent(ids(mapping), 2, full, side, _census(side)) is not None


def test_a_side_pool_s_tensor_census_asks_the_pool_whether_its_free_pages_are_its_own():
    """A side model freeing a page outside its pool (a model bug): the
    tensor census's containment is the plain census's."""
    full = OwnershipModel.from_census(list(range(1, TENSOR_CENSUS_PAGES + 1)))
    side = SWASide.from_census(full, list(range(1, TENSOR_CENSUS_PAGES + 1)))
    assert side.free_in_pool()
    side.free.discard(5)
    side.free.add(TENSOR_CENSUS_PAGES + 100)
    pages = sorted(side.free)
    assert not side.free_in_pool()
    assert TensorCensus(torch.tensor(pages), side).within(side) is Census(pages).within(side) is False


def test_a_side_s_counts_are_summed_once_while_it_holds_still():
    """Inside ``unchanging()`` (one step's checks) ``counts()`` and
    ``violations()`` share one sum, and a caller's change to the Counter it
    got reaches no other; after the block a change is counted again."""
    full, side, _ = _pair()
    outside = side.counts()
    with side.unchanging():
        first = side.counts()
        first[FREE] += 100
        assert side.counts() == outside and side.violations() == []
    full.new_request(row=1, pages=[9])
    side.take([9], [19])
    assert side.counts() == outside + Counter({REQUEST: 1}) - Counter({FREE: 1})


@pytest.mark.parametrize("page_size", [1, 2, 3, 4, 8, 12, 16, 32])
def test_the_rows_a_mapping_check_reads_are_those_with_any_entry_differing(page_size):
    """``rows_to_read``: exactly the pages past page 0 with an entry other
    than the model's (a live page's peer slots up to its filled count, then
    0; 0 for a page with no peer), whatever entries differ, a partly
    filled page's tail included."""
    pages = TENSOR_CENSUS_PAGES
    full = OwnershipModel.from_census(list(range(1, pages + 1)))
    full.new_request(row=0, pages=list(range(1, 41)))
    side = SWASide.from_census(full, list(range(1, pages + 1)))
    side.take(list(range(1, 41)), list(range(101, 141)), filled=[page_size] * 39 + [max(page_size - 2, 1)])
    mapping = torch.zeros((pages + 1) * page_size, dtype=torch.int64)
    for page, peer in side.mapping.items():
        fill = side.filled_slots(page, page_size)
        mapping[page * page_size : page * page_size + fill] = torch.arange(fill) + peer * page_size
    assert rows_to_read(mapping, page_size, full, side, sentinel=False) == []
    rng = random.Random(page_size)
    for _ in range(20):
        spoilt = mapping.clone()
        for _ in range(rng.randrange(1, 6)):
            spoilt[rng.randrange(len(spoilt))] += rng.choice([-1, 1, 7])
        want = {at // page_size for at in (spoilt != mapping).nonzero().reshape(-1).tolist()} - {0}
        assert rows_to_read(spoilt, page_size, full, side, sentinel=False) == sorted(want)
