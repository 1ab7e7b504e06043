"""A custom target's fresh pool and its census: the layout a fresh pool must
have (pages 1..N free, each once: ``fresh_pool_lists_every_page``), and the
census shapes the README names (a tensor, or a list of free page ids)."""

import textwrap

import attrs
import pytest

from reference_model import invariants
from state_machines.config import Config
from state_machines.harness import InvariantViolation, build
from state_machines.runs.minimize import minimize, shrink_configs
from state_machines.runs.runner import fuzz
from state_machines.runs.trace import Trace
from state_machines.targets import TargetError

POOLS = textwrap.dedent(
    '''
    import torch
    from allocators.token import TokenAllocator

    def _shifted(by, drop=0):
        class Pool(TokenAllocator):
            def __init__(self, size, page_size, device, need_sort):
                super().__init__(size, page_size, device, need_sort)
                self.free_pages = torch.arange(1 + by, size + 1 + by - drop, dtype=torch.int64)
        return Pool

    HandsOutPadding = _shifted(-1)     # pages 0..N-1: page 0 is sglang's padding page
    class LeaksWhenBig(TokenAllocator):
        """Correct below 24 slots; from 24 on, its fresh pool never lists the last page."""
        def __init__(self, size, page_size, device, need_sort):
            super().__init__(size, page_size, device, need_sort)
            if size >= 24:
                self.free_pages = self.free_pages[:-1].clone()
    class LeaksWhenSorted(TokenAllocator):
        """Correct with need_sort off; with it on, its fresh pool never lists the last page."""
        def __init__(self, size, page_size, device, need_sort):
            super().__init__(size, page_size, device, need_sort)
            if need_sort:
                self.free_pages = self.free_pages[:-1].clone()
    PastThePool = _shifted(1)          # pages 2..N+1
    LeaksOne = _shifted(0, drop=1)     # pages 1..N-1: page N never free

    class ListCensus(TokenAllocator):
        """Correct; its census a plain list of page ids (get_all_free_pages)."""
        def get_all_free_pages(self):
            return super().get_all_free_pages().tolist()

    def sixteen_slots():
        """Correct; a factory that takes no size and makes its own pool of 16 slots."""
        return TokenAllocator(16)

    def sixteen_from_zero():
        """Its own pool of 16 slots, hands out the padding page 0."""
        return HandsOutPadding(16, 1, "cpu", False)

    class AvailableNone(TokenAllocator):
        """available_size() answers None: int() of it was a traceback, no trace."""
        def available_size(self):
            return None

    class GeneratorCensus(TokenAllocator):
        """Correct; get_all_free_pages() a fresh generator of page ids each call."""
        def get_all_free_pages(self):
            return (int(p) for p in super().get_all_free_pages())

    class ViewCensus(TokenAllocator):
        """Correct; its census the keys of a dict (a view, no list)."""
        def get_all_free_pages(self):
            return dict.fromkeys(super().get_all_free_pages().tolist()).keys()

    class IteratorAttribute(TokenAllocator):
        """Keeps its free pages as an iterator: reading it would empty it."""
        def get_all_free_pages(self):
            return None
        def __init__(self, size, page_size, device, need_sort):
            super().__init__(size, page_size, device, need_sort)
            self.free_pages = iter(self.free_pages.tolist())

    class NoCensus(TokenAllocator):
        """Correct, but nothing the harness can read its free pages from."""
        def __getattribute__(self, name):
            if name in ("get_all_free_pages", "free_pages", "release_pages", "staged_pages", "free_slots"):
                raise AttributeError(name)
            return super().__getattribute__(name)
    '''
)


@pytest.fixture
def pools(tmp_path, monkeypatch):
    (tmp_path / "census_pools.py").write_text(POOLS)
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("initial, pages, said", [
    ([1, 2, 3], 3, None),
    ([3, 1, 2], 3, None),
    ([0, 1, 2], 3, "fresh allocator's free pages (3) / pages 1..3: not pages of the pool: [0]; missing: [3]"),
    ([1, 2], 3, "fresh allocator's free pages (2) / pages 1..3: missing: [3]"),
    ([1, 2, 3, 3], 3, None),  # no_page_freed_twice's, checked next
])
def test_a_fresh_pool_lists_pages_one_to_n(initial, pages, said):
    assert invariants.fresh_pool_lists_every_page(initial, pages) == said


@pytest.mark.parametrize("name, said", [
    ("HandsOutPadding", "not pages of the pool: [0]; missing: [10]"),
    ("PastThePool", "not pages of the pool: [11]; missing: [1]"),
    ("LeaksOne", "missing: [10]"),
])
def test_a_fresh_pool_laid_out_wrong_fails_before_any_step(pools, name, said):
    """The model starts from the fresh pool's census: a pool that began with
    the padding page, a page past its end or one page short was taken for
    the pool itself, and fuzz came back clean."""
    with pytest.raises(InvariantViolation) as failed:
        build(target=f"census_pools:{name}")
    assert failed.value.invariant == "fresh_pool_lists_every_page" and not failed.value.steps
    assert said in failed.value.detail


def test_a_census_of_plain_page_ids_is_read(pools):
    """A census returned as a list of ints failed a correct allocator with
    the harness's own AttributeError ('int' object has no attribute 'is_cpu')."""
    state = build(target="census_pools:ListCensus")
    state.alloc(n=3)
    state.check()


@pytest.mark.parametrize("name", ["GeneratorCensus", "ViewCensus"])
def test_a_census_of_any_iterable_is_read_once(pools, name):
    """A generator or a dict view was read as no census at all: a correct
    allocator failed fresh_pool_lists_every_page ('missing: [1, ..., 10]')."""
    state = build(target=f"census_pools:{name}")
    state.alloc(n=3)
    state.check()
    assert fuzz(Config(target=f"census_pools:{name}"), max_examples=30, seed=0, database=None).failures == ()


def test_a_census_kept_as_an_iterator_is_bad_input(pools):
    """Reading it would empty the allocator's own free list: then every
    later check would blame the allocator for what the harness did."""
    with pytest.raises(TargetError, match=r"IteratorAttribute\.free_pages is an iterator: reading it would empty it"):
        build(target="census_pools:IteratorAttribute")


def test_an_allocator_with_no_census_is_bad_input(pools):
    """Read as an empty census, it failed available_size_agrees."""
    with pytest.raises(TargetError, match=r"census_pools:NoCensus has no census: give it get_all_free_pages\(\), or one of"):
        build(target="census_pools:NoCensus")


def test_a_count_that_is_no_number_fails_the_allocator_not_the_harness(pools):
    with pytest.raises(InvariantViolation) as failed:
        build(target="census_pools:AvailableNone")
    assert failed.value.invariant == "answer_is_a_count"
    assert failed.value.detail == "available_size() returned NoneType None / a number"


def test_a_factory_that_takes_no_size_is_checked_for_page_0_only(pools):
    """A factory that sizes its own pool never saw ``size``: its pages are
    not size // page_size, and the full layout check failed a correct one
    (``not pages of the pool: [11, ..., 16]``).  Page 0 free is still a bug."""
    state = build(target="census_pools:sixteen_slots")
    state.alloc(n=3)
    state.check()
    with pytest.raises(InvariantViolation) as failed:
        build(target="census_pools:sixteen_from_zero")
    assert failed.value.detail == "fresh allocator's free pages (16) / pages from 1: not pages of the pool: [0]"


def test_a_pool_laid_out_wrong_only_at_a_drawn_size_is_found(pools):
    """A run that pins no size draws pools of 4, 24 and 64 pages; a size
    whose fresh pool failed was left out of the draws, and the run came
    back clean (300 examples, no word).  The example that draws it fails,
    shrunk to building that pool, in the run's own rows."""
    outcome = fuzz(Config(target="census_pools:LeaksWhenBig"), max_examples=300, seed=0, database=None)
    [trace] = outcome.failures
    assert (trace.invariant, trace.steps, trace.config.size, trace.config.rows) == (
        "fresh_pool_lists_every_page", (), 24, Config().rows)
    assert trace.detail == "fresh allocator's free pages (23) / pages 1..24: missing: [24]"
    assert outcome.record.first_failure_s is not None


def test_a_fresh_pool_failure_met_at_64_pages_shrinks_to_the_drawn_24(pools):
    """The same pool met at 64 pages (an example may draw it first): the
    minimiser is offered the drawn sizes between the run's and the trace's
    (``shrink_configs``) and comes back at 24, the smallest that fails."""
    run = Config(target="census_pools:LeaksWhenBig")
    met = Trace(attrs.evolve(run, size=64), (), "fresh_pool_lists_every_page")
    shortest = minimize(met, configs=shrink_configs(met, run, (None, 4, 24, 64)))
    assert (shortest.invariant, shortest.steps, shortest.config.size) == ("fresh_pool_lists_every_page", (), 24)


def test_a_pool_laid_out_wrong_only_with_need_sort_is_found(pools):
    """A run that leaves need_sort off draws it on too, where the allocator
    keeps it; one whose fresh pool failed with it on drew it never, and the
    run came back clean (300 examples), where --need-sort failed at once."""
    outcome = fuzz(Config(target="census_pools:LeaksWhenSorted"), max_examples=300, seed=0, database=None)
    [trace] = outcome.failures
    assert (trace.invariant, trace.steps, trace.config.need_sort) == ("fresh_pool_lists_every_page", (), True)
    n = trace.config.pool_size
    assert trace.detail == f"fresh allocator's free pages ({n - 1}) / pages 1..{n}: missing: [{n}]"


def test_targets_on_a_pool_wrong_from_the_start_names_the_fuzz_that_writes_its_trace(pools, capsys):
    """``targets --target`` printed "FAILED before any step" and the detail,
    and no way on to a trace (helper-77): the listing writes no file, so
    it names the run that does, with the options that reach the failure."""
    from state_machines.cli import main

    assert main(["targets", "--target", "census_pools:LeaksWhenSorted", "--need-sort"]) == 1
    said = capsys.readouterr().out.splitlines()
    assert said[0] == "FAILED before any step: fresh_pool_lists_every_page"
    assert said[-1] == ("  a trace: kv-lockstep fuzz --target census_pools:LeaksWhenSorted --need-sort"
                        " (its failure shrinks to building the pool)")


def test_size_on_a_factory_that_takes_none_is_bad_input(pools, tmp_path, capsys):
    """A factory without ``size`` builds its own pool: ``--size`` was
    ignored without a word (helper-88).  Refused before anything runs; with
    no --size, the run takes the factory's pool."""
    from state_machines.cli import main

    assert main(["fuzz", "--target", "census_pools:sixteen_slots", "--size", "32", "--trace-dir", str(tmp_path / "t")]) == 2
    said = capsys.readouterr()
    assert (said.out, said.err) == ("", "kv-lockstep: error: --size 32: census_pools:sixteen_slots takes no size parameter,"
                                        " so it builds a pool of its own size; give its factory a `size` parameter,"
                                        " or leave --size out\n")
    assert main(["fuzz", "--target", "census_pools:sixteen_slots", "--max-examples", "5", "--seed", "0",
                 "--trace-dir", str(tmp_path / "t")]) == 0
