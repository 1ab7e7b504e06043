"""Virtual page ids over compacting physical pages: the twin of sglang's
``MultiEndedAllocator`` (``unified_sub_pool.py``), one grow-up sub-pool
with lazy compaction.

``alloc`` hands out virtual page ids (``free_virtual_ids``) and binds each
to a physical page in ``virtual_to_physical`` / ``physical_to_virtual``:
a hole left by an earlier free first (``_free_phys_pages``), else the next
page past ``watermark_physical``.  A free unbinds at once and leaves a
hole; a flush compacts (moves the topmost live pages down into the lowest
holes, the KV bytes with them, then pulls the watermark back).
``alloc_physical`` lends physical pages with no virtual id (HiCache
load-back); while a loan is out, pages may not move.  Free groups queue
two lists, as sglang's does: ``free_group`` (``free``) and
``free_page_reps_group`` (``free_segment``'s page representatives).
"""

from __future__ import annotations

import torch

from allocators.base import Mutant

I64 = torch.int64


class PageStamps:
    """The KV bytes, reduced to who wrote each physical page: the harness
    stamps a page with the virtual page whose KV it holds, and a compaction
    move carries the stamp along."""

    def __init__(self) -> None:
        self.stamps: dict[int, int] = {}

    def move_physical_pages(self, dst: torch.Tensor, src: torch.Tensor, page_size: int) -> None:
        for d, s in zip(dst.tolist(), src.tolist()):
            self.stamps[d] = self.stamps.pop(s, None)


class MultiEndedAllocator:
    """Virtual page ids bound to compacting physical pages, lazily compacted.

    One sub-pool of ``size // page_size`` pages plus the padding page 0."""

    # Read by targets: the unified harness drives this family.
    family = "unified"

    def __init__(self, size: int, page_size: int = 1, device: str = "cpu", need_sort: bool = False):
        self.page_size = page_size
        self.device = device
        self.need_sort = need_sort
        # Page 0 is the padding anchor (virtual 0 <-> physical 0), never handed out.
        self.min_page_index = 1
        self.num_pages = size // page_size + 1
        self.grow_direction = "up"
        # One page's bytes in the arena, and the arena (this sub-pool's alone).
        self.entry_bytes_per_page = page_size
        self.total_bytes = self.num_pages * page_size
        self._kvcache = PageStamps()
        self.clear()

    def clear(self) -> None:
        n = self.num_pages
        self.virtual_to_physical = torch.full((n + 1,), -1, dtype=I64)
        self.physical_to_virtual = torch.full((n + 1,), -1, dtype=I64)
        self.virtual_to_physical[0] = self.physical_to_virtual[0] = 0
        self.free_virtual_ids = torch.arange(self.min_page_index, n, dtype=I64)
        self.watermark_physical = self.min_page_index
        self._free_phys_pages = torch.empty(0, dtype=I64)
        # Pages lent by alloc_physical and not yet returned: moves wait for them.
        self._pending_loads = 0
        self.free_group: list[torch.Tensor] | None = None
        self.free_page_reps_group: list[torch.Tensor] | None = None

    def get_kvcache(self) -> PageStamps:
        return self._kvcache

    # -- capacity --

    def available_size(self) -> int:
        """Pages past the watermark plus the holes, in tokens."""
        return (self.num_pages - self.watermark_physical + len(self._free_phys_pages)) * self.page_size

    def _take_physical(self, n: int) -> torch.Tensor | None:
        """``n`` physical pages: the lowest holes first, then past the watermark."""
        if n > self.available_size() // self.page_size:
            return None
        holes = torch.sort(self._free_phys_pages).values
        drained, self._free_phys_pages = holes[:n], holes[n:]
        more = n - len(drained)
        fresh = torch.arange(self.watermark_physical, self.watermark_physical + more, dtype=I64)
        self.watermark_physical += more
        return torch.cat([drained, fresh])

    def _tokens(self, pages: torch.Tensor) -> torch.Tensor:
        ps = self.page_size
        return (pages[:, None] * ps + torch.arange(ps, dtype=I64)).reshape(-1)

    # -- alloc --

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` virtual token ids (whole pages), or None when short."""
        n = need_size // self.page_size
        if need_size > self.available_size():
            self.flush_for_allocation()
        if n > len(self.free_virtual_ids) or need_size > self.available_size():
            return None
        v = self.free_virtual_ids[:n].clone()
        p = self._take_physical(n)
        self.free_virtual_ids = self.free_virtual_ids[n:]
        self.virtual_to_physical[v] = p
        self.physical_to_virtual[p] = v
        return self._tokens(v)

    def alloc_physical(self, need_size: int) -> torch.Tensor | None:
        """Lend ``need_size`` physical token slots with no virtual id."""
        n = need_size // self.page_size
        p = self._take_physical(n)
        if p is None:
            return None
        self._pending_loads += n
        return self._tokens(p)

    # -- free --

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(free_index.clone())
            return
        self._unbind(self._pages_of(free_index))

    def _pages_of(self, free_index: torch.Tensor) -> torch.Tensor:
        return torch.unique(free_index.to(I64) // self.page_size)

    def _unbind(self, v: torch.Tensor) -> None:
        """Unmap virtual pages ``v`` (each once); their physical pages become holes."""
        p = self.virtual_to_physical[v].clone()
        self.virtual_to_physical[v] = -1
        self.physical_to_virtual[p] = -1
        self.free_virtual_ids = torch.cat([self.free_virtual_ids, v])
        self._free_phys_pages = torch.cat([self._free_phys_pages, p])

    def _segment_reps(self, free_index: torch.Tensor) -> torch.Tensor:
        """One token of each page of a page-aligned segment, owned by the queue."""
        return free_index.detach().to(I64)[:: self.page_size].clone()

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        if free_index.numel() == 0:
            return
        if self.page_size == 1:
            self.free(free_index)
            return
        reps = self._segment_reps(free_index)
        if self.free_page_reps_group is None:
            self._unbind(reps // self.page_size)
        else:
            self.free_page_reps_group.append(reps)

    def free_physical(self, free_index: torch.Tensor) -> None:
        """Return a loan's physical pages: they become holes."""
        p = free_index.to(I64)[:: self.page_size] // self.page_size
        self._pending_loads -= len(p)
        self._free_phys_pages = torch.cat([self._free_phys_pages, p])

    cancel_physical_reservation = free_physical

    def free_group_begin(self) -> None:
        assert self.free_group is None, "free groups cannot be nested"
        self.free_group, self.free_page_reps_group = [], []

    def free_group_end(self) -> None:
        pending, self.free_group = self.free_group, None
        reps = self._take_reps()
        if pending:
            self.free(torch.cat(pending))
        if reps:
            self._unbind(torch.cat(reps) // self.page_size)

    def _take_reps(self) -> list[torch.Tensor] | None:
        reps, self.free_page_reps_group = self.free_page_reps_group, None
        return reps

    # -- compaction --

    def flush_opportunistic(self) -> int:
        """Pull the watermark back over holes already next to it; no moves."""
        self._absorb()
        return 0

    def flush_for_allocation(self) -> int:
        """Move the topmost live pages into the lowest holes, then absorb;
        nothing moves while a loan is out.  Returns the number of moves."""
        if self._pending_loads:
            return 0
        holes = sorted(self._free_phys_pages.tolist())
        hole_set = set(holes)
        live = [p for p in range(self.min_page_index, self.watermark_physical) if p not in hole_set]
        moves = [(s, d) for s, d in zip(reversed(live), holes) if s > d]
        if moves:
            src = torch.tensor([s for s, _ in moves], dtype=I64)
            dst = torch.tensor([d for _, d in moves], dtype=I64)
            self._move(src, dst)
            moved = set(dst.tolist())
            self._free_phys_pages = torch.tensor([h for h in holes if h not in moved] + src.tolist(), dtype=I64)
        self._absorb()
        return len(moves)

    def _move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        v = self.physical_to_virtual[src].clone()
        self._kvcache.move_physical_pages(dst, src, self.page_size)
        self.virtual_to_physical[v] = dst
        self.physical_to_virtual[dst] = v
        self.physical_to_virtual[src] = -1

    def _absorb(self) -> None:
        holes = set(self._free_phys_pages.tolist())
        while self.watermark_physical - 1 in holes:
            self.watermark_physical -= 1
            holes.discard(self.watermark_physical)
        self._free_phys_pages = torch.tensor(sorted(holes), dtype=I64)


class SegmentViewAllocator(MultiEndedAllocator):
    """Mutant: free_segment queues ``free_index.to(int64)[::ps]`` as it is,
    as sglang 0.5.22/0.5.23 do: a copy of an int32 row, a view of an int64
    one, so a row rewritten before the group ends frees the wrong pages."""

    def _segment_reps(self, free_index: torch.Tensor) -> torch.Tensor:
        return free_index.detach().to(I64)[:: self.page_size]


class RepsDriftAllocator(MultiEndedAllocator):
    """Mutant: free_group_end frees the page-reps list but leaves it in
    place (one of the group's lists not cleared), so a later end frees the
    same pages again."""

    def _take_reps(self) -> list[torch.Tensor] | None:
        reps = self.free_page_reps_group
        if reps is not None:
            self.free_page_reps_group = list(reps)
        return reps


class LazyNoDedupAllocator(MultiEndedAllocator):
    """Mutant: the lazy free path takes ``index // page_size`` without
    deduplicating, so a page of several tokens is unbound once per token:
    a double free nothing detects (the tombstone joins the free lists)."""

    def _pages_of(self, free_index: torch.Tensor) -> torch.Tensor:
        return free_index.to(I64) // self.page_size


class MoveKeepsMappingAllocator(MultiEndedAllocator):
    """Mutant: compaction copies the KV but leaves v2p pointing at the old
    page, so a moved virtual page reads a hole."""

    def _move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._kvcache.move_physical_pages(dst, src, self.page_size)
        self.physical_to_virtual[dst] = self.physical_to_virtual[src]
        self.physical_to_virtual[src] = -1


class ClearKeepsFreeIdsAllocator(MultiEndedAllocator):
    """Mutant: ``clear()`` empties the page tables but keeps the free
    virtual ids as they were: the pages the cache held are never handed
    out again."""

    def clear(self) -> None:
        kept = getattr(self, "free_virtual_ids", None)
        super().clear()
        if kept is not None:
            self.free_virtual_ids = kept


MULTI_ENDED_MUTANTS = {
    m.name: m
    for m in (
        Mutant(
            "segment-view", SegmentViewAllocator, "free_segment queues a view of an int64 row (sglang 0.5.22/0.5.23's form)",
            {"min_page_size": 2, "row_dtype": "int64"},
        ),
        Mutant("reps-drift", RepsDriftAllocator, "free_group_end leaves the page-reps list in place", {"min_page_size": 2}),
        Mutant("lazy-no-dedup", LazyNoDedupAllocator, "the lazy free unbinds a page once per token", {"min_page_size": 2}),
        Mutant("move-keeps-mapping", MoveKeepsMappingAllocator, "compaction moves the KV but not the mapping"),
        Mutant("clear-keeps-free-ids", ClearKeepsFreeIdsAllocator, "clear() empties the tables but keeps the free ids"),
    )
}
