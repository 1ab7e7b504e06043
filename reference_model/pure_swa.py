"""A pure-SWA pool's window slides, in plain Python (no torch).

Every layer is windowed, so the one pool is the SWA pool and a slide gives
the request's oldest pages back for good: nothing frees them again (their
``free_full`` has nothing to release).  The caller's ``req_to_token`` row
still holds their ids, so the model keeps the row's layout by moving them
from the request's ``own`` pages to the end of its ``prefix``: every later
free of its own pages starts after them, as the caller's does.
"""

from __future__ import annotations

from reference_model.ledger import EVICTED
from reference_model.model import FREE_OWNER, QUEUED, Owner, OwnershipModel


def slide(model: OwnershipModel, rid: int, pages: int, *, defer: bool) -> list[int]:
    """Request ``rid``'s ``pages`` oldest own pages leave the window.

    Pre: the request holds at least ``pages`` own pages.  Post: they are
    free, or queued in the open group when ``defer`` (the allocator's
    ``free_swa`` queues inside a group), and sit at the end of the
    request's ``prefix``.  Returns them, oldest first."""
    request = model.requests[rid]
    assert pages <= len(request.own), f"req_{rid} slides {pages} pages, holds {len(request.own)}"
    gone, request.own = request.own[:pages], request.own[pages:]
    request.prefix.extend(gone)
    request.spare = 0
    if defer and model.ledger.queue(gone, EVICTED):
        for p in gone:
            model.owner[p] = Owner(QUEUED)
    else:
        for p in gone:
            model.owner[p] = FREE_OWNER
        model.ledger.gave_back(len(gone), EVICTED)
    return gone
