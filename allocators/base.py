"""The contract every built-in allocator keeps, and the free-group mechanism."""

from __future__ import annotations

import abc

import torch
from attrs import frozen


@frozen
class Mutant:
    """A named bug variant of an allocator class."""

    name: str
    cls: type
    # What the bug is, in one line; `kv-lockstep targets` shows it.
    summary: str
    # Settings without which the bug cannot show at all, and a run is refused:
    # {"need_sort": True} (a setting equal to a value), {"min_page_size": 2}
    # (a setting at least a value).
    needs: dict = {}


class SlotAllocator(abc.ABC):
    """Hands out KV slots from a pool of ``size // page_size`` pages.

    Page 0 is reserved: the padded slot 0 receives dummy outputs of padded
    tokens, so it is never free and never handed out.  Free pages live in
    ``free_pages``; with ``need_sort`` frees land in ``release_pages`` and are
    merged (sorted) into ``free_pages`` only when an alloc runs short.
    """

    def __init__(
        self, size: int, page_size: int = 1, device: str = "cpu", need_sort: bool = False
    ):
        if page_size < 1 or size < page_size:
            raise ValueError(f"need size >= page_size >= 1, got size={size}, page_size={page_size}")
        self.size = size
        self.page_size = page_size
        self.device = device
        self.need_sort = need_sort
        self.num_pages = size // page_size
        self.clear()

    def clear(self) -> None:
        """Every page free again, no group open."""
        self.free_pages = torch.arange(
            1, self.num_pages + 1, dtype=torch.int64, device=self.device
        )
        self.release_pages = torch.empty((0,), dtype=torch.int64, device=self.device)
        # The container is the state: None frees at once, a list is an open
        # group.  A separate flag beside it can drift (sglang PR 36739).
        self.free_group: list[torch.Tensor] | None = None

    def available_size(self) -> int:
        return (len(self.free_pages) + len(self.release_pages)) * self.page_size

    def get_all_free_pages(self) -> torch.Tensor:
        """Debug / invariant census: the ids of every free page, merged or not."""
        return torch.cat((self.free_pages, self.release_pages))

    # -- free groups --

    def free_group_begin(self) -> None:
        """Queue frees until ``free_group_end()``.  Groups do not nest."""
        if self.free_group is not None:
            raise RuntimeError(
                "free_group_begin() while a free group is open: groups do not nest; "
                "call free_group_end() first"
            )
        self.free_group = []

    def free_group_end(self) -> None:
        """Release everything queued since ``free_group_begin()``.

        Taking the queue and closing the group is one assignment, so a
        repeated end finds ``None`` and does nothing.
        """
        pending, self.free_group = self.free_group, None
        if pending:
            self._release_pages(self._pages_of(torch.cat(pending)))

    @staticmethod
    def _own(index: torch.Tensor) -> torch.Tensor:
        """What a queue keeps of a caller's tensor: its own copy.

        Callers pass views of ``req_to_token`` rows and may overwrite the row
        before the group ends (sglang PR 34067), so the queue must not alias.
        """
        return index.clone()

    # -- freeing --

    def free(self, free_index: torch.Tensor) -> None:
        """Release the pages holding these slots (each page once)."""
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(self._own(free_index))
        else:
            self._release_pages(self._pages_of(free_index))

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """Free ``row[start_pos : start_pos + n]`` of one request's kv row.

        ``start_pos`` is page-aligned; the end may sit mid-page, and that
        trailing page is released whole.  Default: a plain ``free()``.
        """
        if start_pos % self.page_size:
            raise ValueError(f"segment start {start_pos} is not page-aligned (page size {self.page_size})")
        self.free(free_index)

    def free_segments(self, segments) -> None:
        """Free several ``(free_index, start_pos)`` segments of one request's
        kv row, each as ``free_segment`` frees it: starts page-aligned, the
        segments' page ranges disjoint, so each page goes back once."""
        for free_index, start_pos in segments:
            self.free_segment(free_index, start_pos=start_pos)

    def _pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        if self.page_size == 1:
            return slots
        return torch.unique(slots // self.page_size)

    def _release_pages(self, pages: torch.Tensor) -> None:
        if self.need_sort:
            self.release_pages = torch.cat((self.release_pages, pages))
        else:
            self.free_pages = torch.cat((self.free_pages, pages))

    def merge_and_sort_free(self) -> None:
        if len(self.release_pages) > 0:
            self.free_pages, _ = torch.sort(torch.cat((self.free_pages, self.release_pages)))
            self.release_pages = self.release_pages[:0]

    # -- allocation --

    def _take_pages(self, num_pages: int) -> torch.Tensor | None:
        if self.need_sort and num_pages > len(self.free_pages):
            self.merge_and_sort_free()
        if num_pages > len(self.free_pages):
            return None
        taken = self.free_pages[:num_pages]
        self.free_pages = self.free_pages[num_pages:]
        return taken

    @abc.abstractmethod
    def alloc(self, need_size: int) -> torch.Tensor | None:
        raise NotImplementedError


class FlagDriftMixin:
    """Mutant: a boolean flag beside the queue, as before sglang PR 36739.

    ``free_group_end()`` resets the flag but keeps the list, so a repeated
    end frees the same pages again.
    """

    def clear(self) -> None:
        super().clear()
        self.is_not_in_free_group = True
        self.free_group = []

    def free_group_begin(self) -> None:
        self.is_not_in_free_group = False
        self.free_group = []

    def free_group_end(self) -> None:
        self.is_not_in_free_group = True
        if self.free_group:
            self._release_pages(self._pages_of(torch.cat(self.free_group)))

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.is_not_in_free_group:
            self._release_pages(self._pages_of(free_index))
        else:
            self.free_group.append(self._own(free_index))


class AliasMixin:
    """Mutant: the queue keeps the caller's view, as before sglang PR 34067."""

    @staticmethod
    def _own(index: torch.Tensor) -> torch.Tensor:
        return index
