"""The device pool of a HiSparse pair, in plain Python (no torch).

A HiSparse allocator hands out logical pages (the core ``OwnershipModel``)
and, for each, a device page joined to it by the full-to-HiSparse mapping,
as an SWA pool's pages are joined to the full pool's: ``DeviceSide`` is an
``SWASide`` whose pages may also sit in a request's device buffer.  Once a
request's device buffer is made (``alloc_device_buffer``), the device pages
of its row leave the mapping: the first ones become the buffer, the rest go
free, and more are taken if the buffer needs them.  Frees are never deferred.
"""

from __future__ import annotations

from collections import Counter

from attrs import define, field

from reference_model import mirrors
from reference_model.ledger import FREED
from reference_model.model import CACHE, REQUEST, Owner
from reference_model.swa import SWASide


@define
class DeviceSide(SWASide):
    """Device pages: free, the peer of a held logical page (``mapping``), or
    in a live request's device buffer (``buffers``)."""

    # Request -> the device pages of its buffer, in buffer order.  Changed
    # by give_buffer and drop_buffer only, which keep ``_in_buffers``.
    buffers: dict[int, list[int]] = field(factory=dict)
    # Per page id, how many buffer places hold it, a lane (``mirrors.lanes``;
    # None once an id no flat array holds, or a count past LANE_MOST, came in).
    _in_buffers: bytearray | None = field(factory=bytearray, eq=False, repr=False)

    def owner_map(self) -> dict[int, Owner]:
        out = SWASide.owner_map(self)
        for rid, pages in self.buffers.items():
            for p in pages:
                out[p] = Owner(REQUEST, rid)
        return out

    def _held_lanes(self) -> list:
        return [self.mapping.held, self._in_buffers]

    def _buffered(self) -> int:
        return sum(map(len, self.buffers.values()))

    def _count_buffer(self, pages: list[int], step: int) -> None:
        self._in_buffers = mirrors.count(self._in_buffers, pages, step, self.free.most)

    def unmap(self, logical_pages) -> list[int]:
        """The peers of ``logical_pages`` leave the mapping (they stay held,
        for ``give_buffer`` to place); returns them in the pages' order."""
        return [self.mapping.pop(p) for p in logical_pages if p in self.mapping]

    def give_buffer(self, rid: int, kept: list[int], extra: list[int], surplus: list[int]) -> None:
        """Request ``rid``'s device buffer is ``kept`` (unmapped peers it
        keeps) then ``extra`` (pages taken from the free set); the
        ``surplus`` peers go free."""
        self._count_buffer(self.buffers.get(rid, []), -1)
        self.buffers[rid] = list(kept) + list(extra)
        self._count_buffer(self.buffers[rid], 1)
        self.free.difference_update(extra)
        self.ledger.allocated += len(extra)
        self._to_free(surplus, FREED)

    def drop_buffer(self, rid: int) -> list[int]:
        """The request's buffer goes free (``free_hisparse_indices``)."""
        pages = self.buffers.pop(rid, [])
        self._count_buffer(pages, -1)
        self._to_free(pages, FREED)
        return pages

    def violations(self) -> list[str]:
        if (self._partition_counts() is not None and self.full.requests.keys() >= self.buffers.keys()
                and self.ledger.balance_problem(len(self.free), "device ") is None):
            return []
        return self.violations_found()

    def violations_found(self) -> list[str]:
        out = []
        buffered = [p for pages in self.buffers.values() for p in pages]
        # Queued: released inside a free group (a wrapper that defers frees).
        seen = Counter(list(self.mapping.values()) + buffered + self.ledger.queued_pages() + list(self.free))
        if twice := sorted(p for p, n in seen.items() if n > 1):
            out.append(f"device pages {twice} are mapped, in a buffer, queued or free more than once")
        if set(seen) != set(self.universe):
            out.append(f"device pages tracked {len(seen)} / device pool {len(self.universe)}")
        for page, peer in self.mapping.items():
            kind = self.full.owner.get(page, Owner("outside the pool")).kind
            if kind not in (REQUEST, CACHE):
                out.append(f"logical page {page} is {kind} but still maps to device page {peer}")
        for rid in self.buffers:
            if rid not in self.full.requests:
                out.append(f"req_{rid} has finished but still holds a device buffer")
        if problem := self.ledger.balance_problem(len(self.free), "device "):
            out.append(problem)
        return out
