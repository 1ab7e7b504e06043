"""HiSparse allocation: a logical pool, a smaller device pool and a
full-to-HiSparse mapping between them; no deferred frees."""

from __future__ import annotations

import torch

from allocators.base import Mutant
from allocators.paged import PagedAllocator


class HiSparseAllocator:
    """A logical pool and a device pool half its size, joined by a mapping.

    The logical pool has ``size * host_to_device_ratio`` slots, the device
    pool ``size``, each paged; ``alloc`` takes a page from both and maps
    each logical slot to its device slot.

    A request's device buffer (``alloc_device_buffer``) takes the device
    slots its row's tokens map to, first ones first, unmaps them, frees
    those past the buffer and allocates more if it needs them;
    ``free_hisparse_indices`` gives a buffer back.  Free groups are not
    supported: ``free()`` releases at once, since it must clear the mapping.
    """

    # Read by targets.py: the HiSparse harness drives this family, and the
    # model must not expect queued frees.
    family = "hisparse"
    defers_frees = False

    def __init__(self, size: int, page_size: int = 1, device: str = "cpu", need_sort: bool = False, host_to_device_ratio: int = 2):
        self.page_size = page_size
        self.device = device
        self.logical_attn_allocator = PagedAllocator(size * host_to_device_ratio, page_size, device, need_sort)
        self.hisparse_attn_allocator = PagedAllocator(size, page_size, device, need_sort)
        # The trailing -1 is what a last_loc of -1 translates to.
        self.full_to_hisparse_device_index_mapping = torch.zeros(size * host_to_device_ratio + page_size + 1, dtype=torch.int64, device=device)
        self.full_to_hisparse_device_index_mapping[-1] = -1

    def clear(self) -> None:
        self.logical_attn_allocator.clear()
        self.hisparse_attn_allocator.clear()
        self.full_to_hisparse_device_index_mapping[:-1] = 0

    def available_size(self) -> int:
        return min(self.logical_attn_allocator.available_size(), self.hisparse_attn_allocator.available_size())

    def alloc(self, need_size: int) -> torch.Tensor | None:
        logical = self.logical_attn_allocator.alloc(need_size)
        if logical is None:
            return None
        device_slots = self.hisparse_attn_allocator.alloc(need_size)
        if device_slots is None:
            self._device_short(logical)
            return None
        self.full_to_hisparse_device_index_mapping[logical] = device_slots
        return logical

    def _device_short(self, logical: torch.Tensor) -> None:
        # The logical pages were taken for nothing: give them back.
        self.logical_attn_allocator.free(logical)

    def alloc_device_buffer(self, allocated_indices: torch.Tensor, need_size: int) -> torch.Tensor:
        """The device buffer of a request whose row is ``allocated_indices``:
        ``need_size`` device slots (a whole number of pages), starting with
        the slots its tokens map to, in row order."""
        if need_size % self.page_size:
            raise ValueError(f"alloc_device_buffer({need_size}) is not page-aligned (page size {self.page_size})")
        mapped = self._take_buffer_slots(allocated_indices)
        mapped = mapped[mapped > 0]
        if len(mapped) >= need_size:
            self._free_surplus(mapped[need_size:])
            return mapped[:need_size]
        extra = self.hisparse_attn_allocator.alloc(need_size - len(mapped))
        if extra is None:
            raise RuntimeError(f"alloc_device_buffer({need_size}): the device pool is short")
        return torch.cat((mapped, extra))

    def _take_buffer_slots(self, allocated_indices: torch.Tensor) -> torch.Tensor:
        """The device slots these logical slots map to (a new tensor); unmaps them."""
        mapped = self.full_to_hisparse_device_index_mapping[allocated_indices]
        self.full_to_hisparse_device_index_mapping[allocated_indices] = 0
        return mapped

    def _free_surplus(self, surplus: torch.Tensor) -> None:
        self.free_hisparse_indices(surplus)

    def free_hisparse_indices(self, buffer_indices: torch.Tensor) -> None:
        """Give device slots back; page 0 is the padding sink, never owned."""
        self.hisparse_attn_allocator.free(buffer_indices[buffer_indices >= self.page_size])

    def free_hisparse(self, free_index: torch.Tensor) -> None:
        """Free the device slots these logical slots map to, and unmap them."""
        device_slots = self.full_to_hisparse_device_index_mapping[free_index]
        self.free_hisparse_indices(device_slots[device_slots > 0])
        self.full_to_hisparse_device_index_mapping[free_index] = 0

    def free_group_begin(self) -> None:
        return

    def free_group_end(self) -> None:
        return

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        self.logical_attn_allocator.free(free_index)
        self.free_hisparse(free_index)


class QueuingHiSparseAllocator(HiSparseAllocator):
    """Mutant: free_group_begin() opens a queue anyway, and the no-op
    free_group_end() never releases it, so frees inside a group are dropped."""

    free_group: list[torch.Tensor] | None = None

    def free_group_begin(self) -> None:
        self.free_group = []

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() and self.free_group is not None:
            self.free_group.append(free_index.clone())
            return
        super().free(free_index)


class MappingClearedFirstHiSparseAllocator(HiSparseAllocator):
    """Mutant: free() clears the mapping before reading it, so the device
    pages behind the freed slots leak."""

    def free_hisparse(self, free_index: torch.Tensor) -> None:
        self.full_to_hisparse_device_index_mapping[free_index] = 0
        super().free_hisparse(free_index)


class BufferKeepsMappingHiSparseAllocator(HiSparseAllocator):
    """Mutant: alloc_device_buffer() leaves the row mapped to the slots it
    moved into the buffer; freeing the buffer, then the row, frees them twice
    (the double free sglang's request_finished clears the mapping against)."""

    def _take_buffer_slots(self, allocated_indices: torch.Tensor) -> torch.Tensor:
        return self.full_to_hisparse_device_index_mapping[allocated_indices]


class BufferDropsSurplusHiSparseAllocator(HiSparseAllocator):
    """Mutant: alloc_device_buffer() unmaps the device slots past the buffer
    but never frees them: they leak."""

    def _free_surplus(self, surplus: torch.Tensor) -> None:
        return


class ShortLeaksHiSparseAllocator(HiSparseAllocator):
    """Mutant: an alloc the device pool cannot serve returns None but keeps
    the logical pages it took."""

    def _device_short(self, logical: torch.Tensor) -> None:
        return


HISPARSE_MUTANTS = {
    m.name: m
    for m in (
        Mutant("queues-anyway", QueuingHiSparseAllocator, "queues frees in a group its no-op end never releases"),
        Mutant("mapping-cleared-first", MappingClearedFirstHiSparseAllocator, "free() clears the mapping before releasing the device pages"),
        Mutant("buffer-keeps-mapping", BufferKeepsMappingHiSparseAllocator, "alloc_device_buffer leaves the row mapped to its buffer"),
        Mutant("buffer-drops-surplus", BufferDropsSurplusHiSparseAllocator, "alloc_device_buffer never frees the device slots past the buffer"),
        Mutant("short-leaks", ShortLeaksHiSparseAllocator, "an alloc the device pool cannot serve keeps its logical pages"),
    )
}
