"""The lockstep harness for DeepSeek V4 HiSparse pools (the "dsv4_hisparse" family).

sglang's ``DeepSeekV4HiSparseTokenToKVPoolAllocator`` wraps an SWA pair
(``logical_attn_allocator``: full + SWA pools) and adds a device pool of
compressed (C4) slots, ``hisparse_attn_allocator``, at a quarter of the
page size, joined to the full pool by ``full_to_hisparse_device_index_mapping``
(compressed index ``slot // 4`` of each full slot with ``(slot + 1) % 4 ==
0``).  ``DSV4HiSparseLockstep`` runs the SWA family's steps over the
wrapper, checks the full, SWA and C4 device pools each step, the two
mappings and both available sizes, and adds what the HiSparse coordinator
does (``managers/hisparse_coordinator.py``):

- ``alloc`` / ``extend`` (``alloc_extend``) take device pages for the
  compressed tokens they complete; a request is extended only in its
  prefill, before it decodes (``alloc_decode``, logical only), gets its
  device buffer or is aborted: after those its compressed tokens map to
  nothing, and the wrapper would continue a device page at
  ``mapping[last_loc] + 1`` of nothing;
- ``device_buffer_pages`` (``alloc_device_buffer`` of the row's compressed slots, the
  coordinator's ``alloc_device_buffer``), ``free_hisparse`` (an aborted
  staging request, ``abort_staging_request``); a finishing request gives its
  buffer back (``free_hisparse_indices``) before its row is freed;
- ``free()`` inside a group is queued, device side included, until
  ``free_group_end()``; ``free_swa`` goes straight to the SWA pair.

The window slides (``slide``, ``evict_swa``) only over pages with no device
peer: the wrapper's ``free_full`` frees no device page, and the coordinator
unmaps a request's pages (its buffer) before it decodes, where windows
slide.  ``remap`` is disabled (the wrapper has no ``set_full_to_swa_mapping``).
"""

from __future__ import annotations

import torch
from attrs import define, field

from reference_model import SWASide, invariants
from reference_model.census import Census
from reference_model.dsv4_hisparse import buffer_plan, compressed_growth, compressed_new_pages
from reference_model.hisparse import DeviceSide
from state_machines.harness.drawing import PrefillOnly, ReleasesDevicePeers, rematch_among
from state_machines.harness.lockstep import Lockstep, Pool, census_of, ids, pool_ids
from state_machines.harness.machines import MAX_PAGES, PICKS, _pick, draws
from state_machines.harness.steps import EntryRef, ReqRef, step
from state_machines.harness.swa import SWALockstep, SWAMachine, free_swa_defers, swa_steps_disabled

C4 = dict(name="device_no_slot_handed_out_twice", label="C4 device pool: ")


@define
class DSV4HiSparseLockstep(PrefillOnly, ReleasesDevicePeers, SWALockstep):
    device: DeviceSide | None = None
    # Requests past their prefill (decoded, buffered, aborted, preallocated):
    # never extended again.
    settled: set[int] = field(factory=set)
    # Requests PD decode preallocated (extend_swa_tail): they decode next.
    preallocated: set[int] = field(factory=set)
    # Device pages the current allocator call needs, while one runs.
    c4_need: int | None = None

    @property
    def ratio(self) -> int:
        return int(self.allocator.compress_ratio)

    @property
    def c4_page_size(self) -> int:
        return int(self.allocator.hisparse_page_size)

    @property
    def logical(self):
        return self.allocator.logical_attn_allocator

    def start_models(self, defers_frees: bool) -> None:
        Lockstep.start_models(self, defers_frees)
        logical = self.logical
        self.swa = SWASide.from_census(self.model, pool_ids(self._call("SWA census", census_of, logical.swa_attn_allocator))[0])
        self.swa_defers = free_swa_defers(self.allocator, lambda a: a.logical_attn_allocator.swa_attn_allocator)
        self.stand_ins = list(getattr(self.allocator, "kv_lockstep_stand_ins", ()))
        self.disabled_rules.update(swa_steps_disabled(self.allocator, self.page_size))
        initial = self._call("C4 device census", census_of, self.allocator.hisparse_attn_allocator)
        self.device = DeviceSide.from_census(self.model, pool_ids(initial)[0])

    # -- checks --

    def pools(self) -> list[Pool]:
        logical = self.logical
        return [
            Pool(logical.full_attn_allocator, self.model, "", "full pool: "),
            Pool(logical.swa_attn_allocator, self.swa, "swa_", "SWA pool: "),
            Pool(self.allocator.hisparse_attn_allocator, self.device, "device_", "C4 device pool: ", self.c4_page_size),
        ]

    def check_joint(self, censuses: list[Census]) -> None:
        """Both mappings, the SWA pair's available size and the wrapper's."""
        a, logical = self.allocator, self.logical
        self._judge_mapping(invariants.swa_mapping_consistent, a.full_to_swa_index_mapping, self.page_size, self.swa,
                            censuses[1], free_census=censuses[1])
        logical_available = self._count("logical available_size()", logical.available_size)
        self._judge(
            invariants.hybrid_available_size_agrees, logical_available,
            self._count("full available_size()", logical.full_attn_allocator.available_size),
            self._count("SWA available_size()", logical.swa_attn_allocator.available_size),
        )
        self._judge_mapping(invariants.compressed_mapping_consistent, a.full_to_hisparse_device_index_mapping,
                            self.c4_page_size, self.device, sentinel=True)
        self._judge(
            invariants.compressed_available_size_agrees, self._count("available_size()", a.available_size), logical_available,
            self._count("C4 device available_size()", a.hisparse_attn_allocator.available_size), self.ratio,
        )

    # -- allocation --

    def _short(self, pages: int) -> bool:
        return super()._short(pages) or (self.c4_need is not None and self.device.num_free < self.c4_need)

    def _grow(self, what: str, spans: list[tuple[ReqRef | None, int, int]], step):
        """Run ``step`` (an allocation growing each ``(req, prefix_len,
        seq_len)`` of ``spans``; a ``None`` request is the one it makes) with
        the device pages it needs known to ``_short``, then judge and record
        the compressed tokens it mapped.  Returns what ``step`` returned."""
        r, hps = self.ratio, self.c4_page_size
        self.c4_need = sum(compressed_new_pages(p, s, r, hps) for _, p, s in spans)
        try:
            made = step()
        finally:
            self.c4_need = None
        spans = [(req or made, p, s) for req, p, s in spans]
        map_growth(self, self.device, self.allocator.full_to_hisparse_device_index_mapping, what, spans, r, hps, **C4)
        return made

    @step
    def alloc(self, n: int, req: ReqRef | None = None, prefix: EntryRef | None = None) -> ReqRef | None:
        """As the SWA family's (``alloc_extend`` of one request from its
        page-aligned end); its compressed tokens take device pages."""
        before, _ = self._alloc_start(req, prefix)
        return self._grow("alloc_extend", [(req, before, before + n)], lambda: super(DSV4HiSparseLockstep, self).alloc(n, req, prefix))

    @step
    def extend(self, reqs: list[ReqRef], tokens: list[int]) -> None:
        """One prefill batch (``alloc_extend``): the SWA family's, plus a
        device page for each page whose first compressed token it writes,
        and the next device slots of a page already on one."""
        ps = self.page_size
        spans = [(r, self.model.tokens(r.rid, ps), self.model.tokens(r.rid, ps) + k) for r, k in zip(reqs, tokens)]
        self._grow("alloc_extend", spans, lambda: super(DSV4HiSparseLockstep, self).extend(reqs, tokens))

    @step
    def decode(self, reqs: list[ReqRef]) -> None:
        """``alloc_decode``: logical pages only (the coordinator maps decode
        tokens to the device buffer itself).  The requests leave prefill."""
        super().decode(reqs)
        self.settled.update(r.rid for r in reqs)

    @step
    def extend_swa_tail(self, req: ReqRef, tokens: int, tail: int) -> None:
        """PD decode's preallocation, as the SWA family's: logical only."""
        super().extend_swa_tail(req, tokens, tail)
        self.settled.add(req.rid)
        self.preallocated.add(req.rid)

    # -- the HiSparse coordinator's calls --

    def _device_slots(self, req: ReqRef) -> list[int]:
        """The device slots the request's compressed tokens map to, in row order."""
        hps = self.c4_page_size
        out = []
        for page in self.model.requests[req.rid].pages:
            if page in self.device.mapping:
                peer = self.device.mapping[page]
                out += [peer * hps + k for k in range(self.device.filled_slots(page, hps))]
        return out

    def _compressed_row(self, req: ReqRef):
        """The compressed indices of the request's tokens, as the coordinator
        reads them off its row (``translate_loc_from_full_to_compressed``)."""
        request = self.model.requests[req.rid]
        length = self.model.tokens(req.rid, self.page_size)
        row = self.rows[request.row, :length]
        return row, f"req_to_token[{request.row}, :{length}]"

    @step
    def device_buffer_pages(self, req: ReqRef, pages: int) -> None:
        """The coordinator's ``alloc_device_buffer`` of a request past its
        prefill: ``alloc_device_buffer(compressed row, pages * c4_page_size)``
        (``buffer_plan``: the row's device slots leave the mapping, the first
        ones and the newest make the buffer, pages only the rest touch go
        free, fresh pages make up a shortfall)."""
        hps = self.c4_page_size
        n = pages * hps
        row, name = self._compressed_row(req)
        compressed = row.to(torch.int64)
        compressed = compressed[(compressed + 1) % self.ratio == 0] // self.ratio
        what = f"alloc_device_buffer(compressed {name}, {n})"
        plan = buffer_plan(self._device_slots(req), n, hps)
        out = self._call(what, self.allocator.alloc_device_buffer, compressed, n)
        got = ids(out)
        self._judge(invariants.device_buffer_slots_distinct, what, got, label="C4 device pool: ")
        self._judge(invariants.device_buffer_as_planned, what, got, list(plan.head), n, hps)
        extra = [got[i] // hps for i in range(len(plan.head), n, hps)]
        self._judge(invariants.no_slot_handed_out_twice, extra, self.device, **C4)
        self.device.unmap(self.model.requests[req.rid].pages)
        self.device.give_buffer(req.rid, list(plan.kept), extra, list(plan.surplus))
        self.settled.add(req.rid)

    @step
    def free_hisparse(self, req: ReqRef) -> None:
        """A request still staging is aborted (``abort_staging_request``):
        ``free_hisparse`` of a view of its row frees the device pages its
        compressed tokens map to, at once; its logical pages stay."""
        row, length = self.model.requests[req.rid].row, self.model.tokens(req.rid, self.page_size)
        view = self.rows[row, :length]
        self._call(f"free_hisparse(req_to_token[{row}, :{length}])", self.allocator.free_hisparse, view)
        self.device.release(self.model.requests[req.rid].pages, "free", defer=False)
        self.settled.add(req.rid)

    @step
    def finish(self, req: ReqRef) -> None:
        """The request ends: its device buffer, if any, goes back
        (``free_hisparse_indices``, the coordinator's ``request_finished``),
        then its row is freed as in the SWA family."""
        self._return_buffer(req, self.c4_page_size)
        super().finish(req)
        self.settled.discard(req.rid)

    @step
    def begin(self) -> None:
        super().begin()
        self.device.begin()

    @step
    def end(self) -> None:
        """``free_group_end()``, also when no group is open."""
        super().end()
        self.device.end()

    # -- what the rules may act on --

    def decodable(self) -> list[ReqRef]:
        """Requests the coordinator has made ready: with a device buffer, or
        preallocated by PD decode (their compressed tokens map nothing more)."""
        return [r for r in super().decodable() if r.rid in self.device.buffers or r.rid in self.preallocated]

    def tail_ready(self) -> list[ReqRef]:
        return [r for r in super().tail_ready() if r.rid not in self.settled]

    def live_own(self, req: ReqRef) -> int:
        """Own pages the window may slide past: as the SWA family's, and
        only up to the first with a device peer."""
        own = self.model.requests[req.rid].own
        first = self._slid(own)
        limit = super().live_own(req)
        return next((i for i in range(limit) if own[first + i] in self.device.mapping), limit)

    def swa_evictable(self) -> list[EntryRef]:
        return [e for e in super().swa_evictable() if not any(p in self.device.mapping for p in self.model.cache[e.eid].pages)]

    def unbuffered(self) -> list[ReqRef]:
        return [r for r in self.live() if r.rid not in self.device.buffers and self.model.requests[r.rid].pages]

    def buffer_shortfall(self, req: ReqRef, pages: int) -> int:
        """Fresh device pages a buffer of ``pages`` pages takes."""
        return buffer_plan(self._device_slots(req), pages * self.c4_page_size, self.c4_page_size).fresh

    def step_not_applicable(self, rule: str, args: dict) -> str | None:
        """Why a replayed step is one this family's rules never draw."""
        req = args.get("req")
        if why := self.prefill_step_not_applicable(rule, args):
            return why
        if rule == "free_segment" and args["start"] + args["n"] < self.model.tokens(req.rid, self.page_size):
            return "a caller frees a request's tail up to its length: a segment ends past every written token"
        if rule == "decode" and any(r not in self.decodable() for r in args["reqs"]):
            return "a request decodes once the coordinator made it ready (its device buffer)"
        if rule in ("device_buffer_pages", "free_hisparse") and req.rid in self.device.buffers:
            return f"{req!r} already has a device buffer"
        if rule == "device_buffer_pages" and self.buffer_shortfall(req, args["pages"]) > self.device.num_free:
            return f"the device pool cannot make up {req!r}'s buffer"
        if rule == "slide" and args["pages"] > self.live_own(req):
            return f"{req!r}'s window would slide past a page with a device peer"
        return super().step_not_applicable(rule, args)


class DSV4HiSparseMachine(SWAMachine):
    """The SWA rules over a DeepSeek V4 HiSparse wrapper, plus device buffers and aborts."""

    def segment_trim_room(self, request) -> int:
        # A caller frees a request's tail up to its length, so a segment ends
        # mid-page only in the page's unused part, past every compressed token.
        return request.spare + 1

    # The radix cache inserts whole pages, and a radix match extends a
    # prefix with entries it does not hold yet (an entry twice in one row
    # would hand alloc_device_buffer a slot twice).
    @draws(guard=lambda s: s.aligned(), which=PICKS, dup=(0, MAX_PAGES), entry=PICKS)
    def rematch(self, which, dup, entry):
        s = self.state
        rematch_among(self, s.aligned(), which, dup, entry, lambda req, e: e.eid not in s.model.requests[req.rid].locks)

    @draws(guard=lambda s: s.unbuffered(), which=PICKS, pages=(1, 6))
    def device_buffer_pages(self, which, pages):
        s = self.state
        req = _pick(s.unbuffered(), which)
        if s.buffer_shortfall(req, pages) <= s.device.num_free:
            self._do("device_buffer_pages", req, pages)

    @draws(guard=lambda s: s.unbuffered(), which=PICKS)
    def free_hisparse(self, which):
        self._do("free_hisparse", _pick(self.state.unbuffered(), which))


def map_growth(state: Lockstep, side: DeviceSide, mapping: torch.Tensor, what: str, spans, ratio: int, page_size: int,
               name: str, label: str) -> None:
    """After an allocation that grew each ``(req, prefix_len, seq_len)`` of
    ``spans`` (a request that did not reach ``seq_len`` grew nothing), judge
    and record on ``side`` the device slots its tokens (every ``ratio``-th,
    compressed) were mapped to: a page already on a device page fills its
    next slots, a page given its first token takes a fresh device page
    (read off ``mapping``, ``page_size`` slots a page)."""
    hps = page_size
    fresh, fills = [], []
    for req, prefix_len, seq_len in spans:
        request = state.model.requests.get(req.rid) if req is not None else None
        if request is None or state.model.tokens(req.rid, state.page_size) < seq_len:
            continue
        for index, filled in compressed_growth(prefix_len, seq_len, ratio, hps).items():
            page = request.pages[index]
            if page in side.mapping:
                side.fill(page, filled - side.filled_slots(page, hps), hps)
            else:
                fresh.append(page)
                fills.append(filled)
    if not fresh:
        return
    slots = torch.tensor([p * hps + k for p in fresh for k in range(hps)], dtype=torch.int64)
    mapped = ids(mapping.to("cpu")[slots])
    got = [mapped[i * hps : (i + 1) * hps] for i in range(len(fresh))]
    state._judge(invariants.compressed_new_pages_mapped, what, fresh, got, fills, hps, label=label)
    device_pages = [g[0] // hps for g in got]
    state._judge(invariants.no_slot_handed_out_twice, device_pages, side, name=name, label=label)
    side.take(fresh, device_pages, fills)


def is_dsv4_hisparse(allocator) -> bool:
    """Whether an allocator is sglang's DeepSeek V4 HiSparse wrapper (an SWA
    pair under ``logical_attn_allocator``, a compressed device pool)."""
    return hasattr(allocator, "hisparse_page_size") and hasattr(getattr(allocator, "logical_attn_allocator", None), "swa_attn_allocator")
