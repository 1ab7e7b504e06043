"""The compressed (C4) device side of a DeepSeek V4 HiSparse pool, in plain
Python (no torch).

DeepSeek V4's HiSparse wrapper keeps its logical pages in an SWA pair (the
core ``OwnershipModel`` and an ``SWASide``) and a device pool of compressed
slots: every ``ratio`` (4) tokens make one compressed token, written at the
full slot whose ``(slot + 1) % ratio == 0``, compressed index
``slot // ratio``.  A logical page of ``page_size`` slots thus owns the
compressed slots ``page * c4_page_size ..`` of ``c4_page_size = page_size //
ratio``, and its device page (a ``DeviceSide`` peer) is taken when its first
compressed token is: a page's peer maps its first ``filled`` compressed
slots, the rest map to nothing.  Decode is logical only; a device buffer
(``alloc_device_buffer``) takes the row's device slots, with the newest
moved to the buffer's reserved position (``buffer_plan``).
"""

from __future__ import annotations

from attrs import frozen


def compressed_growth(prefix_len: int, seq_len: int, ratio: int, c4_page_size: int) -> dict[int, int]:
    """Growing a request from ``prefix_len`` to ``seq_len`` tokens: the
    request's page index -> how many leading compressed slots of that page
    are filled afterwards, for each page a new compressed token lands on."""
    out = {}
    for c in range(prefix_len // ratio, seq_len // ratio):
        out[c // c4_page_size] = c % c4_page_size + 1
    return out


def compressed_new_pages(prefix_len: int, seq_len: int, ratio: int, c4_page_size: int) -> int:
    """Device pages that growth takes: pages whose first compressed token it writes."""
    hps = c4_page_size
    return -(-(seq_len // ratio) // hps) - -(-(prefix_len // ratio) // hps)


@frozen
class BufferPlan:
    """What ``alloc_device_buffer(row, n)`` must return and do."""

    # The buffer's first slots, exactly; past them come fresh whole pages.
    head: tuple[int, ...]
    # Device pages of the row that stay, in the buffer (in head order).
    kept: tuple[int, ...]
    # Device pages of the row that go free.
    surplus: tuple[int, ...]
    # Fresh device pages taken to fill the buffer.
    fresh: int


def _pages(slots, hps: int) -> list[int]:
    return list(dict.fromkeys(s // hps for s in slots))


def buffer_plan(slots: list[int], n: int, c4_page_size: int) -> BufferPlan:
    """The device buffer of ``n`` compressed slots (whole pages) for a row
    whose tokens map to device ``slots`` (row order; each page's filled
    slots, only the last page partly filled).  Its last page is reserved
    for new tokens, and the newest token's slot moves to its start
    (position ``n - c4_page_size``) when the row reaches past it.  A row of
    ``n`` slots or more keeps the first ``n`` and frees the pages only the
    rest touch; a shorter row keeps all, completed to a whole page, and fresh
    pages make up the rest."""
    hps = c4_page_size
    s = list(slots)
    reserved = n - hps
    if len(s) > reserved + 1:
        s[reserved], s[-1] = s[-1], s[reserved]
    if len(s) >= n:
        kept = _pages(s[:n], hps)
        surplus = [p for p in _pages(s[n:], hps) if p not in kept]
        return BufferPlan(tuple(s[:n]), tuple(kept), tuple(surplus), 0)
    if s and len(s) % hps:
        # The residue of the newest token's page belongs to the row too.
        last = slots[-1] // hps
        s += [last * hps + k for k in range(len(s) % hps, hps)]
    return BufferPlan(tuple(s), tuple(_pages(s, hps)), (), (n - len(s)) // hps)
