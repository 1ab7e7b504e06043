"""Rule bodies the pure-SWA and HiSparse machines share with the core's,
narrowed: which requests a rule may pick, which cache entries it may use;
and the prefill order both HiSparse harnesses keep (``PrefillOnly``)."""

from __future__ import annotations

from typing import Callable

import torch

from state_machines.harness.machines import _pick


def rematch_among(machine, reqs: list, which: int, dup: int, entry: int, donor_ok: Callable | None = None) -> None:
    """The core ``rematch`` rule over ``reqs`` only, and over the cache
    entries ``donor_ok(req, entry)`` allows (all, when None)."""
    s = machine.state
    req = _pick(reqs, which)
    dup = min(dup, len(s.model.requests[req.rid].own))
    donors = [
        e for e in s.entries()
        if len(s.model.cache[e.eid].pages) >= dup and (donor_ok is None or donor_ok(req, e))
    ] if dup else []
    if not donors:
        dup = 0
    machine._do("rematch", req, dup, _pick(donors, entry) if donors else None)


class PrefillOnly:
    """For a harness whose allocator maps each extend's tokens to device
    slots and continues from the mapping of ``last_loc``: a request is
    grown only in its prefill (not once in ``self.settled``), an ``alloc``
    only from a full last page, and ``rematch`` inserts whole pages only."""

    def extendable(self) -> list:
        """Requests still in prefill."""
        return [r for r in self.live() if r.rid not in self.settled]

    def allocatable(self) -> list:
        """Requests in prefill whose last page is full: an ``alloc`` grows a
        request from its page-aligned end, and a caller never leaves the
        rest of a page unwritten (its tokens would map nothing)."""
        return [r for r in self.extendable() if not self.model.requests[r.rid].spare]

    def aligned(self) -> list:
        """Requests whose own pages are whole (the radix cache inserts whole pages only)."""
        return [r for r in self.with_own_pages() if not self.model.requests[r.rid].spare]

    def prefill_step_not_applicable(self, rule: str, args: dict) -> str | None:
        """Why a replayed step breaks that order, or None."""
        req = args.get("req")
        if rule in ("alloc", "extend") and any(r.rid in self.settled for r in (args.get("reqs") or ([req] if req else []))):
            return "a request is extended only in its prefill, before a logical-only decode, its device buffer or an abort"
        if rule == "alloc" and req is not None and req not in self.allocatable():
            return f"{req!r} ends mid-page: an alloc would leave the rest of its page unmapped"
        if rule == "rematch" and req not in self.aligned():
            return f"{req!r} ends mid-page: the radix cache inserts whole pages"
        return None


class ReleasesDevicePeers:
    """For a harness whose logical pages have device peers (``self.device``):
    a free or an eviction of logical pages releases their peers too, queued
    where the side's group is open."""

    def _give_back(self, row: int, start: int, end: int, pages: list[int], *, segment: bool) -> None:
        super()._give_back(row, start, end, pages, segment=segment)
        self.device.release(pages, "free")

    def _evict_slots(self, entry, slots, pages) -> None:
        super()._evict_slots(entry, slots, pages)
        self.device.release(pages, "evict")

    def _return_buffer(self, req, page_size: int) -> None:
        """The coordinator's ``request_finished``: the request's device
        buffer, if any (pages of ``page_size`` slots), goes back
        (``free_hisparse_indices``)."""
        buffer = self.device.buffers.get(req.rid)
        if buffer is None:
            return
        ps = page_size
        slots = torch.tensor([p * ps + k for p in buffer for k in range(ps)], dtype=torch.int64, device=self.rows.device)
        self._call(f"free_hisparse_indices({req!r} device buffer)", self.allocator.free_hisparse_indices, slots)
        self.device.drop_buffer(req.rid)
