"""The lockstep harness for HiSparse pools (the "hisparse" family).

``HiSparseLockstep`` drives the logical pool (``logical_attn_allocator``)
against the core ``OwnershipModel`` and the device pool
(``hisparse_attn_allocator``) against ``DeviceSide``, checks both pools
each step the way the core checks one, and the full-to-HiSparse mapping
between them.  Frees are never deferred (``defers_frees = False``).

Beyond the core steps: ``device_buffer`` (``alloc_device_buffer`` of a
request's row, as the HiSparse coordinator admits a request) and
``free_hisparse`` (a request still staging is aborted: its device pages
go, its logical pages stay).  A request with a device buffer gives it back
(``free_hisparse_indices``) before its row is freed, as the coordinator's
``request_finished`` does.  Segments end on a page boundary (see
``HiSparseMachine``).  At a page size above 1, where sglang's
``alloc()`` is page-size-1 only, ``alloc`` goes through ``alloc_extend``
(one request, its row page-aligned) when the allocator has one.  ``decode``
runs as the core's, on requests holding a device buffer (the coordinator
decodes a request only once staged: a logical-only decode page in a row
still mapped would leave a partly mapped page before its last, which no
caller hands ``alloc_device_buffer``); the batched ``extend`` maps token
by token, so a page an extend leaves partly used maps only its tokens'
slots, and a request is extended only in its prefill (before its device
buffer or an abort), as the coordinator orders it.
"""

from __future__ import annotations

import torch
from attrs import define, field

from reference_model import invariants
from reference_model.census import Census
from reference_model.hisparse import DeviceSide
from state_machines.harness.drawing import PrefillOnly, ReleasesDevicePeers, rematch_among
from state_machines.harness.dsv4_hisparse import map_growth
from state_machines.harness.lockstep import Lockstep, Pool, census_of, ids, pool_ids
from state_machines.harness.machines import MAX_PAGES, PICKS, FreeGroupMachine, _pick, draws
from state_machines.harness.steps import EntryRef, ReqRef, step
from state_machines.targets import TargetError, probe

DEVICE = dict(name="device_no_slot_handed_out_twice", label="device pool: ")


@define
class HiSparseLockstep(PrefillOnly, ReleasesDevicePeers, Lockstep):
    device: DeviceSide | None = None

    # A batched extend maps token by token (hisparse.py:254 in 0.5.23): an
    # extend ending mid-page maps only its tokens' slots (``DeviceSide``
    # keeps each page's fill), and the next one continues the device page
    # at ``mapping[last_loc] + 1`` (hisparse.py:241), which is 0 once a
    # request's mapping is gone (a device buffer, ``free_hisparse``, a
    # logical-only decode page).  So, as the coordinator orders it, a
    # request is extended only in its prefill (``settled`` after those).
    caller_steps = ("decode", "extend")
    # Requests past their prefill: never extended again.
    settled: set[int] = field(factory=set)
    alloc_extends = True
    # Set while a call takes logical pages only (alloc_decode).
    logical_only: bool = False

    def start_models(self, defers_frees: bool) -> None:
        super().start_models(defers_frees)
        if self.page_size > 1 and "extend" in self.disabled_rules:
            # alloc() is page-size-1 only: without alloc_extend nothing allocates.
            raise TargetError(f"{self.config.target} at page size {self.page_size} allocates through alloc_extend, "
                              f"which cannot run here: {self.disabled_rules['extend']}")
        initial = self._call("device census", census_of, self.allocator.hisparse_attn_allocator)
        self.device = DeviceSide.from_census(self.model, pool_ids(initial)[0])

    @property
    def mapping(self) -> torch.Tensor:
        return self.allocator.full_to_hisparse_device_index_mapping

    # -- checks --

    def pools(self) -> list[Pool]:
        a = self.allocator
        return [
            Pool(a.logical_attn_allocator, self.model, "", "logical pool: "),
            Pool(a.hisparse_attn_allocator, self.device, "device_", "device pool: "),
        ]

    def check_joint(self, censuses: list[Census]) -> None:
        """The mapping between the pools, and the joint available size."""
        a = self.allocator
        self._judge_mapping(invariants.hisparse_mapping_consistent, self.mapping, self.page_size, self.device, sentinel=True)
        self._judge(
            invariants.hisparse_available_size_agrees,
            self._count("available_size()", a.available_size),
            self._count("logical available_size()", a.logical_attn_allocator.available_size),
            self._count("device available_size()", a.hisparse_attn_allocator.available_size),
        )

    # -- steps --

    def _short(self, pages: int) -> bool:
        return self.model.num_free < pages or (not self.logical_only and self.device.num_free < pages)

    @step
    def decode(self, reqs: list[ReqRef]) -> None:
        """As the core's; where the caller sends it to ``alloc_decode`` (page
        size > 1) a new page is logical only, where to ``alloc()`` (page size
        1) each new page has a device page too."""
        self.logical_only = probe.caller_sends("decode", self.page_size, self.config.latent) is not None
        before = {r.rid: len(self.model.requests[r.rid].own) for r in reqs}
        try:
            super().decode(reqs)
        finally:
            logical_only, self.logical_only = self.logical_only, False
        new = [p for r in reqs for p in self.model.requests[r.rid].own[before[r.rid]:]]
        if new and not logical_only:
            self._map_new(f"alloc({len(reqs)})", new)
        if logical_only:
            # Its new tokens map nothing: an extend would continue from nothing.
            self.settled.update(r.rid for r in reqs)

    @step
    def extend(self, reqs: list[ReqRef], tokens: list[int]) -> None:
        """One prefill batch, as the core's; each new logical slot maps to a
        device slot: a page takes a device page with its first token, a
        continued page's slots continue its device page."""
        ps = self.page_size
        spans = [(r, self.model.tokens(r.rid, ps), self.model.tokens(r.rid, ps) + k) for r, k in zip(reqs, tokens)]
        super().extend(reqs, tokens)
        map_growth(self, self.device, self.mapping, "extend", spans, 1, ps, **DEVICE)

    @step
    def alloc(self, n: int, req: ReqRef | None = None, prefix: EntryRef | None = None) -> ReqRef | None:
        pool_short = self._short(n // self.page_size)
        made = super().alloc(n, req, prefix)
        if pool_short:
            return None
        self._map_new(f"alloc({n})", self.model.requests[(made or req).rid].own[-(n // self.page_size):])
        return made

    def _map_new(self, what: str, new: list[int]) -> None:
        """The logical pages ``new`` just handed out each map onto a whole
        device page, free until now; the device side takes them."""
        ps = self.page_size
        slots = [p * ps + k for p in new for k in range(ps)]
        device_slots = ids(self.mapping.to("cpu")[torch.tensor(slots, dtype=torch.int64)])
        self._judge(invariants.hisparse_alloc_maps_whole_pages, what, slots, device_slots, ps)
        device_pages = [device_slots[i] // ps for i in range(0, len(device_slots), ps)]
        self._judge(invariants.no_slot_handed_out_twice, device_pages, self.device, **DEVICE)
        self.device.take(new, device_pages)

    @step
    def device_buffer(self, req: ReqRef, n: int) -> None:
        """``alloc_device_buffer`` of a view of the request's whole row and
        ``n`` slots: the device pages its tokens map to leave the mapping,
        the first ``n`` slots' worth become its buffer, the rest go free,
        and fresh pages make up a shortfall."""
        ps = self.page_size
        request = self.model.requests[req.rid]
        row, length = self._row_of(req)
        view = self.rows[row, :length]
        what = f"alloc_device_buffer(req_to_token[{row}, :{length}], {n})"
        out = self._call(what, self.allocator.alloc_device_buffer, view, n)
        peers = self.device.unmap(request.pages)
        kept, surplus = peers[: n // ps], peers[n // ps :]
        got = ids(out)
        self._judge(invariants.device_buffer_keeps_token_slots, what, got, kept, n, ps)
        extra = [got[i] // ps for i in range(len(kept) * ps, n, ps)]
        self._judge(invariants.no_slot_handed_out_twice, extra, self.device, **DEVICE)
        self.device.give_buffer(req.rid, kept, extra, surplus)
        self.settled.add(req.rid)

    @step
    def free_hisparse(self, req: ReqRef) -> None:
        """A request still staging is aborted: ``free_hisparse`` of a view of
        its row frees the device pages its tokens map to; its logical pages
        stay until it finishes."""
        row, length = self._row_of(req)
        view = self.rows[row, :length]
        self._call(f"free_hisparse(req_to_token[{row}, :{length}])", self.allocator.free_hisparse, view)
        self.device.release(self.model.requests[req.rid].pages, "free")
        self.settled.add(req.rid)

    @step
    def finish(self, req: ReqRef) -> None:
        """The request ends: its device buffer, if any, goes back
        (``free_hisparse_indices``), then its row is freed as in the core."""
        self._return_buffer(req, self.page_size)
        super().finish(req)

    # -- what the rules may act on --

    def decodable(self) -> list[ReqRef]:
        """Requests holding a device buffer: the coordinator stages a
        request after its prefill and admits it to the running batch only
        once ``collect_ready_reqs`` made its buffer (``hisparse_coordinator.py``);
        an aborted one (``free_hisparse``) never decodes."""
        return [r for r in super().decodable() if r.rid in self.device.buffers]

    def unbuffered(self) -> list[ReqRef]:
        return [r for r in self.live() if r.rid not in self.device.buffers]

    def buffer_shortfall(self, req: ReqRef, n: int) -> int:
        """Device pages a buffer of ``n`` slots must take from the free set."""
        peers = sum(1 for p in self.model.requests[req.rid].pages if p in self.device.mapping)
        return max(0, n // self.page_size - peers)

    def step_not_applicable(self, rule: str, args: dict) -> str | None:
        """Why a replayed step is one this family's rules never draw."""
        req = args.get("req")
        if rule == "free_segment" and (args["start"] + args["n"]) % self.page_size:
            return "a HiSparse segment ends on a page boundary (allocs map whole pages)"
        entry = args.get("entry")
        if rule == "rematch" and entry is not None and entry.eid in self.model.requests[req.rid].locks:
            return f"{req!r} already holds {entry!r} in its row"
        if why := self.prefill_step_not_applicable(rule, args):
            return why
        if rule == "decode" and (staging := [r for r in args["reqs"] if r.rid not in self.device.buffers]):
            return f"{staging[0]!r} has no device buffer yet: the coordinator decodes a request once it is staged"
        if rule in ("device_buffer", "free_hisparse") and req.rid in self.device.buffers:
            return f"{req!r} already has a device buffer"
        if rule == "device_buffer" and self.buffer_shortfall(req, args["n"]) > self.device.num_free:
            return f"the device pool cannot make up {req!r}'s buffer"
        return None


class HiSparseMachine(FreeGroupMachine):
    """The core rules over a HiSparse pair, plus device buffers and aborts."""

    # sglang maps each token's slot, and an alloc here maps whole pages: a
    # segment ending mid-page would leave a token slot mapped that no caller
    # mapped.  So segments end on a page boundary.
    @draws(guard=lambda s: s.with_own_pages(), which=PICKS, start=(0, 15))
    def free_segment(self, which, start):
        s = self.state
        req = _pick(s.with_own_pages(), which)
        request = s.model.requests[req.rid]
        start_page = len(request.prefix) + start % len(request.own)
        self._do("free_segment", req, start_page * s.page_size, (len(request.pages) - start_page) * s.page_size)

    # A radix match extends a prefix with entries it does not hold yet; an
    # entry twice in one row would hand alloc_device_buffer a slot twice.
    @draws(guard=lambda s: s.aligned(), which=PICKS, dup=(0, MAX_PAGES), entry=PICKS)
    def rematch(self, which, dup, entry):
        s = self.state
        rematch_among(self, s.aligned(), which, dup, entry, lambda req, e: e.eid not in s.model.requests[req.rid].locks)

    @draws(guard=lambda s: s.unbuffered(), which=PICKS, pages=(1, MAX_PAGES + 2))
    def device_buffer(self, which, pages):
        s = self.state
        req = _pick(s.unbuffered(), which)
        n = pages * s.page_size
        if s.buffer_shortfall(req, n) <= s.device.num_free:
            self._do("device_buffer", req, n)

    @draws(guard=lambda s: s.unbuffered(), which=PICKS)
    def free_hisparse(self, which):
        self._do("free_hisparse", _pick(self.state.unbuffered(), which))


def is_hisparse(allocator) -> bool:
    """Whether an allocator has sglang's HiSparse pools and mapping."""
    return all(hasattr(allocator, n) for n in ("logical_attn_allocator", "hisparse_attn_allocator", "full_to_hisparse_device_index_mapping"))
