"""Harder bugs for the bench, beyond the suite's mutants: each needs a
deeper or rarer state to show.  They are custom targets (``bench.bugs:NAME``)
rather than mutants, so the suite's catalogue and its tests do not grow.

Each class is a built-in allocator with one deliberate fault; the docstring
says the state the fault needs, which is what makes it hard to reach.
"""

from __future__ import annotations

import functools

import torch

from allocators.paged import PagedAllocator
from allocators.token import TokenAllocator
from state_machines.config import Config


class ExactlyFull(TokenAllocator):
    """An alloc that takes every free slot leaves the last one on the free
    list.  Needs: the pool exactly full after an alloc."""

    def alloc(self, need_size: int) -> torch.Tensor | None:
        exact = need_size == len(self.free_pages) + len(self.release_pages) and need_size > 0
        taken = self._take_pages(need_size)
        if exact and taken is not None:
            self.free_pages = taken[-1:].clone()
        return taken


class ThirdGroup(TokenAllocator):
    """The third free group that released anything releases nothing (its
    slots leak).  Needs: three groups, each freeing something."""

    def clear(self) -> None:
        super().clear()
        self.groups_released = 0

    def free_group_end(self) -> None:
        pending, self.free_group = self.free_group, None
        if pending:
            self.groups_released += 1
            if self.groups_released != 3:
                self._release_pages(self._pages_of(torch.cat(pending)))


class BigFree(TokenAllocator):
    """A free of 9 slots or more at once drops the last one.  Needs: one
    request of 9 slots or more, freed whole: grown by several steps (a
    step draws at most 4), or taken at once where the walk's fill asks."""

    def _release_pages(self, pages: torch.Tensor) -> None:
        super()._release_pages(pages[:-1] if len(pages) >= 9 else pages)


class BigPool(TokenAllocator):
    """With more than 48 slots free, an alloc hands out a slot it leaves on
    the free list.  Needs: a pool larger than the default 10 slots (the
    random baseline's), which no number of steps on the default pool
    reaches."""

    def alloc(self, need_size: int) -> torch.Tensor | None:
        big = len(self.free_pages) > 48
        taken = self._take_pages(need_size)
        if big and taken is not None and len(taken):
            self.free_pages = torch.cat((taken[-1:], self.free_pages))
        return taken


class OffsetThree(PagedAllocator):
    """At page size 4, a ``free_segment`` that ends 3 slots into its last
    page leaks that page.  Needs: a segment of one particular length modulo
    the page size."""

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        if len(free_index) % self.page_size == 3:
            free_index = free_index[: len(free_index) - 3]
        super().free_segment(free_index, start_pos=start_pos)


class TenthAlloc(TokenAllocator):
    """The tenth alloc that hands out anything leaves its last slot free.
    Needs: a long history, ten allocs in one example."""

    def clear(self) -> None:
        super().clear()
        self.served = 0

    def alloc(self, need_size: int) -> torch.Tensor | None:
        taken = self._take_pages(need_size)
        if taken is not None and len(taken):
            self.served += 1
            if self.served == 10:
                self.free_pages = torch.cat((taken[-1:], self.free_pages))
        return taken


def npu_without_free_groups(size: int, page_size: int, device: str, need_sort: bool):
    """sglang's own ``NPUPagedTokenToKVPoolAllocator``, of the release that
    ``--sglang-path`` loads, built as ``sglang:npu`` builds it, with its free
    groups kept out: ``free_group_begin`` and ``free_group_end`` raise
    ``NotImplementedError``, so the probe turns ``begin`` and ``end`` off
    (with that reason) and no run reaches the group bugs 0.5.17 and 0.5.18
    show first (a queue of views; the repeated end).

    Past them is their decode bug: ``alloc_decode`` of a batch whose first
    request takes a new page and a later one none, with exactly one page
    free, indexes one past the free pages (``IndexError``,
    ``hardware_backend/npu/allocator_npu.py:129``; 0.5.19 clamps the index).
    Needs: the pool down to exactly one free page, two requests decoding in
    that order, one at a page's end.  No code of sglang's is copied or changed."""
    from state_machines.targets import sglang

    allocator = sglang.make_npu(size, page_size, device, need_sort)
    # Methods only: the subclass adds no state, so the instance stays as built.
    allocator.__class__ = _without_free_groups(type(allocator))
    return allocator


@functools.cache
def _without_free_groups(cls: type) -> type:
    """``cls`` whose ``free_group_begin`` / ``free_group_end`` refuse."""

    def refuse(self) -> None:
        raise NotImplementedError("free groups are kept out of this bench target")

    return type(f"{cls.__name__}WithoutFreeGroups", (cls,), {"free_group_begin": refuse, "free_group_end": refuse})


def _config(name: str, page_size: int = 1) -> Config:
    return Config(target=f"bench.bugs:{name}", page_size=page_size)


# The bench's harder bugs, each under the page size it needs (sglang's come
# with bench/targets.py's releases: a process can load only one).
HARD = (
    _config("ExactlyFull"),
    _config("ThirdGroup"),
    _config("BigFree"),
    _config("BigPool"),
    _config("OffsetThree", page_size=4),
    _config("TenthAlloc"),
)
