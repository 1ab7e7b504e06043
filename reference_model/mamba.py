"""Mamba state slots, in plain Python (no torch).

A Mamba slot allocator hands out whole slots, one state per request (and
more for its ping-pong track buffers): page size 1, no free groups, frees
released at once.  What it adds is the *allocation* group:
``alloc_group_begin(n)`` pre-allocates ``n`` slots for the scheduler's
batch, each ``alloc(1)`` may draw one of them, and ``alloc_group_end()``
returns the ones not drawn.  The model is the core ``OwnershipModel`` plus
that reserve: a reserved slot is held by the group (the ``queued`` kind, so
every check counts it held) until a request draws it or the group ends.
"""

from __future__ import annotations

from attrs import define

from reference_model.ledger import FREED, Ledger
from reference_model.model import FREE_OWNER, QUEUED, Owner, OwnerMap, OwnershipModel


@define
class ReservingLedger(Ledger):
    """A ledger whose held-by-the-group pages include the open allocation
    group's reserve (``None``: no allocation group open)."""

    reserved: list[int] | None = None

    def queued_pages(self) -> list[int]:
        return super().queued_pages() + list(self.reserved or ())


@define
class MambaModel(OwnershipModel):
    """Slot ownership with an allocation group's reserve."""

    @classmethod
    def from_census(cls, free_pages: list[int], *, defers_frees: bool = False) -> MambaModel:
        return cls(owner=OwnerMap.all_free(free_pages), ledger=ReservingLedger(len(free_pages), defers=defers_frees))

    @property
    def reserved(self) -> list[int] | None:
        """The open allocation group's slots no alloc drew; None with none open."""
        return self.ledger.reserved

    def group_begin(self, slots: list[int]) -> None:
        """``alloc_group_begin``: ``slots`` (free until now) are reserved.
        Pre: no allocation group is open."""
        assert self.ledger.reserved is None, "allocation groups do not nest"
        self.ledger.reserved = list(slots)
        for s in slots:
            self.owner[s] = Owner(QUEUED)
        self.ledger.allocated += len(slots)

    def group_end(self) -> list[int]:
        """``alloc_group_end``: the slots no alloc drew go free; with no group
        open, nothing.  Returns them."""
        leftover, self.ledger.reserved = self.ledger.reserved or [], None
        for s in leftover:
            self.owner[s] = FREE_OWNER
        self.ledger.gave_back(len(leftover), FREED)
        return leftover

    def take(self, rid: int, pages: list[int]) -> None:
        """As ``OwnershipModel.take``; a slot drawn from the reserve was
        counted allocated when it was reserved."""
        reserve = self.ledger.reserved or []
        drawn = [p for p in pages if p in reserve]
        if drawn:
            self.ledger.reserved = [p for p in reserve if p not in drawn]
        super().take(rid, pages)
        self.ledger.allocated -= len(drawn)
