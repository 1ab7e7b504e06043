"""The census of a real prefix cache driven by its release's own scheduler
helpers (``state_machines/callers``), as named predicates over plain values.

Where the allocator harness predicts each page's owner with a model, a run
under ``--caller`` asks the real objects who holds what and checks that the
answers fit together.  After every action, and after every request's result
while a free group is open, the harness reads four holders of pages:

- the tree: every node's slots (``all_values_flatten()``);
- each live request: its ``req_to_token`` row from ``cache_protected_len``
  to ``kv_allocated_len`` (what it will free itself);
- the free list: the allocator's census;
- the open free group: what its queued tensors hold *now*.

On an SWA cache the SWA pool has holders too: its free list, the open
group's SWA queue and the full slots' peers; the peers must pair at most one
full slot with each SWA slot, and no free full slot keeps a peer.

Each predicate returns ``None`` when it holds, else a message showing both
sides and naming the action that led there.  Pages are slots at page size 1.
"""

from __future__ import annotations

from collections import Counter

from attrs import frozen

TREE = "the tree"
FREE = "the free list"
QUEUED = "the open free group"


@frozen
class Holder:
    """Pages one owner holds: ``name`` as a message shows it (``req_1's row
    3``), ``pages`` with the repeats it reported."""

    name: str
    pages: tuple[int, ...]


def _show(pages, limit: int = 12, ordered: bool = False) -> str:
    """A list for a message, sorted unless its order is the point."""
    pages = list(pages) if ordered else sorted(pages)
    shown = ", ".join(map(str, pages[:limit]))
    return f"[{shown}{', ...' if len(pages) > limit else ''}]"


def _unit(page_size: int) -> str:
    return "slot" if page_size == 1 else "page"


def free_list_has_no_repeats(free: list[int], page_size: int, action: str) -> str | None:
    """No page is in the allocator's free list twice (freed twice)."""
    twice = sorted(p for p, n in Counter(free).items() if n > 1)
    if twice:
        unit = _unit(page_size)
        return f"after {action}: {unit}s {_show(twice)} are in {FREE} more than once / each belongs there once at most"
    return None


def tree_holds_each_slot_once(slots: list[int], action: str) -> str | None:
    """No slot is the value of two tree positions."""
    twice = sorted(s for s, n in Counter(slots).items() if n > 1)
    if twice:
        return f"after {action}: slots {_show(twice)} appear in {TREE} more than once / each once at most"
    return None


def census_covers_pool(holders: list[Holder], pool: frozenset[int], page_size: int, action: str) -> str | None:
    """The holders are disjoint and together hold exactly the pool's pages.

    Precondition: ``pool`` is the allocator's first census (every page free
    before any action).  Postcondition of a sound caller: each page of the
    pool is held by exactly one holder; none is held outside the pool.
    """
    unit = _unit(page_size)
    owners: dict[int, list[str]] = {}
    for holder in holders:
        for page in sorted(set(holder.pages)):
            owners.setdefault(page, []).append(holder.name)
    shared = {p: names for p, names in owners.items() if len(names) > 1}
    if shared:
        page = min(shared)
        more = f" ({len(shared) - 1} more {unit}s held twice: {_show(set(shared) - {page})})" if len(shared) > 1 else ""
        return f"after {action}: {unit} {page} is held by {' and by '.join(shared[page])} / one holder each{more}"
    outside = sorted(set(owners) - pool)
    if outside:
        page = outside[0]
        return f"after {action}: {owners[page][0]} holds {unit} {page} / the pool is {unit}s {_show(pool, 6)}"
    leaked = sorted(pool - set(owners))
    if leaked:
        return (
            f"after {action}: {unit}s {_show(leaked)} are held by nobody (not in the tree, no live row, not free,"
            f" not queued) / every {unit} of the pool has a holder"
        )
    return None


def protected_prefix_is_locked_path(req: str, row_prefix: list[int], path: list[int], action: str) -> str | None:
    """A live request's protected row prefix (``[0, cache_protected_len)``)
    holds exactly the slots of the tree path it locks."""
    if row_prefix == path:
        return None
    n = len(row_prefix)
    first = next((i for i, (a, b) in enumerate(zip(row_prefix, path)) if a != b), min(n, len(path)))
    return (
        f"after {action}: {req}'s row holds {_show(row_prefix, 16, True)} in its protected prefix (0..{n})"
        f" / the tree path it locks holds {_show(path, 16, True)} (first difference at position {first})"
    )


def tree_sizes_balance(evictable: int, protected: int, tree_tokens: int, action: str) -> str | None:
    """``evictable_size() + protected_size()`` is the tree's token count."""
    if evictable + protected == tree_tokens:
        return None
    return (
        f"after {action}: evictable_size() {evictable} + protected_size() {protected} = {evictable + protected}"
        f" / the tree holds {tree_tokens} tokens"
    )


# --------------------------------------------------------------------------- #
# SWA: every full slot may have one sliding-window peer (``full_to_swa_index_mapping``,
# 0 meaning none); a window slide frees peers and keeps the full slots.

SWA_FREE = "the SWA free list"
SWA_QUEUED = "the open free group's SWA queue"


def swa_peers_are_a_partial_bijection(peers: dict[int, int], action: str) -> str | None:
    """No SWA slot is the peer of two full slots.

    ``peers`` maps each full slot that has a peer to it (slots, not pages);
    a full slot without a peer is absent.
    """
    owners: dict[int, list[int]] = {}
    for full, swa in sorted(peers.items()):
        owners.setdefault(swa, []).append(full)
    shared = {s: fulls for s, fulls in owners.items() if len(fulls) > 1}
    if shared:
        swa = min(shared)
        return (
            f"after {action}: SWA slot {swa} is the peer of full slots {_show(shared[swa])}"
            f" / one full slot at most ({len(shared)} SWA slots shared)"
        )
    return None


def free_full_slots_have_no_peer(free_full: list[int], peers: dict[int, int], action: str) -> str | None:
    """A full slot on the free list (or queued to it) keeps no SWA peer: its
    peer was freed with it, or a later allocation of it would alias the peer.

    ``free_full`` is slots (a free page's every slot at page size > 1).
    """
    kept = sorted(s for s in set(free_full) if s in peers)
    if kept:
        slot = kept[0]
        more = f" ({len(kept) - 1} more: {_show(kept[1:])})" if len(kept) > 1 else ""
        return f"after {action}: full slot {slot} is free and still has SWA peer {peers[slot]} / a free full slot has none{more}"
    return None


def swa_tree_sizes_balance(evictable: int, protected: int, live: int, action: str) -> str | None:
    """``swa_evictable_size() + swa_protected_size()`` is the number of tree
    slots whose SWA is live (that have a peer); a tombstoned node's slots
    have none."""
    if evictable + protected == live:
        return None
    return (
        f"after {action}: swa_evictable_size() {evictable} + swa_protected_size() {protected} = {evictable + protected}"
        f" / the tree holds {live} slots with an SWA peer"
    )


# Run after every action, in this order; the first that fails is reported.
CENSUS = (free_list_has_no_repeats, tree_holds_each_slot_once, census_covers_pool, protected_prefix_is_locked_path, tree_sizes_balance)
# Also run on an SWA cache, after CENSUS; the SWA pool's cover is census_covers_pool
# over the SWA free list, the open group's SWA queue and the peers.
SWA_CENSUS = (swa_peers_are_a_partial_bijection, free_full_slots_have_no_peer, swa_tree_sizes_balance)
