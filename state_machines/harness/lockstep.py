"""One allocator and the ownership model, driven side by side.

``Lockstep`` owns a real ``req_to_token`` tensor and passes *views* of its
rows to the allocator, as sglang's callers do: that is how a queue that
aliases the caller's tensor shows up.  Each public method is one step
(``alloc``, ``begin``, ``free``, ``free_segment``, ``overwrite_row``,
``rematch``, ``evict``, ``finish``, ``end``); it drives the allocator and
the model, records itself, and then checks every invariant.  A printed
trace is a program of these calls, so it can be pasted and run.
"""

from __future__ import annotations

import signal
import threading
import traceback
from contextlib import contextmanager
from typing import Any

import torch
from attrs import define, field, frozen

from reference_model import CHECKS, OwnershipModel, no_slot_handed_out_twice
from state_machines import targets
from state_machines.targets import devices
from state_machines.config import Config

# An allocator call that takes longer than this is reported as a hang.
CALL_TIMEOUT_S = 10.0


@frozen(repr=False)
class ReqRef:
    """A request, as a trace names it: ``req_0``."""

    rid: int

    def __repr__(self) -> str:
        return f"req_{self.rid}"


@frozen(repr=False)
class EntryRef:
    """A prefix-cache entry, as a trace names it: ``cache_0``."""

    eid: int

    def __repr__(self) -> str:
        return f"cache_{self.eid}"


@frozen
class Step:
    """One recorded call: ``rule`` with its ``args``; ``returns`` names what
    it created (``req_0``), if anything."""

    rule: str
    args: dict
    returns: str | None = None

    def to_dict(self) -> dict:
        return {"rule": self.rule, "args": self.args, "returns": self.returns}

    def call_text(self) -> str:
        """The step as a line of a replayable program: ``req_0 = state.alloc(n=3)``."""
        args = ", ".join(f"{k}={v}" if _is_ref(v) else f"{k}={v!r}" for k, v in self.args.items())
        call = f"state.{self.rule}({args})"
        return f"{self.returns} = {call}" if self.returns else call


class InvariantViolation(AssertionError):
    """An invariant failed, or the allocator raised or hung.

    Each invariant has its own subclass (see ``violation_type``), so
    Hypothesis tells distinct bugs apart and shrinks each one.
    """

    invariant = "invariant"

    def __init__(self, detail: str, steps: list[Step], config: Config):
        super().__init__(f"{self.invariant}: {detail}")
        self.detail = detail
        self.steps = list(steps)
        self.config = config


_VIOLATION_TYPES: dict[str, type[InvariantViolation]] = {}


def violation_type(invariant: str) -> type[InvariantViolation]:
    if invariant not in _VIOLATION_TYPES:
        name = "".join(part.title() for part in invariant.split("_")) + "Violation"
        _VIOLATION_TYPES[invariant] = type(name, (InvariantViolation,), {"invariant": invariant})
    return _VIOLATION_TYPES[invariant]


def _ids(t) -> list[int]:
    return t.detach().to("cpu").reshape(-1).tolist()


def census_of(allocator) -> list[int]:
    """The allocator's free pages, with repeats: ``get_all_free_pages()``
    where it has one, else its ``free_pages``, ``release_pages`` and
    ``staged_pages`` containers."""
    get_all = getattr(allocator, "get_all_free_pages", None)
    if callable(get_all):
        pages = get_all()
        if pages is not None:
            return _ids(pages)
    out: list[int] = []
    for name in ("free_pages", "release_pages", "staged_pages"):
        part = getattr(allocator, name, None)
        if isinstance(part, torch.Tensor):
            out += _ids(part)
        elif isinstance(part, (list, tuple)):
            for t in part:
                out += _ids(t)
    return out


def _on_alarm(signum, frame):
    raise TimeoutError(f"no return within {CALL_TIMEOUT_S:g} s")


@contextmanager
def _deadline(seconds: float):
    """Interrupt a hung allocator call (main thread only; elsewhere, no limit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return
    # Installed once; restoring another handler per call costs more than the call.
    if signal.getsignal(signal.SIGALRM) is not _on_alarm:
        signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


@define
class Lockstep:
    """The harness state: allocator, model, real rows, recorded steps."""

    config: Config
    allocator: Any
    model: OwnershipModel
    # req_to_token: one row per request slot, holding its kv slot ids.
    rows: torch.Tensor
    # Which request holds each row; None when the row is unused.
    row_holder: list[int | None]
    # The cache's own copy of each entry's slot ids.
    entry_slots: dict[int, torch.Tensor] = field(factory=dict)
    steps: list[Step] = field(factory=list)
    in_group: bool = False
    has_free_segment: bool = True
    has_alloc_decode: bool = False
    # Rules the target cannot run here, with the reason (Target.rule_gate).
    disabled_rules: dict[str, str] = field(factory=dict)

    @classmethod
    def build(cls, config: Config | None = None, **overrides) -> Lockstep:
        """A fresh allocator and model.  Raises ``TargetError`` on bad input."""
        config = config or Config(**overrides)
        target = targets.resolve(config.target, config.mutant, config.sglang_path)
        if cls is Lockstep and target.family != "free_group":
            # The target's family picks the harness, so replays rebuild the right one.
            from state_machines.harness.swa import lockstep_for_family

            return lockstep_for_family(target.family).build(config)
        devices.require(config.device)
        allocator = targets.build(
            target,
            size=config.pool_size,
            page_size=config.page_size,
            device=config.device,
            need_sort=config.need_sort,
        )
        state = cls(
            config=config,
            allocator=allocator,
            model=OwnershipModel(owner={}, defers_frees=target.defers_frees),
            rows=torch.zeros(
                (config.rows, config.row_pages * config.page_size), dtype=torch.int64, device=config.device
            ),
            row_holder=[None] * config.rows,
            has_free_segment=callable(getattr(allocator, "free_segment", None)),
            disabled_rules=target.rule_gate(allocator) if target.rule_gate else {},
        )
        state.has_alloc_decode = callable(getattr(allocator, "alloc_decode", None)) and "decode" not in state.disabled_rules
        initial = state._call("get_all_free_pages", census_of, state.pool())
        state.model = OwnershipModel.from_census(sorted(set(initial)), defers_frees=target.defers_frees)
        state.check()
        return state

    @property
    def page_size(self) -> int:
        return self.config.page_size

    def pool(self):
        """The allocator whose census the model starts from (SWA: the full pool)."""
        return self.allocator

    # -- what a rule may act on --

    def free_rows(self) -> list[int]:
        return [r for r, holder in enumerate(self.row_holder) if holder is None]

    def live(self) -> list[ReqRef]:
        return [ReqRef(rid) for rid in self.model.requests]

    def with_own_pages(self) -> list[ReqRef]:
        return [ReqRef(r.rid) for r in self.model.requests.values() if r.own]

    def entries(self) -> list[EntryRef]:
        return [EntryRef(eid) for eid in self.model.cache]

    def evictable(self) -> list[EntryRef]:
        return [EntryRef(eid) for eid in self.model.evictable()]

    def stale_rows(self) -> list[int]:
        """Rows holding slot ids past what a live request uses."""
        stale = []
        for row, holder in enumerate(self.row_holder):
            used = len(self.model.requests[holder].pages) * self.page_size if holder is not None else 0
            if bool(self.rows[row, used:].any()):
                stale.append(row)
        return stale

    def room(self, req: ReqRef) -> int:
        """Pages the request's row can still take."""
        return self.config.row_pages - len(self.model.requests[req.rid].pages)

    # -- steps --

    def alloc(self, n: int, req: ReqRef | None = None, prefix: EntryRef | None = None) -> ReqRef | None:
        """A new request of ``n`` slots (after ``prefix``'s, if given), or an
        extend of ``req`` by ``n`` slots.  Returns the new request."""
        ps = self.page_size
        step = self._record("alloc", n=n, req=req, prefix=prefix)
        want_pages = n // ps
        short = self._short(want_pages)
        out = self._call(f"alloc({n})", self.allocator.alloc, n)
        if self._none_iff_short(f"alloc({n})", out, short, want_pages):
            self.check()
            return None
        slots = _ids(out)
        pages = self._pages_of_alloc(n, slots)
        if problem := no_slot_handed_out_twice(pages, self.model):
            self._fail("no_slot_handed_out_twice", problem)
        if req is None:
            row = self.free_rows()[0]
            entry = self.model.cache[prefix.eid] if prefix is not None else None
            start = len(entry.pages) * ps if entry else 0
            if entry:
                self.rows[row, :start] = self.entry_slots[prefix.eid]
            made = self.model.new_request(row, pages, prefix.eid if prefix is not None else None)
            self.row_holder[row] = made.rid
            req = ReqRef(made.rid)
            step = self._returns(step, req)
        else:
            self.model.take(req.rid, pages)
            row = self.model.requests[req.rid].row
            start = (len(self.model.requests[req.rid].pages) - want_pages) * ps
        self.rows[row, start : start + n] = out.to(self.rows.device)
        self.check()
        return req

    def decode(self, reqs: str) -> None:
        """``alloc_decode``: each request in the batch (``'req_0,req_2'``, in
        batch order) grows by one token; a request takes a new page exactly
        when its length crosses a page boundary, else it gets the next slot
        of its last page."""
        # A pasted program passes one request as a ReqRef, not a string.
        reqs = reqs if isinstance(reqs, str) else repr(reqs)
        self._record("decode", reqs=reqs)
        ps = self.page_size
        batch = [ReqRef(int(name.strip().partition("_")[2])) for name in reqs.split(",")]
        lengths = [self.model.tokens(r.rid, ps) for r in batch]
        rows = [self.model.requests[r.rid].row for r in batch]
        last = [int(self.rows[row, n - 1]) if n else -1 for row, n in zip(rows, lengths)]
        needs = [self.model.decode_needs_page(r.rid, ps) for r in batch]
        want = sum(needs)
        short = self._short(want)
        seq_lens_cpu = torch.tensor([n + 1 for n in lengths], dtype=torch.int64)
        seq_lens = seq_lens_cpu.to(self.rows.device)
        last_loc = torch.tensor(last, dtype=torch.int64, device=self.rows.device)
        what = f"alloc_decode(seq_lens={seq_lens_cpu.tolist()}, last_loc={last})"
        out = self._call(what, self.allocator.alloc_decode, seq_lens, seq_lens_cpu, last_loc)
        if self._none_iff_short(what, out, short, want):
            self.check()
            return
        slots = _ids(out)
        if len(slots) != len(batch):
            self._fail("decode_one_slot_per_request", f"{what} returned {len(slots)} slots / {len(batch)} requests")
        new_pages = []
        for ref, need, prev, slot in zip(batch, needs, last, slots):
            if need and slot % ps:
                self._fail("decode_takes_page_boundary", f"{what} gave {ref!r} slot {slot} mid-page / the first slot of a new page of {ps}")
            if not need and slot != prev + 1:
                self._fail("decode_takes_page_boundary", f"{what} gave {ref!r} slot {slot} / the next slot of its page, {prev + 1}")
            if need:
                new_pages.append(slot // ps)
        if problem := no_slot_handed_out_twice(new_pages, self.model):
            self._fail("no_slot_handed_out_twice", problem)
        offsets = torch.arange(ps, dtype=torch.int64, device=self.rows.device)
        for ref, need, slot in zip(batch, needs, slots):
            request = self.model.requests[ref.rid]
            if need:
                # The row holds whole pages; later decodes fill the rest of this one.
                self.rows[request.row, len(request.pages) * ps : (len(request.pages) + 1) * ps] = slot + offsets
            self.model.decode(ref.rid, slot // ps if need else None, ps)
        self.check()

    def begin(self) -> None:
        self._record("begin")
        self._call("free_group_begin()", self.allocator.free_group_begin)
        self.model.begin()
        self.in_group = True
        self.check()

    def end(self) -> None:
        """``free_group_end()``, also when no group is open."""
        self._record("end")
        self._call("free_group_end()", self.allocator.free_group_end)
        self.model.end()
        self.in_group = False
        self.check()

    def free(self, req: ReqRef, n: int) -> None:
        """``free()`` of a view of the request's last ``n`` own slots."""
        self._record("free", req=req, n=n)
        row, length = self._row_of(req)
        self._call(f"free(req_to_token[{row}, {length - n}:{length}])", self.allocator.free, self.rows[row, length - n : length])
        self.model.release_tail(req.rid, n // self.page_size)
        self.check()

    def free_segment(self, req: ReqRef, start: int, n: int) -> None:
        """``free_segment()`` of a view ``row[start : start + n]``: ``start``
        is page-aligned and the segment runs to the request's last page,
        perhaps ending mid-page."""
        self._record("free_segment", req=req, start=start, n=n)
        row, length = self._row_of(req)
        self._free_segment(row, start, n)
        self.model.release_tail(req.rid, length // self.page_size - start // self.page_size)
        self.check()

    def overwrite_row(self, row: int) -> None:
        """Zero the part of ``row`` no live request uses, as sglang's tests do
        after queuing a free (the whole row when it is unused)."""
        self._record("overwrite_row", row=row)
        holder = self.row_holder[row]
        used = len(self.model.requests[holder].pages) * self.page_size if holder is not None else 0
        self.rows[row, used:] = 0
        self.check()

    def rematch(self, req: ReqRef, dup: int, entry: EntryRef | None = None) -> EntryRef | None:
        """``cache_unfinished_req``: insert the request's own pages into the
        cache; the first ``dup`` of them the cache already held (in ``entry``),
        so free that span as a view, overwrite it with the cache's slots, and
        move the lock.  Returns the new cache entry, if any."""
        step = self._record("rematch", req=req, dup=dup, entry=entry)
        ps = self.page_size
        row, length = self._row_of(req)
        protected = len(self.model.requests[req.rid].prefix) * ps
        dup_end = protected + dup * ps
        new_slots = self.rows[row, dup_end:length].clone()
        if dup:
            self._free_segment(row, protected, dup * ps)
            self.rows[row, protected:dup_end] = self.entry_slots[entry.eid][: dup * ps]
        return self._cache_rest(step, req, dup, entry, new_slots)

    def _cache_rest(self, step: Step, req: ReqRef, dup: int, entry: EntryRef | None, new_slots) -> EntryRef | None:
        """The model side of a rematch: the request's pages past ``dup``
        become a cache entry holding ``new_slots``; then every check."""
        made = self.model.rematch(req.rid, dup, entry.eid if entry is not None else None)
        result = None
        if made is not None:
            self.entry_slots[made.eid] = new_slots
            result = EntryRef(made.eid)
            self._returns(step, result)
        self.check()
        return result

    def evict(self, entry: EntryRef) -> None:
        """The cache evicts an unlocked entry: ``free()`` of its own tensor."""
        self._record("evict", entry=entry)
        slots = self.entry_slots.pop(entry.eid)
        self._call(f"free({entry!r} slots)", self.allocator.free, slots)
        self.model.evict(entry.eid)
        self.check()

    def finish(self, req: ReqRef) -> None:
        """The request ends: ``free()`` of a view of its own slots; its row is
        left as it is, for the next request to reuse."""
        self._record("finish", req=req)
        row, length = self._row_of(req)
        protected = len(self.model.requests[req.rid].prefix) * self.page_size
        if length > protected:
            self._call(f"free(req_to_token[{row}, {protected}:{length}])", self.allocator.free, self.rows[row, protected:length])
        self.model.finish(req.rid)
        self.row_holder[row] = None
        self.check()

    # -- checks --

    def check(self) -> None:
        """Every invariant, in ``CHECKS`` order; the first failure raises."""
        census = self._call("get_all_free_pages()", census_of, self.allocator)
        available = self._call("available_size()", self.allocator.available_size)
        for predicate in CHECKS:
            if problem := predicate(census, int(available), self.page_size, self.model):
                self._fail(predicate.__name__, problem)

    def teardown(self) -> None:
        """Close any open group; the final state must still check out."""
        if self.in_group:
            self.end()

    # -- helpers --

    def _none_iff_short(self, what: str, out, short: bool, want: int) -> bool:
        """Whether the call returned None, which it must exactly when the
        model is short of ``want`` pages; fails the run otherwise."""
        if (out is None) != short:
            got = "None" if out is None else f"{len(_ids(out))} slots"
            only = "only " if short else ""
            self._fail("alloc_none_iff_short", f"{what} returned {got} / model has {only}{self.model.num_free} free pages, needs {want}")
        return out is None

    def _short(self, pages: int) -> bool:
        """Whether an alloc of ``pages`` pages must return None."""
        return self.model.num_free < pages

    def _row_of(self, req: ReqRef) -> tuple[int, int]:
        request = self.model.requests[req.rid]
        return request.row, len(request.pages) * self.page_size

    def _free_segment(self, row: int, start: int, n: int) -> None:
        view = self.rows[row, start : start + n]
        what = f"free_segment(req_to_token[{row}, {start}:{start + n}], start_pos={start})"
        if self.has_free_segment:
            self._call(what, lambda: self.allocator.free_segment(view, start_pos=start))
        else:
            self._call(what.replace("free_segment", "free").replace(f", start_pos={start}", ""), self.allocator.free, view)

    def _pages_of_alloc(self, n: int, slots: list[int]) -> list[int]:
        ps = self.page_size
        whole = len(slots) == n and all(
            slots[i] // ps == slots[i - i % ps] // ps and slots[i] % ps == i % ps for i in range(len(slots))
        )
        if not whole:
            self._fail("alloc_returns_whole_pages", f"alloc({n}) returned {slots[:16]} / {n} slots in whole pages of {ps}")
        return [slots[i] // ps for i in range(0, n, ps)]

    def _record(self, rule: str, **args) -> Step:
        step = Step(rule, {k: _arg(v) for k, v in args.items() if v is not None})
        self.steps.append(step)
        return step

    def _returns(self, step: Step, ref) -> Step:
        named = Step(step.rule, step.args, repr(ref))
        self.steps[-1] = named
        return named

    def _call(self, what: str, fn, *args):
        limit = self.config.call_timeout_s
        try:
            with _deadline(limit):
                return fn(*args)
        except InvariantViolation:
            raise
        except TimeoutError:
            self._fail("allocator_hung", f"{what} hung: no return within {limit:g} s")
        except (Exception, KeyboardInterrupt, SystemExit) as exc:
            # The allocator's own KeyboardInterrupt or SystemExit is its failure too;
            # only where SIGINT has Python's default handler can a real Ctrl-C land
            # inside the call, and that stops the run.
            if isinstance(exc, KeyboardInterrupt) and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                raise
            where = traceback.extract_tb(exc.__traceback__)[-1]
            self._fail(
                "allocator_raised",
                f"{what} raised {type(exc).__name__}: {exc} (at {where.filename}:{where.lineno})",
            )

    def _fail(self, invariant: str, detail: str):
        raise violation_type(invariant)(detail, self.steps, self.config)


def _is_ref(value) -> bool:
    return isinstance(value, str) and value.partition("_")[0] in ("req", "cache") and value.partition("_")[2].isdigit()


def _arg(value):
    if isinstance(value, (ReqRef, EntryRef)):
        return repr(value)
    return value
