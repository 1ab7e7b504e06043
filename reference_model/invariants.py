"""Named predicates over the model and an allocator's census, in plain values.

Each returns ``None`` when it holds, else a message that shows both sides:
what the allocator says, then what the model says.
"""

from __future__ import annotations

from collections import Counter

from reference_model.model import CACHE, QUEUED, REQUEST, OwnershipModel


def _show(pages) -> str:
    pages = sorted(pages)
    shown = ", ".join(map(str, pages[:12]))
    return f"[{shown}{', ...' if len(pages) > 12 else ''}]"


def no_page_freed_twice(census: list[int], available: int, page_size: int, model: OwnershipModel) -> str | None:
    twice = sorted(p for p, n in Counter(census).items() if n > 1)
    if twice:
        return f"pages {_show(twice)} are in the allocator's free list more than once / once each"
    return None


def free_sets_agree(census: list[int], available: int, page_size: int, model: OwnershipModel) -> str | None:
    got, want = set(census), model.free_pages
    if got == want:
        return None
    parts = []
    if extra := got - want:
        parts.append(f"free in allocator, held in model: {_describe(extra, model)}")
    if missing := want - got:
        parts.append(f"free in model, missing from allocator: {_show(missing)}")
    return f"allocator free set ({len(got)}) / model free set ({len(want)}): " + "; ".join(parts)


def _describe(pages, model: OwnershipModel) -> str:
    owners = Counter(str(model.owner.get(p, "outside the pool")) for p in pages)
    return f"{_show(pages)} (" + ", ".join(f"{n} of {who}" for who, n in sorted(owners.items())) + ")"


def eviction_accounting_balances(census: list[int], available: int, page_size: int, model: OwnershipModel) -> str | None:
    # What the pool physically gained back since it started, against what the
    # cache and requests logically gave back.
    physically_freed = len(census) - model.initial_free + model.allocated
    logical = model.evicted + model.freed
    if physically_freed == logical:
        return None
    return f"logical evicted {model.evicted} + freed {model.freed} = {logical} / physically freed {physically_freed}"


def slots_conserved(census: list[int], available: int, page_size: int, model: OwnershipModel) -> str | None:
    counts = model.counts()
    total = len(set(census)) + counts[REQUEST] + counts[CACHE] + counts[QUEUED]
    if total == model.capacity and set(census) <= model.owner.keys():
        return None
    outside = set(census) - model.owner.keys()
    return (
        f"free {len(set(census))} + requests {counts[REQUEST]} + cache {counts[CACHE]} + queued {counts[QUEUED]}"
        f" = {total} / capacity {model.capacity}"
        + (f"; free pages outside the pool: {_show(outside)}" if outside else "")
    )


def available_size_agrees(census: list[int], available: int, page_size: int, model: OwnershipModel) -> str | None:
    if available == len(census) * page_size:
        return None
    return f"available_size() {available} / census {len(census)} pages x {page_size} = {len(census) * page_size}"


def model_consistent(census: list[int], available: int, page_size: int, model: OwnershipModel) -> str | None:
    problems = model.violations()
    return "; ".join(problems) if problems else None


# Checked after every step, in this order: the first that fails is reported.
CHECKS = (
    no_page_freed_twice,
    free_sets_agree,
    eviction_accounting_balances,
    slots_conserved,
    available_size_agrees,
    model_consistent,
)


def no_slot_handed_out_twice(pages: list[int], model: OwnershipModel) -> str | None:
    """Checked after every alloc: each page handed out was free, and only once."""
    twice = sorted(p for p, n in Counter(pages).items() if n > 1)
    free = model.free_pages
    held = [p for p in pages if p in model.owner and p not in free]
    outside = [p for p in pages if p not in model.owner]
    if not (twice or held or outside):
        return None
    parts = []
    if twice:
        parts.append(f"pages {_show(twice)} twice in one alloc")
    if held:
        parts.append(f"pages already held: {_describe(held, model)}")
    if outside:
        parts.append(f"pages outside the pool: {_show(outside)}")
    return "alloc handed out " + "; ".join(parts) + " / only free pages, once each"
