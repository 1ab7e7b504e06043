"""Mamba state slots: one free list of whole slots, with allocation groups."""

from __future__ import annotations

import torch

from allocators.base import Mutant


class MambaSlotAllocator:
    """Per-request state slots with allocation groups; frees at once.

    Slots ``1..size`` (slot 0 is the padding target), one per request
    state or track buffer.  ``alloc_group_begin(n)`` pre-allocates ``n``
    slots (none when fewer are free) that ``alloc(1)`` hands out first;
    ``alloc_group_end()`` returns those not handed out.  Frees are immediate."""

    # Read by targets.py: the Mamba harness drives this family; slots, not pages.
    family = "mamba"
    defers_frees = False
    page_sizes = (1,)

    def __init__(self, size: int, device: str = "cpu"):
        self.size = size
        self.device = device
        self.clear()

    def clear(self) -> None:
        self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        # The group's pre-allocated slots and how many alloc(1) has handed
        # out; None with no group open.
        self.batch: torch.Tensor | None = None
        self.drawn = 0

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc_group_begin(self, num_reqs: int) -> None:
        """Pre-allocate ``num_reqs`` slots.  Groups do not nest."""
        if self.batch is not None:
            raise RuntimeError("alloc_group_begin() while an allocation group is open: call alloc_group_end() first")
        self.batch, self.drawn = self._reserve(num_reqs), 0

    def _reserve(self, num_reqs: int) -> torch.Tensor:
        taken = self._take(num_reqs) if num_reqs > 0 else None
        return taken if taken is not None else self.free_slots[:0]

    def alloc_group_end(self) -> None:
        """Return the pre-allocated slots no alloc(1) took; with no group open, nothing."""
        batch, self.batch = self.batch, None
        if batch is not None:
            self.free(batch[self.drawn :])

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if need_size == 1 and self.batch is not None and self.drawn < len(self.batch):
            self.drawn += 1
            return self.batch[self.drawn - 1 : self.drawn]
        return self._take(need_size)

    def _take(self, need_size: int) -> torch.Tensor | None:
        if need_size > len(self.free_slots):
            return None
        taken, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return taken

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel():
            self.free_slots = torch.cat((self.free_slots, free_index.reshape(-1)))


class EndKeepsLeftoversMambaAllocator(MambaSlotAllocator):
    """Mutant: alloc_group_end() closes the group without returning the
    slots no alloc drew: they leak."""

    def alloc_group_end(self) -> None:
        self.batch = None


class EndRepeatsMambaAllocator(MambaSlotAllocator):
    """Mutant: a flag closes the group but the batch stays, so a repeated
    alloc_group_end() returns the same slots again."""

    def clear(self) -> None:
        super().clear()
        self.open = False

    def alloc_group_begin(self, num_reqs: int) -> None:
        self.batch, self.drawn, self.open = self._reserve(num_reqs), 0, True

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if not self.open:
            return self._take(need_size)
        return super().alloc(need_size)

    def alloc_group_end(self) -> None:
        self.open = False
        if self.batch is not None:
            self.free(self.batch[self.drawn :])


class ReserveNotTakenMambaAllocator(MambaSlotAllocator):
    """Mutant: alloc_group_begin() reads the first free slots but leaves
    them in the free list, so a slot can be handed out twice."""

    def _reserve(self, num_reqs: int) -> torch.Tensor:
        return self.free_slots[: num_reqs if num_reqs <= len(self.free_slots) else 0].clone()


class FreeKeepsViewMambaAllocator(MambaSlotAllocator):
    """Mutant: free() keeps the caller's tensor (a view of its slot table)
    and reads it only when the free list is next needed: a caller that
    rewrites its row first frees the wrong slots."""

    def clear(self) -> None:
        self.pending: list[torch.Tensor] = []
        super().clear()

    @property
    def free_slots(self) -> torch.Tensor:
        return torch.cat([self._free_slots, *(v.reshape(-1) for v in self.pending)])

    @free_slots.setter
    def free_slots(self, value: torch.Tensor) -> None:
        self._free_slots, self.pending = value, []

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel():
            self.pending.append(free_index)


MAMBA_MUTANTS = {
    m.name: m
    for m in (
        Mutant("end-keeps-leftovers", EndKeepsLeftoversMambaAllocator, "alloc_group_end drops the slots no alloc drew"),
        Mutant("end-repeats", EndRepeatsMambaAllocator, "a repeated alloc_group_end returns the same slots again"),
        Mutant("reserve-not-taken", ReserveNotTakenMambaAllocator, "alloc_group_begin leaves its slots in the free list"),
        Mutant("free-keeps-view", FreeKeepsViewMambaAllocator, "free keeps the caller's view and reads it later"),
    )
}
