"""The lockstep harness for a unified sub-pool (the "unified" family).

sglang's ``MultiEndedAllocator`` (``unified_sub_pool.py``, 0.5.20 on) hands
out *virtual* page ids and binds each to a physical page of a byte arena
it shares with other sub-pools.  The core steps run as they are on the
virtual ids (census ``free_virtual_ids``, the ``OwnershipModel``); after
every step this harness also reads the physical side (``PageTables``: the
v2p/p2v tables, the watermark span, the holes) and judges it with the
predicates of ``reference_model.unified``.  It writes each live virtual
page's KV, as a forward would, into the KV pool stand-in (a stamp per
physical page), so a compaction move that loses the data or the mapping
shows.  Steps it adds: ``flush`` (``flush_for_allocation`` when urgent,
else ``flush_opportunistic``), ``alloc_physical`` (HiCache lends physical
pages with no virtual id) and ``free_physical`` (returns a loan, through
``cancel_physical_reservation`` where the allocator has it: the CPU path,
as no H2D copy was queued).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
from attrs import define, field

from reference_model import CHECKS, OwnershipModel
from reference_model import invariants as core
from reference_model import unified as ru
from state_machines.harness import twins
from state_machines.harness.lockstep import TENSOR_CENSUS_PAGES, Lockstep, ids, pool_ids
from state_machines.harness.machines import MAX_PAGES, FreeGroupMachine, draws
from state_machines.harness.steps import step


def virtual_census(allocator) -> list[int]:
    """The free virtual page ids, with repeats."""
    return ids(allocator.free_virtual_ids)


def page_tables(allocator, *, rows: bool = True) -> ru.PageTables:
    """The allocator's physical side as plain ints (either grow direction);
    without ``rows``, its bounds and pending pages only (no tables, no
    holes: what ``span_within_arena`` reads)."""
    wm, first, n = int(allocator.watermark_physical), int(allocator.min_page_index), int(allocator.num_pages)
    span = (first, wm) if allocator.grow_direction == "up" else (wm + 1, n)
    pending = sorted(getattr(allocator, "_pending_reuse_pages_cpu", ()) or ())
    return ru.PageTables(
        v2p=tuple(ids(allocator.virtual_to_physical)) if rows else (),
        p2v=tuple(ids(allocator.physical_to_virtual)) if rows else (),
        first_page=first,
        num_pages=n,
        span=span,
        holes=tuple(ids(allocator._free_phys_pages)) if rows else (),
        pending=tuple(pending),
    )


def arena_bytes(allocator) -> tuple[int, int]:
    """(bytes per physical page, the arena's bytes): sglang's allocator reads
    them off its unified buffer, the twin keeps them itself."""
    buffer = getattr(allocator, "unified_buffer", None)
    total = buffer.total_bytes if buffer is not None else allocator.total_bytes
    return int(allocator.entry_bytes_per_page), int(total)


CORE_CHECKS = tuple(c for c in CHECKS if c is not core.available_size_agrees)


def free_empty(state: Lockstep, segment: bool) -> None:
    """Free an empty view of row 0 through the allocator's ``free_segment``
    (at its page-aligned start 0) or ``free``."""
    view = state.rows[0, :0]
    if segment and state.has_free_segment:
        state._call("free_segment(empty)", lambda: state.allocator.free_segment(view, start_pos=0))
    else:
        state._call("free(empty)", state.allocator.free, view)


def judge_reader_views(state: Lockstep, allocator, universe, live: Callable[[], set[int]], pool=None) -> None:
    """What a forward and the invariant checker read off a pool with page
    tables, where it has the method: ``is_slot_allocated`` of each virtual
    page's first token (exactly the ``live()`` pages) and
    ``translate_kv_loc`` of its first and last token (through ``pool``'s
    v2p, ``allocator``'s own by default; an unmapped page to the sink 0)."""
    pool = allocator if pool is None else pool
    ps = state.page_size
    if callable(allocated := getattr(allocator, "is_slot_allocated", None)):
        said = {v: bool(state._call(f"is_slot_allocated({v * ps})", allocated, v * ps)) for v in sorted(universe)}
        state._judge(ru.slot_allocated_agrees, said, live())
    if callable(translate := getattr(allocator, "translate_kv_loc", None)):
        probes = [v * ps + o for v in sorted(universe) for o in sorted({0, ps - 1})]
        got = ids(state._call("translate_kv_loc()", translate, torch.tensor(probes, dtype=torch.int64)))
        v2p = tuple(ids(state._call("virtual_to_physical", lambda: pool.virtual_to_physical)))
        state._judge(ru.translation_follows_tables, probes, got, v2p, ps)


class Clears:
    """The ``clear`` step, for a harness whose models can start again
    (``_cleared``).  The scheduler's ``flush_cache`` (``scheduler.py``)
    runs only when it is fully idle: no request running or waiting, so no
    free or allocation group open and no HiCache load in flight; it resets
    the prefix cache (``tree_cache.reset()`` drops the entries, freeing
    nothing) and then calls the allocator's ``clear()``."""

    __slots__ = ()

    @step
    def clear(self) -> None:
        """``flush_cache``: the cache's entries dropped, then ``clear()``;
        afterwards every page of every pool is free again, as when the
        allocator was built, and every table is empty."""
        self._call("clear()", self.allocator.clear)
        self.model.clear()
        self.entry_slots.clear()
        self._cleared()

    def _cleared(self) -> None:
        """The family's other models after a clear (the core's is done)."""

    def clearable(self) -> bool:
        """Whether the scheduler may flush: no request live, no group open
        (a family adds what else must be idle)."""
        return not self.model.requests and not self.in_group

    def disable_clear(self) -> None:
        """Disable ``clear`` where the allocator has no ``clear()``."""
        if not callable(getattr(self.allocator, "clear", None)):
            self.disabled_rules["clear"] = f"{type(self.allocator).__name__} has no clear"


class ClearRules:
    """The machine rule for ``Clears``: drawn only where the scheduler may flush."""

    @draws(guard=lambda s: s.runs("clear") and s.clearable())
    def clear(self):
        self._do("clear")


class FreesNothing:
    """An empty free as a step of its own, ``free_nothing``, for the unified
    families, whose radix cache sends one inside a free group (they have no
    ``empty_frees``: ``free_empty_span`` is not theirs)."""

    __slots__ = ()
    empty_frees = ()

    @step
    def free_nothing(self, segment: bool) -> None:
        """``free_segment`` (or ``free``) of an empty view of a row, as the
        radix cache sends when a request duplicated nothing
        (``radix_cache.py`` ``cache_unfinished_req``: ``kv_indices[protected:prefix]``
        with the two equal); nothing changes hands."""
        free_empty(self, segment)


class FreeNothingRules:
    """The machine rule for ``FreesNothing``: drawn inside a group only
    (where the radix cache frees), so it does not crowd out the steps a
    compaction bug needs."""

    @draws(guard=lambda s: s.in_group, segment=bool)
    def free_nothing(self, segment):
        self._do("free_nothing", segment)


@define
class UnifiedLockstep(FreesNothing, Clears, Lockstep):
    # Physical pages lent out by alloc_physical, by handle.
    loans: ru.Loans = field(factory=ru.Loans)
    # Each loan's token ids as alloc_physical returned them (handed back as is).
    loan_slots: dict[int, torch.Tensor] = field(factory=dict)
    # Virtual pages whose KV the harness has written, since they were handed out.
    written: set[int] = field(factory=set)

    # The allocator methods a step calls; a release may lack them
    # (alloc_physical and free_physical are new in 0.5.22).
    STEP_METHODS = {
        "flush": ("flush_for_allocation", "flush_opportunistic"),
        "alloc_physical": ("alloc_physical", "free_physical"),
        "free_physical": ("alloc_physical", "free_physical"),
    }

    def start_models(self, defers_frees: bool) -> None:
        for rule, methods in self.STEP_METHODS.items():
            if missing := [m for m in methods if not callable(getattr(self.allocator, m, None))]:
                self.disabled_rules[rule] = f"{self.config.target} has no {', '.join(missing)}"
        if getattr(self.allocator, "lazy_compaction", True) is False:
            # sglang's install_move_gate asserts it: an eager free moves pages under the H2D copy.
            for rule in ("alloc_physical", "free_physical"):
                self.disabled_rules.setdefault(rule, "HiCache's physical loans need lazy compaction (install_move_gate asserts it)")
        initial = self._call("free_virtual_ids", virtual_census, self.allocator)
        self.model = OwnershipModel.from_census(pool_ids(initial)[0], defers_frees=defers_frees)
        self.disable_clear()

    def clearable(self) -> bool:
        """Idle also means no HiCache load-back holds a physical loan."""
        return super().clearable() and not self.loans.loans

    def _cleared(self) -> None:
        # The KV stand-in keeps its stamps: no page is live to judge them by.
        self.written.clear()

    def _short(self, pages: int) -> bool:
        """A lent page has no virtual id but takes a physical page."""
        return self.model.num_free - len(self.loans.pages()) < pages

    # -- steps --

    @step
    def flush(self, urgent: bool) -> None:
        """``flush_for_allocation()`` (urgent: compact every hole it may)
        or ``flush_opportunistic()``; no virtual id changes hands."""
        if urgent:
            self._call("flush_for_allocation()", self.allocator.flush_for_allocation)
        else:
            self._call("flush_opportunistic()", self.allocator.flush_opportunistic)

    @step
    def alloc_physical(self, n: int) -> None:
        """``alloc_physical(n)``: ``n`` physical slots (whole pages) lent with
        no virtual id; None exactly when fewer physical pages are free."""
        ps = self.page_size
        what = f"alloc_physical({n})"
        out = self._call(what, self.allocator.alloc_physical, n)
        slots = self._index_tensor(what, out, n, n // ps)
        if slots is None:
            return
        self._judge(core.alloc_returns_whole_pages, n, slots, ps)
        handle = self.loans.lend([slots[i] // ps for i in range(0, n, ps)])
        self.loan_slots[handle] = out.clone()

    @step
    def free_physical(self, loan: int) -> None:
        """Return loan number ``loan`` (of those out, in order):
        ``cancel_physical_reservation`` where the allocator has it, else
        ``free_physical``."""
        handle = self.loans.handles()[loan]
        slots = self.loan_slots.pop(handle)
        self.loans.give_back(handle)
        cancel = getattr(self.allocator, "cancel_physical_reservation", None)
        method = cancel if callable(cancel) else self.allocator.free_physical
        self._call(f"{method.__name__}(loan {loan})", method, slots)

    # -- checks --

    def check(self) -> None:
        """The core checks on the virtual ids, then the physical side."""
        census = self._call("free_virtual_ids", lambda: twins.census(self.allocator.free_virtual_ids, self.model))
        available = self._count("available_size()", self.allocator.available_size)
        for predicate in CORE_CHECKS:
            self._judge(predicate, census, available, self.page_size, self.model)
        lent = self.loans.pages()
        self._judge(ru.available_counts_lent, available, len(census), len(lent), self.page_size)
        a = self.allocator
        tables, v2p, p2v, holes = self._call("page tables", lambda: (
            page_tables(a, rows=False), a.virtual_to_physical, a.physical_to_virtual, a._free_phys_pages))
        live = ru.live_virtual(self.model)
        # At a large pool the tables are judged by twins (``twins``, in NumPy); a
        # twin that cannot say the predicate holds hands it the whole tables.
        first, n, span = tables.first_page, tables.num_pages, tables.span
        if len(self.model.owner) >= TENSOR_CENSUS_PAGES:
            # Each twin with the inputs it is called on (``_twin_holds``).
            fast = {
                ru.tables_bijective: (twins.tables_hold, (v2p, p2v, first, n, self.model.owner.codes)),
                ru.physical_pages_owned_once: (twins.roles_hold, (p2v, first, n, span, holes, tables.pending, lent)),
                ru.physical_frees_match_logical: (twins.bound_count_is, (p2v, first, n, len(live))),
            }
        else:
            fast = {}
        for predicate, args in ((ru.tables_bijective, (live,)), (ru.physical_pages_owned_once, (lent,)),
                                (ru.span_within_arena, arena_bytes(a)), (ru.physical_frees_match_logical, (self.model,))):
            if predicate in fast:
                twin, inputs = fast[predicate]
                if self._twin_holds(predicate, predicate.__name__, twin, *inputs):
                    continue
            if not tables.v2p and predicate is not ru.span_within_arena:
                tables = self._call("page tables", page_tables, a)
            self._judge(predicate, tables, *args)
        own = getattr(a, "_byte_accounting_violations", None)
        if callable(own):
            self._judge(ru.allocator_accounting_clean, self._call("_byte_accounting_violations()", own))
        judge_reader_views(self, a, self.model.owner.keys(), lambda: live)
        # What kv_follows_mapping reads: the bounds and v2p, where the twins
        # left the rows unread (``int_view``: it reads the live pages' entries only).
        self._write_kv(tables if tables.v2p else attrs.evolve(tables, v2p=twins.int_view(v2p)), live)

    def _write_kv(self, tables: ru.PageTables, live: set[int]) -> None:
        """Judge the KV of pages written before, then write it for pages
        handed out since (as the next forward would)."""
        stamps = self.allocator.get_kvcache().stamps
        self.written &= live
        self._judge(ru.kv_follows_mapping, stamps, tables, self.written)
        for v in live - self.written:
            # tables_bijective has passed, so every live page is mapped.
            page = tables.page_of(v)
            assert page != ru.UNMAPPED, f"live virtual page {v} is unmapped, yet tables_bijective passed"
            stamps[page] = v
            self.written.add(v)

    @property
    def stand_ins(self) -> list[str]:
        """The stand-ins the allocator was built over (sglang's class), as their reprs say."""
        parts = (getattr(self.allocator, "unified_buffer", None), getattr(self.allocator, "_kvcache", None))
        return [repr(p) for p in parts if p is not None and "stand-in" in repr(p)] + list(
            getattr(self.allocator, "kv_lockstep_kernels", ()))

    def teardown(self) -> None:
        """Close any open group and return every loan; the state must still check out."""
        super().teardown()
        while self.loans.loans:
            self.free_physical(0)

    def step_not_applicable(self, rule: str, args: dict) -> str | None:
        """Why a replayed step is one this family's rules never draw."""
        if rule == "free_physical" and not 0 <= args.get("loan", -1) < len(self.loans.loans):
            return f"loan {args.get('loan')} is not out ({len(self.loans.loans)} loans)"
        return None


class UnifiedMachine(FreeNothingRules, ClearRules, FreeGroupMachine):
    """The core rules, plus flushes, physical loans and the scheduler's ``clear``."""

    @draws(guard=lambda s: s.runs("flush"), urgent=bool)
    def flush(self, urgent):
        self._do("flush", urgent)

    # Loans are named by their index in a trace, bounded by row_pages there.
    @draws(guard=lambda s: s.runs("alloc_physical") and len(s.loans.loans) < s.config.row_pages, pages=(1, MAX_PAGES))
    def alloc_physical(self, pages):
        self._do("alloc_physical", pages * self.state.page_size)

    @draws(guard=lambda s: bool(s.loans.loans), pick=(0, 3))
    def free_physical(self, pick):
        self._do("free_physical", pick % len(self.state.loans.loans))


def is_unified(allocator) -> bool:
    """Whether an allocator keeps virtual ids over physical pages."""
    return all(hasattr(allocator, name) for name in ("free_virtual_ids", "virtual_to_physical", "physical_to_virtual"))

