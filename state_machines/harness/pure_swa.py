"""The lockstep harness for pure-SWA pools (the "pure_swa" family).

Every layer is windowed: one pool (sglang's ``PureSWATokenToKVPoolAllocator``
keeps it as ``swa_attn_allocator``, which is also its
``full_attn_allocator``), checked as the core checks one, against the core
``OwnershipModel``.  A window slide (``slide``: ``free_swa`` or
``free_swa_segment`` of the request's oldest own pages) gives pages back for
good; when the request finishes, the slid span goes to ``free_full`` (or
``free_full_segment``) as sglang's callers send it there, and must release
nothing.  A request whose window slid is not inserted into the cache
(``rematch``): the pure-SWA radix cache keeps only what is still in the window.
"""

from __future__ import annotations

from attrs import define, field

from reference_model import hooks as hook_checks
from reference_model import invariants
from reference_model import pure_swa as windows
from reference_model.census import Census
from state_machines.harness import hooks
from state_machines.harness.drawing import rematch_among
from state_machines.harness.lockstep import Lockstep, Pool, ids
from state_machines.harness.machines import MAX_PAGES, PICKS, FreeGroupMachine, _pick, draws
from state_machines.harness.steps import ReqRef, step
from state_machines.harness.swa import EMPTY_FREES, free_swa_defers, free_swa_view, judge_swa_counts


@define
class PureSWALockstep(Lockstep):
    # Request -> how many of its pages, right after its cache prefix, slid
    # out of the window (the model keeps them at the end of its prefix).
    slid: dict[int, int] = field(factory=dict)
    # Whether free_swa() inside an open group queues (see window_free_defers).
    swa_defers: bool = True
    # The scheduler's hooks, the SWA ones too: one pool answers for both sides.
    hook_steps = hooks.HOOK_STEPS
    asked_hooks = hooks.CORE_HOOKS + hooks.SWA_HOOKS
    empty_frees = EMPTY_FREES

    def start_models(self, defers_frees: bool) -> None:
        super().start_models(defers_frees)
        self.swa_defers = window_free_defers(self.allocator)

    @property
    def pool(self):
        """The one pool: ``swa_attn_allocator`` where the allocator wraps one."""
        return getattr(self.allocator, "swa_attn_allocator", self.allocator)

    def pools(self) -> list[Pool]:
        return [Pool(self.pool, self.model)]

    def check_joint(self, censuses: list[Census]) -> None:
        """A wrapper reports its pool's available size."""
        if self.pool is not self.allocator:
            self._judge(
                invariants.pool_available_size_agrees,
                self._count("available_size()", self.allocator.available_size),
                self._count("swa_attn_allocator.available_size()", self.pool.available_size),
                "swa_attn_allocator",
            )

    # -- steps --

    @step
    def slide(self, req: ReqRef, pages: int, segment: bool = False) -> None:
        """The window slides past the request's ``pages`` oldest own pages:
        ``free_swa`` (or ``free_swa_segment``) of a view of them releases
        them, or queues them inside an open group."""
        request = self.model.requests[req.rid]
        row, start = request.row, len(request.prefix) * self.page_size
        end = start + pages * self.page_size
        free_swa_view(self, row, start, end, segment)
        windows.slide(self.model, req.rid, pages, defer=self.swa_defers)
        self.slid[req.rid] = self.slid.get(req.rid, 0) + pages

    @step
    def finish(self, req: ReqRef) -> None:
        """The request ends: its slid span goes to ``free_full_segment`` (or
        ``free_full``) where the allocator has one, then its own slots to
        ``free()``, each a view of its row."""
        slid = self.slid.pop(req.rid, 0)
        request = self.model.requests[req.rid]
        names = [n for n in ("free_full_segment", "free_full") if self.provides(n)]
        if slid and names:
            row, end = request.row, len(request.prefix) * self.page_size
            start = end - slid * self.page_size
            view = self.rows[row, start:end]
            if names[0] == "free_full_segment":
                self._call(f"free_full_segment(req_to_token[{row}, {start}:{end}], start_pos={start})",
                           lambda: self.allocator.free_full_segment(view, start_pos=start))
            else:
                self._call(f"free_full(req_to_token[{row}, {start}:{end}])", self.allocator.free_full, view)
        super().finish(req)

    # -- the scheduler's hooks: the full and SWA sides are one pool --

    def _available_tokens(self) -> tuple[int, int | None]:
        free = self.model.num_free * self.page_size
        return free, free

    def _judge_family_hook(self, hook: str, got, tokens: int, full: int, swa: int | None, asked) -> bool:
        """The SWA hooks over one pool: both sides report its counts, a
        transfer addresses the full ids themselves (no mapping), and a PD
        preallocation reclaims the SWA side only."""
        if judge_swa_counts(self, hook, got, tokens, full, swa, asked):
            return True
        if hook == "translate_swa_indices_for_transfer":
            self._judge(hook_checks.hook_answer_agrees, hook, ids(got), ids(self._transfer_ids()[0]))
        elif hook in ("size_swa", "size"):
            self._judge(hook_checks.hook_answer_agrees, hook, got, self.model.capacity * self.page_size)
        else:
            return False
        return True

    def _give_back_segments(self, row: int, start: int, end: int, pages: list[int], cut: int) -> None:
        """As ``free_kv_row_segments`` splits a row: the slid span (the end
        of the model's prefix) goes to ``free_full_segments``, which must
        release nothing, the rest to ``free_segments``."""
        slid = self.slid.pop(self.row_holder[row], 0)
        if slid and self.provides("free_full_segments"):
            self._free_segments("free_full_segments", row, start - slid * self.page_size, start, 0)
        self._free_segments("free_segments", row, start, end, cut)

    def _rebuilt(self, free_pages: list[int]) -> None:
        super()._rebuilt(free_pages)
        self.slid.clear()

    # -- what the rules may act on --

    def slidable(self) -> list[ReqRef]:
        return self.with_own_pages()

    def live_own(self, req: ReqRef) -> int:
        """Own pages still in the window."""
        return len(self.model.requests[req.rid].own)

    def rematchable(self) -> list[ReqRef]:
        return [r for r in self.with_own_pages() if not self.slid.get(r.rid)]

    def step_not_applicable(self, rule: str, args: dict) -> str | None:
        """Why a replayed step is one this family's rules never draw."""
        req = args.get("req")
        if rule == "rematch" and req is not None and self.slid.get(req.rid):
            return f"{req!r}'s window slid: the pure-SWA cache does not take it"
        return None


def window_free_defers(allocator) -> bool:
    """Whether ``free_swa()`` inside an open free group queues (True) or
    releases at once (False, sglang 0.5.17), probed on a throwaway copy
    (``free_swa_defers`` over the one pool).  Both are sound: an immediate
    release reads the caller's view at once."""
    return free_swa_defers(allocator, swa_pool=lambda a: a, one_page=lambda a: a.alloc(1))


class PureSWAMachine(FreeGroupMachine):
    """The core rules over a pure-SWA pool, plus window slides; a request
    whose window slid is not rematched."""

    @draws(guard=lambda s: s.slidable(), which=PICKS, pages=(1, MAX_PAGES), segment=bool)
    def slide(self, which, pages, segment):
        s = self.state
        req = _pick(s.slidable(), which)
        self._do("slide", req, min(pages, s.live_own(req)), segment=segment)

    @draws(guard=lambda s: s.rematchable(), which=PICKS, dup=(0, MAX_PAGES), entry=PICKS)
    def rematch(self, which, dup, entry):
        rematch_among(self, self.state.rematchable(), which, dup, entry)


def is_pure_swa(allocator) -> bool:
    """Whether an allocator has sglang's SWA names over one pool."""
    full = getattr(allocator, "full_attn_allocator", None)
    return full is not None and full is getattr(allocator, "swa_attn_allocator", None)
