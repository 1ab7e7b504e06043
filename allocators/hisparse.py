"""HiSparse-style allocation: a logical pool with a device buffer mapped beside it, no deferred frees."""

from __future__ import annotations

import torch

from allocators.base import Mutant, SlotAllocator
from allocators.paged import PagedAllocator


class HiSparseAllocator(SlotAllocator):
    """A logical pool and a device-buffer pool joined by a logical-to-device
    slot mapping; free groups are unsupported, so ``free()`` always releases
    at once (it must clear the mapping then)."""

    # Read by targets.py: the model must not expect queued frees.
    defers_frees = False

    def __init__(self, size: int, page_size: int = 1, device: str = "cpu", need_sort: bool = False):
        # Equal sizes: the device buffer never runs short before the logical pool does.
        self.device_pool = PagedAllocator(size, page_size, device, need_sort)
        self.mapping = torch.zeros(size + page_size, dtype=torch.int64, device=device)
        super().__init__(size, page_size, device, need_sort)

    def clear(self) -> None:
        super().clear()
        self.device_pool.clear()
        self.mapping.fill_(0)

    def available_size(self) -> int:
        return min(super().available_size(), self.device_pool.available_size())

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if need_size % self.page_size:
            raise ValueError(f"alloc({need_size}) is not page-aligned (page size {self.page_size})")
        pages = self._take_pages(need_size // self.page_size)
        if pages is None:
            return None
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
        logical = (pages[:, None] * self.page_size + offsets).reshape(-1)
        buffer = self.device_pool.alloc(need_size)
        if buffer is None:
            SlotAllocator._release_pages(self, pages)
            return None
        self.mapping[logical] = buffer
        return logical

    def free_group_begin(self) -> None:
        return

    def free_group_end(self) -> None:
        return

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        self._release_pages(self._pages_of(free_index))
        self._free_buffer(free_index)

    def _free_buffer(self, free_index: torch.Tensor) -> None:
        buffer = self.mapping[free_index]
        self.device_pool.free(buffer[buffer > 0])
        self.mapping[free_index] = 0


class QueuingHiSparseAllocator(HiSparseAllocator):
    """Mutant: free_group_begin() opens a queue anyway, and the no-op
    free_group_end() never releases it, so frees inside a group are dropped."""

    def free_group_begin(self) -> None:
        self.free_group = []

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(free_index.clone())
            return
        super().free(free_index)


class MappingClearedFirstHiSparseAllocator(HiSparseAllocator):
    """Mutant: free() clears the mapping before reading it, so the device
    buffer behind the freed slots leaks."""

    def _free_buffer(self, free_index: torch.Tensor) -> None:
        self.mapping[free_index] = 0
        buffer = self.mapping[free_index]
        self.device_pool.free(buffer[buffer > 0])


HISPARSE_MUTANTS = {
    m.name: m
    for m in (
        Mutant("queues-anyway", QueuingHiSparseAllocator, "queues frees in a group its no-op end never releases"),
        Mutant("mapping-cleared-first", MappingClearedFirstHiSparseAllocator, "free() clears the mapping before releasing the device buffer"),
    )
}
