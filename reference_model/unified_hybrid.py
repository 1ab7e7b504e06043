"""Unified hybrid pools (full + SWA sub-pools in one byte arena), in plain
Python (no torch).

sglang's ``UnifiedSWATokenToKVPoolAllocator`` (and its Mamba variant) hand
out *virtual* page ids, minted by the full sub-pool; each sub-pool binds a
virtual page to one of its own physical pages through a page table
(``v2p``, with its inverse ``p2v``).  The two sub-pools grow inward from
the arena's two ends (sglang's factory puts full at the high end, SWA at the
low end), and they share the free bytes between them.  A window slide unbinds a virtual page's SWA side
(``v2p == -1``, a tombstone) and gives its bytes back to the shared gap
while the full side stays live.

The model reuses the SWA family's: the full side is an ``OwnershipModel``
over virtual page ids, the SWA side an ``SWASide`` whose "SWA page" of a
virtual page is the virtual page itself (physical ids move under compaction,
so the model names no physical page).  What this module adds is the arena:
``Arena`` (the geometry read once from a fresh allocator) predicts whether an
alloc fits in bytes, and the predicates below judge the page tables and the
byte bands after every step.
"""

from __future__ import annotations

from collections import Counter

from attrs import frozen


def _show(items) -> str:
    items = sorted(items)
    shown = ", ".join(map(str, items[:12]))
    return f"[{shown}{', ...' if len(items) > 12 else ''}]"


@frozen
class SubPool:
    """One sub-pool's fixed geometry: physical pages ``[first, end)`` are
    allocatable (below ``first`` is the padding sink), ``page_bytes`` each;
    ``grows`` is "up" (from the arena's low end) or "down"."""

    name: str
    first: int
    end: int
    page_bytes: int
    grows: str

    @property
    def pages(self) -> int:
        return self.end - self.first

    def band(self, live: int) -> range:
        """The physical pages ``live`` pages occupy when compacted to this
        pool's end of the arena."""
        return range(self.first, self.first + live) if self.grows == "up" else range(self.end - live, self.end)


@frozen
class Arena:
    """The byte arena two END sub-pools share: ``low`` grows up from byte
    ``low.first * low.page_bytes``, ``high`` grows down from byte
    ``high.end * high.page_bytes``; together they fit in between."""

    low: SubPool
    high: SubPool

    @property
    def budget_bytes(self) -> int:
        return self.high.end * self.high.page_bytes - self.low.first * self.low.page_bytes

    def fits(self, low_live: int, high_live: int) -> bool:
        """Whether ``low_live`` pages of the low pool and ``high_live`` of
        the high one fit at once, each within its own index range and both
        within the shared bytes (compacted: no holes)."""
        return (
            low_live <= self.low.pages
            and high_live <= self.high.pages
            and low_live * self.low.page_bytes + high_live * self.high.page_bytes <= self.budget_bytes
        )

    def room(self, low_live: int, high_live: int, *, low: bool) -> int:
        """The most pages the low pool (``low``) or the high one can take on
        top of ``low_live`` and ``high_live`` and still ``fit``: 0 where
        those do not fit already."""
        if not self.fits(low_live, high_live):
            return 0
        spare = self.budget_bytes - low_live * self.low.page_bytes - high_live * self.high.page_bytes
        pool, live = (self.low, low_live) if low else (self.high, high_live)
        # A page of no bytes (or fewer, from a confused allocator) never
        # runs the bytes out: only the index range bounds it.
        if pool.page_bytes <= 0:
            return pool.pages - live
        return min(pool.pages - live, spare // pool.page_bytes)

    def fits_sides(self, full: int, swa: int) -> bool:
        """``fits`` named by side: ``full`` pages of the full pool and
        ``swa`` of the SWA pool, whichever end each grows from."""
        return self.fits(full, swa) if self.low.name.startswith("full") else self.fits(swa, full)


# -- predicates: each returns None, or what the allocator says / what the model says --


def unified_page_table_bijective(
    pool: SubPool, v2p: list[int], p2v: list[int], live: set[int], universe: set[int]
) -> str | None:
    """``v2p`` and ``p2v`` are inverse on the model's live virtual pages:
    each live virtual page maps to its own allocatable physical page, whose
    ``p2v`` names it back; every other virtual page of ``universe`` maps to
    -1 (a tombstone on the SWA side); no other physical page names a
    virtual one.  The padding sink (virtual 0 <-> physical 0) is left out."""
    problems = []
    bound = {v: v2p[v] for v in universe if v2p[v] != -1}
    if set(bound) != live:
        if extra := set(bound) - live:
            problems.append(f"bound in {pool.name}, not live in model: {_show(extra)}")
        if missing := live - set(bound):
            problems.append(f"live in model, unbound (-1) in {pool.name}: {_show(missing)}")
    outside = {v: p for v, p in bound.items() if not pool.first <= p < pool.end}
    if outside:
        problems.append(f"virtual -> physical outside [{pool.first}, {pool.end}): {dict(sorted(outside.items())[:6])}")
    twice = sorted(p for p, n in Counter(bound.values()).items() if n > 1)
    if twice:
        problems.append(f"physical pages {_show(twice)} bound to two virtual pages")
    unpaired = sorted(v for v, p in bound.items() if 0 <= p < len(p2v) and p2v[p] != v)
    if unpaired:
        problems.append(f"p2v[v2p[v]] != v for virtual pages {_show(unpaired)}")
    stray = sorted(p for p in range(1, len(p2v) - 1) if p2v[p] != -1 and bound.get(p2v[p]) != p)
    if stray:
        problems.append(f"p2v names a virtual page for physical pages {_show(stray)} that it does not map to")
    if not problems:
        return None
    return f"{pool.name} page table: " + "; ".join(problems) + f" / a bijection on the model's {len(live)} live pages"


def unified_compacted(pool: SubPool, physical: list[int], allocated_tokens: int, page_size: int) -> str | None:
    """Eager compaction: a pool's live physical pages are exactly the band
    at its end of the arena, and ``allocated_count()`` is their tokens."""
    want = set(pool.band(len(physical)))
    if set(physical) == want and allocated_tokens == len(physical) * page_size:
        return None
    return (
        f"{pool.name} holds physical pages {_show(physical)} and allocated_count() {allocated_tokens}"
        f" / {len(physical)} live pages compacted to {_show(want)}, {len(physical) * page_size} tokens"
    )


def unified_bands_disjoint(arena: Arena, low_physical: list[int], high_physical: list[int]) -> str | None:
    """No byte of the arena is in a live page of both sub-pools."""
    if not low_physical or not high_physical:
        return None
    low_top = (max(low_physical) + 1) * arena.low.page_bytes
    high_bottom = min(high_physical) * arena.high.page_bytes
    if low_top <= high_bottom:
        return None
    return (
        f"{arena.low.name}'s live bytes reach {low_top}, {arena.high.name}'s start at {high_bottom}"
        f" / disjoint byte bands"
    )


# -- admission: what the scheduler asks before it allocates --


@frozen
class Demand:
    """One admission question over the arena: ``full`` and ``swa`` new pages,
    with at most ``evict_full`` / ``evict_swa`` pages the cache could evict
    (already capped by the live pages), while ``live_full`` / ``live_swa``
    are held and ``universe`` virtual ids exist."""

    full: int
    swa: int
    live_full: int
    live_swa: int
    universe: int
    evict_full: int = 0
    evict_swa: int = 0

    def fits(self, arena: Arena, reclaim_full: int = 0, reclaim_swa: int = 0) -> bool:
        """Whether the demand fits, compacted, once ``reclaim_*`` live pages
        of each side are evicted: a virtual id per new full page, and both
        sides' pages in the arena's bytes."""
        full = self.live_full - reclaim_full + self.full
        swa = self.live_swa - reclaim_swa + self.swa
        return full <= self.universe and swa <= self.universe and arena.fits_sides(full, swa)


def least_reclaim(arena: Arena, demand: Demand, prefer_swa: bool) -> tuple[int, int] | None:
    """The eviction the cache must do first, in pages (full, SWA), as sglang
    documents its plan: nothing when the demand fits now; ``None`` when even
    evicting all it may does not fit; else, the tree evicting full before
    SWA, the fewest SWA pages that fit with all evictable full pages gone,
    then the fewest full pages that fit with those (``prefer_swa``: the
    fewest full pages first, then the fewest SWA pages)."""
    if demand.fits(arena):
        return (0, 0)
    top_full, top_swa = demand.evict_full, demand.evict_swa
    if not demand.fits(arena, top_full, top_swa):
        return None

    def fewest(top: int, ok) -> int:
        return next(k for k in range(top + 1) if ok(k))

    if prefer_swa:
        full = fewest(top_full, lambda k: demand.fits(arena, k, top_swa))
        return (full, fewest(top_swa, lambda k: demand.fits(arena, full, k)))
    swa = fewest(top_swa, lambda k: demand.fits(arena, top_full, k))
    return (fewest(top_full, lambda k: demand.fits(arena, k, swa)), swa)


def unified_reclaim_plan_agrees(what: str, got: tuple[int, int] | None, want: tuple[int, int] | None) -> str | None:
    """``reclaim_plan`` names the least eviction (full, SWA pages) after
    which the demand fits the arena, or ``None`` exactly when none does."""
    if got == want:
        return None
    return f"{what} = {got} pages / the arena says {want if want is not None else 'None (no eviction makes it fit)'}"


def unified_admission_agrees(what: str, got: bool, want: bool) -> str | None:
    """An admission query (``can_reserve``, ``prealloc_fits``,
    ``prealloc_ceiling_fits``) says yes exactly when the arena holds the demand."""
    if bool(got) == want:
        return None
    return f"{what} = {bool(got)} / the arena {'holds' if want else 'cannot hold'} the demand"


def unified_admission_sound(what: str, got: bool, want: bool) -> str | None:
    """Over a float chain (where the float sits is placement policy the
    model does not predict), an admission query may say no to what the
    arena holds, never yes to what it cannot hold."""
    if not got or want:
        return None
    return f"{what} = True / the arena cannot hold the demand (an over-commit)"


def unified_extend_demand_agrees(what: str, got: int, prefix: int, seq: int, page_size: int) -> str | None:
    """An extend from ``prefix`` to ``seq`` tokens asks for the whole new
    pages it touches: ``page_size`` x (pages of ``seq`` - pages of ``prefix``)."""
    want = page_size * (-(-seq // page_size) - -(-prefix // page_size))
    if got == want:
        return None
    return f"{what} = {got} tokens / {want} (the new pages from {prefix} to {seq} tokens)"


def unified_max_new_agrees(what: str, got: int | None, most: int, fitting: list[bool]) -> str | None:
    """``max_new_tokens_for_memory`` (``fitting[c]``: whether ``c`` new
    tokens fit an empty pool) is ``None`` exactly when none fit, else a
    count that fits, either ``most`` or one whose next does not."""
    if not fitting[0]:
        return None if got is None else f"{what} = {got} / nothing fits an empty pool: None"
    if got is not None and 0 <= got <= most and fitting[got] and (got == most or not fitting[got + 1]):
        return None
    fits = [c for c in range(most + 1) if fitting[c]]
    return f"{what} = {got} / fitting counts {_show(fits)} of 0..{most}: a fitting one, {most} or one whose next does not fit"


def unified_allocated_agrees(side: str, allocated_tokens: int, live_pages: int, page_size: int) -> str | None:
    """A side's capacity less what it has available (``current_*_capacity``
    - ``*_available_size()``) is the tokens of its live pages."""
    if allocated_tokens == live_pages * page_size:
        return None
    return f"{side} capacity - available = {allocated_tokens} tokens / {live_pages} live pages x {page_size}"


def unified_read_path_agrees(side: str, tokens: list[int], got: list[int], v2p: list[int], live: set[int],
                             page_size: int) -> str | None:
    """The read path (``translate_kv_loc`` / ``translate_loc_from_full_to_swa``)
    resolves each token of a live virtual page to its own physical page's
    slot, and every other token (a tombstone, a free id) to the page-0 sink:
    a kernel never reads another request's KV through a dead id."""
    wrong = []
    for t, p in zip(tokens, got):
        v = t // page_size
        want = v2p[v] * page_size + t % page_size if v in live else 0
        if p != want:
            wrong.append((t, p, want))
    if not wrong:
        return None
    shown = ", ".join(f"token {t} -> {p} (want {w})" for t, p, w in wrong[:6])
    return f"{side} read path: {shown} / live pages through v2p, every other token to the sink 0"
