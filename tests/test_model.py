"""The ownership model on its own, without an allocator."""

import pytest

from reference_model import CHECKS, OwnershipModel, no_slot_handed_out_twice
from reference_model.invariants import eviction_accounting_balances, free_sets_agree, no_page_freed_twice


def fresh(n=8):
    return OwnershipModel.from_census(list(range(1, n + 1)))


def cached(model, pages):
    """A cache entry holding ``pages``, made as the harness makes one: a
    request takes them, is rematched with nothing duplicated, and finishes."""
    req = model.new_request(row=3, pages=pages)
    entry = model.rematch(req.rid, dup=0, entry=None)
    model.finish(req.rid)
    return entry


def test_fresh_model_is_healthy():
    """A model started from a census holds every page free."""
    model = fresh()
    assert model.violations() == []
    assert model.free_pages == set(range(1, 9))


def test_queued_frees_are_snapshots_released_at_end():
    """Inside a group a free is queued, and end releases exactly the snapshot."""
    model = fresh()
    req = model.new_request(row=0, pages=[1, 2, 3])
    model.begin()
    model.release_tail(req.rid, 2)
    assert model.free_pages == set(range(4, 9))
    assert model.counts()["queued"] == 2
    model.end()
    assert model.free_pages == {2, 3} | set(range(4, 9))
    assert model.ledger.freed == 2 and model.violations() == []


def test_end_without_group_changes_nothing():
    """A repeated end is a no-op in the model."""
    model = fresh()
    model.new_request(row=0, pages=[1])
    before = dict(model.owner)
    model.end()
    model.end()
    assert model.owner == before


def test_rematch_moves_pages_to_cache_and_frees_duplicates():
    """cache_unfinished_req: duplicated pages are freed, the rest cached and locked."""
    model = fresh()
    donor = cached(model, [7, 8])
    req = model.new_request(row=0, pages=[1, 2, 3])
    new_entry = model.rematch(req.rid, dup=1, entry=donor.eid)
    assert 1 in model.free_pages
    assert set(new_entry.pages) == {2, 3}
    assert model.requests[req.rid].prefix == [7, 2, 3]
    assert model.evictable() == []
    model.finish(req.rid)
    assert sorted(model.evictable()) == sorted([donor.eid, new_entry.eid])
    assert model.violations() == []


def test_evicting_counts_logical_evictions():
    """Evicted pages count as evicted, not freed."""
    model = fresh()
    entry = cached(model, [1, 2])
    model.evict(entry.eid)
    assert (model.ledger.evicted, model.ledger.freed) == (2, 0)
    assert model.violations() == []


def test_violations_report_a_corrupted_owner_map():
    """violations() names a page whose owner disagrees with the structures."""
    model = fresh()
    model.new_request(row=0, pages=[1])
    model.owner[2] = model.owner[1]
    assert any("page 2" in v for v in model.violations())


def test_invariant_messages_show_both_sides():
    """The accounting check reads `logical evicted E + freed F = L / physically freed P`."""
    model = fresh(4)
    model.new_request(row=0, pages=[1, 2])
    message = eviction_accounting_balances([3, 4, 1], 3, 1, model)
    assert message == "logical evicted 0 + freed 0 = 0 / physically freed 1"


def test_duplicate_and_foreign_pages_are_named():
    """Free-list duplicates and pages outside the pool are reported."""
    model = fresh(4)
    assert "[2]" in no_page_freed_twice([1, 2, 2, 3, 4], 5, 1, model)
    assert "missing from allocator: [4]" in free_sets_agree([1, 2, 3], 3, 1, model)
    assert "outside the pool" in no_slot_handed_out_twice([9], model)
    assert "held" in no_slot_handed_out_twice([1], _with_request(model))
    # Who holds them, counted: "(1 of outside the pool)" read badly (helper-80).
    assert free_sets_agree([0, 1, 2, 3], 4, 1, fresh(4)).endswith(
        "free in allocator, held in model: [0] (1 outside the pool); free in model, missing from allocator: [4]")


def _with_request(model):
    model.new_request(row=0, pages=[1])
    return model


def test_every_check_passes_on_a_healthy_census():
    """Each named predicate holds for a census equal to the model's."""
    model = fresh()
    model.new_request(row=0, pages=[1, 2])
    census = sorted(model.free_pages)
    assert [c.__name__ for c in CHECKS if c(census, len(census), 1, model)] == []


def _corrupted(how: str) -> OwnershipModel:
    """A model with a request on pages 1-2, a cache entry on 3-4 locked by
    it and a group queueing page 5, then broken one way (``how``)."""
    model = fresh()
    entry = cached(model, [3, 4])
    model.new_request(row=0, pages=[1, 2], prefix_entry=entry.eid)
    holder = model.new_request(row=1, pages=[5])
    model.begin()
    model.finish(holder.rid)
    assert model.violations() == []
    req = model.requests[1]
    if how == "page claimed twice":
        req.own.append(3)
    elif how == "claim outside the pool":
        req.own.append(99)
    elif how == "held page unclaimed":
        req.own.remove(2)
    elif how == "owner of another kind":
        model.owner[1] = model.owner[3]
    elif how == "lock on an evicted entry":
        req.locks.append(7)
    elif how == "lock count drifts":
        model.cache[entry.eid].lock_count += 1
    elif how == "queued page freed in the map":
        model.owner[5] = model.owner[6]
    elif how == "ledger off by one":
        model.ledger.freed += 1
    return model


CORRUPTIONS = (
    "page claimed twice", "claim outside the pool", "held page unclaimed", "owner of another kind",
    "lock on an evicted entry", "lock count drifts", "queued page freed in the map", "ledger off by one",
)


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_violations_report_each_inconsistency(how):
    """violations() (its quick pass over the structures included) names each kind of model corruption."""
    assert _corrupted(how).violations() != []


def test_violations_report_a_lock_with_the_cache_empty():
    """A request locking an entry when the cache holds none is a violation (the quick pass skips its lock checks only where no request locks anything)."""
    model = fresh()
    req = model.new_request(row=0, pages=[1, 2])
    assert model.violations() == []
    req.locks.append(0)
    assert model.violations() == ["req_0 locks evicted cache_0"]


def test_the_fast_self_check_counts_an_open_mamba_reserve_as_queued():
    """_structures_agree is exact: a Mamba allocation group's reserve is in
    the ledger's queued pages with no free group open, and a healthy model
    with one open agrees (its slow path would say nothing is wrong)."""
    from reference_model.mamba import MambaModel

    model = MambaModel.from_census(list(range(1, 17)))
    model.group_begin([1, 2, 3, 4])
    assert model.violations() == []
    assert model._structures_agree()
