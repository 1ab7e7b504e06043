"""Full KV pages and Mamba state slots in one byte arena, each over its own
virtual ids (the twin of sglang's ``UnifiedMambaTokenToKVPoolAllocator``
and the ``UnifiedMambaSlotAllocator`` its request pool wraps around the
Mamba sub-pool).

The full sub-pool grows up from the arena's low end, the Mamba sub-pool
(one slot a page) down from its high end; an alloc on either side fits only
in the bytes the other leaves.  The composite's ``free`` / ``free_segment``
reach the full side only (queued in a free group); the Mamba slots are
allocated and freed through ``mamba_slots``, with allocation groups.
"""

from __future__ import annotations

import torch

from allocators.base import Mutant
from allocators.unified_swa import FULL_SLOT_BYTES, ArenaSubPool, most_that_fit, page_tokens

MAMBA_SLOT_BYTES = 32


class Arena:
    """Two end sub-pools and the bytes between them."""

    def __init__(self, low: ArenaSubPool, high: ArenaSubPool, budget: int):
        self.low, self.high, self.budget = low, high, budget

    def fits(self, low_more: int, high_more: int) -> bool:
        lo, hi = self.low, self.high
        return (
            lo.live + low_more <= lo.num_pages - lo.min_page_index
            and hi.live + high_more <= hi.num_pages - hi.min_page_index
            and (lo.live + low_more) * lo.entry_bytes_per_page + (hi.live + high_more) * hi.entry_bytes_per_page
            <= self.budget
        )


class MambaSlots:
    """Mamba state slots (virtual ids of the Mamba sub-pool) with allocation groups."""

    def __init__(self, owner: UnifiedMambaAllocator):
        self.owner = owner
        self.batch: list[torch.Tensor] | None = None

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if need_size == 1 and self.batch:
            return self.batch.pop(0)
        arena, pool = self.owner.arena, self.owner.mamba_allocator
        if need_size > len(pool.free_virtual_ids) or not arena.fits(0, need_size):
            return None
        return pool.mint(need_size)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel():
            self.owner.mamba_allocator.recycle(free_index.to(torch.int64).clone())

    def schedulable_available_size(self) -> int:
        """Slots an ``alloc`` can take now: free ids the arena's bytes hold."""
        return most_that_fit(len(self.owner.mamba_allocator.free_virtual_ids), lambda k: self.owner.arena.fits(0, k))

    def alloc_group_begin(self, num_reqs: int) -> None:
        got = self.alloc(num_reqs) if num_reqs > 0 else None
        self.batch = list(got.split(1)) if got is not None else None

    def alloc_group_end(self) -> None:
        batch, self.batch = self.batch, None
        if batch:
            self.free(torch.cat(batch))


class UnifiedMambaAllocator:
    """Full pages and Mamba slots over one byte arena; frees of full pages
    are queued in a free group (whole frees and segment representatives)."""

    family = "unified_mamba"
    lazy_compaction = False

    def __init__(self, size: int, page_size: int = 1, device: str = "cpu", need_sort: bool = False):
        self.size, self.page_size, self.device = size, page_size, device
        total = (size + page_size) * FULL_SLOT_BYTES
        full_pages, slots = total // (FULL_SLOT_BYTES * page_size), total // MAMBA_SLOT_BYTES
        mamba_first = -(-FULL_SLOT_BYTES * page_size // MAMBA_SLOT_BYTES)
        self.full_attn_allocator = ArenaSubPool("full", "up", full_pages, 1, FULL_SLOT_BYTES * page_size,
                                                full_pages, page_size, device)
        self.mamba_allocator = ArenaSubPool("mamba", "down", slots, mamba_first, MAMBA_SLOT_BYTES, slots, 1, device)
        self.full_attn_allocator.free_virtual_ids = torch.arange(1, full_pages, dtype=torch.int64, device=device)
        self.mamba_allocator.free_virtual_ids = torch.arange(mamba_first, slots, dtype=torch.int64, device=device)
        # The Mamba band tops out at its last whole slot, the full band starts past the sink page.
        self.arena = Arena(self.full_attn_allocator, self.mamba_allocator,
                           slots * MAMBA_SLOT_BYTES - FULL_SLOT_BYTES * page_size)
        self.mamba_slots = MambaSlots(self)
        self.clear()

    def clear(self) -> None:
        """The scheduler's flush: both sub-pools as built, no group open."""
        for sub in self._cleared_pools():
            sub.clear()
        self.mamba_slots.batch = None
        self.free_group: list[torch.Tensor] | None = None
        self.free_page_reps_group: list[torch.Tensor] | None = None

    def _cleared_pools(self) -> tuple[ArenaSubPool, ...]:
        return self.full_attn_allocator, self.mamba_allocator

    def available_size(self) -> int:
        return most_that_fit(len(self.full_attn_allocator.free_virtual_ids), self._fits) * self.page_size

    def _fits(self, pages: int) -> bool:
        return self.arena.fits(pages, 0)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        pages = need_size // self.page_size
        if pages > len(self.full_attn_allocator.free_virtual_ids) or not self._fits(pages):
            return None
        return page_tokens(self.full_attn_allocator.mint(pages), self.page_size)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(free_index.clone())
            return
        self.full_attn_allocator.recycle(torch.unique(free_index.to(torch.int64) // self.page_size))

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        if free_index.numel() == 0:
            return
        assert start_pos % self.page_size == 0, f"segment start {start_pos} is not page-aligned"
        reps = free_index[:: self.page_size].to(torch.int64).clone()
        if self.free_page_reps_group is not None:
            self.free_page_reps_group.append(reps)
            return
        self.full_attn_allocator.recycle(reps // self.page_size)

    def free_group_begin(self) -> None:
        self.free_group, self.free_page_reps_group = [], []

    def free_group_end(self) -> None:
        whole, self.free_group = self.free_group, None
        reps, self.free_page_reps_group = self.free_page_reps_group, None
        self._flush(whole or [], reps or [])

    def _flush(self, whole, reps) -> None:
        if whole:
            self.free(torch.cat(whole))
        for r in reps:
            self.full_attn_allocator.recycle(r // self.page_size)

    # -- what the radix cache and the scheduler call besides --

    def flush_opportunistic(self) -> int:
        """Eager compaction leaves no holes: nothing to do."""
        return 0

    def prepare_mamba_allocation(self, target_size: int) -> None:
        """Apply the frees an open free group holds, and keep the group open."""
        if self.free_group is not None and (self.free_group or self.free_page_reps_group):
            self.free_group_end()
            self.free_group_begin()

    def full_tokens_before_mamba_recheck(self, target_size: int) -> int:
        """Full tokens whose bytes must come free before ``target_size`` slots
        can: 0 when they fit now; else the missing slots' bytes, less what
        the last slot may already have, in full tokens (rounded up)."""
        missing = max(0, target_size - self.mamba_slots.schedulable_available_size())
        if not missing:
            return 0
        return -(-((missing - 1) * MAMBA_SLOT_BYTES + 1) // FULL_SLOT_BYTES)


class RepsNotFlushedAllocator(UnifiedMambaAllocator):
    """Mutant: ``free_group_end`` flushes the whole frees but drops the
    queued segment representatives: those full pages leak."""

    def _flush(self, whole, reps) -> None:
        super()._flush(whole, [])


class BytesNotSharedAllocator(UnifiedMambaAllocator):
    """Mutant: the full side checks only its own index range, not the bytes
    the Mamba slots hold: its band grows into theirs."""

    def _fits(self, pages: int) -> bool:
        fa = self.full_attn_allocator
        return fa.live + pages <= fa.num_pages - fa.min_page_index


class GroupEndKeepsLeftoversSlots(MambaSlots):
    def alloc_group_end(self) -> None:
        self.batch = None


class GroupEndKeepsLeftoversAllocator(UnifiedMambaAllocator):
    """Mutant: the Mamba slots' ``alloc_group_end`` drops the slots no alloc drew: they leak."""

    def __init__(self, size: int, page_size: int = 1, device: str = "cpu", need_sort: bool = False):
        super().__init__(size, page_size, device, need_sort)
        self.mamba_slots = GroupEndKeepsLeftoversSlots(self)


class PrepareClosesGroupAllocator(UnifiedMambaAllocator):
    """Mutant: ``prepare_mamba_allocation`` applies the queued frees but
    leaves the caller's free group closed: later frees the caller means to
    defer free at once."""

    def prepare_mamba_allocation(self, target_size: int) -> None:
        if self.free_group is not None and (self.free_group or self.free_page_reps_group):
            self.free_group_end()


class SlotsIgnoreFullBytesSlots(MambaSlots):
    def schedulable_available_size(self) -> int:
        return len(self.owner.mamba_allocator.free_virtual_ids)


class SchedulableOverpromisesAllocator(UnifiedMambaAllocator):
    """Mutant: the Mamba slots' ``schedulable_available_size()`` counts free
    ids and ignores the bytes the full side holds: the planner is promised
    slots an alloc refuses."""

    def __init__(self, size: int, page_size: int = 1, device: str = "cpu", need_sort: bool = False):
        super().__init__(size, page_size, device, need_sort)
        self.mamba_slots = SlotsIgnoreFullBytesSlots(self)


class ClearKeepsMambaAllocator(UnifiedMambaAllocator):
    """Mutant: ``clear()`` resets the full sub-pool and forgets the Mamba
    end (the fan-out sglang's tri-pool adds in its own override): the
    Mamba states the cache held stay taken."""

    def _cleared_pools(self) -> tuple[ArenaSubPool, ...]:
        return (self.full_attn_allocator,)


UNIFIED_MAMBA_MUTANTS = {
    m.name: m
    for m in (
        Mutant("reps-not-flushed", RepsNotFlushedAllocator,
               "free_group_end() drops the queued free_segment() representatives", {"min_page_size": 2}),
        Mutant("bytes-not-shared", BytesNotSharedAllocator,
               "the full side's alloc ignores the bytes Mamba slots hold"),
        Mutant("group-end-keeps-leftovers", GroupEndKeepsLeftoversAllocator,
               "the Mamba slots' alloc_group_end() leaks the undrawn slots"),
        Mutant("prepare-closes-group", PrepareClosesGroupAllocator,
               "prepare_mamba_allocation() applies the queued frees and leaves the free group closed"),
        Mutant("schedulable-overpromises", SchedulableOverpromisesAllocator,
               "the Mamba slots' schedulable_available_size() ignores the full side's bytes"),
        Mutant("clear-keeps-mamba", ClearKeepsMambaAllocator,
               "clear() resets the full sub-pool only: the Mamba slots stay taken"),
    )
}
