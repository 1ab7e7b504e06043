"""One pool's accounting, shared by every model: pages handed out, pages
given back (freed by a request or evicted by the cache) and the open free
group's queue.  Plain Python, no torch.

``eviction_accounting_balances`` checks the ledger against the pool: what
the pool physically gained back since it started must equal what was
logically freed and evicted.
"""

from __future__ import annotations

from attrs import define, field, frozen

FREED, EVICTED = "free", "evict"


@frozen
class Queued:
    """One queued release: its pages, snapshotted when queued."""

    pages: tuple[int, ...]
    # "free" for a request's release, "evict" for the cache's.
    source: str


@define
class Ledger:
    """Counts for ``eviction_accounting_balances`` and the open group.

    The container is the state: ``group`` is ``None`` with no group open, a
    list while one is open (a flag beside it could drift, sglang PR 36739).
    """

    initial_free: int
    # Whether free_group_begin() really defers frees (HiSparse-style pools don't).
    defers: bool = True
    allocated: int = 0
    evicted: int = 0
    freed: int = 0
    group: list[Queued] | None = field(default=None)

    def begin(self) -> None:
        assert self.group is None, "free groups do not nest"
        if self.defers:
            self.group = []

    def end(self) -> list[Queued]:
        """Close the group; what it queued, in order (nothing with no group open)."""
        pending, self.group = self.group, None
        return pending or []

    def queue(self, pages, source: str) -> bool:
        """Queue a release in the open group; False when none is open."""
        if self.group is None:
            return False
        self.group.append(Queued(tuple(pages), source))
        return True

    def queued_pages(self) -> list[int]:
        return [p for q in self.group or () for p in q.pages]

    def gave_back(self, count: int, source: str) -> None:
        if source == EVICTED:
            self.evicted += count
        else:
            self.freed += count

    @property
    def expected_free(self) -> int:
        return self.initial_free - self.allocated + self.evicted + self.freed

    def balance_problem(self, free: int, label: str = "") -> str | None:
        """Whether ``free`` pages is what the counts say; a message if not."""
        if self.expected_free == free:
            return None
        return (
            f"{label}initial {self.initial_free} - allocated {self.allocated} + evicted {self.evicted}"
            f" + freed {self.freed} = {self.expected_free} / free {free}"
        )
