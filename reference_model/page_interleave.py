"""Owner classes of a page-interleaved pool, in plain Python (no torch).

sglang's ``PageInterleavePoolAllocator`` (logical-page KV sharding) keeps one
free set per owner class: logical page ``l`` belongs to class ``l % N``
(``N`` the shard size), whatever list it sits in.  A chain of pages (a
request's row) has a rotation base ``b``: its position-page ``P`` is drawn
from class ``(b + P) % N``.  A new chain's base is chosen by the allocator
(the least-full class, a balance policy this model does not predict) and
written back in place; a continuing chain's base is the caller's.

The model is the core ``OwnershipModel``; this module adds what classes
predict from its free set and the bases, never which page of a class comes
out first.  Each predicate returns ``None`` when it holds, else a message
showing the allocator's side, then the model's.
"""

from __future__ import annotations

from reference_model.model import FREE, KIND_CODES, OwnershipModel


def owner_class(page: int, shard_size: int) -> int:
    return page % shard_size


def chain_base(last_page: int, num_pages: int, shard_size: int) -> int:
    """The rotation base of a chain of ``num_pages`` (> 0) pages whose last
    page is ``last_page``: the base under which that page's position owns
    its class, as a consistent prefix tree keeps it."""
    return (owner_class(last_page, shard_size) - (num_pages - 1)) % shard_size


def class_counts(start_class: int, new_pages: int, shard_size: int) -> list[int]:
    """Pages each class gives a cyclic run of ``new_pages`` starting at
    ``start_class``: ``new_pages // N``, plus one for the first
    ``new_pages % N`` classes of the cycle."""
    return [
        new_pages // shard_size + (1 if (c - start_class) % shard_size < new_pages % shard_size else 0)
        for c in range(shard_size)
    ]


def class_free_counts(model: OwnershipModel, shard_size: int) -> list[int]:
    """Free pages per class, read off the model's free set (its owner
    map's per-id kind codes, one strided slice a class counted in C, where
    the model keeps them)."""
    codes = getattr(model.owner, "codes", None)
    if codes is not None:
        free = bytes([KIND_CODES[FREE]])
        return [codes[c::shard_size].count(free) for c in range(shard_size)]
    counts = [0] * shard_size
    for page in model.free:
        counts[owner_class(page, shard_size)] += 1
    return counts


def batch_class_needs(bases: list[int], prefix_pages: list[int], new_pages: list[int], shard_size: int) -> list[int]:
    """Pages each class gives a batch: request ``i`` takes ``new_pages[i]``
    pages from position ``prefix_pages[i]`` of the chain of base ``bases[i]``."""
    need = [0] * shard_size
    for base, start, n in zip(bases, prefix_pages, new_pages):
        for c, k in enumerate(class_counts((base + start) % shard_size, n, shard_size)):
            need[c] += k
    return need


# -- predicates --


def free_pages_in_own_class(class_lists: list[list[int]], shard_size: int) -> str | None:
    """Checked after every step: class ``r``'s free and released lists hold
    only pages ``l`` with ``l % N == r``."""
    for r, pages in enumerate(class_lists):
        strays = sorted(p for p in pages if owner_class(p, shard_size) != r)
        if strays:
            owners = sorted({owner_class(p, shard_size) for p in strays})
            return f"class {r}'s free list holds pages {strays[:12]} (of classes {owners}) / only pages l with l % {shard_size} == {r}"
    return None


def interleave_available_size_agrees(available: int, class_free: list[int], page_size: int, shard_size: int) -> str | None:
    """``available_size()`` is the min-class floor: ``N * page_size *`` the
    fewest free pages of any class (the model's per-class counts)."""
    want = shard_size * page_size * min(class_free)
    if available == want:
        return None
    return (f"available_size() {available} / {shard_size} classes x page {page_size} x fewest free in a class"
            f" {min(class_free)} (model's class counts {class_free}) = {want}")


def rotation_bases_resolved(what: str, given: list[int | None], got: list, shard_size: int) -> str | None:
    """After an ``alloc_extend`` that succeeded, each request's base is a
    class: a new chain's (given ``None``) drawn and written back in place,
    a continuing chain's the one the caller gave."""
    for i, (want, have) in enumerate(zip(given, got)):
        if not isinstance(have, int) or not 0 <= have < shard_size:
            return f"{what} left request {i}'s rotation base {have!r} / a class 0..{shard_size - 1} written back in place"
        if want is not None and have != want:
            return f"{what} changed request {i}'s rotation base to {have} / the caller's {want}"
    return None


def pages_follow_rotation(
    what: str, names: list[str], bases: list[int], prefix_pages: list[int], pages: list[list[int]], shard_size: int
) -> str | None:
    """Request ``i``'s new position-page ``P`` (counted from its chain's
    start) is a page of class ``(bases[i] + P) % N``."""
    for name, base, start, got in zip(names, bases, prefix_pages, pages):
        want = [(base + start + j) % shard_size for j in range(len(got))]
        have = [owner_class(p, shard_size) for p in got]
        if have != want:
            return (f"{what} gave {name} pages {got} of classes {have}"
                    f" / classes {want} (base {base}, from position-page {start})")
    return None


def none_iff_class_short(what: str, got_none: bool, need: list[int], class_free: list[int]) -> str | None:
    """``alloc_extend`` returns ``None`` exactly when some class has fewer
    free pages than the batch draws from it (under the bases it resolved)."""
    short = [c for c, (n, f) in enumerate(zip(need, class_free)) if n > f]
    if got_none == bool(short):
        return None
    got = "None" if got_none else "slots"
    why = f"class {short[0]} is short" if short else "every class can supply"
    return f"{what} returned {got} / model: {why} (needs per class {need}, free per class {class_free})"
