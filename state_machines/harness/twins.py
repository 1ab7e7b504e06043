"""Torch twins of page-by-page predicates (the unified families',
multi-ended's, page-interleave's).

A check that walks every page of a large pool in Python costs what the
pool costs.  Each twin here computes, in torch over the allocator's own
tensors, whether its predicate (``reference_model``'s, named in its
docstring) holds, and answers only True (it does: the predicate would return None) or
False (ask the predicate, which says what is wrong, or that nothing is).
So a twin changes how fast a step is judged, never the verdict or the
message.  A tensor not of integers makes a twin say False: int64 would
change its values.  The model stays torch-free: its per-page flags are
viewed in place (``torch.frombuffer``).
"""

from __future__ import annotations

import functools

import torch

from state_machines.harness.lockstep import TENSOR_CENSUS_PAGES, TensorCensus, ids, integral


def cpu(t: torch.Tensor) -> torch.Tensor:
    """``t`` flat, on the CPU, as int64."""
    return t.to("cpu", torch.int64).reshape(-1)


def _ints(pages) -> torch.Tensor | None:
    """``pages`` (a tensor or a sequence) as a tensor of integers; None
    where it holds something else."""
    if isinstance(pages, torch.Tensor):
        return pages if integral(pages) else None
    return torch.tensor(list(pages), dtype=torch.int64) if all(type(p) is int for p in pages) else None


@functools.lru_cache(maxsize=8)
def universe_tensor(universe: frozenset[int]) -> torch.Tensor | None:
    """The pool's pages, sorted, as int64; None where a Python walk costs
    less than the torch ops (a small pool) or an id is negative."""
    if len(universe) < TENSOR_CENSUS_PAGES or min(universe) < 0:
        return None
    return torch.tensor(sorted(universe), dtype=torch.int64)


def live_mask(pages: torch.Tensor, free_flags) -> torch.Tensor | None:
    """Per page of ``pages``, whether it is live (not free) by the model's
    ``free_flags`` (1 per free page id); None without flags."""
    if not free_flags:
        return None
    flags = torch.frombuffer(free_flags, dtype=torch.int64)
    if not pages.numel() or int(pages.max()) < len(flags):
        return flags.index_select(0, pages) != 1
    free = torch.zeros(pages.numel(), dtype=torch.bool)
    inside = pages < len(flags)
    free[inside] = flags[pages[inside]] == 1
    return ~free


def census(pages: torch.Tensor, model) -> TensorCensus | list[int]:
    """A census of ``pages`` (an allocator's free-id tensor) against
    ``model``, as ``read_census`` makes one: a tensor census of integers
    from ``TENSOR_CENSUS_PAGES`` pages on, else its list (``ids``)."""
    if pages.numel() < TENSOR_CENSUS_PAGES or not integral(pages):
        return ids(pages)
    return TensorCensus(cpu(pages), model)


def page_table_holds(pool, v2p: torch.Tensor, p2v: torch.Tensor, pages: torch.Tensor, live: torch.Tensor) -> bool:
    """``unified_page_table_bijective``'s twin, over ``pages`` (the
    universe) with ``live`` its mask: exactly the live pages are bound,
    each to its own page in ``[first, end)`` whose ``p2v`` names it back,
    and no other physical page names a virtual one."""
    if not (integral(v2p) and integral(p2v)):
        return False
    v2p, p2v = cpu(v2p), cpu(p2v)
    if pages.numel() and int(pages.max()) >= len(v2p):
        return False
    physical = v2p[pages]
    if not torch.equal(physical != -1, live):
        return False
    bound, virtual = physical[live], pages[live]
    if bound.numel():
        if int(bound.min()) < pool.first or int(bound.max()) >= pool.end:
            return False
        if torch.unique(bound).numel() != bound.numel():
            return False
        paired = bound < len(p2v)
        if not torch.equal(p2v[bound[paired]], virtual[paired]):
            return False
    inner = p2v[1:-1]
    named = inner != -1
    names = inner[named]
    if not names.numel():
        return True
    if int(names.min()) < 0 or int(names.max()) >= len(v2p):
        return False
    in_universe = torch.zeros(len(v2p), dtype=torch.bool)
    in_universe[pages] = True
    at = torch.arange(1, len(p2v) - 1)[named]
    return bool(in_universe[names].all()) and torch.equal(v2p[names], at)


def compacted_holds(pool, physical: torch.Tensor, allocated_tokens: int, page_size: int) -> bool:
    """``unified_compacted``'s twin: the live physical pages are the band
    at the pool's end of the arena, and the count is their tokens."""
    if not integral(physical):
        return False
    band = pool.band(physical.numel())
    return (allocated_tokens == physical.numel() * page_size
            and torch.equal(torch.sort(physical).values, torch.arange(band.start, band.stop)))


def read_path_holds(got: torch.Tensor, v2p: torch.Tensor, pages: torch.Tensor, live: torch.Tensor,
                    page_size: int) -> bool:
    """``unified_read_path_agrees``' twin, for the tokens of ``pages`` in
    order, each page's ``page_size`` of them: a live page's tokens resolve
    to its physical page's slots, every other token to 0."""
    if not (integral(got) and integral(v2p)):
        return False
    v2p, ps = cpu(v2p), page_size
    if pages.numel() and int(pages.max()) >= len(v2p):
        return False
    offsets = torch.arange(ps)
    want = torch.where(live[:, None], v2p[pages][:, None] * ps + offsets, 0).reshape(-1)
    got = cpu(got)
    return got.numel() == want.numel() and torch.equal(got, want)


def tokens_of(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Every token of ``pages``, in order: ``v * page_size + k``."""
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def roles_hold(p2v: torch.Tensor, first: int, num_pages: int, span: tuple[int, int], *others) -> bool:
    """``physical_pages_owned_once``' twin: each physical page inside the
    span has exactly one role (bound in ``p2v`` at ``first`` or past it,
    or in one of ``others``: holes, pending, lent), and none outside."""
    if not integral(p2v):
        return False
    others = [_ints(o) for o in others]
    if any(o is None for o in others):
        return False
    roles = torch.cat([bound_pages(p2v, first, num_pages), *(cpu(o) for o in others)])
    if roles.numel() and int(roles.min()) < 0:
        return False
    lo, hi = span
    if lo < 0 or hi < 0:
        return False
    length = max(hi, lo, int(roles.max()) + 1 if roles.numel() else 0)
    want = torch.zeros(length, dtype=torch.int64)
    want[lo:hi] = 1
    return torch.equal(torch.bincount(roles, minlength=length), want)


def classes_hold(lists: list[torch.Tensor], shard_size: int) -> bool:
    """``free_pages_in_own_class``' twin: class ``c``'s list holds only
    pages ``l`` with ``l % shard_size == c``."""
    return all(integral(pages) and bool((cpu(pages) % shard_size == c).all()) for c, pages in enumerate(lists))


def tables_hold(v2p: torch.Tensor, p2v: torch.Tensor, first: int, num_pages: int, codes) -> bool:
    """``tables_bijective``'s twin: the virtual pages mapped (from ``first``
    on, the last row a sentinel) are exactly those the model holds (its
    owner map's ``codes``: 2 and up), each on its own page in ``[first,
    num_pages)`` whose ``p2v`` names it back, and each page bound in
    ``p2v`` (from ``first`` on) names one that maps back to it."""
    if not (integral(v2p) and integral(p2v)):
        return False
    if codes is None:
        return False
    v2p, p2v = cpu(v2p), cpu(p2v)
    rows = len(v2p) - 1
    if rows < 0:
        return False
    held = torch.frombuffer(codes, dtype=torch.uint8) >= 2 if len(codes) else torch.zeros(0, dtype=torch.bool)
    if bool(held[rows:].any()):
        return False
    live = torch.zeros(rows, dtype=torch.bool)
    live[: min(rows, len(held))] = held[:rows]
    virtual = torch.arange(rows)
    mapped = (v2p[:rows] != -1) & (virtual >= first)
    if not torch.equal(mapped, live):
        return False
    pages, names = v2p[:rows][mapped], virtual[mapped]
    if pages.numel():
        if int(pages.min()) < first or int(pages.max()) >= min(num_pages, len(p2v)):
            return False
        if torch.unique(pages).numel() != pages.numel() or not torch.equal(p2v[pages], names):
            return False
    bound = bound_pages(p2v, first, num_pages)
    named = p2v[bound]
    if named.numel() and (int(named.min()) < 0 or int(named.max()) >= rows):
        return False
    return torch.equal(v2p[named], bound)


def bound_count_is(p2v: torch.Tensor, first: int, num_pages: int, held: int) -> bool:
    """``physical_frees_match_logical``'s twin: as many pages bound
    (``PageTables.bound()``) as the model holds virtual pages (``held``)."""
    return integral(p2v) and bound_pages(p2v, first, num_pages).numel() == held


def bound_pages(p2v: torch.Tensor, first: int, num_pages: int) -> torch.Tensor:
    """``PageTables.bound()``'s pages: those from ``first`` below
    ``num_pages`` whose ``p2v`` names a virtual page."""
    p2v = cpu(p2v)[:num_pages]
    pages = torch.nonzero(p2v != -1).reshape(-1)
    return pages[pages >= first]
