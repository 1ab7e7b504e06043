"""Twins of page-by-page predicates (the unified families',
multi-ended's, page-interleave's).

A check that walks every page of a large pool in Python costs what the
pool costs.  Each twin here computes, over the allocator's own tensors,
whether its predicate (``reference_model``'s, named in its docstring)
holds, and answers only True (it does: the predicate would return None)
or False (ask the predicate, which says what is wrong, or that nothing
is).  So a twin changes how fast a step is judged, never the verdict or
the message.  A tensor not of integers makes a twin say False: int64
would change its values.  The model stays torch-free: its per-page flags
are viewed in place (``numpy.frombuffer``).

The twins that read a whole table compute in NumPy, over the tensors' own
memory (``to_numpy``; at 16,384 entries a NumPy op costs a third to a
quarter of the torch op, whose dispatch alone is several µs, and a twin
runs ten or so of them); the rest in torch.  Where this torch hands no
tensor to NumPy (``NUMPY_BRIDGE``) the NumPy twins say False and give
no live mask: their predicates judge every page.
"""

from __future__ import annotations

import torch

from state_machines.harness.lockstep import (
    NUMPY_BRIDGE,
    TENSOR_CENSUS_PAGES,
    TensorCensus,
    equal,
    ids,
    integral,
    to_numpy,
    unchanging,
)
from state_machines.harness.lockstep import numpy as np


def cpu(t: torch.Tensor) -> torch.Tensor:
    """``t`` flat, on the CPU, as int64."""
    return t.to("cpu", torch.int64).reshape(-1)


def _hosted(*tables: torch.Tensor) -> bool:
    """Whether the twins can read ``tables`` in NumPy: integers
    (``integral``) with a NumPy bridge."""
    return NUMPY_BRIDGE and all(map(integral, tables))


def _ints(pages) -> torch.Tensor | None:
    """``pages`` (a tensor or a sequence) as a tensor of integers; None
    where it holds something else."""
    if isinstance(pages, torch.Tensor):
        return pages if integral(pages) else None
    return torch.tensor(list(pages), dtype=torch.int64) if all(type(p) is int for p in pages) else None


# The last few universes, their tensors and where a run of ids starts
# (None: not a run), matched by identity first: a
# machine keeps one universe object for an example, so a step's lookup is a
# pointer compare.  (An lru_cache compared each new example's equal
# universe with the first's, element by element, on every lookup: 0.2 ms a
# step at 16,384 pages.)
_UNIVERSES: list[tuple[frozenset[int], torch.Tensor | None, int | None]] = []


def universe_tensor(universe: frozenset[int]) -> torch.Tensor | None:
    """The pool's pages, sorted, as int64; None where a Python walk costs
    less than the torch ops (a small pool) or an id is negative.  Shared
    and ``unchanging``: never write into it (hand an allocator a copy)."""
    for known, pages, _ in _UNIVERSES:
        if known is universe:
            return pages
    if len(universe) < TENSOR_CENSUS_PAGES or min(universe) < 0:
        pages, start = None, None
    else:
        pages, start = next(((t, s) for u, t, s in _UNIVERSES if u == universe), (None, None))
        if pages is None:
            pages = unchanging(torch.tensor(sorted(universe), dtype=torch.int64))
            # Its first id where its ids are a run (``at_pages``), from the set.
            low = min(universe)
            start = low if max(universe) - low + 1 == len(universe) else None
    _UNIVERSES.insert(0, (universe, pages, start))
    del _UNIVERSES[8:]
    return pages


def at_pages(t, pages: torch.Tensor):
    """``t[pages]`` (``t`` a tensor or a NumPy array) for ``pages`` a
    universe (``universe_tensor``: sorted, distinct, each below
    ``len(t)``): a slice where they are a run of ids, as a pool's usually
    are, else one gather (``index_select``: advanced indexing costs twice
    that).  A kept universe's run is known without reading an element of
    it (two element reads cost more than the slice, three calls a unified
    step)."""
    n, start = pages.numel(), _run_start(pages)
    if start is not None:
        return t[start : start + n]
    return t.index_select(0, pages) if isinstance(t, torch.Tensor) else t.take(to_numpy(pages))


def _run_start(pages: torch.Tensor) -> int | None:
    """The first id of ``pages`` (a universe) where its ids are a run; else None."""
    n = pages.numel()
    known = next((s for _, p, s in _UNIVERSES if p is pages), _UNKNOWN)
    if known is _UNKNOWN:
        known = int(pages[0]) if n and int(pages[-1]) - int(pages[0]) + 1 == n else None
    return known if n else None


# A universe ``at_pages`` was handed that ``_UNIVERSES`` does not keep.
_UNKNOWN = object()


def live_mask(pages: torch.Tensor, free_flags) -> torch.Tensor | None:
    """Per page of ``pages`` (a universe), whether it is live (not free) by
    the model's ``free_flags`` (1 per free page id); None without flags
    (or without NumPy: the twins that read it say False there anyway)."""
    if not free_flags or not NUMPY_BRIDGE:
        return None
    flags = np.frombuffer(free_flags, dtype=np.int64)
    n = pages.numel()
    if not n or int(pages[-1]) < len(flags):
        return torch.from_numpy(at_pages(flags, pages) != 1)
    # An id past the flags was never freed, so it is live: the sorted ids
    # below them (``inside``) come first.
    live = np.ones(n, dtype=bool)
    if (start := _run_start(pages)) is not None:
        inside = min(max(len(flags) - start, 0), n)
        live[:inside] = flags[start : start + inside] != 1
    else:
        at = to_numpy(pages)
        inside = int(np.searchsorted(at, len(flags)))
        live[:inside] = flags.take(at[:inside]) != 1
    return torch.from_numpy(live)


def unmapped(v2p: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """The pages of ``pages`` (a universe, each below ``len(v2p)``) that
    ``v2p`` (of integers) binds to no page (-1), in order."""
    if not NUMPY_BRIDGE:
        return pages.masked_select(at_pages(cpu(v2p), pages) == -1)
    return torch.from_numpy(to_numpy(pages)[at_pages(to_numpy(v2p), pages) == -1])


def census(pages: torch.Tensor, model) -> TensorCensus | list[int]:
    """A census of ``pages`` (an allocator's free-id tensor) against
    ``model``, as ``read_census`` makes one: a tensor census of integers
    from ``TENSOR_CENSUS_PAGES`` pages on, else its list (``ids``)."""
    if pages.numel() < TENSOR_CENSUS_PAGES or not integral(pages):
        return ids(pages)
    return TensorCensus(cpu(pages), model)


def live_pages(v2p: torch.Tensor, pages: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """The physical pages ``v2p`` binds the live ones of ``pages`` (a
    universe, each below ``len(v2p)``) to, in the order of ``pages``."""
    return torch.from_numpy(at_pages(to_numpy(v2p), pages)[to_numpy(live, torch.bool)])


def page_table_holds(pool, v2p: torch.Tensor, p2v: torch.Tensor, pages: torch.Tensor, live: torch.Tensor) -> bool:
    """``unified_page_table_bijective``'s twin, over ``pages`` (the
    universe) with ``live`` its mask: exactly the live pages are bound,
    each to its own page in ``[first, end)`` whose ``p2v`` names it back,
    and no other physical page names a virtual one."""
    if not _hosted(v2p, p2v):
        return False
    v2p, p2v = to_numpy(v2p), to_numpy(p2v)
    if pages.numel() and int(pages[-1]) >= len(v2p):
        return False
    physical, live = at_pages(v2p, pages), to_numpy(live, torch.bool)
    if not np.array_equal(physical != -1, live):
        return False
    # The live pages' places, then two small gathers: few pages of a large pool are live.
    at = np.flatnonzero(live)
    bound, virtual = physical.take(at), to_numpy(pages).take(at)
    if bound.size:
        lo, hi = int(bound.min()), int(bound.max())
        # (A page below 0, inside a pool a confused allocator starts there,
        # is left to the predicate, which reads it as it is.)
        if lo < max(pool.first, 0) or hi >= pool.end:
            return False
        if hi < len(p2v):
            # Each bound page names its own virtual page back, and the
            # virtual pages are distinct: so are the bound pages.
            if not np.array_equal(p2v.take(bound), virtual):
                return False
        else:
            paired = bound < len(p2v)
            if not np.array_equal(p2v.take(bound[paired]), virtual[paired]):
                return False
            rest = bound[~paired]
            if np.unique(rest).size != rest.size:
                return False
    # No stray name: every bound page inside p2v's inner range names its
    # virtual page back (above), so the inner pages naming any virtual page
    # are exactly those when, and only when, there are as many of them.
    named = np.count_nonzero(p2v[1:-1] != -1)
    return named == np.count_nonzero((bound >= 1) & (bound < len(p2v) - 1))


def compacted_holds(pool, physical: torch.Tensor, allocated_tokens: int, page_size: int) -> bool:
    """``unified_compacted``'s twin: the live physical pages are the band
    at the pool's end of the arena, and the count is their tokens."""
    if not _hosted(physical):
        return False
    band = pool.band(physical.numel())
    if allocated_tokens != physical.numel() * page_size:
        return False
    if not physical.numel():
        return True
    physical = to_numpy(physical)
    if int(physical.min()) < band.start or int(physical.max()) >= band.stop:
        return False
    # As many pages as the band, all inside it: the band when none repeats.
    return bool((np.bincount(physical - band.start, minlength=len(band)) == 1).all())


def read_path_holds(got: torch.Tensor, v2p: torch.Tensor, pages: torch.Tensor, live: torch.Tensor,
                    page_size: int) -> bool:
    """``unified_read_path_agrees``' twin, for the tokens of ``pages`` in
    order, each page's ``page_size`` of them: a live page's tokens resolve
    to its physical page's slots, every other token to 0."""
    if not _hosted(got, v2p):
        return False
    v2p, ps = to_numpy(v2p), page_size
    if pages.numel() and int(pages[-1]) >= len(v2p):
        return False
    live, got = to_numpy(live, torch.bool), to_numpy(got)
    at = at_pages(v2p, pages)
    if ps != 1 and at.size and max(int(at.max()), -int(at.min())) > _INT64_MOST // ps:
        return False  # a page whose slot would wrap in int64: the predicate reads it in Python
    # Each page's first token: its physical page's first slot where live, else 0.
    base = np.where(live, at if ps == 1 else at * ps, 0)
    if ps == 1:
        return np.array_equal(got, base)
    if got.size != base.size * ps:
        return False
    # Row k holds token k of every page: its page's first slot plus k where
    # live, else 0.  (Laid out page by page, with k the inner axis, NumPy
    # loops once per page: three times the cost.)
    return np.array_equal(got.reshape(-1, ps).T, base + np.arange(ps)[:, None] * live)


_INT64_MOST = 2**63 - 1


def int_view(t: torch.Tensor):
    """``t``'s values, flat, as a sequence of Python ints, built in C: a
    memoryview of an int64 CPU copy (reading an entry makes an int; what
    the allocator does to ``t`` afterwards changes nothing read), so a few
    entries read cost no list of the whole table; its list where it holds
    something else, or where this torch has no NumPy bridge."""
    if not integral(t):
        return ids(t)
    try:
        return memoryview(cpu(t).clone(memory_format=torch.contiguous_format).numpy())
    except (RuntimeError, TypeError, ValueError):
        return ids(t)


def tokens_of(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Every token of ``pages``, in order: ``v * page_size + k``."""
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


# The tokens of the last few universes, by the universe's identity (each
# holds it, so its id stays its own) and page size.
_TOKENS: list[tuple[torch.Tensor, int, torch.Tensor]] = []


def universe_tokens(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """``tokens_of`` a universe (``universe_tensor``), made once and kept
    ``unchanging``: a unified step asks both read paths for them (its
    callers pass copies; the allocator may write what it is given)."""
    for known, ps, tokens in _TOKENS:
        if known is pages and ps == page_size:
            return tokens
    tokens = unchanging(tokens_of(pages, page_size))
    _TOKENS.insert(0, (pages, page_size, tokens))
    del _TOKENS[8:]
    return tokens


def roles_hold(p2v: torch.Tensor, first: int, num_pages: int, span: tuple[int, int], *others) -> bool:
    """``physical_pages_owned_once``' twin: each physical page inside the
    span has exactly one role (bound in ``p2v`` at ``first`` or past it,
    or in one of ``others``: holes, pending, lent), and none outside."""
    if not _hosted(p2v):
        return False
    others = [_ints(o) for o in others]
    if any(o is None for o in others):
        return False
    lo, hi = span
    if lo < 0 or hi < 0:
        return False
    # The bound pages: p2v names a virtual page, from ``first`` below ``num_pages``.
    roles = to_numpy(p2v)[:num_pages] != -1
    roles[: max(first, 0)] = False
    listed = [to_numpy(o) for o in others if o.numel()]
    past = 0
    if listed:
        listed = np.concatenate(listed) if len(listed) > 1 else listed[0]
        # Each listed page inside the span, listed once, and not bound: its one role.
        if int(listed.min()) < lo or int(listed.max()) >= hi:
            return False
        within = listed < len(roles)
        if not within.all():
            # Past the table: listed once each (a handful at most).
            outside = listed[~within]
            if np.unique(outside).size != outside.size:
                return False
            listed, past = listed[within], outside.size
        before = np.count_nonzero(roles)
        if roles[listed].any():
            return False
        roles[listed] = True
        # None was bound, so each listed once adds one.
        if np.count_nonzero(roles) - before != listed.size:
            return False
    # Now no page has two roles: one each inside the span and none outside,
    # when the span's pages in the table all have one, no other does, and
    # the listings name each of the span's pages past the table.
    inside = roles[lo:hi]
    return (bool(inside.all()) and np.count_nonzero(roles) == inside.size
            and past == max(hi - max(lo, len(roles)), 0))


def classes_hold(lists: list[torch.Tensor], shard_size: int) -> bool:
    """``free_pages_in_own_class``' twin: class ``c``'s list holds only
    pages ``l`` with ``l % shard_size == c``."""
    if not lists:
        return True
    if not all(map(integral, lists)):
        return False
    # One pass over all the lists: each page's class against its list's.
    pages = torch.cat([cpu(t) for t in lists])
    classes = torch.repeat_interleave(torch.arange(len(lists)), torch.tensor([t.numel() for t in lists]))
    return equal(pages.remainder(shard_size), classes)


def tables_hold(v2p: torch.Tensor, p2v: torch.Tensor, first: int, num_pages: int, codes) -> bool:
    """``tables_bijective``'s twin: the virtual pages mapped (from ``first``
    on, the last row a sentinel) are exactly those the model holds (its
    owner map's ``codes``: 2 and up), each on its own page in ``[first,
    num_pages)`` whose ``p2v`` names it back, and each page bound in
    ``p2v`` (from ``first`` on) names one that maps back to it."""
    if not _hosted(v2p, p2v) or codes is None:
        return False
    v2p, p2v = to_numpy(v2p), to_numpy(p2v)
    rows = len(v2p) - 1
    if rows < 0:
        return False
    held = np.frombuffer(codes, dtype=np.uint8) >= 2
    if held[rows:].any():
        return False
    live = held[:rows] if len(held) >= rows else np.concatenate([held, np.zeros(rows - len(held), dtype=bool)])
    mapped = v2p[:rows] != -1
    mapped[: max(first, 0)] = False
    if not np.array_equal(mapped, live):
        return False
    at = np.flatnonzero(mapped)
    if at.size:
        pages = v2p.take(at)
        if int(pages.min()) < max(first, 0) or int(pages.max()) >= min(num_pages, len(p2v)):
            return False
        # Each mapped page names its own virtual page back, and the virtual
        # pages are distinct: so are the pages.
        if not np.array_equal(p2v.take(pages), at):
            return False
    # Every mapped page is bound (it names its virtual page), so the bound
    # pages are exactly the mapped ones, each naming one that maps back to
    # it, when, and only when, there are as many.
    return bound_count(p2v, first, num_pages) == at.size


def bound_count_is(p2v: torch.Tensor, first: int, num_pages: int, held: int) -> bool:
    """``physical_frees_match_logical``'s twin: as many pages bound
    (``PageTables.bound()``) as the model holds virtual pages (``held``)."""
    return _hosted(p2v) and bound_count(to_numpy(p2v), first, num_pages) == held


def bound_count(p2v: np.ndarray, first: int, num_pages: int) -> int:
    """How many pages ``PageTables.bound()`` holds: those from ``first``
    below ``num_pages`` whose ``p2v`` (``to_numpy``'s) names a virtual page."""
    return int(np.count_nonzero(p2v[:num_pages][max(first, 0):] != -1))
