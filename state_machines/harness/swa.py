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
sglang's own SWA classes (``sglang:swa``), or any target whose factory
says ``family = "swa"`` or whose allocator has those two pools, runs here
(``family.py``).
"""

from __future__ import annotations

import copy

import torch
from attrs import define, field

from reference_model import SWASide, invariants
from reference_model.census import Census
from state_machines.harness.lockstep import Lockstep, Pool, census_of, ids
from state_machines.harness.machines import PICKS, FreeGroupMachine, _pick, draws
from state_machines.harness.steps import EntryRef, ReqRef, step


@define
class SWALockstep(Lockstep):
    swa: SWASide | None = None
    # Whether free_swa() inside an open group queues the SWA release (see
    # free_swa_defers); a free() queues it either way.
    swa_defers: bool = True
    # Checks this allocator does not offer, with the reason: sglang 0.5.8's
    # available_size() raises NotImplementedError by design (its callers ask
    # each pool), so the joint size is not checked; each pool's still is.
    skipped_checks: dict[str, str] = field(factory=dict)
    # Decode and extend would take SWA slots this harness does not model.
    caller_steps = ()

    def start_models(self, defers_frees: bool) -> None:
        super().start_models(defers_frees)
        initial = self._call("SWA census", census_of, self.allocator.swa_attn_allocator)
        self.swa = SWASide.from_census(self.model, sorted(set(initial)))
        self.swa_defers = free_swa_defers(self.allocator)
        try:
            self.allocator.available_size()
        except NotImplementedError as exc:
            said = f" ({exc})" if str(exc) else ""
            self.skipped_checks["hybrid_available_size_agrees"] = (
                f"available_size() raises NotImplementedError{said}; each pool's available_size() is still checked"
            )

    # -- checks --

    def pools(self) -> list[Pool]:
        a = self.allocator
        return [
            Pool(a.full_attn_allocator, self.model, "", "full pool: "),
            Pool(a.swa_attn_allocator, self.swa, "swa_", "SWA pool: "),
        ]

    def check_joint(self, censuses: list[Census]) -> None:
        """The mapping between the pools, and the joint available size."""
        a = self.allocator
        swa_free = censuses[1].distinct()
        mapping = ids(a.full_to_swa_index_mapping)
        self._judge(invariants.swa_mapping_consistent, mapping, self.page_size, self.model, self.swa, swa_free)
        if "hybrid_available_size_agrees" in self.skipped_checks:
            return
        self._judge(
            invariants.hybrid_available_size_agrees,
            int(self._call("available_size()", a.available_size)),
            int(self._call("full_available_size()", a.full_attn_allocator.available_size)),
            int(self._call("swa_available_size()", a.swa_attn_allocator.available_size)),
        )

    # -- steps --

    def _short(self, pages: int) -> bool:
        return self.model.num_free < pages or self.swa.num_free < pages

    @step
    def alloc(self, n: int, req: ReqRef | None = None, prefix: EntryRef | None = None) -> ReqRef | None:
        pool_short = self._short(n // self.page_size)
        made = super().alloc(n, req, prefix)
        if pool_short:
            return None
        ps = self.page_size
        full_pages = self.model.requests[(made or req).rid].own[-(n // ps):]
        full_slots = [p * ps + k for p in full_pages for k in range(ps)]
        swa_slots = ids(self.allocator.full_to_swa_index_mapping.to("cpu")[torch.tensor(full_slots, dtype=torch.int64)])
        self._judge(invariants.swa_alloc_maps_whole_pages, n, full_slots, swa_slots, ps)
        swa_pages = [swa_slots[i] // ps for i in range(0, len(swa_slots), ps)]
        self._judge(invariants.no_slot_handed_out_twice, swa_pages, self.swa, name="swa_no_slot_handed_out_twice", label="SWA pool: ")
        self.swa.take(full_pages, swa_pages)
        return made

    @step
    def begin(self) -> None:
        super().begin()
        self.swa.begin()

    @step
    def end(self) -> None:
        """``free_group_end()``, also when no group is open."""
        super().end()
        self.swa.end()

    def _give_back(self, row: int, start: int, end: int, pages: list[int], *, segment: bool) -> None:
        """``free_full`` for the span's slid pages, ``free`` for the rest;
        their live SWA peers go too."""
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
        self.swa.release(pages, "free")

    def _evict_slots(self, entry: EntryRef, slots, pages) -> None:
        dead = self._slid(pages) * self.page_size
        if dead:
            name, fn = self._free_full_fn()
            self._call(f"{name}({entry!r} slots[:{dead}])", fn, slots[:dead])
        if dead < len(slots):
            self._call(f"free({entry!r} slots[{dead}:])", self.allocator.free, slots[dead:])
        self.swa.release(pages, "evict")

    @step
    def slide(self, req: ReqRef, pages: int, segment: bool = False) -> None:
        """The window slides past the request's ``pages`` oldest own pages
        that still have an SWA side: ``free_swa`` (or ``free_swa_segment``)
        of a view of them."""
        ps = self.page_size
        request = self.model.requests[req.rid]
        first = len(request.prefix) + self._slid(request.own)
        row = request.row
        start, end = first * ps, (first + pages) * ps
        free_swa_view(self, row, start, end, segment)
        self.swa.release(request.pages[first : first + pages], "evict", defer=self.swa_defers)

    @step
    def evict_swa(self, entry: EntryRef) -> None:
        """The cache drops the SWA side of an unlocked entry (a tombstone):
        ``free_swa`` of its slots that still have one."""
        pages = self.model.cache[entry.eid].pages
        dead = self._slid(pages) * self.page_size
        slots = self.entry_slots[entry.eid][dead:]
        self._call(f"free_swa({entry!r} slots[{dead}:])", self.allocator.free_swa, slots)
        self.swa.release(pages, "evict", defer=self.swa_defers)

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


class SWAMachine(FreeGroupMachine):
    """The core rules over an SWA hybrid pool, plus window slides and SWA-side eviction."""

    @draws(guard=lambda s: s.slidable(), which=PICKS, pages=(1, 4), segment=bool)
    def slide(self, which, pages, segment):
        s = self.state
        req = _pick(s.slidable(), which)
        self._do("slide", req, min(pages, s.live_own(req)), segment=segment)

    @draws(guard=lambda s: s.swa_evictable(), which=PICKS)
    def evict_swa(self, which):
        self._do("evict_swa", _pick(self.state.swa_evictable(), which))


def is_hybrid(allocator) -> bool:
    """Whether an allocator has sglang's two SWA pools."""
    return all(hasattr(allocator, name) for name in ("full_attn_allocator", "swa_attn_allocator", "full_to_swa_index_mapping"))


def free_swa_view(state: Lockstep, row: int, start: int, end: int, segment: bool) -> None:
    """The window slides past ``row[start:end]``: ``free_swa_segment`` of a
    view of it where asked and the allocator has one, else ``free_swa``."""
    view = state.rows[row, start:end]
    if segment and callable(getattr(state.allocator, "free_swa_segment", None)):
        state._call(f"free_swa_segment(req_to_token[{row}, {start}:{end}], start_pos={start})",
                    lambda: state.allocator.free_swa_segment(view, start_pos=start))
    else:
        state._call(f"free_swa(req_to_token[{row}, {start}:{end}])", state.allocator.free_swa, view)
