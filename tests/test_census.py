"""The census the checks read once per step: the tensor census answers as the
plain one does, and the model's bookkeeping stays exact."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference_model import CHECKS, OwnershipModel
from reference_model.census import Census
from reference_model.model import FREE, Owner, OwnerMap
from state_machines.harness.lockstep import TENSOR_CENSUS_PAGES, TensorCensus, read_census

POOL = 40


def _model(held: set[int]) -> OwnershipModel:
    """A pool of pages 1..POOL; ``held`` (pool pages) belong to one request."""
    model = OwnershipModel.from_census(list(range(1, POOL + 1)))
    model.new_request(row=0, pages=sorted(held))
    return model


def _verdicts(census, model) -> list[str | None]:
    return [check(census, len(census), 1, model) for check in CHECKS]


@given(held=st.sets(st.integers(1, POOL), max_size=10), census=st.lists(st.integers(0, POOL), max_size=60))
def test_tensor_census_gives_every_check_the_plain_census_verdict(held, census):
    """On any census of ids up to the pool's (repeats, missing pages, page 0
    outside the pool), every check returns the same verdict and message
    from the tensor census as from the plain one."""
    model = _model(held)
    tensor = TensorCensus(torch.tensor(census, dtype=torch.int64), model)
    assert _verdicts(tensor, model) == _verdicts(Census(census), model)


@pytest.mark.parametrize("census", [[-1, 2, 3], [POOL + 5, 2], [2, 2, 10**9]], ids=["negative", "past", "outsized"])
def test_tensor_census_falls_back_on_ids_it_cannot_count(census):
    """A negative id, one past the model's, or an outsized one: the checks
    still return the plain census's verdicts and messages."""
    model = _model({1})
    tensor = TensorCensus(torch.tensor(census, dtype=torch.int64), model)
    assert _verdicts(tensor, model) == _verdicts(Census(census), model)


@given(held=st.sets(st.integers(1, POOL), max_size=10), repeated=st.sets(st.integers(1, POOL), max_size=5))
def test_tensor_census_answers_each_question_as_the_plain_one(held, repeated):
    """A census of the model's free pages, some repeated: repeats, distinct
    count, sameness and containment agree with the plain census."""
    model = _model(held)
    pages = sorted(model.free_pages) + sorted(repeated)
    tensor, plain = TensorCensus(torch.tensor(pages, dtype=torch.int64), model), Census(pages)
    assert (tensor.repeats(), tensor.num_distinct(), tensor.lists_free_of(model), tensor.within(model)) == (
        plain.repeats(), plain.num_distinct(), plain.lists_free_of(model), plain.within(model))


@given(held=st.sets(st.integers(1, POOL), max_size=10),
       census=st.lists(st.integers(1, POOL), max_size=60)
       | st.lists(st.integers(-1, POOL + 3) | st.sampled_from([2**40, 2**62]), max_size=60))
def test_tensor_census_tells_what_changed_hands_as_the_plain_one(held, census):
    """``change``: the model's free pages the census lacks and the pages it
    lists the model holds (or lacks), from the flags as from the sets; an
    id past the flags (2**62) is read from the sets, not counted per id."""
    model = _model(held)
    tensor = TensorCensus(torch.tensor(census, dtype=torch.int64), model)
    listed = set(census)
    assert tensor.change(model) == Census(census).change(model) == (
        sorted(model.free - listed), sorted(listed - model.free))


def test_a_census_listing_each_free_page_once_is_judged_in_torch():
    """The fast path is taken on a healthy census (in any order), and not on
    one with a repeat, a missing page or a held page."""
    model = _model({3, 4})
    free = sorted(model.free_pages)
    assert TensorCensus(torch.tensor(free[::-1]), model).exact()
    assert not TensorCensus(torch.tensor(free + [free[0]]), model).exact()
    assert not TensorCensus(torch.tensor(free[1:]), model).exact()
    assert not TensorCensus(torch.tensor(free + [3]), model).exact()
    # -1 in place of the last free page: counted as the last id (as indexing
    # wraps it), it would pass for it.
    assert not TensorCensus(torch.tensor(free[:-1] + [-1]), model).exact()


def test_a_census_counts_afresh_in_the_buffer_it_reuses():
    """``_counts`` hands out the same buffer each call: a count over more
    ids, then over fewer, then of ids the first listed, each starts at 0."""
    model = _model(set())
    many = torch.arange(1, POOL + 1).repeat(3)
    assert TensorCensus(many, model)._counts(POOL + 1)[1:].tolist() == [3] * POOL
    assert TensorCensus(torch.tensor([2, 2]), model)._counts(4).tolist() == [0, 0, 2, 0]
    # Counted up to the id past the size, then refused: the next count starts at 0 all the same.
    assert TensorCensus(torch.tensor([2, 5]), model)._counts(4) is None
    assert TensorCensus(torch.tensor(sorted(model.free_pages)), model).exact()


def test_read_census_uses_torch_only_for_large_pools():
    """Below TENSOR_CENSUS_PAGES free pages the plain census is cheaper, and is the one read."""

    class Pool:
        def __init__(self, n):
            self.pages = torch.arange(1, n + 1)

        def get_all_free_pages(self):
            return self.pages

    assert type(read_census(Pool(TENSOR_CENSUS_PAGES - 1))) is Census
    assert type(read_census(Pool(TENSOR_CENSUS_PAGES))) is TensorCensus


def test_owner_map_keeps_free_held_kinds_and_flags_exact():
    """After any sequence of owner[page] = who, the derived views equal a
    recount from the map itself."""
    owner = OwnerMap({p: Owner(FREE) for p in range(1, 9)})
    for page, who in [(3, Owner("request", 0)), (4, Owner("cache", 1)), (3, Owner(FREE)), (9, Owner("queued")),
                      (4, Owner("queued")), (1, Owner("request", 2))]:
        owner[page] = who
    assert owner.free == {p for p, w in owner.items() if w.kind == FREE}
    assert owner.held == {p for p, w in owner.items() if w.kind != FREE}
    assert owner.kinds == {"free": 6, "queued": 2, "request": 1}
    assert owner.flags.tolist() == [int(owner.get(p, Owner("none")).kind == FREE) for p in range(10)]


@pytest.mark.parametrize("mutate", ["pop", "update", "delete", "clear", "setdefault"])
def test_owner_map_refuses_changes_its_bookkeeping_would_miss(mutate):
    """Only owner[page] = who changes the map: every other mutator raises."""
    owner = OwnerMap({1: Owner(FREE)})
    calls = {
        "pop": lambda: owner.pop(1), "update": lambda: owner.update({2: Owner(FREE)}),
        "delete": lambda: owner.__delitem__(1), "clear": owner.clear, "setdefault": lambda: owner.setdefault(2, Owner(FREE)),
    }
    with pytest.raises(TypeError):
        calls[mutate]()
