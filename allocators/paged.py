"""Page-granular allocation: ``alloc(n)`` hands out whole pages."""

from __future__ import annotations

import torch

from allocators.base import AliasMixin, FlagDriftMixin, Mutant, SlotAllocator


class PagedAllocator(SlotAllocator):
    """Pages ``1..size // page_size``; page 0 is reserved for padding.

    Slot ``s`` lives on page ``s // page_size``.  ``free()`` dedups pages, so
    freeing any slot of a page releases the page.
    """

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Precondition: ``need_size`` is a multiple of the page size.
        Returns the slots of ``need_size // page_size`` whole pages."""
        if need_size % self.page_size:
            raise ValueError(f"alloc({need_size}) is not page-aligned (page size {self.page_size})")
        pages = self._take_pages(need_size // self.page_size)
        if pages is None:
            return None
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        """One batch of extends, as sglang's scheduler sends it.

        Preconditions: request ``i`` grows from ``prefix_lens[i]`` tokens to
        ``seq_lens[i]`` (the ``_cpu`` tensors are host copies);
        ``last_loc[i]`` is the slot of its last token, -1 when it has none;
        ``extend_num_tokens`` is the sum of the growths.

        Returns ``extend_num_tokens`` slots, request by request in batch
        order: a request first fills the page its prefix ends in
        (``last_loc + 1``, ...), then takes ``ceil(seq_len / page_size) -
        ceil(prefix_len / page_size)`` whole pages off the free list, the
        last perhaps partly used.  ``None``, taking nothing, when the pool
        has fewer free pages (released ones included) than the batch takes.
        """
        ps = self.page_size
        prefix, seq = prefix_lens_cpu.tolist(), seq_lens_cpu.tolist()
        num_new = self._num_new_pages(prefix, seq)
        if self.need_sort and num_new > len(self.free_pages):
            self.merge_and_sort_free()
        if num_new > len(self.free_pages):
            return None
        offsets = torch.arange(ps, dtype=torch.int64, device=self.device)
        parts = [torch.empty((0,), dtype=torch.int64, device=self.device)]
        taken = 0
        # The slots are laid out request by request, apart from the count of
        # pages the free list gives up (as a device kernel lays them out).
        for before, after, last in zip(prefix, seq, last_loc.tolist()):
            cont = min(after, -(-before // ps) * ps) - before
            parts.append(self._continue(last, cont))
            rest = after - before - cont
            pages = self.free_pages[taken : taken + -(-rest // ps)]
            taken += len(pages)
            parts.append((pages[:, None] * ps + offsets).reshape(-1)[:rest])
        self.free_pages = self.free_pages[num_new:]
        return torch.cat(parts)

    def _num_new_pages(self, prefix: list[int], seq: list[int]) -> int:
        ps = self.page_size
        return sum(-(-after // ps) - -(-before // ps) for before, after in zip(prefix, seq))

    def _continue(self, last: int, count: int) -> torch.Tensor:
        """The ``count`` slots after ``last``, on the page it sits on."""
        return last + 1 + torch.arange(count, dtype=torch.int64, device=self.device)

    def clear(self) -> None:
        super().clear()
        # Page representatives queued by free_segment() while a group is open.
        self.free_page_reps_group: list[torch.Tensor] = []

    def free_group_end(self) -> None:
        reps, self.free_page_reps_group = self.free_page_reps_group, []
        super().free_group_end()
        if reps:
            self._release_pages(torch.cat(reps) // self.page_size)

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """Free ``row[start_pos : start_pos + n]`` without a data-dependent unique.

        A page's slots sit consecutively in the row and the start is
        page-aligned, so ``free_index[::page_size]`` names each page once,
        the trailing partial page included.
        """
        if start_pos % self.page_size:
            raise ValueError(f"segment start {start_pos} is not page-aligned (page size {self.page_size})")
        if free_index.numel() == 0:
            return
        reps = self._representatives(free_index)
        if self.free_group is not None:
            self.free_page_reps_group.append(self._own_reps(reps))
        else:
            self._release_pages(reps // self.page_size)

    def _representatives(self, free_index: torch.Tensor) -> torch.Tensor:
        return free_index[:: self.page_size]

    # A strided slice is still a view of the caller's row.
    _own_reps = staticmethod(SlotAllocator._own)


class AliasPagedAllocator(AliasMixin, PagedAllocator):
    # Only free()'s queue aliases; free_segment's keeps its copies.
    _own_reps = staticmethod(SlotAllocator._own)


class RepsAliasPagedAllocator(PagedAllocator):
    """Mutant: free_segment queues views of the row's page representatives."""

    _own_reps = staticmethod(lambda reps: reps)


class FlagDriftPagedAllocator(FlagDriftMixin, PagedAllocator):
    def free_group_end(self) -> None:
        reps, self.free_page_reps_group = self.free_page_reps_group, []
        FlagDriftMixin.free_group_end(self)
        if reps:
            self._release_pages(torch.cat(reps) // self.page_size)

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        reps = self._representatives(free_index)
        if self.is_not_in_free_group:
            self._release_pages(reps // self.page_size)
        else:
            self.free_page_reps_group.append(self._own_reps(reps))


class SegmentDropsTailPagedAllocator(PagedAllocator):
    """Mutant: free_segment keeps whole pages only, so a segment ending
    mid-page leaks its trailing page."""

    def _representatives(self, free_index: torch.Tensor) -> torch.Tensor:
        whole = free_index.numel() - free_index.numel() % self.page_size
        return free_index[:whole : self.page_size]


class NoDedupPagedAllocator(PagedAllocator):
    """Mutant: free() releases ``index // page_size`` without unique, so a
    page is released once per slot freed."""

    def _pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        return slots // self.page_size


class ExtendEarlyPagedAllocator(PagedAllocator):
    """Mutant: alloc_extend continues a partly used page from ``last_loc``,
    not ``last_loc + 1``: the request's own last slot is handed out again."""

    def _continue(self, last: int, count: int) -> torch.Tensor:
        return last + torch.arange(count, dtype=torch.int64, device=self.device)


class ExtendFloorPagedAllocator(PagedAllocator):
    """Mutant: alloc_extend counts the pages the free list gives up with
    floor, not ceil: a partly used new page is handed out and stays free."""

    def _num_new_pages(self, prefix: list[int], seq: list[int]) -> int:
        ps = self.page_size
        return sum(after // ps - before // ps for before, after in zip(prefix, seq))


PAGED_MUTANTS = {
    m.name: m
    for m in (
        Mutant("alias", AliasPagedAllocator, "free()'s group queue keeps the caller's row view"),
        Mutant("reps-alias", RepsAliasPagedAllocator, "free_segment queues views of page representatives"),
        Mutant("flag-drift", FlagDriftPagedAllocator, "flag beside the queue; a repeated end frees again"),
        Mutant("segment-drops-tail", SegmentDropsTailPagedAllocator, "free_segment leaks a trailing partial page", needs={"min_page_size": 2}),
        Mutant("free-no-dedup", NoDedupPagedAllocator, "free() releases a page once per slot", needs={"min_page_size": 2}),
        # At page size 1 sglang's callers extend through alloc(): these need pages.
        Mutant("extend-early", ExtendEarlyPagedAllocator, "alloc_extend continues a page at last_loc, not last_loc + 1",
               needs={"min_page_size": 2}),
        Mutant("extend-floor", ExtendFloorPagedAllocator, "alloc_extend takes floor, not ceil, new pages off the free list",
               needs={"min_page_size": 2}),
    )
}
