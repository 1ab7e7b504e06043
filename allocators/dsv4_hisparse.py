"""DeepSeek V4 HiSparse allocation: an SWA pair (logical pages) and a device
pool of compressed (C4) slots at a quarter of its page size, joined by a
compressed-index mapping; frees deferred in a free group."""

from __future__ import annotations

import torch

from allocators.base import Mutant
from allocators.paged import PagedAllocator
from allocators.swa import SWAAllocator


class DSV4HiSparseAllocator:
    """The twin of sglang's ``DeepSeekV4HiSparseTokenToKVPoolAllocator``.

    Every ``compress_ratio`` (4) tokens make one compressed token, stored at
    the full slot ``s`` with ``(s + 1) % 4 == 0``, compressed index ``s //
    4``; a logical page of ``page_size`` slots (a multiple of 4) owns
    ``hisparse_page_size = page_size // 4`` compressed slots.  ``alloc_extend``
    takes logical slots from the SWA pair and a device slot for every
    compressed token it completes (continuing the device page of the last
    complete one); ``alloc_decode`` is logical only.  ``free()`` releases the
    logical slots and the device slots they map to, queued inside a free
    group; ``alloc_device_buffer`` turns a row's device slots into a
    request's buffer (its last page reserved, the newest token at its start).
    """

    # Read by targets.py: the DeepSeek V4 HiSparse harness drives this family.
    family = "dsv4_hisparse"
    page_sizes = (4, 8, 16)
    compress_ratio = 4

    def __init__(self, size: int, page_size: int = 4, device: str = "cpu", need_sort: bool = False):
        if page_size % self.compress_ratio:
            raise ValueError(f"page size {page_size} is not a multiple of the compress ratio {self.compress_ratio}")
        hps = page_size // self.compress_ratio
        self.page_size = page_size
        self.hisparse_page_size = hps
        self.device = device
        self.logical_attn_allocator = SWAAllocator(size, page_size, device, need_sort)
        # Half as many device pages as logical ones: the device pool binds too.
        self.hisparse_attn_allocator = PagedAllocator(max(2, size // page_size // 2) * hps, hps, device, need_sort)
        # The trailing -1 is what a last_loc of -1 translates to.
        self.full_to_hisparse_device_index_mapping = torch.zeros(size // self.compress_ratio + hps + 1, dtype=torch.int64, device=device)
        self.clear()

    def clear(self) -> None:
        self.logical_attn_allocator.clear()
        self.hisparse_attn_allocator.clear()
        self.full_to_hisparse_device_index_mapping[:-1] = 0
        self.full_to_hisparse_device_index_mapping[-1] = -1
        # None: frees are immediate.  Lists: the group's queued frees, copies.
        self.free_group: list[torch.Tensor] | None = None
        self.full_free_group: list[torch.Tensor] = []

    @property
    def full_to_swa_index_mapping(self) -> torch.Tensor:
        return self.logical_attn_allocator.full_to_swa_index_mapping

    def available_size(self) -> int:
        return min(self.logical_attn_allocator.available_size(), self.hisparse_attn_allocator.available_size() * self.compress_ratio)

    def alloc(self, need_size: int):
        raise NotImplementedError("allocate through alloc_extend or alloc_decode")

    # -- compressed indices --

    def compressed(self, full_slots: torch.Tensor) -> torch.Tensor:
        """The compressed indices of the full slots that end a block of 4."""
        r = self.compress_ratio
        return full_slots[(full_slots + 1) % r == 0] // r

    def last_complete(self, last_loc: torch.Tensor) -> torch.Tensor:
        """The compressed index of the last complete block of a prefix ending
        at ``last_loc`` (-1 stays -1)."""
        r = self.compress_ratio
        return (last_loc - (r - 1)) // r

    # -- allocation --

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens):
        """Logical slots as the SWA pair gives them, and a device slot per
        compressed token completed.  ``None``, taking nothing, when the SWA
        pair or the device pool is short of the batch's new pages."""
        r, hps = self.compress_ratio, self.hisparse_page_size
        prefix, seq = prefix_lens_cpu // r, seq_lens_cpu // r
        device_pages = sum(-(-after // hps) - -(-before // hps) for before, after in zip(prefix.tolist(), seq.tolist()))
        if device_pages * hps > self.hisparse_attn_allocator.available_size():
            return None
        logical = self.logical_attn_allocator.alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens)
        if logical is None:
            return None
        compressed = self.compressed(logical)
        device_last = self.full_to_hisparse_device_index_mapping[self.last_complete(last_loc)]
        device = self.hisparse_attn_allocator.alloc_extend(prefix_lens // r, prefix, seq_lens // r, seq, device_last, len(compressed))
        self.full_to_hisparse_device_index_mapping[compressed] = device
        return logical

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        return self.logical_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc)

    def alloc_extend_swa_tail(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens,
                              swa_tail_len: int):
        return self.logical_attn_allocator.alloc_extend_swa_tail(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, swa_tail_len=swa_tail_len)

    # -- device buffers --

    def alloc_device_buffer(self, compressed_indices: torch.Tensor, need_size: int) -> torch.Tensor:
        """A request's buffer of ``need_size`` device slots (whole pages)
        from its row's compressed indices: the slots they map to leave the
        mapping, the newest moves to the reserved last page's start, pages
        only the surplus touches go free, fresh pages fill a shortfall."""
        hps = self.hisparse_page_size
        if need_size % hps:
            raise ValueError(f"alloc_device_buffer({need_size}) is not page-aligned (page size {hps})")
        mapping = self.full_to_hisparse_device_index_mapping
        slots = mapping[compressed_indices]
        mapping[compressed_indices] = 0
        slots = slots[slots > 0].clone()
        reserved, n = need_size - hps, len(slots)
        last_page = int(slots[-1]) // hps if n else 0
        if n > reserved + 1:
            slots[[reserved, n - 1]] = slots[[n - 1, reserved]]
        if n >= need_size:
            buffer, surplus = slots[:need_size], slots[need_size:]
            self._free_surplus(buffer // hps, torch.unique(surplus // hps))
            return buffer
        if n % hps:
            slots = torch.cat((slots, last_page * hps + torch.arange(n % hps, hps, device=slots.device)))
        extra = self.hisparse_attn_allocator.alloc(need_size - len(slots))
        if extra is None:
            raise RuntimeError(f"alloc_device_buffer({need_size}): the device pool is short")
        return torch.cat((slots, extra))

    def _free_surplus(self, buffer_pages: torch.Tensor, surplus_pages: torch.Tensor) -> None:
        """Free the surplus pages the buffer does not share."""
        only = surplus_pages[~torch.isin(surplus_pages, buffer_pages)]
        if only.numel():
            self.hisparse_attn_allocator.free(only * self.hisparse_page_size)

    def free_hisparse_indices(self, buffer_indices: torch.Tensor) -> None:
        """Give device slots back; page 0 is the padding sink, never owned."""
        self.hisparse_attn_allocator.free(buffer_indices[buffer_indices >= self.hisparse_page_size])

    def free_compressed(self, compressed_indices: torch.Tensor) -> None:
        mapping = self.full_to_hisparse_device_index_mapping
        slots = mapping[compressed_indices]
        self.free_hisparse_indices(slots[slots > 0])
        mapping[compressed_indices] = 0

    def free_hisparse(self, free_indices: torch.Tensor) -> None:
        """Free the device slots of these full slots' compressed tokens, and unmap them."""
        self.free_compressed(self.compressed(free_indices))

    # -- frees --

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(self._queued(free_index))
            return
        self._free_now(free_index)

    def _free_now(self, free_index: torch.Tensor) -> None:
        self.logical_attn_allocator.free(free_index)
        self.free_hisparse(free_index)

    @staticmethod
    def _queued(free_index: torch.Tensor) -> torch.Tensor:
        # The caller's row may change before the group ends: own a copy.
        return free_index.clone()

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        self.free(free_index)

    def free_full(self, free_index: torch.Tensor) -> None:
        """The full side of slots whose window slid (no device side here)."""
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.full_free_group.append(free_index.clone())
        else:
            self.logical_attn_allocator.free_full(free_index)

    def free_full_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        self.free_full(free_index)

    def free_swa(self, free_index: torch.Tensor) -> None:
        self.logical_attn_allocator.free_swa(free_index)

    def free_swa_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        self.logical_attn_allocator.free_swa_segment(free_index, start_pos=start_pos)

    def free_group_begin(self) -> None:
        if self.free_group is not None:
            raise RuntimeError("free groups cannot be nested")
        self.free_group, self.full_free_group = [], []

    def free_group_end(self) -> None:
        pending, self.free_group = self.free_group, None
        full, self.full_free_group = self.full_free_group, []
        if pending:
            self.free(torch.cat(pending))
        if full:
            self.free_full(torch.cat(full))


class FreeKeepsDeviceAllocator(DSV4HiSparseAllocator):
    """Mutant (sglang 0.5.17 - 0.5.20): free() releases the logical slots
    only; the device pages they map to stay mapped and leak."""

    def _free_now(self, free_index: torch.Tensor) -> None:
        self.logical_attn_allocator.free(free_index)


class GroupQueuesViewAllocator(DSV4HiSparseAllocator):
    """Mutant (sglang 0.5.17, 0.5.18): free() inside a group queues the
    caller's view; a row rewritten before free_group_end() frees what it
    then holds (the aliasing of PR 34067)."""

    @staticmethod
    def _queued(free_index: torch.Tensor) -> torch.Tensor:
        return free_index


class LastLocFloorAllocator(DSV4HiSparseAllocator):
    """Mutant: the device side continues at the block holding ``last_loc``,
    complete or not, instead of the last complete one: an extend from mid-
    block continues the device page at slot 1 of nothing."""

    def last_complete(self, last_loc: torch.Tensor) -> torch.Tensor:
        return torch.where(last_loc < 0, last_loc, last_loc // self.compress_ratio)


class SurplusFreesSharedAllocator(DSV4HiSparseAllocator):
    """Mutant: alloc_device_buffer frees every page the surplus touches,
    also the newest token's page, which the buffer keeps (the
    ``pure_surplus`` filter dropped)."""

    def _free_surplus(self, buffer_pages: torch.Tensor, surplus_pages: torch.Tensor) -> None:
        if surplus_pages.numel():
            self.hisparse_attn_allocator.free(surplus_pages * self.hisparse_page_size)


DSV4_HISPARSE_MUTANTS = {
    m.name: m
    for m in (
        Mutant("free-keeps-device", FreeKeepsDeviceAllocator, "free() leaves the device pages of the freed slots mapped"),
        Mutant("group-queues-view", GroupQueuesViewAllocator, "free() in a group queues the caller's view"),
        Mutant("last-loc-floor", LastLocFloorAllocator, "the device side continues at the block holding last_loc, complete or not",
               needs={"page_size": 8}),
        Mutant("surplus-frees-shared", SurplusFreesSharedAllocator, "alloc_device_buffer frees the surplus's pages the buffer shares",
               needs={"page_size": 8}),
    )
}
