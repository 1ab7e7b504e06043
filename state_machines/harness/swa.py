"""The lockstep harness for sliding-window hybrid pools (the "swa" family).

``SWALockstep`` drives the full pool against the core ``OwnershipModel`` and
the SWA pool against ``SWASide``, and after every step checks both pools the
way the core checks one, plus the full-to-SWA mapping.  Each span it frees
is split as sglang's callers split it: ``free_full`` for pages whose window
already slid, ``free`` for the rest (slid pages are always the oldest).

The target must offer sglang's SWA names: ``full_attn_allocator`` and
``swa_attn_allocator`` (each with a census), ``full_to_swa_index_mapping``,
``free_swa`` and ``free``; ``free_full``, ``free_segment``,
``free_swa_segment`` and ``free_full_segment`` are used where it has them
(older sglang has only ``free`` and ``free_swa``: its ``free()`` skips slots
whose window slid, so it stands in for ``free_full``).  An adapter for
sglang's own SWA classes (``sglang:swa``) plugs in by giving its factory
``family = "swa"``.
"""

from __future__ import annotations

import copy

import attrs
import torch
from attrs import define

from reference_model import CHECKS, no_slot_handed_out_twice
from reference_model.swa import SWASide
from state_machines.harness.lockstep import EntryRef, Lockstep, ReqRef, _ids, census_of


@define
class SWALockstep(Lockstep):
    swa: SWASide | None = None
    # While set, check() waits: a base step is half done on the SWA side.
    holding: bool = False
    # Whether free_swa() inside an open group queues the SWA release (see
    # free_swa_defers); a free() queues it either way.
    swa_defers: bool = True

    def pool(self):
        return self.allocator.full_attn_allocator

    @classmethod
    def build(cls, config=None, **overrides) -> SWALockstep:
        state = super().build(config, **overrides)
        initial = state._call("swa census", census_of, state.allocator.swa_attn_allocator)
        state.swa = SWASide.from_census(state.model, sorted(set(initial)))
        state.swa_defers = free_swa_defers(state.allocator)
        state.check()
        return state

    # -- checks --

    def check(self) -> None:
        if self.holding:
            return
        a = self.allocator
        full = self._call("full census", census_of, a.full_attn_allocator)
        full_available = self._call("full_available_size()", a.full_attn_allocator.available_size)
        for predicate in CHECKS:
            if problem := predicate(full, int(full_available), self.page_size, self.model):
                self._fail(predicate.__name__, "full pool: " + problem)
        if self.swa is None:
            return
        swa = self._call("SWA census", census_of, a.swa_attn_allocator)
        swa_available = self._call("swa_available_size()", a.swa_attn_allocator.available_size)
        for predicate in CHECKS:
            if problem := predicate(swa, int(swa_available), self.page_size, self.swa):
                self._fail("swa_" + predicate.__name__, "SWA pool: " + problem)
        if problem := self._mapping_problem(set(swa)):
            self._fail("swa_mapping_consistent", problem)
        available = int(self._call("available_size()", a.available_size))
        if available != min(int(full_available), int(swa_available)):
            self._fail("available_size_agrees", f"available_size() {available} / min(full {full_available}, SWA {swa_available})")

    def _mapping_problem(self, swa_free: set[int]) -> str | None:
        """Every live full page with a live window maps, slot by slot, to its
        SWA page, which is not free; a page whose release (or whose SWA
        peer's) is queued in the open group maps to that queued SWA page or
        to nothing; every other full page maps to nothing."""
        ps = self.page_size
        mapping = _ids(self.allocator.full_to_swa_index_mapping)
        for page in sorted(self.model.owner):
            got = mapping[page * ps : (page + 1) * ps]
            if page in self.swa.mapping:
                problem = self._maps_to(page, got, self.swa.mapping[page], swa_free, "")
            elif page in self.swa.pending_map and any(got):
                # The allocator may clear the mapping at free time or at
                # free_group_end(); until then only the queued peer will do.
                problem = self._maps_to(page, got, self.swa.pending_map[page], swa_free, "nothing or ")
            elif any(got):
                why = "its window slid" if self.model.owner[page].kind != "free" else "it is free"
                problem = f"full page {page} ({self.model.owner[page]}) maps to SWA slots {got} / nothing: {why}"
            else:
                problem = None
            if problem:
                return problem
        return None

    def _maps_to(self, page: int, got: list[int], swa_page: int, swa_free: set[int], alternative: str) -> str | None:
        """Full ``page`` maps slot by slot to ``swa_page``, which is not free."""
        ps = self.page_size
        want = [swa_page * ps + k for k in range(ps)]
        if got != want:
            return f"full page {page} ({self.model.owner[page]}) maps to SWA slots {got} / {alternative}its SWA page {swa_page}: {want}"
        if swa_page in swa_free:
            return f"full page {page} ({self.model.owner[page]}) maps to SWA page {swa_page}, free in the SWA pool / {alternative}its SWA page, held"
        return None

    def _held(self, fn, *args, **kwargs):
        """Run a base step without its final check, which the SWA side must precede."""
        self.holding = True
        try:
            return fn(*args, **kwargs)
        finally:
            self.holding = False

    # -- steps --

    def _short(self, pages: int) -> bool:
        return self.model.num_free < pages or self.swa.num_free < pages

    def alloc(self, n: int, req: ReqRef | None = None, prefix: EntryRef | None = None) -> ReqRef | None:
        made = self._held(super().alloc, n, req=req, prefix=prefix)
        if made is None:
            self.check()
            return None
        ps = self.page_size
        full_pages = self.model.requests[made.rid].own[-(n // ps):]
        full_slots = torch.tensor([p * ps + k for p in full_pages for k in range(ps)], dtype=torch.int64)
        swa_slots = _ids(self.allocator.full_to_swa_index_mapping.to("cpu")[full_slots])
        whole = all(swa_slots[i] % ps == i % ps and swa_slots[i] // ps == swa_slots[i - i % ps] // ps for i in range(len(swa_slots)))
        if not whole or 0 in swa_slots:
            self._fail("swa_alloc_maps_whole_pages", f"alloc({n}) mapped full slots {full_slots.tolist()[:16]} to SWA slots {swa_slots[:16]} / whole SWA pages")
        swa_pages = [swa_slots[i] // ps for i in range(0, len(swa_slots), ps)]
        if problem := no_slot_handed_out_twice(swa_pages, self.swa):
            self._fail("swa_no_slot_handed_out_twice", "SWA pool: " + problem)
        self.swa.take(full_pages, swa_pages)
        self.check()
        return made

    def begin(self) -> None:
        self._held(super().begin)
        self.swa.begin()
        self.check()

    def end(self) -> None:
        self._held(super().end)
        self.swa.end()
        self.check()

    def free(self, req: ReqRef, n: int) -> None:
        self._record("free", req=req, n=n)
        row, length = self._row_of(req)
        pages = self.model.requests[req.rid].own[len(self.model.requests[req.rid].own) - n // self.page_size :]
        self._free_split(row, length - n, length, pages, segment=False)
        self.swa.release(pages, "free")
        self.model.release_tail(req.rid, n // self.page_size)
        self.check()

    def free_segment(self, req: ReqRef, start: int, n: int) -> None:
        self._record("free_segment", req=req, start=start, n=n)
        ps = self.page_size
        request = self.model.requests[req.rid]
        row, length = self._row_of(req)
        pages = request.pages[start // ps :]
        self._free_split(row, start, start + n, pages, segment=True)
        self.swa.release(pages, "free")
        self.model.release_tail(req.rid, length // ps - start // ps)
        self.check()

    def finish(self, req: ReqRef) -> None:
        self._record("finish", req=req)
        request = self.model.requests[req.rid]
        row, length = self._row_of(req)
        protected = len(request.prefix) * self.page_size
        self._free_split(row, protected, length, request.own, segment=False)
        self.swa.release(request.own, "free")
        self.model.finish(req.rid)
        self.row_holder[row] = None
        self.check()

    def rematch(self, req: ReqRef, dup: int, entry: EntryRef | None = None) -> EntryRef | None:
        step = self._record("rematch", req=req, dup=dup, entry=entry)
        ps = self.page_size
        request = self.model.requests[req.rid]
        row, length = self._row_of(req)
        protected = len(request.prefix) * ps
        dup_end = protected + dup * ps
        new_slots = self.rows[row, dup_end:length].clone()
        if dup:
            dup_pages = request.own[:dup]
            self._free_split(row, protected, dup_end, dup_pages, segment=True)
            self.swa.release(dup_pages, "free")
            self.rows[row, protected:dup_end] = self.entry_slots[entry.eid][: dup * ps]
        return self._cache_rest(step, req, dup, entry, new_slots)

    def evict(self, entry: EntryRef) -> None:
        self._record("evict", entry=entry)
        slots = self.entry_slots.pop(entry.eid)
        pages = self.model.cache[entry.eid].pages
        dead = self._slid(pages) * self.page_size
        if dead:
            name, fn = self._free_full_fn()
            self._call(f"{name}({entry!r} slots[:{dead}])", fn, slots[:dead])
        if dead < len(slots):
            self._call(f"free({entry!r} slots[{dead}:])", self.allocator.free, slots[dead:])
        self.swa.release(pages, "evict")
        self.model.evict(entry.eid)
        self.check()

    def slide(self, req: ReqRef, pages: int, segment: bool = False) -> None:
        """The window slides past the request's ``pages`` oldest own pages
        that still have an SWA side: ``free_swa`` (or ``free_swa_segment``)
        of a view of them."""
        self._record("slide", req=req, pages=pages, segment=segment)
        ps = self.page_size
        request = self.model.requests[req.rid]
        first = len(request.prefix) + self._slid(request.own)
        row = request.row
        start, end = first * ps, (first + pages) * ps
        view = self.rows[row, start:end]
        if segment and callable(getattr(self.allocator, "free_swa_segment", None)):
            self._call(f"free_swa_segment(req_to_token[{row}, {start}:{end}], start_pos={start})",
                       lambda: self.allocator.free_swa_segment(view, start_pos=start))
        else:
            self._call(f"free_swa(req_to_token[{row}, {start}:{end}])", self.allocator.free_swa, view)
        self.swa.release(request.pages[first : first + pages], "evict", defer=self.swa_defers)
        self.check()

    def evict_swa(self, entry: EntryRef) -> None:
        """The cache drops the SWA side of an unlocked entry (a tombstone):
        ``free_swa`` of its slots that still have one."""
        self._record("evict_swa", entry=entry)
        pages = self.model.cache[entry.eid].pages
        dead = self._slid(pages) * self.page_size
        slots = self.entry_slots[entry.eid][dead:]
        self._call(f"free_swa({entry!r} slots[{dead}:])", self.allocator.free_swa, slots)
        self.swa.release(pages, "evict", defer=self.swa_defers)
        self.check()

    # -- what the SWA rules may act on --

    def slidable(self) -> list[ReqRef]:
        return [ReqRef(r.rid) for r in self.model.requests.values() if self.live_own(ReqRef(r.rid))]

    def live_own(self, req: ReqRef) -> int:
        own = self.model.requests[req.rid].own
        return len(own) - self._slid(own)

    def swa_evictable(self) -> list[EntryRef]:
        return [e for e in self.evictable() if any(self.swa.live(p) for p in self.model.cache[e.eid].pages)]

    # -- helpers --

    def _slid(self, pages) -> int:
        """How many leading pages have no SWA side (slid pages are the oldest)."""
        count = 0
        for p in pages:
            if self.swa.live(p):
                break
            count += 1
        return count

    def _free_split(self, row: int, start: int, end: int, pages, *, segment: bool) -> None:
        """Free ``row[start:end]``: ``free_full`` for its slid pages, ``free`` for the rest."""
        if end <= start:
            return
        cut = min(start + self._slid(pages) * self.page_size, end)
        for lo, hi, full in ((start, cut, True), (cut, end, False)):
            if hi <= lo:
                continue
            view = self.rows[row, lo:hi]
            name, fn = self._free_full_fn(segment) if full else self._free_fn(segment)
            if name.endswith("_segment"):
                self._call(f"{name}(req_to_token[{row}, {lo}:{hi}], start_pos={lo})",
                           lambda fn=fn, view=view, lo=lo: fn(view, start_pos=lo))
            else:
                self._call(f"{name}(req_to_token[{row}, {lo}:{hi}])", fn, view)

    def _method(self, *names: str):
        """The first of ``names`` the allocator has: (name, bound method)."""
        for name in names:
            fn = getattr(self.allocator, name, None)
            if callable(fn):
                return name, fn
        raise AttributeError(f"{type(self.allocator).__name__} has none of {', '.join(names)}")

    def _free_fn(self, segment: bool = False):
        return self._method(*(["free_segment"] if segment and self.has_free_segment else []), "free")

    def _free_full_fn(self, segment: bool = False):
        """``free_full`` (or its segment form); where the allocator has none,
        ``free``, whose SWA half skips slots that map to nothing."""
        names = ["free_full_segment", "free_full"] if segment else ["free_full"]
        return self._method(*names, *(["free_segment"] if segment and self.has_free_segment else []), "free")


def free_swa_defers(allocator) -> bool:
    """Whether ``free_swa()`` inside an open free group queues the SWA
    release (True) or releases the slots at once (False), probed on a
    throwaway copy.  Both keep ownership sound: an immediate release frees
    exactly the slid slots and clears their mapping.  A probe that cannot
    run reads as queuing, the stricter model."""
    try:
        probe = copy.deepcopy(allocator)
        slots = probe.alloc(probe.page_size)
        if slots is None:
            return True
        before = int(probe.swa_attn_allocator.available_size())
        probe.free_group_begin()
        probe.free_swa(slots.clone())
        return int(probe.swa_attn_allocator.available_size()) == before
    except Exception:  # noqa: BLE001 - the run itself reports what raises
        return True


FAMILIES = {"swa": SWALockstep}


def lockstep_for_family(family: str) -> type[Lockstep]:
    from state_machines.targets import TargetError

    if family == "free_group":
        return Lockstep
    if family not in FAMILIES:
        raise TargetError(f"unknown allocator family '{family}'; known: free_group, {', '.join(FAMILIES)}")
    return FAMILIES[family]
