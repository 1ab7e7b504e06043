"""The SWA side of a sliding-window hybrid pool, in plain Python (no torch).

The full pool is an ``OwnershipModel``; this tracks the SWA pool beside it:
which full page maps to which live SWA page, which SWA pages are free or
queued, and the logical frees and evictions.  It offers the views the
named invariants read (``free_pages``, ``owner``, ``counts()``, the
counters), so every check on the full pool runs on the SWA pool too.
"""

from __future__ import annotations

from collections import Counter

from attrs import define, field

from reference_model.ledger import Ledger
from reference_model.model import CACHE, FREE_OWNER, QUEUED, REQUEST, Owner, OwnershipModel


@define
class SWASide:
    """SWA pages: free, queued in a group, or the live peer of a held full page."""

    full: OwnershipModel
    universe: frozenset[int]
    free: set[int]
    # Full page -> its live SWA page.  A full page whose window slid, or
    # which is free or queued, maps to nothing.
    # The SWA pool's counts and open group; it defers when the full pool does.
    ledger: Ledger
    mapping: dict[int, int] = field(factory=dict)
    # Full page -> the SWA page its queued release will free.  Until the group
    # ends an allocator may still read that mapping (sglang <= 0.5.18 do).
    pending_map: dict[int, int] = field(factory=dict)
    # Full page -> how many of its leading slots are mapped, where fewer than
    # a page: a partly used last page (page size > 1) maps only the slots its
    # tokens use, and the rest must map to nothing until a decode or an
    # extend fills them.
    filled: dict[int, int] = field(factory=dict)

    @classmethod
    def from_census(cls, full: OwnershipModel, free_pages: list[int]) -> SWASide:
        ledger = Ledger(len(set(free_pages)), defers=full.defers_frees)
        return cls(full=full, universe=frozenset(free_pages), free=set(free_pages), ledger=ledger)

    # -- the views the invariants read --

    @property
    def capacity(self) -> int:
        return len(self.universe)

    @property
    def free_pages(self) -> set[int]:
        return set(self.free)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def owner(self) -> dict[int, Owner]:
        out = {p: FREE_OWNER for p in self.universe}
        for full_page, swa_page in self.mapping.items():
            out[swa_page] = self.full.owner.get(full_page, Owner("unknown"))
        for p in self.ledger.queued_pages():
            out[p] = Owner(QUEUED)
        return out

    def counts(self) -> Counter:
        return Counter(o.kind for o in self.owner.values())

    def live(self, full_page: int) -> bool:
        return full_page in self.mapping

    def filled_slots(self, full_page: int, page_size: int) -> int:
        """How many leading slots of a live or queued full page are mapped."""
        return self.filled.get(full_page, page_size)

    # -- steps --

    def take(self, full_pages: list[int], swa_pages: list[int], filled: list[int] | None = None) -> None:
        """Each of ``full_pages`` now maps to its fresh SWA page; ``filled``
        says how many leading slots of each are mapped (None: all)."""
        for i, (full_page, swa_page) in enumerate(zip(full_pages, swa_pages, strict=True)):
            self.mapping[full_page] = swa_page
            self.free.discard(swa_page)
            self.filled.pop(full_page, None)
            if filled is not None:
                self.filled[full_page] = filled[i]
        self.ledger.allocated += len(swa_pages)

    def fill(self, full_page: int, slots: int, page_size: int) -> None:
        """``slots`` more slots of a live, partly used full page are mapped."""
        if full_page in self.mapping:
            self.filled[full_page] = self.filled_slots(full_page, page_size) + slots

    def release(self, full_pages, source: str, *, defer: bool = True) -> list[int]:
        """The SWA peers of ``full_pages`` that are still live go (or queue,
        when a group is open and ``defer``); ``source`` is "free" for a
        request's release, "evict" for a window slide or a cache eviction."""
        pairs = [(p, self.mapping.pop(p)) for p in full_pages if p in self.mapping]
        pages = [swa for _, swa in pairs]
        if not pages:
            return pages
        if defer and self.ledger.queue(pages, source):
            # The fill stays: until end() the queued peer may still be read.
            self.pending_map.update(pairs)
        else:
            self._to_free(pages, source)
            for p, _ in pairs:
                self.filled.pop(p, None)
        return pages

    def begin(self) -> None:
        self.ledger.begin()

    def end(self) -> None:
        for p in self.pending_map:
            if p not in self.mapping:
                self.filled.pop(p, None)
        self.pending_map.clear()
        for queued in self.ledger.end():
            self._to_free(queued.pages, queued.source)

    def _to_free(self, pages, source: str) -> None:
        self.free.update(pages)
        self.ledger.gave_back(len(pages), source)

    # -- self-check --

    def violations(self) -> list[str]:
        out = []
        queued = self.ledger.queued_pages()
        mapped = list(self.mapping.values())
        seen = Counter(mapped + queued + list(self.free))
        if twice := sorted(p for p, n in seen.items() if n > 1):
            out.append(f"SWA pages {twice} are mapped, queued or free more than once")
        if set(seen) != set(self.universe):
            out.append(f"SWA pages tracked {len(seen)} / SWA pool {len(self.universe)}")
        for full_page in self.mapping:
            kind = self.full.owner.get(full_page, Owner("outside the pool")).kind
            if kind not in (REQUEST, CACHE):
                out.append(f"full page {full_page} is {kind} but still maps to SWA page {self.mapping[full_page]}")
        if problem := self.ledger.balance_problem(len(self.free), "SWA "):
            out.append(problem)
        return out
