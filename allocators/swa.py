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
        self.set_full_to_swa_mapping(full, swa)
        return full

    def _new_pages(self, prefix_lens_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor) -> int:
        ps = self.page_size
        return sum(-(-after // ps) - -(-before // ps) for before, after in zip(prefix_lens_cpu.tolist(), seq_lens_cpu.tolist()))

    def _room(self, full_pages: int, swa_pages: int) -> bool:
        ps = self.page_size
        return full_pages <= self.full_available_size() // ps and swa_pages <= self.swa_available_size() // ps

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens):
        """Page size > 1: both pools extend in step (the SWA pool continues
        at the SWA peer of ``last_loc``), and each new full slot maps to its
        SWA slot.  ``None``, taking nothing, when either pool is short of the
        batch's new pages."""
        pages = self._new_pages(prefix_lens_cpu, seq_lens_cpu)
        if not self._room(pages, pages):
            return None
        swa_last = self.full_to_swa_index_mapping[last_loc]
        args = (prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu)
        full = self.full_attn_allocator.alloc_extend(*args, last_loc, extend_num_tokens)
        swa = self.swa_attn_allocator.alloc_extend(*args, swa_last, extend_num_tokens)
        self.set_full_to_swa_mapping(full, swa)
        return full

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        """One token per request: an extend from ``seq_lens - 1``."""
        prefix = seq_lens - 1
        return self.alloc_extend(prefix, seq_lens_cpu - 1, seq_lens, seq_lens_cpu, last_loc, len(seq_lens_cpu))

    def alloc_extend_swa_tail(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens,
                              swa_tail_len: int):
        """One request: full slots for the whole extend, SWA slots (fresh
        pages) only for its last ``swa_tail_len`` tokens.  Preconditions (PD
        decode's preallocation): the prefix and the tail's start are
        page-aligned.  The full slots before the tail map to nothing."""
        full_pages = self._new_pages(prefix_lens_cpu, seq_lens_cpu)
        if not self._room(full_pages, -(-swa_tail_len // self.page_size)):
            return None
        full = self.full_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens
        )
        if swa_tail_len:
            tail = torch.tensor([swa_tail_len], dtype=torch.int64)
            zero, none = torch.zeros((1,), dtype=torch.int64), torch.tensor([-1], dtype=torch.int64)
            swa = self.swa_attn_allocator.alloc_extend(zero, zero, tail, tail, none, swa_tail_len)
            self.set_full_to_swa_mapping(full[-swa_tail_len:], swa)
        self._clear_before_tail(full[: extend_num_tokens - swa_tail_len])
        return full

    def _clear_before_tail(self, full_slots: torch.Tensor) -> None:
        # Recycled full pages may still map somewhere (sglang PR 25805).
        self.clear_full_to_swa_mapping(full_slots)

    def set_full_to_swa_mapping(self, full_indices: torch.Tensor, swa_indices: torch.Tensor) -> None:
        """``mapping[full_indices[i]] = swa_indices[i]`` (also HiCache's
        load-back and tombstone recovery, with freshly allocated SWA slots)."""
        self.full_to_swa_index_mapping[full_indices.to(torch.int64)] = swa_indices.to(torch.int64)

    def clear_full_to_swa_mapping(self, full_indices: torch.Tensor) -> None:
        self.full_to_swa_index_mapping[full_indices.to(torch.int64)] = 0

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

    def free_segments(self, segments) -> None:
        """``free_segment`` of each ``(free_index, start_pos)`` of one kv row
        (page ranges disjoint)."""
        for free_index, start_pos in segments:
            self.free_segment(free_index, start_pos=start_pos)

    def free_full_segments(self, segments) -> None:
        """``free_full_segment`` of each segment: slots whose SWA side is gone."""
        for free_index, start_pos in segments:
            self.free_full_segment(free_index, start_pos=start_pos)

    def free_swa(self, free_index: torch.Tensor) -> None:
        """Release the SWA peers of these full slots (whole pages) and unmap them."""
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(self._take_mapping(free_index))
            return
        self._release_swa(self._take_mapping(free_index))

    def free_swa_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """free_swa() of a kv-row segment: one representative per page."""
        if free_index.numel() == 0:
            return
        if start_pos % self.page_size:
            raise ValueError(f"segment start {start_pos} is not page-aligned (page size {self.page_size})")
        reps = free_index[:: self.page_size]
        swa_reps = self._take_mapping(reps)[:: self.page_size]
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
        """The SWA slots every slot of these full slots' pages maps to (a new
        tensor, ``page_size`` per slot given); unmaps those pages."""
        pages = self._expand(full_slots)
        swa = self.full_to_swa_index_mapping[pages]
        self._unmap(full_slots, pages)
        return swa

    def _unmap(self, full_slots: torch.Tensor, pages: torch.Tensor) -> None:
        # Per page: the SWA pool releases whole pages (sglang PR 27779).
        self.clear_full_to_swa_mapping(pages)

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
            # The full slots themselves; their mapping is read at end.
            self.free_group.append(self._queued(free_index))
            return
        super().free_swa(free_index)

    def free_swa_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        if free_index.numel() and self.free_group is not None:
            # A strided view of the row, like free_segment's representatives.
            self.free_group.append(self._queued(free_index[:: self.page_size]))
            return
        super().free_swa_segment(free_index, start_pos=start_pos)

    @staticmethod
    def _queued(full_slots: torch.Tensor) -> torch.Tensor:
        # The view itself: expanding to whole pages here would copy it.
        return full_slots

    def _resolve_queued(self, pending: list[torch.Tensor]) -> torch.Tensor:
        return self._take_mapping(torch.cat(pending))


class EndResolvesSWAAllocator(AliasSWASideSWAAllocator):
    """Mutant: a queued free_swa keeps a copy of the full slots (no alias)
    but still reads their mapping at ``free_group_end()``: a full slot
    re-pointed in between (HiCache load-back, tombstone recovery) frees its
    replacement SWA slot, and the original leaks."""

    @staticmethod
    def _queued(full_slots: torch.Tensor) -> torch.Tensor:
        return full_slots.clone()


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


class PerTokenUnmapSWAAllocator(SWAAllocator):
    """Mutant: a free of the SWA side unmaps only the slots it was passed,
    not their whole pages, though the SWA pool releases whole pages: the
    page's other slots still map to a freed SWA page (sglang 0.5.12's
    free_swa, fixed by PR 27779)."""

    def _unmap(self, full_slots: torch.Tensor, pages: torch.Tensor) -> None:
        self.clear_full_to_swa_mapping(full_slots)


class TailKeepsStaleSWAAllocator(PerTokenUnmapSWAAllocator):
    """Mutant: sglang 0.5.12's pair.  Frees unmap per token (above), so a
    recycled full page can keep a stale mapping, and
    ``alloc_extend_swa_tail`` leaves the slots before the tail mapped as
    they were (fixed by PR 25805); a later free releases an SWA page that
    another request holds."""

    def _clear_before_tail(self, full_slots: torch.Tensor) -> None:
        return


SWA_MUTANTS = {
    m.name: m
    for m in (
        Mutant("alias-full", AliasFullSWAAllocator, "the full pool's group queue keeps the caller's row view"),
        Mutant("alias-swa", AliasSWASideSWAAllocator, "the SWA queue keeps the row view and translates it at end"),
        Mutant("swa-keeps-mapping", KeepsMappingSWAAllocator, "free_swa releases SWA slots but leaves them mapped"),
        Mutant("end-resolves-swa", EndResolvesSWAAllocator,
               "a queued free_swa reads the mapping at end: a slot re-pointed in the group frees its replacement"),
        Mutant("unmap-per-token", PerTokenUnmapSWAAllocator, "frees unmap only the slots passed, not their whole pages",
               needs={"min_page_size": 2}),
        Mutant("swa-tail-stale", TailKeepsStaleSWAAllocator,
               "per-token unmapping, and alloc_extend_swa_tail keeps the pre-tail slots' stale mapping",
               needs={"min_page_size": 2}),
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

    def free_full_segments(self, segments) -> None:
        """``free_full_segment`` of each segment, as sglang's base class has it
        (``free_kv_row_segments`` sends a finished row's slid span here)."""
        for free_index, start_pos in segments:
            self.free_full_segment(free_index, start_pos=start_pos)


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
