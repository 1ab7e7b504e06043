"""Paged allocation as an NPU backend shapes it: host-side dedup, token-by-token decode."""

from __future__ import annotations

import torch

from allocators.base import AliasMixin, Mutant
from allocators.paged import PagedAllocator


class NPUPagedAllocator(PagedAllocator):
    """Paged pool whose ``free()`` dedups pages on the host and which has
    ``alloc_decode``: a batch grows by one token per request, and a request
    takes a new page exactly when its new token starts one."""

    def _pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        # A data-dependent unique is cheap on the host and costly on the device.
        return torch.unique(slots.cpu() // self.page_size).to(self.free_pages.device)

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        """``seq_lens``: each request's length after this step; ``last_loc``:
        the slot of its current last token (-1 when it has none).  Returns one
        slot per request, or ``None`` when the pool is short."""
        ps = self.page_size
        num_new = int(self._starts_page(seq_lens_cpu).sum())
        if self.need_sort and num_new > len(self.free_pages):
            self.merge_and_sort_free()
        if num_new > len(self.free_pages):
            return None
        needs = self._starts_page(seq_lens.to(torch.int64)).to(torch.int64)
        if num_new == 0:
            out = last_loc + 1
        else:
            # Request i's new page is the (number of earlier requests needing one)-th taken.
            which = torch.cumsum(needs, 0) - needs
            which = self._in_range(which, num_new)
            out = torch.where(needs.bool(), self.free_pages[which] * ps, last_loc + 1)
        self.free_pages = self.free_pages[num_new:]
        return out

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens: int):
        """``PagedAllocator.alloc_extend``'s contract, computed token by token
        on the device as a kernel would; int32 slots, as sglang's NPU
        allocator returns them."""
        ps = self.page_size
        pages_before = (prefix_lens_cpu + ps - 1) // ps
        num_new = int(((seq_lens_cpu + ps - 1) // ps - pages_before).sum())
        if self.need_sort and num_new > len(self.free_pages):
            self.merge_and_sort_free()
        if num_new > len(self.free_pages):
            return None
        dev = self.free_pages.device
        prefix, seq, last = (t.to(dev, torch.int64) for t in (prefix_lens, seq_lens, last_loc))
        grow = seq - prefix
        # Token j of the batch: its request, and its position in that request.
        owner = torch.repeat_interleave(torch.arange(len(grow), device=dev), grow)
        first = torch.cumsum(grow, 0) - grow
        pos = prefix[owner] + torch.arange(extend_num_tokens, device=dev) - first[owner]
        before = (prefix + ps - 1) // ps
        on_last_page = pos < before[owner] * ps
        out = last[owner] + 1 + pos - prefix[owner]
        if num_new:
            new_per_request = (seq + ps - 1) // ps - before
            rank = (torch.cumsum(new_per_request, 0) - new_per_request)[owner] + pos // ps - before[owner]
            pages = self._new_pages(num_new)
            fresh = pages[rank.clamp(0, num_new - 1)] * ps + pos % ps
            out = torch.where(on_last_page, out, fresh)
        self.free_pages = self.free_pages[num_new:]
        return out.int()

    def _new_pages(self, num_new: int) -> torch.Tensor:
        """The pages an extend hands out: those it takes off the free list."""
        return self.free_pages[:num_new]

    def _starts_page(self, seq_lens: torch.Tensor) -> torch.Tensor:
        return (seq_lens - 1) % self.page_size == 0

    @staticmethod
    def _in_range(which: torch.Tensor, num_new: int) -> torch.Tensor:
        # Requests after the last one needing a page point one past the taken
        # pages; their value is discarded, but the read must stay in bounds.
        return which.clamp(max=num_new - 1)


class AliasNPUPagedAllocator(AliasMixin, NPUPagedAllocator):
    pass


class DecodeOnePastNPUPagedAllocator(NPUPagedAllocator):
    """Mutant: each request's new page is indexed with an inclusive count of
    the requests needing one, so it reads one past its own page: that page
    stays on the free list while handed out (or the read runs off the end)."""

    @staticmethod
    def _in_range(which: torch.Tensor, num_new: int) -> torch.Tensor:
        return which + 1


class DecodeBoundaryNPUPagedAllocator(NPUPagedAllocator):
    """Mutant: a new page when the old length, not the new token, sits on a boundary."""

    def _starts_page(self, seq_lens: torch.Tensor) -> torch.Tensor:
        return seq_lens % self.page_size == 0


class ExtendWrongEndNPUPagedAllocator(NPUPagedAllocator):
    """Mutant: alloc_extend hands out the free list's last pages and takes
    its first ones off: the pages handed out stay free."""

    def _new_pages(self, num_new: int) -> torch.Tensor:
        return self.free_pages[len(self.free_pages) - num_new :]


NPU_MUTANTS = {
    m.name: m
    for m in (
        Mutant("alias", AliasNPUPagedAllocator, "free()'s group queue keeps the caller's row view"),
        Mutant("decode-one-past", DecodeOnePastNPUPagedAllocator, "alloc_decode indexes one past each new page"),
        Mutant("decode-boundary", DecodeBoundaryNPUPagedAllocator, "alloc_decode takes a page one token late", needs={"min_page_size": 2}),
        Mutant("extend-wrong-end", ExtendWrongEndNPUPagedAllocator, "alloc_extend hands out pages it leaves on the free list",
               needs={"min_page_size": 2}),
    )
}
