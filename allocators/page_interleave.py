"""Page-interleaved (owner-classed) pages: the twin of sglang's
``PageInterleavePoolAllocator`` (logical-page KV sharding)."""

from __future__ import annotations

import torch

from allocators.base import AliasMixin, Mutant, SlotAllocator

# Shard-group size the harness builds: 3 classes, so a cycle is not a swap.
SHARD_SIZE = 3


class PageInterleaveAllocator(SlotAllocator):
    """Logical page ``l`` belongs to owner class ``l % shard_size``; each
    class keeps its own free list (and, with ``need_sort``, its own release
    list).  Pages ``0 .. shard_size - 1`` are reserved (every rank's padding
    page); class ``r`` starts with ``r + shard_size * k`` for ``k = 1 ..
    size // page_size``.  ``size`` is one rank's slots.

    Allocation is ``alloc_extend`` only, with one rotation base per request:
    position-page ``P`` of a chain of base ``b`` is drawn from class
    ``(b + P) % shard_size``.  A ``None`` base (a new chain) is resolved in
    place to the class with the most free pages (lowest id on a tie), seeing
    the draws of earlier requests in the batch.  ``alloc()`` and
    ``alloc_decode()`` raise ``NotImplementedError``, as sglang's do.  Frees
    split pages by owner class; a free group queues copies (``SlotAllocator``'s)."""

    family = "page_interleave"
    # sglang's caller sends page size 1 to alloc(), which this class lacks.
    min_page_size = 2

    def __init__(self, size: int, page_size: int, device: str = "cpu", need_sort: bool = False, shard_size: int = SHARD_SIZE):
        if shard_size < 2:
            raise ValueError(f"need shard_size >= 2, got {shard_size}")
        # Set before the base constructor, whose clear() builds the class lists.
        self.shard_size = shard_size
        super().__init__(size * shard_size, page_size, device, need_sort)

    def clear(self) -> None:
        per_class = self.num_pages // self.shard_size
        n = self.shard_size
        self.class_free_pages = [torch.arange(1, per_class + 1, dtype=torch.int64, device=self.device) * n + r for r in range(n)]
        self.class_release_pages = [torch.empty((0,), dtype=torch.int64, device=self.device) for _ in range(n)]
        self.free_group: list[torch.Tensor] | None = None

    # -- census --

    def class_free_page_counts(self) -> list[int]:
        return [len(f) + len(r) for f, r in zip(self.class_free_pages, self.class_release_pages)]

    def available_size(self) -> int:
        """The min-class floor: every class must supply a batch's share."""
        return self.shard_size * self.page_size * min(self.class_free_page_counts())

    def aggregate_free_size(self) -> int:
        return self.page_size * sum(self.class_free_page_counts())

    def get_all_free_pages(self) -> torch.Tensor:
        return torch.cat(self.class_free_pages + self.class_release_pages)

    # -- allocation --

    def alloc(self, need_size: int):
        raise NotImplementedError("page-interleaved pages are allocated through alloc_extend only")

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        raise NotImplementedError("page-interleaved pools serve prefill only")

    def _draw_base(self, counts: list[int]) -> int:
        return max(range(self.shard_size), key=lambda c: (counts[c], -c))

    def _start_class(self, base: int, prefix_len: int) -> int:
        return (base + prefix_len // self.page_size) % self.shard_size

    def _class_need(self, start: int, new_pages: int) -> list[int]:
        n = self.shard_size
        return [sum(1 for j in range(new_pages) if (start + j) % n == c) for c in range(n)]

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, rotation_bases=None):
        """Preconditions: each prefix is page-aligned; ``rotation_bases``
        has one entry per request (``None``: a new chain).  Returns the
        batch's slots, request by request, each request's new pages in
        position order (the last perhaps partly used); ``None``, taking
        nothing, when a class has fewer free pages (released included) than
        the batch draws from it.  ``None`` bases are resolved in place either way."""
        ps, n = self.page_size, self.shard_size
        prefix, seq = [int(x) for x in prefix_lens_cpu.tolist()], [int(x) for x in seq_lens_cpu.tolist()]
        if rotation_bases is None or len(rotation_bases) != len(prefix):
            raise ValueError("alloc_extend needs one rotation base per request")
        counts = self.class_free_page_counts()
        plan = []
        for i, (before, after) in enumerate(zip(prefix, seq)):
            if before % ps:
                raise ValueError(f"prefix {before} is not page-aligned (page size {ps})")
            if rotation_bases[i] is None:
                rotation_bases[i] = self._draw_base(counts)
            start, new = self._start_class(rotation_bases[i], before), -(-after // ps) - before // ps
            for c, k in enumerate(self._class_need(start, new)):
                counts[c] -= k
            plan.append((start, new, after - before))
        if min(counts) < 0:
            return None
        self._merge_where_short(plan)
        parts = [torch.empty((0,), dtype=torch.int64, device=self.device)]
        offsets = torch.arange(ps, dtype=torch.int64, device=self.device)
        for start, new, tokens in plan:
            pages = [self._pop(c) for c in ((start + j) % n for j in range(new))]
            page_t = torch.tensor(pages, dtype=torch.int64, device=self.device)
            parts.append((page_t[:, None] * ps + offsets).reshape(-1)[:tokens])
        return torch.cat(parts)

    def alloc_cyclic(self, start_class: int, need_size: int):
        """One chain of whole pages (``need_size`` a multiple of the page
        size) whose owners cycle from ``start_class % shard_size``: a
        host copy loaded back keeps its pages' owners.  ``None`` when short."""
        lens = torch.tensor([0, need_size], dtype=torch.int64)
        return self.alloc_extend(lens[:1], lens[:1], lens[1:], lens[1:], lens[:1] - 1, need_size,
                                 [start_class % self.shard_size])

    def _merge_where_short(self, plan) -> None:
        """Under ``need_sort``, merge a class's releases in where its free
        list alone cannot supply the batch."""
        if not self.need_sort:
            return
        need = [0] * self.shard_size
        for start, new, _ in plan:
            for c, k in enumerate(self._class_need(start, new)):
                need[c] += k
        for c in range(self.shard_size):
            if need[c] > len(self.class_free_pages[c]):
                self._merge(c)

    def _merge(self, c: int) -> None:
        merged = torch.cat((self.class_free_pages[c], self.class_release_pages[c]))
        self.class_free_pages[c] = torch.sort(merged).values
        self.class_release_pages[c] = merged[:0]

    def _pop(self, c: int) -> int:
        page = int(self.class_free_pages[c][0])
        self.class_free_pages[c] = self.class_free_pages[c][1:]
        return page

    # -- freeing: SlotAllocator's free(), free_segment() and groups, filed by class --

    def _release_pages(self, pages: torch.Tensor) -> None:
        for page in pages.tolist():
            self._file(page, self._class_of(page))

    def _class_of(self, page: int) -> int:
        return page % self.shard_size

    def _file(self, page: int, c: int) -> None:
        one = torch.tensor([page], dtype=torch.int64, device=self.device)
        if self.need_sort:
            self.class_release_pages[c] = torch.cat((self.class_release_pages[c], one))
        else:
            self.class_free_pages[c] = torch.cat((one, self.class_free_pages[c]))


class FreeWrongClassAllocator(PageInterleaveAllocator):
    """Mutant: free() files a page under the next class's free list."""

    def _class_of(self, page: int) -> int:
        return (page + 1) % self.shard_size


class BaseKeepsPageAllocator(PageInterleaveAllocator):
    """Mutant: a continuing chain (a given rotation base) reads its pages
    off the class lists without popping them: a live page is handed out again."""

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, rotation_bases=None):
        self._keep = [b is not None for b in (rotation_bases or [])]
        return super().alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, rotation_bases)

    def _pop(self, c: int) -> int:
        if any(self._keep):
            return int(self.class_free_pages[c][0])
        return super()._pop(c)


class RotationFromExtendAllocator(PageInterleaveAllocator):
    """Mutant: the class cycle restarts at the extend's first page instead
    of continuing from the prefix's position in the chain."""

    def _start_class(self, base: int, prefix_len: int) -> int:
        return base % self.shard_size


class BaseNotWrittenAllocator(PageInterleaveAllocator):
    """Mutant: a new chain's drawn base is used but not written back, so
    the caller stamps no base on the radix nodes."""

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, rotation_bases=None):
        copy = list(rotation_bases) if rotation_bases is not None else None
        return super().alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, copy)


class MergeOnTotalAllocator(PageInterleaveAllocator):
    """Mutant: under need_sort, releases are merged only when the free
    lists together are short, not when one class is: a class then runs dry."""

    def _merge_where_short(self, plan) -> None:
        need = sum(new for _, new, _ in plan)
        if self.need_sort and need > sum(len(f) for f in self.class_free_pages):
            for c in range(self.shard_size):
                self._merge(c)


class AliasPageInterleaveAllocator(AliasMixin, PageInterleaveAllocator):
    """Mutant: the free group keeps the caller's row view (sglang PR 34067)."""


PAGE_INTERLEAVE_MUTANTS = {
    m.name: m
    for m in (
        Mutant("free-wrong-class", FreeWrongClassAllocator, "free() files a page under another class's free list"),
        Mutant("base-keeps-page", BaseKeepsPageAllocator, "a continuing chain's draws stay on the free lists (live pages handed out)"),
        Mutant("rotation-from-extend", RotationFromExtendAllocator, "the class cycle restarts at the extend, not the chain's position"),
        Mutant("base-not-written", BaseNotWrittenAllocator, "a new chain's drawn rotation base is not written back"),
        Mutant("merge-on-total", MergeOnTotalAllocator, "need_sort merges releases only when all classes together are short",
               needs={"need_sort": True}),
        Mutant("alias", AliasPageInterleaveAllocator, "the free group's queue keeps the caller's row view"),
    )
}
