"""A unified hybrid SWA pool: full and SWA sub-pools in one byte arena,
over virtual page ids (the twin of sglang's ``UnifiedSWATokenToKVPoolAllocator``).

The full sub-pool mints virtual page ids (``free_virtual_ids``); each
sub-pool binds a virtual page to one of its physical pages through
``virtual_to_physical`` / ``physical_to_virtual``.  The full pool's pages
grow up from the arena's low end, the SWA pool's down from its high end;
a free compacts each pool at once (eager), so its live pages are always the
band at its end, and the bytes between the two bands are shared.  A window
slide (``free_swa``) unbinds only the SWA side: ``v2p == -1`` there is the
tombstone, and ``free`` skips it.  Inside a free group each kind of free is
queued in its own list, and ``free_group_end`` flushes all four.
"""

from __future__ import annotations

import bisect

import torch

from allocators.base import Mutant

# Bytes per slot of each sub-pool, as the sglang target's arena stand-in.
FULL_SLOT_BYTES, SWA_SLOT_BYTES = 16, 8


class ArenaSubPool:
    """One sub-pool: physical pages ``[min_page_index, num_pages)``, the
    live ones compacted to the end it grows from."""

    def __init__(self, name: str, grow_direction: str, num_pages: int, min_page_index: int, page_bytes: int,
                 num_virtual: int, page_size: int, device: str):
        self.sub_pool_name, self.grow_direction = name, grow_direction
        self.num_pages, self.min_page_index, self.entry_bytes_per_page = num_pages, min_page_index, page_bytes
        self.page_size, self.device = page_size, device
        # Row 0 is the padding sink (virtual 0 <-> physical 0); the last row a -1 sentinel.
        self.num_virtual = num_virtual
        self.clear()

    def clear(self) -> None:
        """Every page unbound, the band empty; an id owner's ids all free."""
        self.virtual_to_physical = torch.full((self.num_virtual + 1,), -1, dtype=torch.int64, device=self.device)
        self.physical_to_virtual = torch.full((self.num_pages + 1,), -1, dtype=torch.int64, device=self.device)
        self.virtual_to_physical[0] = 0
        self.physical_to_virtual[0] = 0
        self.live = 0
        if hasattr(self, "free_virtual_ids"):
            self.free_virtual_ids = torch.arange(self.min_page_index, self.num_pages, dtype=torch.int64,
                                                 device=self.device)

    def allocated_count(self) -> int:
        return self.live * self.page_size

    @property
    def watermark_physical(self) -> int:
        """The next page the band grows into (sglang's watermark)."""
        return self.min_page_index + self.live if self.grow_direction == "up" else self.num_pages - self.live - 1

    @property
    def _free_phys_pages(self) -> torch.Tensor:
        # Eager: no holes await compaction.
        return torch.empty(0, dtype=torch.int64, device=self.device)

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.entry_bytes_per_page

    def _band(self, live: int) -> list[int]:
        if self.grow_direction == "up":
            return list(range(self.min_page_index, self.min_page_index + live))
        return list(range(self.num_pages - live, self.num_pages))

    def bind(self, v_pages: torch.Tensor) -> None:
        """Bind ``v_pages`` to the next physical pages past the band."""
        new = [p for p in self._band(self.live + len(v_pages)) if p not in set(self._band(self.live))]
        phys = torch.tensor(new, dtype=torch.int64, device=self.device)
        self.virtual_to_physical[v_pages] = phys
        self.physical_to_virtual[phys] = v_pages
        self.live += len(v_pages)

    def unbind(self, v_pages: torch.Tensor) -> None:
        """Unbind ``v_pages`` (each bound, once) and compact: survivors past
        the shrunk band move into its holes."""
        if not len(v_pages):
            return
        freed = self.virtual_to_physical[v_pages]
        self.virtual_to_physical[v_pages] = -1
        self._release(freed)

    def mint(self, n: int) -> torch.Tensor:
        """Take ``n`` virtual pages off ``free_virtual_ids`` (an id owner's) and bind them."""
        taken, self.free_virtual_ids = self.free_virtual_ids[:n].clone(), self.free_virtual_ids[n:]
        self.bind(taken)
        return taken

    def recycle(self, v_pages: torch.Tensor) -> None:
        """Unbind ``v_pages`` and give the ids back to ``free_virtual_ids``."""
        self.unbind(v_pages)
        self.free_virtual_ids = torch.cat((self.free_virtual_ids, v_pages))

    def _release(self, freed: torch.Tensor) -> None:
        freed_set = set(freed.tolist())
        self.physical_to_virtual[freed] = -1
        old = self._band(self.live)
        self.live -= len(freed_set)
        keep = set(self._band(self.live))
        movers = [p for p in old if p not in keep and p not in freed_set]
        holes = sorted(p for p in freed_set if p in keep)
        for src, dst in zip(movers, holes):
            v = int(self.physical_to_virtual[src])
            self.virtual_to_physical[v] = dst
            self.physical_to_virtual[dst] = v
            self.physical_to_virtual[src] = -1


def most_that_fit(most: int, fits) -> int:
    """The most ``k`` of ``0..most`` the arena ``fits`` (it holds up to some
    ``k``, not past it), bisected: counting up cost a pool of 16,384 slots
    tens of ms a call."""
    return bisect.bisect_left(range(1, most + 1), True, key=lambda k: not fits(k))


def page_tokens(v_pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Every token id of ``v_pages``, page by page."""
    offsets = torch.arange(page_size, dtype=torch.int64, device=v_pages.device)
    return (v_pages[:, None] * page_size + offsets).reshape(-1)


class UnifiedSWAAllocator:
    """Full + SWA sub-pools over shared virtual page ids in one byte arena."""

    # Read by targets.py: the unified SWA harness drives this family.
    family = "unified_swa"
    lazy_compaction = False

    def __init__(self, size: int, page_size: int = 1, device: str = "cpu", need_sort: bool = False):
        self.size, self.page_size, self.device = size, page_size, device
        # The sglang target's stand-in arena: (size + page_size) full slots of bytes.
        total = (size + page_size) * FULL_SLOT_BYTES
        full_pages, swa_pages = total // (FULL_SLOT_BYTES * page_size), total // (SWA_SLOT_BYTES * page_size)
        swa_first = -(-FULL_SLOT_BYTES * page_size // (SWA_SLOT_BYTES * page_size))
        self.full_attn_allocator = ArenaSubPool("full", "up", full_pages, 1, FULL_SLOT_BYTES * page_size,
                                                full_pages, page_size, device)
        self.swa_attn_allocator = ArenaSubPool("swa", "down", swa_pages, swa_first, SWA_SLOT_BYTES * page_size,
                                               full_pages, page_size, device)
        self.full_attn_allocator.free_virtual_ids = torch.arange(1, full_pages, dtype=torch.int64, device=device)
        self.budget = total - FULL_SLOT_BYTES * page_size
        self.clear()

    def clear(self) -> None:
        """The scheduler's flush: both sub-pools as built, no group open."""
        for sub in self._cleared_pools():
            sub.clear()
        self.free_group: list[torch.Tensor] | None = None
        self.free_page_reps_group: list[torch.Tensor] | None = None
        self.full_free_group: list[torch.Tensor] = []
        self.full_page_reps_group: list[torch.Tensor] = []

    def _cleared_pools(self) -> tuple[ArenaSubPool, ...]:
        return self.full_attn_allocator, self.swa_attn_allocator

    # -- capacity --

    def _fits(self, pages: int) -> bool:
        fa = self.full_attn_allocator
        return pages <= len(fa.free_virtual_ids) and self._holds(fa.live + pages, self.swa_attn_allocator.live + pages)

    def _holds(self, full: int, swa: int) -> bool:
        """Whether ``full`` and ``swa`` live pages fit, each in its index
        range and virtual ids, both in the arena's bytes."""
        fa, sa = self.full_attn_allocator, self.swa_attn_allocator
        ids = fa.num_pages - fa.min_page_index
        return (
            full <= ids
            and swa <= min(ids, sa.num_pages - sa.min_page_index)
            and full * fa.entry_bytes_per_page + swa * sa.entry_bytes_per_page <= self.budget
        )

    def _demand_fits(self, full: int, swa: int, reclaim_full: int = 0, reclaim_swa: int = 0) -> bool:
        return self._holds(self.full_attn_allocator.live - reclaim_full + full,
                           self.swa_attn_allocator.live - reclaim_swa + swa)

    # -- admission (the scheduler's questions; nothing changes hands) --

    def reclaim_plan(self, full_tokens: int, swa_tokens: int, *, full_evictable_tokens: int = 0,
                     swa_evictable_tokens: int = 0, empty_pool: bool = False,
                     prefer_swa: bool = False) -> tuple[int, int] | None:
        """The least eviction (tokens of each side) after which the demand
        fits: SWA minimised with all evictable full pages gone, then full
        (``prefer_swa``: full first); None when nothing makes it fit."""
        ps = self.page_size
        f, s = -(-full_tokens // ps), -(-swa_tokens // ps)
        if empty_pool:
            return (0, 0) if self._holds(f, s) else None
        fits = lambda rf, rs: self._demand_fits(f, s, rf, rs)  # noqa: E731 - read twice below
        if fits(0, 0):
            return (0, 0)
        top_f = min(self.full_attn_allocator.live, full_evictable_tokens // ps)
        top_s = min(self.swa_attn_allocator.live, swa_evictable_tokens // ps)
        if not fits(top_f, top_s):
            return None
        if prefer_swa:
            rf = min(k for k in range(top_f + 1) if fits(k, top_s))
            rs = min(k for k in range(top_s + 1) if fits(rf, k))
        else:
            rs = min(k for k in range(top_s + 1) if fits(top_f, k))
            rf = min(k for k in range(top_f + 1) if fits(k, rs))
        return (rf * ps, rs * ps)

    def can_reserve(self, full_tokens: int, swa_tokens: int, *, full_evictable_tokens: int = 0,
                    swa_evictable_tokens: int = 0, empty_pool: bool = False) -> bool:
        return self.reclaim_plan(full_tokens, swa_tokens, full_evictable_tokens=full_evictable_tokens,
                                 swa_evictable_tokens=swa_evictable_tokens, empty_pool=empty_pool) is not None

    def prealloc_ceiling_fits(self, full_tokens: int, swa_tokens: int) -> bool:
        return self.can_reserve(full_tokens, swa_tokens, empty_pool=True)

    def prealloc_fits(self, tree_cache, full_tokens: int, swa_tokens: int, *, full_budget_tokens: int,
                      swa_budget_tokens: int | None = None) -> bool:
        """``can_reserve`` of the ask, grown by what the budget leaves unused."""
        ef, es = tree_cache.full_evictable_size(), tree_cache.swa_evictable_size()
        full_tokens += self.full_available_size() + ef - full_budget_tokens
        return self.can_reserve(full_tokens, swa_tokens, full_evictable_tokens=ef, swa_evictable_tokens=es)

    def full_available_size(self) -> int:
        return self.available_size()

    @property
    def size_full(self) -> int:
        return (self.full_attn_allocator.num_pages - self.full_attn_allocator.min_page_index) * self.page_size

    @property
    def size_swa(self) -> int:
        return self.size_full

    def max_new_tokens_for_memory(self, input_tokens: int, max_new_tokens: int, *, token_capacity: int,
                                  sliding_window_size: int | None, chunk_size: int | None) -> int | None:
        """The most new tokens (up to ``max_new_tokens``) whose request fits
        an empty pool, a token short of each side's size; no window limit."""
        def fits(new: int) -> bool:
            tokens = input_tokens + new + self.page_size
            return tokens < min(self.size_full, self.size_swa) and self.can_reserve(tokens, tokens, empty_pool=True)

        if not fits(0):
            return None
        return max(c for c in range(max_new_tokens + 1) if fits(c))

    def reclaim_for_prealloc(self, tree_cache, full_tokens: int, swa_tokens: int) -> str | None:
        """None when the demand fits after the cache's eviction; this pool
        compacts eagerly, so nothing else could make room."""
        ef, es = tree_cache.full_evictable_size(), tree_cache.swa_evictable_size()
        if self.can_reserve(full_tokens, swa_tokens, full_evictable_tokens=ef, swa_evictable_tokens=es):
            return None
        return f"short of ({full_tokens}, {swa_tokens}) tokens"

    def get_extend_allocation_demand(self, prefix_lens_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, *,
                                     conservative_num_tokens: int, shard_size: int) -> int:
        """The tokens of the whole new pages an extend touches."""
        ps = self.page_size
        pages = sum(-(-int(s) // ps) - -(-int(p) // ps) for p, s in zip(prefix_lens_cpu, seq_lens_cpu))
        return ps * pages

    def swa_capacity_and_available(self, *, full_capacity: int, swa_capacity: int):
        """((full capacity, available), (SWA capacity, available)) in tokens."""
        av = self.available_size()
        return ((av + self.full_attn_allocator.allocated_count(), av),
                (av + self.swa_attn_allocator.allocated_count(), av))

    # -- the read paths --

    def _translate(self, sub: ArenaSubPool, loc: torch.Tensor) -> torch.Tensor:
        """Token ids through ``sub``'s page table; an unbound page reads the sink 0."""
        ps = self.page_size
        # ``take``: ``v2p[pages]`` on the 1-D table (a negative page wraps, as
        # indexing does) in one gather, half what advanced indexing costs.
        if ps == 1:
            phys = torch.take(sub.virtual_to_physical, loc)
            return torch.where(phys > 0, phys, 0)
        phys = torch.take(sub.virtual_to_physical, loc // ps)
        return torch.where(phys > 0, phys * ps + loc % ps, 0)

    def translate_kv_loc(self, loc: torch.Tensor) -> torch.Tensor:
        return self._translate(self.full_attn_allocator, loc)

    def translate_loc_from_full_to_swa(self, loc: torch.Tensor) -> torch.Tensor:
        return self._translate(self.swa_attn_allocator, loc)

    def available_size(self) -> int:
        return most_that_fit(len(self.full_attn_allocator.free_virtual_ids), self._fits) * self.page_size

    # -- alloc --

    def alloc(self, need_size: int) -> torch.Tensor | None:
        pages = need_size // self.page_size
        if not self._fits(pages):
            return None
        v_pages = self.full_attn_allocator.mint(pages)
        self.swa_attn_allocator.bind(v_pages)
        return page_tokens(v_pages, self.page_size)

    # -- free --

    def _pages(self, free_index: torch.Tensor) -> torch.Tensor:
        return torch.unique(free_index.to(torch.int64) // self.page_size)

    def _reps(self, free_index: torch.Tensor, start_pos: int) -> torch.Tensor:
        """One slot of each page of a page-aligned segment, as a copy."""
        assert start_pos % self.page_size == 0, f"segment start {start_pos} is not page-aligned"
        return free_index[:: self.page_size].to(torch.int64).clone()

    def _swa_live(self, v_pages: torch.Tensor) -> torch.Tensor:
        """The pages whose SWA side is bound: a tombstone (-1) is skipped."""
        return v_pages[self.swa_attn_allocator.virtual_to_physical[v_pages] > 0]

    def _release(self, v_pages: torch.Tensor, *, swa: bool) -> None:
        if not len(v_pages):
            return
        if swa:
            self.swa_attn_allocator.unbind(self._swa_live(v_pages))
        self.full_attn_allocator.recycle(v_pages)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(free_index.clone())
            return
        self._release(self._pages(free_index), swa=True)

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        if free_index.numel() == 0:
            return
        reps = self._reps(free_index, start_pos)
        if self.free_page_reps_group is not None:
            self.free_page_reps_group.append(reps)
            return
        self._release(reps // self.page_size, swa=True)

    def free_full(self, free_index: torch.Tensor) -> None:
        """The full side only: the SWA side is already a tombstone."""
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.full_free_group.append(free_index.clone())
            return
        self._release(self._pages(free_index), swa=False)

    def free_full_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        if free_index.numel() == 0:
            return
        reps = self._reps(free_index, start_pos)
        if self.free_page_reps_group is not None:
            self.full_page_reps_group.append(reps)
            return
        self._release(reps // self.page_size, swa=False)

    def free_swa(self, free_index: torch.Tensor) -> None:
        """The window slid: unbind the SWA side of the bound pages, at once."""
        if free_index.numel() == 0:
            return
        self.swa_attn_allocator.unbind(self._swa_live(self._pages(free_index)))

    def free_swa_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        if free_index.numel() == 0:
            return
        self.swa_attn_allocator.unbind(self._reps(free_index, start_pos) // self.page_size)

    # -- free groups --

    def free_group_begin(self) -> None:
        self.free_group, self.free_page_reps_group = [], []
        self.full_free_group, self.full_page_reps_group = [], []

    def free_group_end(self) -> None:
        """Flush the four queues: whole frees, full-only frees, and the page
        representatives of both kinds of segment."""
        both, self.free_group = self.free_group, None
        both_reps, self.free_page_reps_group = self.free_page_reps_group, None
        full, self.full_free_group = self.full_free_group, []
        full_reps, self.full_page_reps_group = self.full_page_reps_group, []
        self._flush(both or [], both_reps or [], full, full_reps)

    def _flush(self, both, both_reps, full, full_reps) -> None:
        if both:
            self.free(torch.cat(both))
        for reps in both_reps:
            self._release(reps // self.page_size, swa=True)
        if full:
            self.free_full(torch.cat(full))
        for reps in full_reps:
            self._release(reps // self.page_size, swa=False)


class NoTombstoneFilterAllocator(UnifiedSWAAllocator):
    """Mutant: ``free`` forwards every page to the SWA side, tombstones
    (``v2p == -1``) included, as a forwarding wrapper with no ``-1`` filter
    does: the SWA pool counts a page it never held as released."""

    def _swa_live(self, v_pages: torch.Tensor) -> torch.Tensor:
        return v_pages


class FullQueueNotFlushedAllocator(UnifiedSWAAllocator):
    """Mutant: ``free_group_end`` flushes three of its four queues and drops
    the full-only frees (``free_full`` inside a group): those pages leak."""

    def _flush(self, both, both_reps, full, full_reps) -> None:
        super()._flush(both, both_reps, [], full_reps)


class SegmentQueuesViewAllocator(UnifiedSWAAllocator):
    """Mutant: ``free_segment`` inside a group queues a strided *view* of
    the caller's row (sglang's ``.to(torch.int64)[::ps]`` is one for an
    int64 row): an overwrite before the group ends changes what it frees."""

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        if self.free_page_reps_group is not None and free_index.numel():
            self.free_page_reps_group.append(free_index[:: self.page_size])
            return
        super().free_segment(free_index, start_pos=start_pos)


class SlideKeepsBindingAllocator(UnifiedSWAAllocator):
    """Mutant: a slide gives the SWA physical page back but leaves the
    virtual page bound to it (no tombstone): the next alloc binds the same
    physical page to a second virtual page."""

    def free_swa(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        sa = self.swa_attn_allocator
        live = self._swa_live(self._pages(free_index))
        if len(live):
            sa._release(sa.virtual_to_physical[live].clone())


class AdmissionIgnoresSWAAllocator(UnifiedSWAAllocator):
    """Mutant: admission prices only the full side's pages (as if the SWA
    side were free): ``can_reserve`` says yes to what the arena cannot
    hold, and the reclaim plan evicts no SWA page."""

    def _demand_fits(self, full: int, swa: int, reclaim_full: int = 0, reclaim_swa: int = 0) -> bool:
        return super()._demand_fits(full, 0, reclaim_full, 0)


class TombstoneReadWrapsAllocator(UnifiedSWAAllocator):
    """Mutant: the SWA read path indexes with the tombstone itself: page
    -1 is the KV buffer's last page, where the SWA pool (growing down from
    the arena's top) keeps another request's window."""

    def translate_loc_from_full_to_swa(self, loc: torch.Tensor) -> torch.Tensor:
        ps, sa = self.page_size, self.swa_attn_allocator
        pages = loc // ps
        phys = sa.virtual_to_physical[pages]
        tombstone = (phys < 0) & (self.full_attn_allocator.virtual_to_physical[pages] > 0)
        wrapped = (sa.num_pages - 1) * ps + loc % ps
        return torch.where(tombstone, wrapped, super().translate_loc_from_full_to_swa(loc))


class ClearKeepsSWAAllocator(UnifiedSWAAllocator):
    """Mutant: ``clear()`` resets the full sub-pool and forgets the SWA one
    (a composite that does not fan out to every sub-pool): the SWA side of
    every page the cache held stays bound."""

    def _cleared_pools(self) -> tuple[ArenaSubPool, ...]:
        return (self.full_attn_allocator,)


UNIFIED_SWA_MUTANTS = {
    m.name: m
    for m in (
        Mutant("no-tombstone-filter", NoTombstoneFilterAllocator,
               "free() sends tombstoned pages (v2p == -1) to the SWA side too"),
        Mutant("full-queue-not-flushed", FullQueueNotFlushedAllocator,
               "free_group_end() drops the queued free_full() calls"),
        Mutant("segment-queues-view", SegmentQueuesViewAllocator,
               "free_segment() in a group queues a view of the caller's row"),
        Mutant("slide-keeps-binding", SlideKeepsBindingAllocator,
               "free_swa() frees the SWA page but leaves v2p pointing at it"),
        Mutant("admission-ignores-swa", AdmissionIgnoresSWAAllocator,
               "can_reserve() / reclaim_plan() price the full side only"),
        Mutant("tombstone-read-wraps", TombstoneReadWrapsAllocator,
               "the SWA read path sends a tombstone (v2p == -1) to the arena's last page"),
        Mutant("clear-keeps-swa", ClearKeepsSWAAllocator,
               "clear() resets the full sub-pool only: the SWA side keeps its bindings"),
    )
}
