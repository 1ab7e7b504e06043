"""Named predicates over the model and an allocator's census, in plain values.

Each returns ``None`` when it holds, else a message that shows both sides:
what the allocator says, then what the model says.  ``CHECKS`` run after
every step, on every pool a harness checks (the SWA pool too, each name then
prefixed ``swa_``); the rest judge what one call returned.  The harness
reports a failure under the predicate's own name.
"""

from __future__ import annotations

from collections import Counter

from reference_model.census import Census, as_census
from reference_model.model import CACHE, QUEUED, REQUEST, OwnershipModel


def _show(pages) -> str:
    pages = sorted(pages)
    shown = ", ".join(map(str, pages[:12]))
    return f"[{shown}{', ...' if len(pages) > 12 else ''}]"


def no_page_freed_twice(census: Census | list[int], available: int, page_size: int, model: OwnershipModel) -> str | None:
    if twice := as_census(census).repeats():
        return f"pages {_show(twice)} are in the allocator's free list more than once / once each"
    return None


def free_sets_agree(census: Census | list[int], available: int, page_size: int, model: OwnershipModel) -> str | None:
    census = as_census(census)
    if census.lists_free_of(model):
        return None
    got, want = census.distinct(), model.free_pages
    differ = _differences(got, want, "free in allocator, held in model", "free in model, missing from allocator",
                          lambda extra: _describe(extra, model))
    return f"allocator free set ({len(got)}) / model free set ({len(want)}): {differ}"


def _differences(got: set, want: set, extra_is: str, missing_is: str, show_extra=None) -> str:
    """``got``'s pages ``want`` lacks and ``want``'s ``got`` lacks, each
    named, ``; ``-joined (``show_extra`` shows the first kind)."""
    parts = []
    if extra := got - want:
        parts.append(f"{extra_is}: {(show_extra or _show)(extra)}")
    if missing := want - got:
        parts.append(f"{missing_is}: {_show(missing)}")
    return "; ".join(parts)


_OUTSIDE = "outside the pool"


def _describe(pages, model: OwnershipModel) -> str:
    owners = Counter(str(model.owner.get(p, _OUTSIDE)) for p in pages)
    return f"{_show(pages)} (" + ", ".join(f"{n} {who}" if who == _OUTSIDE else f"{n} of {who}"
                                           for who, n in sorted(owners.items())) + ")"


def eviction_accounting_balances(census: Census | list[int], available: int, page_size: int, model: OwnershipModel) -> str | None:
    # What the pool physically gained back since it started, against what the
    # cache and requests logically gave back.
    ledger = model.ledger
    physically_freed = len(census) - ledger.initial_free + ledger.allocated
    logical = ledger.evicted + ledger.freed
    if physically_freed == logical:
        return None
    return f"logical evicted {ledger.evicted} + freed {ledger.freed} = {logical} / physically freed {physically_freed}"


def slots_conserved(census: Census | list[int], available: int, page_size: int, model: OwnershipModel) -> str | None:
    census = as_census(census)
    counts = model.counts()
    free = census.num_distinct()
    # ``get``: a Counter's missing key costs a Python ``__missing__`` call.
    total = free + counts.get(REQUEST, 0) + counts.get(CACHE, 0) + counts.get(QUEUED, 0)
    if total == model.capacity and census.within(model):
        return None
    outside = census.distinct() - model.owner.keys()
    return (
        f"free {free} + requests {counts[REQUEST]} + cache {counts[CACHE]} + queued {counts[QUEUED]}"
        f" = {total} / capacity {model.capacity}"
        + (f"; free pages outside the pool: {_show(outside)}" if outside else "")
    )


def available_size_agrees(census: Census | list[int], available: int, page_size: int, model: OwnershipModel) -> str | None:
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


def answer_is_a_count(what: str, got) -> str | None:
    """A method that answers a count (``available_size()``, ...) returns a
    number ``int()`` takes (an int, a 0-d tensor, a float as ever)."""
    try:
        int(got)
    except Exception:  # noqa: BLE001 - whatever int() of the answer raises
        return f"{what} returned {type(got).__name__} {repr(got)[:80]} / a number"
    return None


def fresh_pool_lists_every_page(initial: list[int], pages: int | None) -> str | None:
    """A fresh pool of ``pages`` pages lists pages 1..``pages`` free, as
    sglang's allocators start (page 0 is the padding page, which the caller
    writes and no request owns).  The model starts from this census: a
    pool that began with page 0, a page past its end, or a page missing
    would otherwise be taken for the pool itself.  A page listed twice is
    ``no_page_freed_twice``'s, checked next.  ``pages`` None: the pool's
    size is not known (a factory that takes no ``size``), and only that no
    page below 1 is free is checked."""
    got = set(initial)
    if pages is None:
        if below := {p for p in got if p < 1}:
            return f"fresh allocator's free pages ({len(got)}) / pages from 1: not pages of the pool: {_show(below)}"
        return None
    want = set(range(1, pages + 1))
    if got == want:
        return None
    return f"fresh allocator's free pages ({len(got)}) / pages 1..{pages}: " + _differences(
        got, want, "not pages of the pool", "missing")


def no_slot_handed_out_twice(pages: list[int], model: OwnershipModel) -> str | None:
    """Checked after every alloc: each page handed out was free, and only once."""
    # Counted only where some page repeats (a set is a C pass; a Counter is not).
    twice = sorted(p for p, n in Counter(pages).items() if n > 1) if len(set(pages)) != len(pages) else []
    # Read once: a model may build its owner map on each read (SWASide).
    owner, free = model.owner, model.free
    held = [p for p in pages if p in owner and p not in free]
    outside = [p for p in pages if p not in owner]
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


# -- what one call returned --


def alloc_returns_index_tensor(what: str, got: str, want: str) -> str | None:
    """An alloc returns ``None`` or an integer tensor on the pool's device, of
    the length asked for.  ``got`` and ``want`` describe it, e.g.
    ``"tensor int64 cpu [8]"``."""
    if got == want:
        return None
    return f"{what} returned {got} / {want}"


def alloc_none_iff_short(what: str, got_none: bool, got_slots: int, short: bool, num_free: int, want: int) -> str | None:
    """``None`` exactly when the model has fewer than ``want`` free pages."""
    if got_none == short:
        return None
    got = "None" if got_none else f"{got_slots} slots"
    only = "only " if short else ""
    return f"{what} returned {got} / model has {only}{num_free} free pages, needs {want}"


def alloc_returns_whole_pages(n: int, slots: list[int], page_size: int) -> str | None:
    """``n`` slots in whole pages: slot ``i`` sits at offset ``i % page_size``
    of the page its page's first slot is on."""
    ps = page_size
    whole = len(slots) == n and all(
        slots[i] // ps == slots[i - i % ps] // ps and slots[i] % ps == i % ps for i in range(len(slots))
    )
    if whole:
        return None
    return f"alloc({n}) returned {slots[:16]} / {n} slots in whole pages of {ps}"


def decode_takes_page_boundary(what: str, names: list[str], needs: list[bool], last: list[int], slots: list[int], page_size: int) -> str | None:
    """A request that starts a page gets a page's first slot; any other gets
    the slot after its last one."""
    for name, need, prev, slot in zip(names, needs, last, slots):
        if need and slot % page_size:
            return f"{what} gave {name} slot {slot} mid-page / the first slot of a new page of {page_size}"
        if not need and slot != prev + 1:
            return f"{what} gave {name} slot {slot} / the next slot of its page, {prev + 1}"
    return None


# -- extend: alloc_extend (or alloc() at page size 1) for a batch --
#
# Each judges one batch: ``names``, ``prefix_lens`` (tokens before), ``last``
# (each request's last slot, -1 when it has none) and ``slots`` (what the
# call returned, split by request in batch order).


def _spare(prefix_len: int, page_size: int) -> int:
    """Slots left on the page a prefix of ``prefix_len`` tokens ends in."""
    return -prefix_len % page_size


def extend_continues_last_page(
    what: str, names: list[str], prefix_lens: list[int], last: list[int], slots: list[list[int]], page_size: int
) -> str | None:
    """A request whose prefix ends mid-page first fills that page: its first
    slots are ``last + 1, last + 2, ...`` up to the page's end."""
    for name, prefix_len, prev, got in zip(names, prefix_lens, last, slots):
        cont = min(len(got), _spare(prefix_len, page_size))
        want = [prev + 1 + j for j in range(cont)]
        if got[:cont] != want:
            return (f"{what} gave {name} (prefix {prefix_len} tokens, last slot {prev}) {got[:cont]} first"
                    f" / the rest of its last page, {want}")
    return None


def extend_takes_whole_new_pages(
    what: str, names: list[str], prefix_lens: list[int], slots: list[list[int]], page_size: int
) -> str | None:
    """Past its last page, a request's slots fill new pages in order, each
    from its first slot (slot ``i`` of a page at offset ``i``); the last may
    be partly used.  (That they are free, and that the allocator takes them
    off its free list, ``no_slot_handed_out_twice`` and the census judge.)"""
    ps = page_size
    for name, prefix_len, got in zip(names, prefix_lens, slots):
        rest = got[min(len(got), _spare(prefix_len, ps)):]
        if not all(rest[i] % ps == i % ps and rest[i] // ps == rest[i - i % ps] // ps for i in range(len(rest))):
            return (f"{what} gave {name} {rest[:16]} past its last page"
                    f" / {len(rest)} slots filling {-(-len(rest) // ps)} whole new pages of {ps} in order")
    return None


# -- hybrid (full + SWA) pools --


def _page_map(swa_page: int, filled: int, page_size: int) -> list[int]:
    """A full page's mapping: its first ``filled`` slots onto ``swa_page``
    slot by slot, the rest onto nothing (0)."""
    return [swa_page * page_size + k if k < filled else 0 for k in range(page_size)]


def swa_new_pages_mapped(what: str, full_pages: list[int], got: list[list[int]], filled: list[int], page_size: int) -> str | None:
    """Each full page a step handed out maps its first ``filled[i]`` slots,
    slot by slot, onto one SWA page (never the padding page 0) and the rest
    onto nothing; a page with ``filled[i] == 0`` (before an
    ``alloc_extend_swa_tail``'s tail) maps onto nothing at all.  ``got[i]``
    is the allocator's mapping of page ``full_pages[i]``'s slots."""
    ps = page_size
    for page, slots, fill in zip(full_pages, got, filled):
        swa_page = slots[0] // ps if fill else 0
        if slots != _page_map(swa_page, fill, ps) or (fill and swa_page == 0):
            want = f"{fill} slots onto one SWA page, the rest onto nothing" if fill else "nothing"
            return f"{what} mapped full page {page}'s slots to SWA slots {slots} / {want}"
    return None


def hybrid_available_size_agrees(available: int, full_available: int, swa_available: int) -> str | None:
    if available == min(full_available, swa_available):
        return None
    return f"available_size() {available} / min(full {full_available}, SWA {swa_available})"


def swa_mapping_consistent(mapping: list[int], page_size: int, full, swa, swa_free: Census | set[int],
                           pages: list[int] | None = None) -> str | None:
    """Every live full page with a live window maps, slot by slot, to its SWA
    page, which is not free (a partly used page only the slots its tokens
    use, the rest to nothing); a page whose release (or whose SWA peer's) is
    queued in the open group maps to that queued SWA page or to nothing;
    every other full page maps to nothing.  ``full`` is the full pool's
    ``OwnershipModel``, ``swa`` its ``SWASide``, ``swa_free`` the SWA pool's
    census.  ``pages``: the full pages to read (None: every one); a harness
    passes fewer only where it has seen the rest hold."""
    ps = page_size
    if isinstance(swa_free, Census):
        swa_free = swa_free.distinct()

    def maps_to(page: int, got: list[int], swa_page: int, alternative: str) -> str | None:
        want = _page_map(swa_page, swa.filled_slots(page, ps), ps)
        if got != want:
            return f"full page {page} ({full.owner[page]}) maps to SWA slots {got} / {alternative}its SWA page {swa_page}: {want}"
        if swa_page in swa_free:
            return f"full page {page} ({full.owner[page]}) maps to SWA page {swa_page}, free in the SWA pool / {alternative}its SWA page, held"
        return None

    for page in sorted(full.owner) if pages is None else pages:
        got = mapping[page * ps : (page + 1) * ps]
        if page in swa.mapping:
            problem = maps_to(page, got, swa.mapping[page], "")
        elif page in swa.pending_map and any(got):
            # The allocator may clear the mapping at free time or at
            # free_group_end(); until then only the queued peer will do.
            problem = maps_to(page, got, swa.pending_map[page], "nothing or ")
        elif any(got):
            why = "its window slid" if full.owner[page].kind != "free" else "it is free"
            problem = f"full page {page} ({full.owner[page]}) maps to SWA slots {got} / nothing: {why}"
        else:
            problem = None
        if problem:
            return problem
    return None


# -- pure-SWA, HiSparse and Mamba pools --


def pool_available_size_agrees(available: int, pool_available: int, pool: str) -> str | None:
    """A wrapper over one pool reports that pool's ``available_size()``."""
    if available == pool_available:
        return None
    return f"available_size() {available} / {pool}.available_size() {pool_available}"


def _whole_pages(slots: list[int], page_size: int) -> bool:
    """Slot ``i`` sits at offset ``i % page_size`` of one page per run of ``page_size``."""
    ps = page_size
    return all(slots[i] % ps == i % ps and slots[i] // ps == slots[i - i % ps] // ps for i in range(len(slots)))


def hisparse_alloc_maps_whole_pages(what: str, logical_slots: list[int], device_slots: list[int], page_size: int) -> str | None:
    """Each new logical page maps, slot by slot, onto one whole device page,
    never onto the padding page 0."""
    if _whole_pages(device_slots, page_size) and all(s >= page_size for s in device_slots):
        return None
    return f"{what} mapped logical slots {logical_slots[:16]} to device slots {device_slots[:16]} / whole device pages past page 0"


def hisparse_available_size_agrees(available: int, logical_available: int, device_available: int) -> str | None:
    if available == min(logical_available, device_available):
        return None
    return f"available_size() {available} / min(logical {logical_available}, device {device_available})"


def hisparse_mapping_consistent(mapping: list[int], page_size: int, logical, device,
                                pages: list[int] | None = None) -> str | None:
    """Every logical page with a device peer maps, slot by slot, onto it;
    every other logical page maps to nothing; the entry past the pool
    (what a ``last_loc`` of -1 reads) stays -1.  ``logical`` is the logical
    pool's ``OwnershipModel``, ``device`` its ``DeviceSide``; ``pages`` as
    ``swa_mapping_consistent``'s."""
    ps = page_size
    if mapping[-1] != -1:
        return f"the mapping's last entry is {mapping[-1]} / -1, what a last_loc of -1 translates to"
    for page in sorted(logical.owner) if pages is None else pages:
        got = mapping[page * ps : (page + 1) * ps]
        if page in device.mapping:
            peer = device.mapping[page]
            # A page an extend left partly used maps only its tokens' slots.
            want = _page_map(peer, device.filled_slots(page, ps), ps)
            if got != want:
                return f"logical page {page} ({logical.owner[page]}) maps to device slots {got} / its device page {peer}: {want}"
        elif any(got):
            return f"logical page {page} ({logical.owner[page]}) maps to device slots {got} / nothing: it has no device page"
    return None


def device_buffer_keeps_token_slots(what: str, got: list[int], kept: list[int], n: int, page_size: int) -> str | None:
    """``alloc_device_buffer(row, n)`` returns ``n`` slots: first the device
    slots of the row's tokens that had one (``kept`` pages, in row order,
    as many as fit), then whole fresh pages."""
    ps = page_size
    want = [p * ps + k for p in kept for k in range(ps)]
    if len(got) == n and got[: len(want)] == want and _whole_pages(got[len(want) :], ps):
        return None
    return f"{what} returned {got[:16]} ({len(got)} slots) / {n} slots, starting with the row's device slots {want[:16]}"


def compressed_new_pages_mapped(what: str, pages: list[int], got: list[list[int]], filled: list[int], c4_page_size: int) -> str | None:
    """Each logical page whose first compressed token a step wrote maps its
    first ``filled[i]`` compressed slots, slot by slot, onto one device page
    (never the padding page 0), the rest onto nothing.  ``got[i]`` is the
    allocator's mapping of page ``pages[i]``'s compressed slots."""
    hps = c4_page_size
    for page, slots, fill in zip(pages, got, filled):
        device_page = slots[0] // hps
        if slots != _page_map(device_page, fill, hps) or device_page == 0:
            return f"{what} mapped logical page {page}'s (compressed) slots to device slots {slots} / {fill} onto one device page past page 0, the rest onto nothing"
    return None


def compressed_mapping_consistent(mapping: list[int], c4_page_size: int, logical, device,
                                  pages: list[int] | None = None) -> str | None:
    """Every logical page with a device peer maps its first ``filled``
    compressed slots onto it, slot by slot, the rest onto nothing; a page
    whose release is queued in the open group maps to its queued peer or to
    nothing; every other page maps to nothing; the entry past the pool stays
    -1 (what a ``last_loc`` of -1 translates to).  ``logical`` is the full
    pool's ``OwnershipModel``, ``device`` its ``DeviceSide`` (in compressed
    pages); ``pages`` as ``swa_mapping_consistent``'s."""
    hps = c4_page_size
    if mapping[-1] != -1:
        return f"the mapping's last entry is {mapping[-1]} / -1, what a last_loc of -1 translates to"
    for page in sorted(logical.owner) if pages is None else pages:
        got = mapping[page * hps : (page + 1) * hps]
        peer = device.mapping.get(page)
        if peer is None and any(got):
            peer = device.pending_map.get(page)
        if peer is None:
            if any(got):
                return f"logical page {page} ({logical.owner[page]}) maps to device slots {got} / nothing: it has no device page"
            continue
        want = _page_map(peer, device.filled_slots(page, hps), hps)
        if got != want:
            return f"logical page {page} ({logical.owner[page]}) maps to device slots {got} / its device page {peer}: {want}"
    return None


def compressed_available_size_agrees(available: int, logical_available: int, device_available: int, ratio: int) -> str | None:
    if available == min(logical_available, device_available * ratio):
        return None
    return f"available_size() {available} / min(logical {logical_available}, device {device_available} x {ratio})"


def device_buffer_slots_distinct(what: str, got: list[int]) -> str | None:
    """A device buffer's slots are distinct: two buffer positions on one
    device slot would write one token's KV over another's."""
    if twice := sorted(s for s, k in Counter(got).items() if k > 1):
        return f"{what} returned slots {_show(twice)} more than once ({got[:16]}) / {len(got)} distinct slots"
    return None


def device_buffer_as_planned(what: str, got: list[int], head: list[int], n: int, c4_page_size: int) -> str | None:
    """``alloc_device_buffer(row, n)`` returns ``n`` slots: first ``head``
    (the row's device slots, the newest at the reserved page's start, the
    last page completed; ``buffer_plan``), then whole fresh pages."""
    if len(got) == n and got[: len(head)] == head and _whole_pages(got[len(head) :], c4_page_size):
        return None
    return f"{what} returned {got[:16]} ({len(got)} slots) / {n} slots, starting with {head[:16]}"


def slots_were_available(pages: list[int], model) -> str | None:
    """Checked after every alloc of a pool with allocation groups: each slot
    handed out was reserved by the open group and not yet drawn, or free
    (``no_slot_handed_out_twice``), and only once."""
    reserve = set(model.reserved or ())
    drawn = [p for p in pages if p in reserve]
    if twice := sorted(p for p, n in Counter(drawn).items() if n > 1):
        return f"alloc handed out reserved slots {_show(twice)} twice in one alloc / once each"
    return no_slot_handed_out_twice([p for p in pages if p not in reserve], model)


def alloc_group_reserves(n: int, left: list[int], entered: list[int], num_free: int) -> str | None:
    """``alloc_group_begin(n)`` takes exactly ``n`` slots out of the free
    list when ``n`` are free (at most the free ones otherwise), and puts none in."""
    fits = len(left) == n if n <= num_free else len(left) <= num_free
    if fits and not entered:
        return None
    extra = f"; slots that became free: {_show(entered)}" if entered else ""
    want = f"{n}" if n <= num_free else f"at most {num_free} (only {num_free} free)"
    return f"alloc_group_begin({n}) reserved {len(left)} slots {_show(left)}{extra} / {want}, none freed"
