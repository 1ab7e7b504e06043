"""The lockstep harness for Mamba state slots (the "mamba" family).

A Mamba slot allocator (sglang's ``MambaSlotAllocator``) hands out whole
slots, one request state each, plus its ping-pong track slots: page size
1, census ``free_slots``, no free groups (frees are released at once), no
segments.  The harness keeps each request's slots in a row of its real
table (as ``req_index_to_mamba_index_mapping`` and the track-buffer rows
are kept) and frees views of it; the core steps ``alloc``, ``free``,
``finish``, ``overwrite_row``, ``rematch`` and ``evict`` run as they are,
against ``MambaModel``.  It adds the *allocation* group
(``alloc_group_begin(n)`` / ``alloc_group_end()``), as the scheduler opens
one around each prefill batch: inside it ``alloc(1)`` may hand out one of
the ``n`` pre-allocated slots, and the end returns those not drawn.
Allocation groups do not nest: sglang's only caller closes each before the
next (``scheduler.py``), and ``alloc_group_begin`` with one open would drop it.
"""

from __future__ import annotations

from attrs import define

from reference_model import invariants
from reference_model.mamba import MambaModel
from state_machines.harness.lockstep import Lockstep, census_of, pool_ids, read_census
from state_machines.harness.machines import MAX_PAGES, FreeGroupMachine, _pick, draws
from state_machines.harness.steps import step


@define
class MambaLockstep(Lockstep):
    # What a Mamba slot allocator lacks: free groups, segments; its slots
    # are per request, so no token-batched decode or extend (nor admit).
    begin = end = free_segment = decode = extend = admit = None
    caller_steps = ()

    def start_models(self, defers_frees: bool) -> None:
        initial = self._call("census", census_of, self.allocator)
        self.model = MambaModel.from_census(pool_ids(initial)[0], defers_frees=defers_frees)

    @property
    def in_alloc_group(self) -> bool:
        return self.model.reserved is not None

    # -- the hooks every alloc goes through --

    def _short(self, pages: int) -> bool:
        """A single slot inside a group with slots left is never short."""
        return self.model.num_free < pages and not (pages == 1 and self.model.reserved)

    def _judge_handout(self, pages: list[int]) -> None:
        self._judge(invariants.slots_were_available, pages, self.model)

    # -- steps --

    @step
    def alloc_group_begin(self, n: int) -> None:
        """``alloc_group_begin(n)``: pre-allocate ``n`` slots (a prefill
        batch's waiting requests) that ``alloc(1)`` then hands out; with
        fewer than ``n`` free, none (or at most the free ones)."""
        free = self.model.num_free
        self._call(f"alloc_group_begin({n})", self.allocator.alloc_group_begin, n)
        taken, back = self._call("census", read_census, self.allocator, self.model).change(self.model)
        self._judge(invariants.alloc_group_reserves, n, taken, back, free)
        self.model.group_begin(taken)

    @step
    def alloc_group_end(self) -> None:
        """``alloc_group_end()``: the pre-allocated slots no alloc drew go
        back; with no group open, nothing."""
        self._call("alloc_group_end()", self.allocator.alloc_group_end)
        self.model.group_end()

    def teardown(self) -> None:
        """Close any open allocation group; the final state must still check out."""
        if self.in_alloc_group:
            self.alloc_group_end()

    def step_not_applicable(self, rule: str, args: dict) -> str | None:
        """Why a replayed step is one this family's rules never draw."""
        if rule == "alloc" and args.get("prefix") is not None:
            return "a Mamba request does not start on a cached prefix's slots"
        if rule == "alloc_group_begin" and self.in_alloc_group:
            return "an allocation group is already open"
        return None


class MambaMachine(FreeGroupMachine):
    """Requests' slots, a cache of slots, allocation groups; no free groups."""

    begin = end = free_segment = None

    @draws(pages=(1, MAX_PAGES), who=(0, 4))
    def alloc(self, pages, who):
        # who: 0 starts a request (a state slot, and track slots when pages > 1);
        # 1..4 gives a live one more.  Shrinks toward a new request.
        s = self.state
        live = [r for r in s.live() if s.room(r) > 0]
        if (who and live) or not s.free_rows():
            if live:
                req = _pick(live, who)
                self._do("alloc", min(pages, s.room(req)), req=req)
            return
        self._do("alloc", pages)

    @draws(guard=lambda s: not s.in_alloc_group, n=(0, MAX_PAGES + 2))
    def alloc_group_begin(self, n):
        self._do("alloc_group_begin", n)

    # Always enabled, also with no group open, like the core's end.
    @draws()
    def alloc_group_end(self):
        self._do("alloc_group_end")


def is_mamba(allocator) -> bool:
    """Whether an allocator has allocation groups and no free groups."""
    return callable(getattr(allocator, "alloc_group_begin", None)) and not callable(getattr(allocator, "free_group_begin", None))

