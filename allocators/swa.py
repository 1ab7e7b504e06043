"""Sliding-window hybrid allocation: a full pool and an SWA pool joined by a full-to-SWA mapping."""

from __future__ import annotations

import torch

from allocators.base import AliasMixin, Mutant
from allocators.paged import PagedAllocator
from allocators.token import TokenAllocator


class SWAAllocator:
    """Full and SWA pools of the same page size; ``alloc`` takes slots from
    both and maps each full slot to its SWA slot.

    ``free`` releases both sides and clears the mapping; ``free_swa`` only
    the SWA side of tokens that slid out of the window; ``free_full`` only
    the full side of tokens whose SWA side is already gone.  In a free group
    each side queues: the full pool in its own group (copies), the SWA side
    here, resolved through the mapping when queued, because a cache action
    later in the group may map the same full slot again.
    """

    # Read by targets.py: the SWA harness drives this family.
    family = "swa"

    def __init__(self, size: int, page_size: int = 1, device: str = "cpu", need_sort: bool = False, size_swa: int | None = None):
        pool = self._pool_class(page_size)
        kwargs = {} if page_size == 1 else {"page_size": page_size}
        self.page_size = page_size
        self.device = device
        self.full_attn_allocator = pool(size, device=device, need_sort=need_sort, **kwargs)
        self.swa_attn_allocator = pool(size_swa or size, device=device, need_sort=need_sort, **kwargs)
        # The trailing -1 is what a last_loc of -1 translates to.
        self.full_to_swa_index_mapping = torch.zeros(size + page_size + 1, dtype=torch.int64, device=device)
        self.full_to_swa_index_mapping[-1] = -1
        self.clear()

    @staticmethod
    def _pool_class(page_size: int) -> type:
        return TokenAllocator if page_size == 1 else PagedAllocator

    def clear(self) -> None:
        self.full_attn_allocator.clear()
        self.swa_attn_allocator.clear()
        self.full_to_swa_index_mapping[:-1] = 0
        # None: frees are immediate.  A list: the group's resolved SWA slots.
        self.free_group: list[torch.Tensor] | None = None
        self.swa_page_ids_group: list[torch.Tensor] = []

    # -- sizes and census --

    def available_size(self) -> int:
        return min(self.full_available_size(), self.swa_available_size())

    def full_available_size(self) -> int:
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
        return self.swa_attn_allocator.available_size()

    def get_all_free_pages(self) -> torch.Tensor:
        """The full pool's census; the SWA pool's is ``swa_attn_allocator``'s."""
        return self.full_attn_allocator.get_all_free_pages()

    # -- allocation --

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if need_size > self.full_available_size() or need_size > self.swa_available_size():
            return None
        full = self.full_attn_allocator.alloc(need_size)
        swa = self.swa_attn_allocator.alloc(need_size)
        if full is None or swa is None:
            raise RuntimeError(f"alloc({need_size}): a pool came up short after its available_size() said it would not")
        self.full_to_swa_index_mapping[full] = swa
        return full

    # -- freeing --

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        # SWA first: it reads the mapping before anything can re-point it.
        self.free_swa(free_index)
        self.free_full(free_index)

    def free_full(self, free_index: torch.Tensor) -> None:
        if free_index.numel():
            self.full_attn_allocator.free(free_index)

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        if free_index.numel() == 0:
            return
        self.free_swa_segment(free_index, start_pos=start_pos)
        self.full_attn_allocator.free_segment(free_index, start_pos=start_pos)

    def free_full_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        if free_index.numel():
            self.full_attn_allocator.free_segment(free_index, start_pos=start_pos)

    def free_swa(self, free_index: torch.Tensor) -> None:
        """Release the SWA peers of these full slots (whole pages) and unmap them."""
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(self._take_mapping(self._expand(free_index)))
            return
        self._release_swa(self._take_mapping(self._expand(free_index)))

    def free_swa_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """free_swa() of a kv-row segment: one representative per page."""
        if free_index.numel() == 0:
            return
        if start_pos % self.page_size:
            raise ValueError(f"segment start {start_pos} is not page-aligned (page size {self.page_size})")
        reps = free_index[:: self.page_size]
        swa_reps = self._take_mapping(self._expand(reps))[:: self.page_size]
        pages = swa_reps[swa_reps > 0] // self.page_size
        if self.free_group is not None:
            self.swa_page_ids_group.append(pages)
            return
        self.swa_attn_allocator._release_pages(pages)

    def _expand(self, index: torch.Tensor) -> torch.Tensor:
        """Every slot of the pages these slots sit on."""
        if self.page_size == 1:
            return index
        base = (index // self.page_size) * self.page_size
        offsets = torch.arange(self.page_size, dtype=index.dtype, device=index.device)
        return (base[:, None] + offsets).reshape(-1)

    def _take_mapping(self, full_slots: torch.Tensor) -> torch.Tensor:
        """The SWA slots these full slots map to (a new tensor); unmaps them."""
        swa = self.full_to_swa_index_mapping[full_slots]
        self._unmap(full_slots)
        return swa

    def _unmap(self, full_slots: torch.Tensor) -> None:
        self.full_to_swa_index_mapping[full_slots] = 0

    def _release_swa(self, swa_slots: torch.Tensor) -> None:
        # Slots whose window already slid read as 0; the padding slot is never freed.
        swa_slots = swa_slots[swa_slots > 0]
        if swa_slots.numel():
            self.swa_attn_allocator.free(swa_slots)

    # -- free groups --

    def free_group_begin(self) -> None:
        if self.free_group is not None:
            raise RuntimeError("free_group_begin() while a free group is open: call free_group_end() first")
        self.free_group = []
        self.swa_page_ids_group = []
        self.full_attn_allocator.free_group_begin()

    def free_group_end(self) -> None:
        pending, self.free_group = self.free_group, None
        pages, self.swa_page_ids_group = self.swa_page_ids_group, []
        if pending:
            self._release_swa(self._resolve_queued(pending))
        if pages:
            self.swa_attn_allocator._release_pages(torch.cat(pages))
        self.full_attn_allocator.free_group_end()

    def _resolve_queued(self, pending: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(pending)


class AliasFullSWAAllocator(SWAAllocator):
    """Mutant: the full pool's group queue keeps the caller's row view."""

    @staticmethod
    def _pool_class(page_size: int) -> type:
        base = TokenAllocator if page_size == 1 else PagedAllocator
        return type(f"Alias{base.__name__}", (AliasMixin, base), {})


class AliasSWASideSWAAllocator(SWAAllocator):
    """Mutant: the SWA queue keeps the caller's row view and translates it at
    ``free_group_end()``, after the cache re-pointed the row: the cache's SWA
    slots are freed and the evicted request's stay mapped (sglang PR 34067)."""

    def free_swa(self, free_index: torch.Tensor) -> None:
        if free_index.numel() and self.free_group is not None:
            # The view itself: expanding to whole pages here would copy it.
            self.free_group.append(free_index)
            return
        super().free_swa(free_index)

    def free_swa_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        if free_index.numel() and self.free_group is not None:
            # A strided view of the row, like free_segment's representatives.
            self.free_group.append(free_index[:: self.page_size])
            return
        super().free_swa_segment(free_index, start_pos=start_pos)

    def _resolve_queued(self, pending: list[torch.Tensor]) -> torch.Tensor:
        return self._take_mapping(self._expand(torch.cat(pending)))


class KeepsMappingSWAAllocator(SWAAllocator):
    """Mutant: free_swa() releases the SWA slots but leaves them mapped, so a
    slid-out full slot still points at a free SWA slot."""

    def free_swa(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        swa = self.full_to_swa_index_mapping[self._expand(free_index)]
        if self.free_group is not None:
            self.free_group.append(swa)
        else:
            self._release_swa(swa)


SWA_MUTANTS = {
    m.name: m
    for m in (
        Mutant("alias-full", AliasFullSWAAllocator, "the full pool's group queue keeps the caller's row view"),
        Mutant("alias-swa", AliasSWASideSWAAllocator, "the SWA queue keeps the row view and translates it at end"),
        Mutant("swa-keeps-mapping", KeepsMappingSWAAllocator, "free_swa releases SWA slots but leaves them mapped"),
    )
}


class PureSWAAllocator(TokenAllocator):
    """Every layer windowed: one pool; a window slide frees for good.

    The full-to-SWA mapping is the identity.  A window slide (``free_swa``)
    gives slots back for good, so ``free_full`` of them later has nothing
    to release."""

    # Read by targets.py: the pure-SWA harness drives this family.
    family = "pure_swa"

    def _pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        # Slots that map to nothing read as the padding slot 0.
        return slots[slots > 0]

    def free_swa(self, free_index: torch.Tensor) -> None:
        self.free(free_index)

    def free_swa_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        self.free_swa(free_index)

    def free_full(self, free_index: torch.Tensor) -> None:
        return

    def free_full_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        return


class AliasPureSWAAllocator(AliasMixin, PureSWAAllocator):
    pass


class EndRequeuesPureSWAAllocator(PureSWAAllocator):
    """Mutant: free_group_end() frees the queue before closing the group, so
    the frees are queued again and never released."""

    def free_group_end(self) -> None:
        pending = self.free_group
        if pending:
            self.free_group = []
            self.free(torch.cat(pending))
        self.free_group = None


class FreeFullReleasesPureSWAAllocator(PureSWAAllocator):
    """Mutant: free_full() is a plain free(), as a single pool's base class
    has it: the slots a window slide already gave back are freed again."""

    def free_full(self, free_index: torch.Tensor) -> None:
        self.free(free_index)

    def free_full_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        self.free_full(free_index)


class SegmentFreesTwicePureSWAAllocator(PureSWAAllocator):
    """Mutant: free_segment() splits into an SWA half and a full half, as the
    hybrid parent does; with one pool both halves release the same slots."""

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        self.free_swa_segment(free_index, start_pos=start_pos)
        self.free(free_index)


PURE_SWA_MUTANTS = {
    m.name: m
    for m in (
        Mutant("alias", AliasPureSWAAllocator, "the free-group queue keeps the caller's row view"),
        Mutant("end-requeues", EndRequeuesPureSWAAllocator, "free_group_end frees while the group is still open"),
        Mutant("free-full-releases", FreeFullReleasesPureSWAAllocator, "free_full releases slots a window slide already freed"),
        Mutant("segment-frees-twice", SegmentFreesTwicePureSWAAllocator, "free_segment releases its slots as SWA and as full"),
    )
}
