"""Token-granular allocation: page size 1, a slot is a page."""

from __future__ import annotations

import torch

from allocators.base import AliasMixin, FlagDriftMixin, Mutant, SlotAllocator


class TokenAllocator(SlotAllocator):
    """Slots ``1..size``; slot 0 is the padding slot and is never handed out."""

    def __init__(self, size: int, page_size: int = 1, device: str = "cpu", need_sort: bool = False):
        if page_size != 1:
            raise ValueError(f"TokenAllocator has page size 1, got {page_size}")
        super().__init__(size, 1, device, need_sort)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        return self._take_pages(need_size)


class AliasTokenAllocator(AliasMixin, TokenAllocator):
    pass


class FlagDriftTokenAllocator(FlagDriftMixin, TokenAllocator):
    pass


class OffByOneTokenAllocator(TokenAllocator):
    """Mutant: the free list is advanced one short, so the last slot handed
    out stays free and is handed out again by the next alloc."""

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if self.need_sort and need_size > len(self.free_pages):
            self.merge_and_sort_free()
        if need_size > len(self.free_pages):
            return None
        taken = self.free_pages[:need_size]
        self.free_pages = self.free_pages[max(need_size - 1, 0):]
        return taken


class MergeDropsReleaseTokenAllocator(TokenAllocator):
    """Mutant: the need_sort merge sorts ``free_pages`` and clears
    ``release_pages`` without concatenating them, so those slots leak."""

    def merge_and_sort_free(self) -> None:
        if len(self.release_pages) > 0:
            self.free_pages, _ = torch.sort(self.free_pages)
            self.release_pages = self.release_pages[:0]


TOKEN_MUTANTS = {
    m.name: m
    for m in (
        Mutant("alias", AliasTokenAllocator, "the free-group queue keeps the caller's row view"),
        Mutant("flag-drift", FlagDriftTokenAllocator, "flag beside the queue; a repeated end frees again"),
        Mutant("alloc-off-by-one", OffByOneTokenAllocator, "alloc advances the free list one short"),
        Mutant(
            "merge-drops-release",
            MergeDropsReleaseTokenAllocator,
            "the need_sort merge forgets release_pages",
            needs={"need_sort": True},
        ),
    )
}
