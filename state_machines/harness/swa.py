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
whose window slid, so it stands in for ``free_full``).

Allocation follows sglang's callers: ``alloc()`` at page size 1; above it
(where sglang's ``alloc()`` asserts page size 1) ``alloc_extend`` for
``alloc`` and ``extend``, ``alloc_decode`` for ``decode`` and
``alloc_extend_swa_tail`` for ``extend_swa_tail`` (PD decode's
preallocation).  A partly used last page maps only the slots its tokens
use, and a window never slides past it (the window holds the newest
token).  ``remap`` re-points an unlocked cache entry's slid pages at fresh
SWA pages (``set_full_to_swa_mapping``, as HiCache load-back and tombstone
recovery do), inside a free group too.  An adapter for
sglang's own SWA classes (``sglang:swa``), or any target whose factory
says ``family = "swa"`` or whose allocator has those two pools, runs here
(``family.py``).
"""

from __future__ import annotations

import copy

import torch
from attrs import define, field

from reference_model import SWASide, invariants
from reference_model import hooks as hook_checks
from reference_model.census import Census
from state_machines.harness import hooks
from state_machines.harness.lockstep import Lockstep, Pool, census_of, ids, pool_ids
from state_machines.harness.machines import EXTEND_TOKENS_PAGES, PICKS, FreeGroupMachine, _pick, draws
from state_machines.harness.steps import EntryRef, ReqRef, step
from state_machines.orphans import call_user_code
from state_machines.targets.base import one_line, quiet
from state_machines.targets.probe import real_interrupt

# Why a step does not run at page size 1 (disaggregation/decode.py sends a
# preallocation there to alloc()).
TAIL_AT_PAGE_SIZE_ONE = "at page size 1 PD decode's preallocation calls alloc(), not alloc_extend_swa_tail"


def judge_swa_counts(state: Lockstep, hook: str, got, tokens: int, full: int, swa: int, asked) -> bool:
    """Judge an SWA hook that reports the two sides' free counts (``full``,
    ``swa`` by the model): ``swa_capacity_and_available``,
    ``reclaim_for_prealloc`` (only the SWA side is reclaimed; None means
    ready) and ``debug_print``.  False when ``hook`` is none of them."""
    if hook == "swa_capacity_and_available":
        got = tuple(tuple(int(v) for v in pair) for pair in got)
        state._judge(hook_checks.hook_answer_agrees, hook, got, ((tokens, full), (tokens, swa)))
    elif hook == "reclaim_for_prealloc":
        state._judge(hook_checks.hook_answer_agrees, f"{hook}: reports a shortfall", got is not None, tokens > swa)
        state._judge(hook_checks.eviction_asks_shortfall, hook, asked, [(0, tokens - swa)] if tokens > swa else [])
    elif hook == "debug_print":
        mentions = [n for n in (swa, full) if str(n) in got]
        state._judge(hook_checks.hook_answer_agrees, f"{hook}(): the free counts it shows", mentions, [swa, full])
    else:
        return False
    return True


# The frees an SWA caller sends a span to, each of which may be empty (a
# window with nothing to slide, a row with nothing dead): ``free_empty_span``.
EMPTY_FREES = ("free", "free_segment", "free_swa", "free_swa_segment", "free_full", "free_full_segment")


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
    # CPU stand-ins the target installed for device-kernel paths, each named.
    stand_ins: list[str] = field(factory=list)
    # SWA pages the current allocator call needs, where not one per full page
    # (alloc_extend_swa_tail's tail); None otherwise.
    swa_need: int | None = None
    # The swa_tail_len of the current extend, when it is an extend_swa_tail.
    tail: int | None = None
    # sglang's SWA alloc() asserts page size 1.
    alloc_extends = True
    hook_steps = hooks.HOOK_STEPS
    asked_hooks = hooks.CORE_HOOKS + hooks.SWA_HOOKS
    empty_frees = EMPTY_FREES

    def start_models(self, defers_frees: bool) -> None:
        super().start_models(defers_frees)
        initial = self._call("SWA census", census_of, self.allocator.swa_attn_allocator)
        self.swa = SWASide.from_census(self.model, pool_ids(initial)[0])
        self.swa_defers = free_swa_defers(self.allocator)
        self.stand_ins = list(getattr(self.allocator, "kv_lockstep_stand_ins", ()))
        self.disabled_rules.update(swa_steps_disabled(self.allocator, self.page_size))
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
        self._judge_mapping(invariants.swa_mapping_consistent, a.full_to_swa_index_mapping, self.page_size, self.swa,
                            censuses[1], free_census=censuses[1])
        if "hybrid_available_size_agrees" in self.skipped_checks:
            return
        self._judge(
            invariants.hybrid_available_size_agrees,
            self._count("available_size()", a.available_size),
            self._count("full_available_size()", a.full_attn_allocator.available_size),
            self._count("swa_available_size()", a.swa_attn_allocator.available_size),
        )

    # -- steps --

    def _short(self, pages: int) -> bool:
        swa_pages = pages if self.swa_need is None else self.swa_need
        return self.model.num_free < pages or self.swa.num_free < swa_pages

    @step
    def alloc(self, n: int, req: ReqRef | None = None, prefix: EntryRef | None = None) -> ReqRef | None:
        before = self._lengths([req] if req is not None else [])
        made = super().alloc(n, req, prefix)
        if made is not None:
            before[made.rid] = (len(self.model.requests[made.rid].prefix), -1)
        self._map_growth("alloc", before, {})
        return made

    @step
    def decode(self, reqs: list[ReqRef]) -> None:
        """Each request grows by one token on both pools (``alloc_decode``
        above page size 1, continuing at the SWA peer of ``last_loc``)."""
        ps = self.page_size
        before = self._lengths(reqs)
        continued = {r.rid: 1 for r in reqs if not self.model.decode_needs_page(r.rid, ps)}
        super().decode(reqs)
        self._map_growth("decode", before, continued)

    @step
    def extend(self, reqs: list[ReqRef], tokens: list[int]) -> None:
        """One prefill batch on both pools: each new full page maps to a new
        SWA page, and a continued page's new slots to its SWA page's."""
        before = self._lengths(reqs)
        continued = {r.rid: min(k, self.model.requests[r.rid].spare) for r, k in zip(reqs, tokens)}
        super().extend(reqs, tokens)
        self._map_growth("extend", before, continued)

    @step
    def extend_swa_tail(self, req: ReqRef, tokens: int, tail: int) -> None:
        """PD decode's preallocation, ``alloc_extend_swa_tail`` of one request
        whose length is page-aligned, by ``tokens`` tokens: full slots for
        all of them, fresh SWA pages only for the last ``tail`` (which start
        on a page boundary).  The full pages before the tail map to nothing:
        their window slid at once.  ``None`` exactly when the full pool has
        fewer free pages than the extend takes, or the SWA pool than
        ``ceil(tail / page_size)``."""
        ps = self.page_size
        before = self._lengths([req])
        new_pages = self.model.extend_new_pages(req.rid, tokens, ps)
        self.tail, self.swa_need = tail, -(-tail // ps)
        try:
            # The core extend, routed to alloc_extend_swa_tail (_extend_call).
            Lockstep.extend(self, [req], [tokens])
        finally:
            self.tail = self.swa_need = None
        self._map_growth("extend_swa_tail", before, {}, dead={req.rid: new_pages - -(-tail // ps)})

    @step
    def remap(self, entry: EntryRef) -> None:
        """HiCache load-back / tombstone recovery: a cache entry whose
        window slid gets fresh SWA pages (``swa_attn_allocator.alloc``)
        for its slid pages, and ``set_full_to_swa_mapping`` re-points those
        full slots at them; inside a group too, after their old SWA pages
        were queued."""
        ps = self.page_size
        pages = list(self.model.cache[entry.eid].pages)
        dead = self._slid(pages)
        n = dead * ps
        what = f"swa_attn_allocator.alloc({n})"
        got = self._call(what, self.allocator.swa_attn_allocator.alloc, n)
        short = self.swa.num_free < dead
        if got is None:
            self._judge(invariants.alloc_none_iff_short, what, True, 0, short, self.swa.num_free, dead)
            return
        slots = ids(got)
        self._judge(invariants.alloc_none_iff_short, what, False, len(slots), short, self.swa.num_free, dead)
        self._judge(invariants.alloc_returns_whole_pages, n, slots, ps)
        swa_pages = [slots[i] // ps for i in range(0, n, ps)]
        self._judge(invariants.no_slot_handed_out_twice, swa_pages, self.swa, name="swa_no_slot_handed_out_twice", label="SWA pool: ")
        full = self.entry_slots[entry.eid][:n]
        self._call(f"set_full_to_swa_mapping({entry!r} slots[:{n}], swa_slots)", self.allocator.set_full_to_swa_mapping,
                   full, got)
        self.swa.take(pages[:dead], swa_pages)

    # -- the scheduler's hooks --

    def _available_tokens(self) -> tuple[int, int | None]:
        return self.model.num_free * self.page_size, self.swa.num_free * self.page_size

    def _judge_family_hook(self, hook: str, got, tokens: int, full: int, swa: int | None, asked) -> bool:
        """The SWA hooks: both pools' counts, the SWA-only reclaim of a PD
        preallocation, and the SWA ids a transfer addresses (the model's
        mapping; a slot whose window slid maps to nothing, 0)."""
        ps = self.page_size
        if judge_swa_counts(self, hook, got, tokens, full, swa, asked):
            return True
        if hook == "translate_swa_indices_for_transfer":
            slots, _ = self._transfer_ids()
            want = []
            for s in ids(slots):
                # A partly used page maps only the slots its tokens filled.
                page = self.swa.mapping.get(s // ps)
                mapped = page is not None and s % ps < self.swa.filled_slots(s // ps, ps)
                want.append(page * ps + s % ps if mapped else 0)
            self._judge(hook_checks.hook_answer_agrees, hook, ids(got), want)
        elif hook == "size_swa":
            self._judge(hook_checks.hook_answer_agrees, hook, got, self.swa.capacity * ps)
        elif hook == "size":
            self._judge(hook_checks.hook_answer_agrees, hook, got, min(self.model.capacity, self.swa.capacity) * ps)
        else:
            return False
        return True

    def _rebuilt(self, free_pages: list[int]) -> None:
        super()._rebuilt(free_pages)
        self.swa = SWASide.from_census(self.model, free_pages)

    def _give_back_segments(self, row: int, start: int, end: int, pages: list[int], cut: int) -> None:
        """As ``free_kv_row_segments`` splits a row: the slid pages go back
        full-side only (``free_full_segments``, where the allocator has it),
        the rest through ``free_segments``; their live SWA peers go too."""
        dead = min(start + self._slid(pages) * self.page_size, end)
        if dead > start:
            if self.provides("free_full_segments"):
                self._free_segments("free_full_segments", row, start, dead, 0)
            else:
                name, fn = self._free_full_fn(True)
                view = self.rows[row, start:dead]
                call = (lambda: fn(view, start_pos=start)) if name.endswith("_segment") else (lambda: fn(view))
                self._call(f"{name}(req_to_token[{row}, {start}:{dead}])", call)
        alive_cut = max(0, cut - (dead - start) // self.page_size)
        self._free_segments("free_segments", row, dead, end, alive_cut)
        self.swa.release(pages, "free")

    def _extend_call(self, prefix_lens: list[int], seq_lens: list[int], last: list[int], total: int):
        if self.tail is None:
            return super()._extend_call(prefix_lens, seq_lens, last, total)
        device = self.rows.device

        def host(values):
            return torch.tensor(values, dtype=torch.int64)

        what = (f"alloc_extend_swa_tail(prefix_lens={prefix_lens}, seq_lens={seq_lens}, last_loc={last},"
                f" extend_num_tokens={total}, swa_tail_len={self.tail})")
        return what, self._call(
            what, lambda: self.allocator.alloc_extend_swa_tail(
                host(prefix_lens).to(device), host(prefix_lens), host(seq_lens).to(device), host(seq_lens),
                host(last).to(device), total, swa_tail_len=self.tail,
            ),
        )

    def _lengths(self, reqs) -> dict[int, tuple[int, int]]:
        """Each request's (pages, tokens), to tell what a step grew."""
        return {r.rid: (len(self.model.requests[r.rid].pages), self.model.tokens(r.rid, self.page_size)) for r in reqs}

    def _map_growth(self, what: str, before: dict[int, tuple[int, int]], continued: dict[int, int],
                    dead: dict[int, int] | None = None) -> None:
        """After a step that may have grown requests (``before``: each one's
        pages and tokens before it; an allocation that returned None grew
        none), judge and record the SWA side: each new full page maps to
        a fresh SWA page (its first ``dead[rid]`` pages to nothing), its
        first slots as many as its tokens use; ``continued[rid]`` more slots
        of the page a request's tokens ended in are mapped."""
        ps = self.page_size
        new_full, fills = [], []
        for rid, (old, tokens) in before.items():
            request = self.model.requests.get(rid)
            if request is None or self.model.tokens(rid, ps) == tokens:
                continue
            if continued.get(rid):
                self.swa.fill(request.pages[old - 1], continued[rid], ps)
            fresh = request.pages[old:]
            skip = (dead or {}).get(rid, 0)
            for i, page in enumerate(fresh):
                new_full.append(page)
                fills.append(0 if i < skip else ps - request.spare if i == len(fresh) - 1 else ps)
        if not new_full:
            return
        slots = torch.tensor([p * ps + k for p in new_full for k in range(ps)], dtype=torch.int64)
        mapping = ids(self.allocator.full_to_swa_index_mapping.to("cpu")[slots])
        got = [mapping[i * ps : (i + 1) * ps] for i in range(len(new_full))]
        self._judge(invariants.swa_new_pages_mapped, what, new_full, got, fills, ps)
        live = [(page, g[0] // ps, f) for page, g, f in zip(new_full, got, fills) if f]
        swa_pages = [swa for _, swa, _ in live]
        self._judge(invariants.no_slot_handed_out_twice, swa_pages, self.swa, name="swa_no_slot_handed_out_twice", label="SWA pool: ")
        self.swa.take([p for p, _, _ in live], swa_pages, [f for _, _, f in live])

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
        """Own pages the window may still slide past: those with an SWA
        side, but never a partly used last page (it holds the newest token)."""
        request = self.model.requests[req.rid]
        own = request.own
        return len(own) - self._slid(own) - (1 if request.spare and self.swa.live(own[-1]) else 0)

    def decode_fits(self, reqs: list[ReqRef]) -> bool:
        """Above page size 1, a decode batch only where both pools have its
        new pages: sglang's scheduler retracts requests first
        (``check_decode_mem``), and a ``None`` from ``alloc_decode`` is a
        fatal "Decode out of memory" (``mem_cache/allocation.py``), so no
        caller meets the pool short.  (sglang's SWA ``alloc_decode`` then
        keeps the page the other pool gave: a latent leak.)"""
        if self.page_size == 1:
            return True
        pages = sum(self.model.decode_needs_page(r.rid, self.page_size) for r in reqs)
        return not self._short(pages)

    def allocatable(self) -> list[ReqRef]:
        """Above page size 1 ``alloc`` is an ``alloc_extend`` from the
        request's page-aligned end, so a request whose last page is partly
        used is grown by ``extend`` only: its caller passes the real length,
        and sglang's SWA side reads the peer of ``last_loc``, which for a
        slot past the tokens maps to nothing (its debug check asserts)."""
        live = self.extendable()
        return live if self.page_size == 1 else [r for r in live if not self.model.requests[r.rid].spare]

    def tail_ready(self) -> list[ReqRef]:
        """Requests ``extend_swa_tail`` may take: page-aligned, no own page
        with an SWA side (so slid pages stay the oldest)."""
        return [ReqRef(r.rid) for r in self.model.requests.values()
                if not r.spare and not any(self.swa.live(p) for p in r.own) and self.room(ReqRef(r.rid)) > 0]

    def remappable(self) -> list[EntryRef]:
        """Cache entries whose window slid past their oldest pages (locked
        too: a request matching a prefix is what loads it back)."""
        return [e for e in self.entries() if self._slid(self.model.cache[e.eid].pages)]

    def swa_evictable(self) -> list[EntryRef]:
        return [e for e in self.evictable() if any(self.swa.live(p) for p in self.model.cache[e.eid].pages)]

    def step_not_applicable(self, rule: str, args: dict) -> str | None:
        """Why a replayed SWA step is one this family's rules never draw."""
        ps = self.page_size
        if rule == "decode" and not self.decode_fits(args["reqs"]):
            return "a pool is short of the batch's new pages: the scheduler retracts requests before such a decode"
        if rule == "alloc" and args.get("req") is not None and args["req"] not in self.allocatable():
            return f"{args['req']!r} ends mid-page: above page size 1 the caller grows it with extend"
        if rule == "remap":
            entry = args["entry"]
            return None if entry in self.remappable() else f"{entry!r} was evicted or has no slid page"
        if rule == "extend_swa_tail":
            req, tokens, tail = args["req"], args["tokens"], args["tail"]
            if req not in self.tail_ready():
                return f"{req!r} ends mid-page, has a page in the window or a full row"
            if self.model.tokens(req.rid, ps) + tokens > self.config.row_pages * ps:
                return f"{req!r}: {tokens} more tokens do not fit in its row"
            if tail > tokens or (tokens - tail) % ps:
                return f"a tail of {tail} of {tokens} tokens does not start on a page boundary"
        return None

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
        """The first of ``names`` the allocator provides: (name, bound method)."""
        for name in names:
            if self.provides(name):
                return name, getattr(self.allocator, name)
        raise AttributeError(f"{type(self.allocator).__name__} has none of {', '.join(names)}")

    def _free_fn(self, segment: bool = False):
        return self._method(*(["free_segment"] if segment and self.has_free_segment else []), "free")

    def _free_full_fn(self, segment: bool = False):
        """``free_full`` (or its segment form); where the allocator has none,
        ``free``, whose SWA half skips slots that map to nothing."""
        names = ["free_full_segment", "free_full"] if segment else ["free_full"]
        return self._method(*names, *(["free_segment"] if segment and self.has_free_segment else []), "free")


def _one_page(allocator):
    """One fresh page's slots from ``allocator`` as its callers allocate:
    ``alloc`` at page size 1, ``alloc_extend`` of one request above it."""
    ps = allocator.page_size
    if ps == 1:
        return allocator.alloc(1)
    zero, page, none = (torch.tensor([v], dtype=torch.int64) for v in (0, ps, -1))
    return allocator.alloc_extend(zero, zero, page, page, none, ps)


def free_swa_defers(allocator, swa_pool=lambda a: a.swa_attn_allocator, one_page=_one_page) -> bool:
    """Whether ``free_swa()`` inside an open free group queues the SWA
    release (True) or releases the slots at once (False), probed on a
    throwaway copy.  Both keep ownership sound: an immediate release frees
    exactly the slid slots and clears their mapping.  A probe that cannot
    run reads as queuing, the stricter model.  ``swa_pool`` reads the
    SWA pool off the allocator (a wrapper keeps it one level down; a pure
    SWA pool is its own), ``one_page`` allocates a page's slots on it.
    The target's code runs as a call of the harness's (``call_user_code``):
    a child it forks there ends as the probe returns, not as a copy of the
    harness."""
    try:
        return call_user_code(_queues_free_swa, allocator, swa_pool, one_page)
    except BaseException as exc:  # noqa: BLE001 - the run itself reports what raises
        real_interrupt(exc)
        return True


def _queues_free_swa(allocator, swa_pool, one_page) -> bool:
    probe = copy.deepcopy(allocator)
    slots = one_page(probe)
    if slots is None:
        return True
    before = int(swa_pool(probe).available_size())
    probe.free_group_begin()
    probe.free_swa(slots.clone())
    return int(swa_pool(probe).available_size()) == before


def swa_steps_disabled(allocator, page_size: int) -> dict[str, str]:
    """The SWA steps this allocator cannot run here, each with the reason:
    ``extend_swa_tail`` (above page size 1 only; probed on a throwaway copy)
    and ``remap`` (``set_full_to_swa_mapping``)."""
    out = {}
    if not callable(getattr(allocator, "set_full_to_swa_mapping", None)):
        out["remap"] = f"{type(allocator).__name__} has no set_full_to_swa_mapping"
    if page_size == 1:
        out["extend_swa_tail"] = TAIL_AT_PAGE_SIZE_ONE
    elif not callable(getattr(allocator, "alloc_extend_swa_tail", None)):
        out["extend_swa_tail"] = f"{type(allocator).__name__} has no alloc_extend_swa_tail"
    else:
        # One request of a page and one token, its tail the last token.
        i64 = dict(dtype=torch.int64)
        zero, seq, none = torch.tensor([0], **i64), torch.tensor([page_size + 1], **i64), torch.tensor([-1], **i64)
        try:
            with quiet():
                call_user_code(copy.deepcopy(allocator).alloc_extend_swa_tail, zero, zero, seq, seq, none, page_size + 1,
                               swa_tail_len=1)
        except BaseException as exc:  # noqa: BLE001 - whatever stops it here disables the step
            real_interrupt(exc)
            out["extend_swa_tail"] = f"alloc_extend_swa_tail: {one_line(exc)}"
    return out


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

    @draws(guard=lambda s: s.runs("remap") and s.entries(), which=PICKS)
    def remap(self, which):
        # An unlocked entry whose window has not slid yet is tombstoned first
        # (its SWA side dropped, queued in an open group), then loaded back.
        s = self.state
        entry = _pick(s.entries(), which)
        if entry not in s.remappable():
            if entry not in s.swa_evictable():
                return
            self._do("evict_swa", entry)
        self._do("remap", entry)

    @draws(guard=lambda s: s.runs("extend_swa_tail") and (s.free_rows() or s.tail_ready()),
           fresh=(0, 2), which=PICKS, tokens=(1, 64), tail=(0, 4))
    def extend_swa_tail(self, which, fresh, tokens, tail):
        # fresh: 0 takes a ready request, 1 admits one, 2 admits one on a
        # cached prefix; tail: the tail's whole pages past the last partial one.
        s = self.state
        ps = s.page_size
        ready = s.tail_ready()
        if fresh or not ready:
            if not s.free_rows():
                return
            entries = s.entries()
            ready = [self._do("admit", prefix=_pick(entries, which) if fresh == 2 and entries else None)]
        req = _pick(ready, which)
        room = s.room(req) * ps
        k = min(1 + (tokens - 1) % (EXTEND_TOKENS_PAGES * ps), room)
        if k <= 0:
            return
        # The tail starts on a page boundary: it ends the last (partial) page.
        part = k % ps
        t = min(part + tail * ps, k)
        self._do("extend_swa_tail", req, k, t)


def is_hybrid(allocator) -> bool:
    """Whether an allocator has sglang's two SWA pools."""
    return all(hasattr(allocator, name) for name in ("full_attn_allocator", "swa_attn_allocator", "full_to_swa_index_mapping"))


def free_swa_view(state: Lockstep, row: int, start: int, end: int, segment: bool) -> None:
    """The window slides past ``row[start:end]``: ``free_swa_segment`` of a
    view of it where asked and the allocator has one, else ``free_swa``."""
    view = state.rows[row, start:end]
    if segment and state.provides("free_swa_segment"):
        state._call(f"free_swa_segment(req_to_token[{row}, {start}:{end}], start_pos={start})",
                    lambda: state.allocator.free_swa_segment(view, start_pos=start))
    else:
        state._call(f"free_swa(req_to_token[{row}, {start}:{end}])", state.allocator.free_swa, view)
