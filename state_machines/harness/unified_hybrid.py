"""The lockstep harness for unified hybrid SWA pools (the "unified_swa" family).

sglang's ``UnifiedSWATokenToKVPoolAllocator`` and
``UnifiedMambaSWATokenToKVPoolAllocator`` keep the SWA allocator's surface
(``alloc``, ``free``, ``free_segment``, ``free_swa``, ``free_swa_segment``,
``free_full``, ``free_full_segment``, free groups) over *virtual* page ids:
``full_attn_allocator`` mints them (census ``free_virtual_ids``), and each
sub-pool (``full_attn_allocator``, ``swa_attn_allocator``) binds them to
physical pages of one shared byte arena through ``virtual_to_physical`` /
``physical_to_virtual``.  A window slide tombstones the SWA side
(``v2p == -1``) and returns its bytes to the shared gap.

``UnifiedSWALockstep`` runs the SWA family's free-side steps as they are (a
slide, an SWA eviction, ``free_full`` for slid spans); ``alloc``, ``decode``
and ``extend`` are the core's, each new virtual page binding its SWA side
(the same id); PD decode's ``extend_swa_tail`` and HiCache's ``remap`` are
not modelled yet (disabled, saying so).  The SWA model is keyed by virtual
page (``reference_model/unified_hybrid.py``).  What it checks
instead of a free list per pool:

- the full pool: the core checks over ``free_virtual_ids`` (the census);
- the SWA pool: the core checks over the virtual pages whose SWA side is
  unbound (a tombstone or never bound), so a slid page counts as free there;
- both page tables a bijection on the model's live pages
  (``unified_page_table_bijective``), compacted to their own ends of the
  arena (``unified_compacted``, eager compaction), in disjoint byte bands
  (``unified_bands_disjoint``);
- an alloc returns ``None`` exactly when the arena, in bytes, cannot hold
  one more page of each side per page asked (``Arena.fits``).

``available_size()`` is a byte-budget view here, not a free-list length:
``available_size_agrees`` does not apply and is not run; an alloc's
``None`` is judged against the arena instead.
"""

from __future__ import annotations

import inspect

import torch
from attrs import define, field

from reference_model import CHECKS, OwnershipModel, SWASide, invariants
from reference_model import unified as ru
from reference_model.census import Census, as_census
from reference_model.invariants import available_size_agrees
from reference_model.mamba import MambaModel
from reference_model.unified import allocator_accounting_clean, physical_pages_owned_once, span_within_arena
from reference_model.unified_hybrid import (
    Arena,
    Demand,
    SubPool,
    least_reclaim,
    unified_admission_agrees,
    unified_admission_sound,
    unified_allocated_agrees,
    unified_bands_disjoint,
    unified_compacted,
    unified_extend_demand_agrees,
    unified_max_new_agrees,
    unified_page_table_bijective,
    unified_read_path_agrees,
    unified_reclaim_plan_agrees,
)
from state_machines.harness import twins
from state_machines.harness.lockstep import TENSOR_CENSUS_PAGES, Lockstep, Pool, ids, integral, pool_ids
from state_machines.harness.machines import MAX_PAGES, PICKS, FreeGroupMachine, draws
from state_machines.harness.steps import EntryRef, ReqRef, step
from state_machines.harness.swa import SWALockstep, SWAMachine, swa_steps_disabled
from state_machines.harness.unified import (
    ClearRules,
    Clears,
    FreeNothingRules,
    FreesNothing,
    arena_bytes,
    judge_reader_views,
    page_tables,
)
from state_machines.targets import probe


class LiveSets:
    """The live (not free) pages of each side's model over one universe,
    as a set (built when a predicate reads it) and, at a large pool, as a
    mask over ``twins.universe_tensor`` (from the model's free flags)."""

    def __init__(self, universe: frozenset[int], models: dict):
        self.universe, self.models = universe, models
        self.pages = twins.universe_tensor(universe)
        self._sets: dict[str, set[int]] = {}
        self._masks: dict[str, torch.Tensor | None] = {}

    def __getitem__(self, side: str) -> set[int]:
        if side not in self._sets:
            self._sets[side] = set(self.universe) - self.models[side].free_pages
        return self._sets[side]

    def mask(self, side: str) -> torch.Tensor | None:
        if side not in self._masks:
            pages = self.pages
            self._masks[side] = None if pages is None else twins.live_mask(pages, self.models[side].free_flags)
        return self._masks[side]


def judge_tables(state: Lockstep, name: str, pool: SubPool, sub, live: LiveSets, side: str, page_size: int, *,
                 compacts: bool) -> list[int] | torch.Tensor:
    """One sub-pool's page tables against its side's model
    (``unified_page_table_bijective``), and, where it ``compacts``
    eagerly, its live pages' band (``unified_compacted``); each through its
    twin at a large pool.  Returns the live pages' physical pages,
    for ``judge_bands``."""
    pages, mask = live.pages, live.mask(side)
    v2p, p2v = sub.virtual_to_physical, sub.physical_to_virtual
    if mask is not None and state._twin_holds(
            unified_page_table_bijective, f"{name} page tables", twins.page_table_holds, pool, v2p, p2v, pages, mask):
        physical = state._while_held(f"{name} page tables", lambda: twins.live_pages(v2p, pages, mask))
    else:
        v2p, p2v = ids(v2p), ids(p2v)
        state._judge(unified_page_table_bijective, pool, v2p, p2v, live[side], set(live.universe),
                     name=f"{name}_page_table_bijective")
        physical = [v2p[v] for v in live[side]]
    if compacts:
        tokens = state._count(f"{name} allocated_count()", sub.allocated_count)
        if not (isinstance(physical, torch.Tensor) and state._twin_holds(
                unified_compacted, f"{name} compacted", twins.compacted_holds, pool, physical, tokens, page_size)):
            state._judge(unified_compacted, pool, list(map(int, physical)), tokens, page_size, name=f"{name}_compacted")
    return physical


def judge_span(state: Lockstep, name: str, sub) -> None:
    """An END sub-pool's span: one role per physical page inside it, none
    outside (``physical_pages_owned_once``, through its twin where the
    tables are large), and inside the arena (``span_within_arena``)."""
    tables, p2v, holes = state._call(f"{name} page tables", lambda: (
        page_tables(sub, rows=False), sub.physical_to_virtual, sub._free_phys_pages))
    if not (p2v.numel() >= TENSOR_CENSUS_PAGES and state._twin_holds(
            physical_pages_owned_once, f"{name} roles", twins.roles_hold,
            p2v, tables.first_page, tables.num_pages, tables.span, holes, tables.pending)):
        tables = state._call(f"{name} page tables", page_tables, sub)
        state._judge(physical_pages_owned_once, tables, [], name=f"{name}_physical_pages_owned_once")
    state._judge(span_within_arena, tables, *arena_bytes(sub), name=f"{name}_span_within_arena")


def judge_bands(state: Lockstep, arena: Arena, physical: dict) -> None:
    """``unified_bands_disjoint`` over each band's live physical pages; a
    tensor's passed as its one extreme the predicate reads (the low band's
    top, the high band's bottom), which gives the same verdict and message."""
    low, high = physical[arena.low.name], physical[arena.high.name]
    if isinstance(low, torch.Tensor):
        low = [int(low.max())] if low.numel() else []
    if isinstance(high, torch.Tensor):
        high = [int(high.min())] if high.numel() else []
    state._judge(unified_bands_disjoint, arena, low, high)


# The census checks that hold on a unified pool (see the module docstring).
UNIFIED_CHECKS = tuple(c for c in CHECKS if c is not available_size_agrees)

# What the ``reserve`` step asks of a two-ended pool (0.5.22 on).
ADMISSION_METHODS = ("reclaim_plan", "can_reserve", "prealloc_fits", "prealloc_ceiling_fits", "swa_capacity_and_available")

# Why the SWA family's other allocation steps do not run on these pools on CPU.
DEVICE_ONLY = {
    "remap": "HiCache load-back binds pages that swa_attn_allocator.alloc_physical reserved; the reservation"
             " clears only with the H2D copy's CUDA event (set_hicache_transfer_done_event), and until then"
             " every compaction move asserts moves_blocked(): device-only",
}


class _TreeStandIn:
    """What the allocator's admission and reclaim read off the radix cache:
    how many tokens of each side it could evict, and whether it shares
    prefixes.  It holds nothing to evict: ``evict_for_alloc`` evicts
    nothing.  (0.5.20's eviction reads the allocator back off the cache,
    ``token_to_kv_pool_allocator``.)"""

    def __init__(self, full: int, swa: int, shares: bool = True, allocator=None):
        self.full, self.swa, self.shares = full, swa, shares
        self.token_to_kv_pool_allocator = allocator

    def full_evictable_size(self) -> int:
        return self.full

    def swa_evictable_size(self) -> int:
        return self.swa

    def mamba_evictable_size(self) -> int:
        return 0

    def supports_prefix_sharing(self) -> bool:
        return self.shares

    def is_chunk_cache(self) -> bool:
        return not self.shares

    def evict_for_alloc(self, params, **_):
        """Evicts nothing (there is nothing to evict), and says so."""
        return _NothingEvicted()


@define(frozen=True)
class _NothingEvicted:
    """What a radix cache's ``evict_for_alloc`` reports when it evicted nothing."""

    num_tokens_evicted: int = 0
    swa_num_tokens_evicted: int = 0
    mamba_num_evicted: int = 0


class _EvictingTree(_TreeStandIn):
    """The radix cache as a reclaim sees it, over the harness's own cache:
    each side's evictable tokens are those of its unlocked entries (the SWA
    side's where still live), and ``evict_for_alloc`` evicts them in entry
    order, each as the ``evict`` step does, until it has evicted the
    tokens asked of each side or the allocator says the reclaim is
    satisfied.  ``evicted`` names the entries it evicted."""

    def __init__(self, state: UnifiedSWALockstep):
        super().__init__(0, 0, allocator=state.allocator)
        self.state = state
        self.evicted: list[EntryRef] = []

    def _tokens(self, entries: list[EntryRef]) -> tuple[int, int]:
        s = self.state
        pages = [p for e in entries for p in s.model.cache[e.eid].pages]
        return len(pages) * s.page_size, sum(s.swa.live(p) for p in pages) * s.page_size

    def full_evictable_size(self) -> int:
        return self._tokens(self.state.evictable())[0]

    def swa_evictable_size(self) -> int:
        return self._tokens(self.state.evictable())[1]

    def evict_for_alloc(self, params, allocation_reclaim_satisfied=None, **_):
        s = self.state
        want_full, want_swa = getattr(params, "num_tokens", 0) or 0, getattr(params, "swa_num_tokens", 0) or 0
        full = swa = 0
        for entry in s.evictable():
            if (full >= want_full and swa >= want_swa) or (allocation_reclaim_satisfied and allocation_reclaim_satisfied()):
                break
            f, w = self._tokens([entry])
            s._evict_entry(entry)
            self.evicted.append(entry)
            full, swa = full + f, swa + w
        return _NothingEvicted(full, swa, 0)


def judge_mamba_donor(state: Lockstep, n: int, schedulable: int) -> None:
    """What the radix cache asks before it evicts for ``n`` Mamba slots
    (``unified_radix_cache.py`` ``_target_met``), of the donor
    ``mamba_full_cache_donor()`` names (the composite itself where it has
    no such method): ``full_tokens_before_mamba_recheck(n)``, 0 exactly
    when ``schedulable`` slots reach ``n``, then
    ``prepare_mamba_allocation(n)``; and the prefill planner's
    ``mamba_slot_full_token_cost()``, the fewest full tokens (one page of
    each attention side per token) whose bytes hold one Mamba state."""
    a = state.allocator
    named = getattr(a, "mamba_full_cache_donor", None)
    donor = state._call("mamba_full_cache_donor()", named) if callable(named) else a
    bound = state._count(f"full_tokens_before_mamba_recheck({n})", donor.full_tokens_before_mamba_recheck, n)
    state._judge(ru.recheck_bound_zero_iff_room, bound, schedulable, n)
    state._call(f"prepare_mamba_allocation({n})", donor.prepare_mamba_allocation, n)
    if callable(cost := getattr(a, "mamba_slot_full_token_cost", None)):
        sides = [a.full_attn_allocator] + [x for x in (getattr(a, "swa_attn_allocator", None),) if x is not None]
        token_bytes = sum(sub_pool(x).page_bytes for x in sides) // state.page_size
        state._judge(ru.slot_cost_covers_state, state._count("mamba_slot_full_token_cost()", cost),
                     sub_pool(a.mamba_allocator).page_bytes, token_bytes)


def sub_pool(allocator) -> SubPool:
    """A ``MultiEndedAllocator``'s fixed geometry, read once."""
    return SubPool(
        name=f"{allocator.sub_pool_name} pool",
        first=int(allocator.min_page_index),
        end=int(allocator.num_pages),
        page_bytes=int(allocator.entry_bytes_per_page),
        grows=str(allocator.grow_direction),
    )


@define
class UnifiedSWALockstep(FreesNothing, Clears, SWALockstep):
    arena: Arena | None = None
    universe: frozenset[int] = frozenset()
    # Whether the pools compact lazily (holes allowed): compaction is then not checked.
    lazy: bool = False
    # Whether reclaim_plan takes prefer_swa (0.5.22 on; 0.5.21's always trims
    # the SWA reclaim first, as prefer_swa=False does).
    plans_prefer_swa: bool = False
    # Whether the last alloc's None went unjudged (``_index_tensor``).
    refused: bool = False

    def start_models(self, defers_frees: bool) -> None:
        a = self.allocator
        fa, sa = a.full_attn_allocator, a.swa_attn_allocator
        full, swa = sub_pool(fa), sub_pool(sa)
        # A float SWA pool (the Mamba variant's chain middle) sits below full,
        # above the Mamba pool's empty low end: the arena is still two bands.
        self.arena = Arena(low=full, high=swa) if full.grows == "up" else Arena(low=swa, high=full)
        self.lazy = bool(getattr(a, "lazy_compaction", False))
        free, self.universe = pool_ids(self._call("free_virtual_ids", self._full_census))
        self.model = OwnershipModel.from_census(free, defers_frees=defers_frees)
        self.swa = SWASide.from_census(self.model, free)
        # free_swa() and free_swa_segment() release at once, inside a group too.
        self.swa_defers = False
        self.stand_ins = list(getattr(a, "kv_lockstep_stand_ins", ()))
        need = ("can_reserve", "prealloc_fits") if self.float_chain else ADMISSION_METHODS
        plan = getattr(a, "reclaim_plan", None)
        self.plans_prefer_swa = callable(plan) and "prefer_swa" in inspect.signature(plan).parameters
        if missing := [m for m in need if not callable(getattr(a, m, None))]:
            self.disabled_rules["reserve"] = f"{type(a).__name__} has no {', '.join(missing)}"
        need = ("evict_to_free_tokens",) if self.float_chain else ("reclaim_for_prealloc",)
        if missing := [m for m in need if not callable(getattr(a, m, None))]:
            self.disabled_rules["make_room"] = f"{type(a).__name__} has no {', '.join(missing)}"
        if not self.lazy:
            self.disabled_rules["flush"] = "eager compaction: every free compacts at once, a flush has nothing to do"
        # extend_swa_tail above page size 1 only, where it runs here (probed).
        self.disabled_rules.update({k: v for k, v in swa_steps_disabled(a, self.page_size).items() if k != "remap"})
        self.disable_clear()

    def _cleared(self) -> None:
        # Every virtual page's SWA side unbound again, as built.
        self.swa = SWASide.from_census(self.model, sorted(self.universe))

    # Device-only here, each for its reason (DEVICE_ONLY).
    not_modelled = ("remap",)
    # Its alloc_extend is a Triton kernel (no CPU path): an alloc stays alloc().
    alloc_extends = False

    def why_not(self, step: str) -> str | None:
        # A probed reason (a Triton kernel on CPU) says more than "not modelled".
        if step in probe.OPTIONAL and step in self.disabled_rules:
            return self.disabled_rules[step]
        if step in self.not_modelled:
            return DEVICE_ONLY[step]
        return super().why_not(step)

    # -- censuses --

    def _full_census(self) -> list[int]:
        return ids(self.allocator.full_attn_allocator.free_virtual_ids)

    def _swa_census(self) -> list[int]:
        """Virtual pages whose SWA side is unbound: a tombstone, or never bound."""
        v2p = ids(self.allocator.swa_attn_allocator.virtual_to_physical)
        return [v for v in sorted(self.universe) if v2p[v] == -1]

    # -- checks --

    def pools(self) -> list[Pool]:
        a = self.allocator
        return [
            Pool(a.full_attn_allocator, self.model, "", "full pool: "),
            Pool(a.swa_attn_allocator, self.swa, "swa_", "SWA pool: "),
        ]

    def check(self) -> None:
        censuses = self._censuses()
        for pool, census in zip(self.pools(), censuses):
            # A side pool's counts summed once for the checks that read them (``SWASide.unchanging``).
            with pool.model.unchanging():
                for predicate in UNIFIED_CHECKS:
                    self._judge(predicate, census, len(census) * self.page_size, self.page_size, pool.model,
                                name=pool.prefix + predicate.__name__, label=pool.label)
        self.check_joint(censuses)

    def _censuses(self) -> list[Census | list[int]]:
        """Both sides' free virtual pages: at a large pool as tensor
        censuses, which the checks answer in torch (``TensorCensus``)."""
        pages, a = twins.universe_tensor(self.universe), self.allocator
        full = self._call("full census (free_virtual_ids)",
                          lambda: twins.census(a.full_attn_allocator.free_virtual_ids, self.model))
        if pages is not None:
            v2p = self._call("SWA census (virtual_to_physical == -1)", lambda: a.swa_attn_allocator.virtual_to_physical)
            if integral(v2p) and int(pages[-1]) < v2p.numel():
                return [full, twins.census(twins.unmapped(v2p, pages), self.swa)]
        return [full, self._call("SWA census (virtual_to_physical == -1)", self._swa_census)]

    def _held(self) -> tuple[int, int]:
        """How many virtual pages the model holds live on the full side and
        on the SWA side (each side's pages are the universe)."""
        return len(self.universe) - self.model.num_free, len(self.universe) - self.swa.num_free

    def check_joint(self, censuses: list[Census | list[int]]) -> None:
        a = self.allocator
        live = LiveSets(self.universe, {"full": self.model, "swa": self.swa})
        physical = {}
        for name, sub in (("full", a.full_attn_allocator), ("swa", a.swa_attn_allocator)):
            pool = self.arena.low if self.arena.low.name.startswith(name) else self.arena.high
            float_pool = pool.grows == "float"
            physical[pool.name] = judge_tables(self, name, pool, sub, live, name, self.page_size,
                                               compacts=not (self.lazy or float_pool))
            if float_pool:
                continue
            # An END pool's span holds bound pages and holes (lazy frees not yet compacted), nothing else.
            judge_span(self, name, sub)
        judge_bands(self, self.arena, physical)
        self.check_read_path(live)
        own = getattr(a, "verify_byte_accounting", None)
        if callable(own):
            self._judge(allocator_accounting_clean, self._call("verify_byte_accounting()", own))

    def check_read_path(self, live: LiveSets) -> None:
        """Every token of every virtual page through both read paths, as an
        attention kernel reads it: live pages to their physical slots,
        tombstones and free ids to the sink."""
        a, ps = self.allocator, self.page_size
        pages = twins.universe_tensor(self.universe)
        if pages is None:
            tokens = [v * ps + k for v in sorted(self.universe) for k in range(ps)]
            loc = torch.tensor(tokens, dtype=torch.int64, device=self.rows.device)
        else:
            loc, tokens = twins.universe_tokens(pages, ps).to(self.rows.device), None
        for side, name, sub in (("full", "translate_kv_loc", a.full_attn_allocator),
                                ("swa", "translate_loc_from_full_to_swa", a.swa_attn_allocator)):
            # A copy each: what a call does to its argument changes no token judged.
            got = self._call(f"{name}(every virtual token)", getattr(a, name), loc.clone())
            mask = live.mask(side)
            v2p = sub.virtual_to_physical
            if mask is not None and self._twin_holds(
                    unified_read_path_agrees, f"{side} read path", twins.read_path_holds, got, v2p, pages, mask, ps):
                continue
            tokens = tokens if tokens is not None else ids(loc)
            self._judge(unified_read_path_agrees, side, tokens, ids(got), ids(v2p), live[side], ps,
                        name=f"{side}_read_path_agrees")

    # -- steps --

    @step
    def reserve(self, full: int, swa: int, evict_full: int, evict_swa: int, prefer_swa: bool) -> None:
        """The scheduler's admission questions for ``full`` and ``swa`` new
        pages while the cache could evict ``evict_full`` / ``evict_swa``
        pages: ``reclaim_plan`` (the least eviction first), ``can_reserve``,
        ``prealloc_fits`` (a budget of what is available plus evictable),
        ``prealloc_ceiling_fits`` (from an empty pool) and the per-side
        capacities.  Each answer is the arena's; no page changes hands.
        Over a float chain only ``can_reserve`` / ``prealloc_fits`` with
        nothing evictable (its ``can_reserve`` refuses any), judged for
        soundness: where the float sits is placement policy; and for at
        most ``full`` SWA pages, the demands an allocation makes there
        (each new SWA page is the SWA side of a new virtual page, and the
        chain's own callers ask ``ensure_capacity(n, swa <= n)``; its
        prefill budget is the plain SWA one, which never calls
        ``can_reserve``).  The float chain prices SWA pages by its index
        range alone, not by the virtual ids the two-ended pool caps them
        at, so a larger SWA-only demand is answered yes (README, Latent
        findings)."""
        a, ps = self.allocator, self.page_size
        if self.float_chain:
            swa = min(swa, full)
        live_full, live_swa = self._held()
        demand = Demand(full, swa, live_full, live_swa, len(self.universe),
                        min(evict_full, live_full), min(evict_swa, live_swa))
        ft, st, ef, es = full * ps, swa * ps, demand.evict_full * ps, demand.evict_swa * ps
        self._judge_extend_demand(full, swa, evict_full, evict_swa)
        if self.float_chain:
            fits = demand.fits(self.arena)
            got = self._call(f"can_reserve({ft}, {st})", a.can_reserve, ft, st)
            self._judge(unified_admission_sound, f"can_reserve({ft}, {st})", got, fits)
            what = f"can_reserve({ft}, {st}, full_evictable_tokens={ef}, swa_evictable_tokens={es})"
            got = self._call(what, lambda: a.can_reserve(ft, st, full_evictable_tokens=ef, swa_evictable_tokens=es))
            self._judge(unified_admission_sound, what, got, least_reclaim(self.arena, demand, False) is not None)
            budget = self._count("full_available_size()", a.full_available_size)
            what = f"prealloc_fits(tree, {ft}, {st}, full_budget_tokens={budget})"
            got = self._call(what, lambda: a.prealloc_fits(_TreeStandIn(0, 0), ft, st, full_budget_tokens=budget))
            self._judge(unified_admission_sound, what, got, fits)
            return
        evictable = f"full_evictable_tokens={ef}, swa_evictable_tokens={es}"
        prefer_swa = prefer_swa and self.plans_prefer_swa
        prefer = {"prefer_swa": prefer_swa} if self.plans_prefer_swa else {}
        what = f"reclaim_plan({ft}, {st}, {evictable}{f', prefer_swa={prefer_swa}' if prefer else ''})"
        plan = self._call(what, lambda: a.reclaim_plan(ft, st, full_evictable_tokens=ef, swa_evictable_tokens=es,
                                                       **prefer))
        want = least_reclaim(self.arena, demand, prefer_swa)
        got = None if plan is None else (int(plan[0]) // ps, int(plan[1]) // ps)
        self._judge(unified_reclaim_plan_agrees, what, got, want)
        what = f"can_reserve({ft}, {st}, {evictable})"
        got = self._call(what, lambda: a.can_reserve(ft, st, full_evictable_tokens=ef, swa_evictable_tokens=es))
        self._judge(unified_admission_agrees, what, got, want is not None)
        # A budget of what is available plus evictable leaves the ask as it is.
        budget = self._count("full_available_size()", a.full_available_size) + ef
        what = f"prealloc_fits(tree, {ft}, {st}, full_budget_tokens={budget})"
        got = self._call(what, lambda: a.prealloc_fits(_TreeStandIn(ef, es), ft, st, full_budget_tokens=budget))
        self._judge(unified_admission_agrees, what, got, want is not None)
        what = f"prealloc_ceiling_fits({ft}, {st})"
        empty = Demand(full, swa, 0, 0, len(self.universe))
        self._judge(unified_admission_agrees, what, self._call(what, a.prealloc_ceiling_fits, ft, st),
                    empty.fits(self.arena))
        if callable(getattr(a, "max_new_tokens_for_memory", None)):
            self._judge_max_new(full * ps + 1, (swa + evict_full) * ps)
        (cap_full, av_full), (cap_swa, av_swa) = self._call(
            "swa_capacity_and_available()", lambda: a.swa_capacity_and_available(full_capacity=0, swa_capacity=0))
        self._judge(unified_allocated_agrees, "full", int(cap_full) - int(av_full), live_full, ps, name="full_allocated_agrees")
        self._judge(unified_allocated_agrees, "swa", int(cap_swa) - int(av_swa), live_swa, ps, name="swa_allocated_agrees")

    def _judge_extend_demand(self, full: int, swa: int, evict_full: int, evict_swa: int) -> None:
        """``get_extend_allocation_demand`` (0.5.23 on) of an extend the
        draws describe: from a prefix that may end mid-page."""
        a, ps = self.allocator, self.page_size
        if not callable(getattr(a, "get_extend_allocation_demand", None)):
            return
        prefix = evict_full * ps + evict_swa % ps
        seq = prefix + full * ps + swa
        what = f"get_extend_allocation_demand([{prefix}], [{seq}], shard_size=1)"
        got = self._call(what, lambda: a.get_extend_allocation_demand(
            torch.tensor([prefix]), torch.tensor([seq]), conservative_num_tokens=seq, shard_size=1))
        self._judge(unified_extend_demand_agrees, what, int(got), prefix, seq, self.page_size)

    def _judge_max_new(self, prompt: int, most: int) -> None:
        """``max_new_tokens_for_memory`` for a ``prompt``-token request, at
        most ``most`` new tokens, with no window limit (the SWA estimate's
        full-length branch: both sides reserve prompt + new + a page), on an
        empty pool: the arena's answer, within the release's one-token slack
        under ``size_full`` / ``size_swa``."""
        a, ps = self.allocator, self.page_size
        what = f"max_new_tokens_for_memory({prompt}, {most}, sliding_window_size=None)"
        got = self._call(what, lambda: a.max_new_tokens_for_memory(
            prompt, most, token_capacity=0, sliding_window_size=None, chunk_size=None))
        size_full, size_swa = int(a.size_full), int(a.size_swa)

        def fits(new: int) -> bool:
            tokens = prompt + new + ps
            pages = -(-tokens // ps)
            return tokens < min(size_full, size_swa) and Demand(pages, pages, 0, 0, len(self.universe)).fits(self.arena)

        self._judge(unified_max_new_agrees, what, got, most, [fits(c) for c in range(most + 2)])

    def step_not_applicable(self, rule: str, args: dict) -> str | None:
        """Why a replayed step is one this family's rules never draw: a
        ``make_room`` inside a free group (the scheduler makes room
        outside one; replayed inside, the group's queued pages were blamed
        on the allocator), else the SWA family's reasons."""
        if rule == "make_room" and self.in_group:
            return "the scheduler makes room outside a free group"
        return super().step_not_applicable(rule, args)

    @step
    def make_room(self, full: int, swa: int) -> None:
        """The scheduler makes room for ``full`` and ``swa`` new pages
        (outside a free group): PD decode's ``reclaim_for_prealloc`` on a
        two-ended pool, over a cache that shares no prefix and has nothing
        evictable (a chunk cache: its ``evict_to_free_tokens`` with a
        sharing cache reads the server's published memory config, which a
        bare allocator has none of); ``evict_to_free_tokens`` of ``full``
        pages on a float chain (its demand is one page of each side per
        token), over the harness's cache (``_EvictingTree``): the entries
        the allocator has evicted are gone.  The pool may compact.  The
        answer is whether the arena holds the demand (over a float chain,
        after the evictions: never yes to what it cannot hold)."""
        a, ps = self.allocator, self.page_size
        if self.float_chain:
            tree = _EvictingTree(self)
            what = f"evict_to_free_tokens(tree, {full * ps})"
            got = self._call(what, a.evict_to_free_tokens, tree, full * ps)
            live_full, live_swa = self._held()
            fits = Demand(full, full, live_full, live_swa, len(self.universe)).fits(self.arena)
            self._judge(unified_admission_sound, f"{what}, after evicting {tree.evicted}", bool(got), fits)
            if callable(getattr(a, "full_tokens_before_mamba_recheck", None)):
                # Before a Mamba state is allocated: flush the full end, move the float away if short.
                schedulable = self._count("mamba schedulable_available_size()",
                                             a.mamba_allocator.schedulable_available_size)
                judge_mamba_donor(self, swa, schedulable)
            elif callable(getattr(a, "prepare_mamba_allocation", None)):
                self._call(f"prepare_mamba_allocation({swa})", a.prepare_mamba_allocation, swa)
            return
        live_full, live_swa = self._held()
        fits = Demand(full, swa, live_full, live_swa, len(self.universe)).fits(self.arena)
        what = f"reclaim_for_prealloc(chunk cache, {full * ps}, {swa * ps})"
        shortfall = self._call(what, a.reclaim_for_prealloc, _TreeStandIn(0, 0, shares=False), full * ps, swa * ps)
        self._judge(unified_admission_agrees, f"{what} is None", shortfall is None, fits)

    @step
    def flush(self, urgent: bool) -> None:
        """Lazy compaction's flushes: the scheduler's idle-time
        ``flush_opportunistic()`` on the composite, or (urgent) what an
        allocation that falls short runs, ``flush_for_allocation()`` on each
        sub-pool.  No virtual id changes hands; pages may move."""
        a = self.allocator
        if not urgent:
            self._call("flush_opportunistic()", a.flush_opportunistic)
            return
        for name in ("full_attn_allocator", "swa_attn_allocator", "mamba_allocator"):
            if (sub := getattr(a, name, None)) is not None:
                self._call(f"{name}.flush_for_allocation()", sub.flush_for_allocation)

    def _short(self, pages: int) -> bool:
        """Short when the virtual ids run out, or the arena cannot hold
        ``pages`` more on the full side and as many on the SWA side (an
        ``extend_swa_tail``: its tail's pages) at once (the model's live
        counts, compacted)."""
        return self._short_sides(pages, pages if self.swa_need is None else self.swa_need)

    def _short_sides(self, full_pages: int, swa_pages: int) -> bool:
        full, swa = self._held()
        return self.model.num_free < full_pages or not self.arena.fits_sides(full + full_pages, swa + swa_pages)

    @step
    def extend_swa_tail(self, req: ReqRef, tokens: int, tail: int) -> None:
        """PD decode's preallocation, ``alloc_extend_swa_tail`` of one
        page-aligned request by ``tokens`` tokens: the full side mints a
        virtual page for each new page, and the SWA side binds only the last
        ``ceil(tail / page_size)`` of them (the tail starts on a page
        boundary); the pages before it are born slid (``v2p == -1``).
        ``None`` exactly when the ids run out or the arena cannot hold both
        sides' new pages; a ``None`` is also accepted where pricing the SWA
        side at the full side's page count falls short (0.5.20's documented
        policy), and over a float chain only a success is judged."""
        ps = self.page_size
        before = len(self.model.requests[req.rid].own)
        self.tail, self.swa_need = tail, -(-tail // ps)
        try:
            # The core extend, routed to alloc_extend_swa_tail (_extend_call).
            Lockstep.extend(self, [req], [tokens])
        finally:
            self.tail = self.swa_need = None
        request = self.model.requests.get(req.rid)
        grown = request.own[before:] if request is not None else []
        bound = grown[len(grown) - -(-tail // ps):] if tail else []
        self.swa.take(bound, bound)

    @property
    def float_chain(self) -> bool:
        """Whether a sub-pool floats between the arena's ends (the Mamba variant's SWA)."""
        return "float" in (self.arena.low.grows, self.arena.high.grows)

    def _index_tensor(self, what: str, out, length: int, want_pages: int) -> list[int] | None:
        """As the core's, except that over a float chain a ``None`` the
        arena's bytes could have served is not judged: where the float sits
        is the release's placement policy, which the model does not predict.
        An alloc that succeeds must still fit (no over-commit)."""
        # 0.5.20 prices alloc_extend_swa_tail's SWA side at the full side's
        # page count, as its docstring says ("pessimistic when the tail is
        # short"): a None that pricing explains is that policy, not a bug.
        pessimistic = self.swa_need is not None and self._short_sides(want_pages, want_pages)
        self.refused = out is None and self.model.num_free >= want_pages and (self.float_chain or pessimistic)
        if self.refused:
            return None
        return super()._index_tensor(what, out, length, want_pages)

    @step
    def alloc(self, n: int, req: ReqRef | None = None, prefix: EntryRef | None = None) -> ReqRef | None:
        """As the core's ``alloc``: the full side mints ``n // page_size``
        virtual pages and the SWA side binds each of them."""
        pool_short = self._short(n // self.page_size)
        made = Lockstep.alloc(self, n, req, prefix)
        if pool_short or self.refused:
            return None
        ps = self.page_size
        pages = self.model.requests[(made or req).rid].own[-(n // ps):]
        self.swa.take(pages, pages)
        return made

    @step
    def decode(self, reqs: list[ReqRef]) -> None:
        """As the core's ``decode``: a new full virtual page binds its SWA side (the same id)."""
        self._grow_both(Lockstep.decode, reqs)

    @step
    def extend(self, reqs: list[ReqRef], tokens: list[int]) -> None:
        """As the core's ``extend``: each new full virtual page binds its SWA side (the same id)."""
        self._grow_both(Lockstep.extend, reqs, tokens)

    def _grow_both(self, core, reqs: list[ReqRef], *args) -> None:
        """Run the core step ``core``; the virtual pages it gave each request
        are now live on the SWA side too (the SWA family's page-by-page
        mapping reads ``full_to_swa_index_mapping``, which these pools do not
        keep: the SWA side of a virtual page is its own binding)."""
        before = {r.rid: len(self.model.requests[r.rid].own) for r in reqs}
        core(self, reqs, *args)
        grown = [p for rid, n in before.items() if rid in self.model.requests for p in self.model.requests[rid].own[n:]]
        self.swa.take(grown, grown)

    def _give_back(self, row: int, start: int, end: int, pages: list[int], *, segment: bool) -> None:
        """A segment splits as the SWA family's does (``free_segment``
        asserts every SWA side bound); a plain free is one ``free()`` of the
        whole span, slid pages included: the composite's ``free()`` skips
        tombstoned SWA sides itself (``swa v2p > 0``)."""
        if segment:
            super()._give_back(row, start, end, pages, segment=True)
            return
        Lockstep._give_back(self, row, start, end, pages, segment=False)
        self.swa.release(pages, "free")


class UnifiedSWAMachine(FreeNothingRules, ClearRules, SWAMachine):
    """The SWA family's rules over a unified pool, plus admission questions and the scheduler's ``clear``."""

    @draws(guard=lambda s: s.runs("reserve"), full=(0, MAX_PAGES), swa=(0, MAX_PAGES), evict_full=(0, MAX_PAGES),
           evict_swa=(0, MAX_PAGES), prefer_swa=bool)
    def reserve(self, full, swa, evict_full, evict_swa, prefer_swa):
        self._do("reserve", full, swa, evict_full, evict_swa, prefer_swa)

    @draws(guard=lambda s: s.runs("make_room") and not s.in_group, full=(0, MAX_PAGES), swa=(0, MAX_PAGES))
    def make_room(self, full, swa):
        self._do("make_room", full, swa)

    @draws(guard=lambda s: s.runs("flush"), urgent=bool)
    def flush(self, urgent):
        self._do("flush", urgent)



def is_unified_swa(allocator) -> bool:
    """Whether an allocator has two sub-pools with virtual page tables."""
    fa = getattr(allocator, "full_attn_allocator", None)
    sa = getattr(allocator, "swa_attn_allocator", None)
    return all(hasattr(x, "virtual_to_physical") for x in (fa, sa)) and hasattr(fa, "free_virtual_ids")


# --------------------------------------------------------------------------- #
# The "unified_mamba" family: full KV pages and Mamba state slots in one arena.


@define
class UnifiedMambaLockstep(FreesNothing, Clears, Lockstep):
    """sglang's ``UnifiedMambaTokenToKVPoolAllocator``: the core steps on
    its full side (virtual page ids, census ``free_virtual_ids``), and the
    Mamba state slots of ``mamba_allocator`` through the slot allocator the
    target hands over (``mamba_slots``: sglang's ``UnifiedMambaSlotAllocator``,
    with allocation groups), against a ``MambaModel``.  The two sides share
    the arena's bytes: each step checks both page tables, eager compaction,
    disjoint bands, and judges each alloc's ``None`` against the arena."""

    arena: Arena | None = None
    universe: frozenset[int] = frozenset()
    mamba: MambaModel | None = None
    mamba_universe: frozenset[int] = frozenset()
    # Live Mamba states, by model request id: the slot each holds.
    states: dict[int, int] = field(factory=dict)
    # Token-batched decode and extend run through Triton kernels (disabled on CPU).
    caller_steps = ("decode", "extend")

    def start_models(self, defers_frees: bool) -> None:
        a = self.allocator
        full, mamba = sub_pool(a.full_attn_allocator), sub_pool(a.mamba_allocator)
        self.arena = Arena(low=full, high=mamba) if full.grows == "up" else Arena(low=mamba, high=full)
        free, self.universe = pool_ids(self._call("free_virtual_ids", self._full_census))
        self.model = OwnershipModel.from_census(free, defers_frees=defers_frees)
        slots, self.mamba_universe = pool_ids(self._call("mamba free_virtual_ids", self._mamba_census))
        self.mamba = MambaModel.from_census(slots)
        for rule, methods in self.STEP_METHODS.items():
            if missing := [m for m in methods if not callable(getattr(a, m, None))]:
                self.disabled_rules[rule] = f"{self.config.target} has no {', '.join(missing)}"
        self.disable_clear()

    def clearable(self) -> bool:
        """Idle also means no Mamba allocation group open (one prefill batch's)."""
        return super().clearable() and not self.in_alloc_group

    def _cleared(self) -> None:
        """The Mamba slots start again too.  With no request live, a state
        still out is the radix cache's (a finished request's, kept in the
        tree): the tree's reset drops it with the rest."""
        self.mamba = MambaModel.from_census(sorted(self.mamba_universe))
        self.states.clear()

    # The composite's methods a step calls (the radix cache's and the scheduler's).
    STEP_METHODS = {
        "idle_flush": ("flush_opportunistic",),
        "prepare_mamba": ("prepare_mamba_allocation", "full_tokens_before_mamba_recheck"),
    }

    def _full_census(self) -> list[int]:
        return ids(self.allocator.full_attn_allocator.free_virtual_ids)

    def _mamba_census(self) -> list[int]:
        return ids(self.allocator.mamba_allocator.free_virtual_ids)

    @property
    def stand_ins(self) -> list[str]:
        """The stand-ins the composite was built over, and the kernels replaced on CPU."""
        return list(getattr(self.allocator, "kv_lockstep_stand_ins", ()))

    @property
    def in_alloc_group(self) -> bool:
        return self.mamba.reserved is not None

    # -- checks --

    def pools(self) -> list[Pool]:
        a = self.allocator
        return [Pool(a.full_attn_allocator, self.model, "", "full pool: "),
                Pool(a.mamba_allocator, self.mamba, "mamba_", "Mamba pool: ")]

    def check(self) -> None:
        a = self.allocator
        censuses = [self._call("full census (free_virtual_ids)",
                               lambda: twins.census(a.full_attn_allocator.free_virtual_ids, self.model)),
                    self._call("Mamba census (free_virtual_ids)",
                               lambda: twins.census(a.mamba_allocator.free_virtual_ids, self.mamba))]
        for pool, census in zip(self.pools(), censuses):
            for predicate in UNIFIED_CHECKS:
                self._judge(predicate, census, len(census), 1, pool.model,
                            name=pool.prefix + predicate.__name__, label=pool.label)
        physical = {}
        compacts = not getattr(self.allocator, "lazy_compaction", False)
        for name, sub, model, universe in (
            ("full", self.allocator.full_attn_allocator, self.model, self.universe),
            ("mamba", self.allocator.mamba_allocator, self.mamba, self.mamba_universe),
        ):
            pool = self.arena.low if self.arena.low.name.startswith(name) else self.arena.high
            physical[pool.name] = judge_tables(self, name, pool, sub, LiveSets(universe, {name: model}), name,
                                               1 if name == "mamba" else self.page_size, compacts=compacts)
        judge_bands(self, self.arena, physical)
        self._check_views()

    def _check_views(self) -> None:
        """What sglang's callers read off the composite, where it has it:
        its own byte diagnostic (``verify_byte_accounting``, the scheduler's
        idle check), the leak check's ``size`` identity, the capacity views
        the planners use (never more than fits), ``is_slot_allocated`` and
        ``translate_kv_loc`` (the forward's reads) against the page tables."""
        a, ps = self.allocator, self.page_size
        if callable(verify := getattr(a, "verify_byte_accounting", None)):
            self._judge(ru.allocator_accounting_clean, self._call("verify_byte_accounting()", verify),
                        name="composite_accounting_clean")
        full_room = self._full_room()
        if hasattr(a, "full_available_size"):
            available = self._count("available_size()", a.available_size)
            self._judge(ru.size_balances, self._count("size", lambda: a.size), available, self._held()[0] * ps)
            self._judge(ru.capacity_view_within_room, "available_size()", available, full_room * ps)
            full_view = self._count("full_available_size()", a.full_available_size)
            self._judge(ru.capacity_view_within_room, "full_available_size()", full_view, full_room * ps)
        slots = a.mamba_slots
        if callable(sched := getattr(slots, "schedulable_available_size", None)):
            self._judge(ru.capacity_view_within_room, "Mamba schedulable_available_size()",
                        self._count("mamba schedulable_available_size()", sched), self._mamba_room(),
                        name="mamba_capacity_view_within_room")
        judge_reader_views(self, a, self.universe, lambda: self.universe - self.model.free, pool=a.full_attn_allocator)
        if callable(write := getattr(a, "translate_write_loc", None)):
            # The forward writes out_cache_loc through it: one GPU, the same page tables as reads.
            probes = [v * self.page_size for v in sorted(self.universe)]
            got = ids(self._call("translate_write_loc()", write, torch.tensor(probes, dtype=torch.int64)))
            self._judge(ru.translation_follows_tables, probes, got,
                        tuple(ids(a.full_attn_allocator.virtual_to_physical)), self.page_size,
                        name="write_translation_follows_tables")

    # -- what fits --

    def _held(self) -> tuple[int, int]:
        """Live pages of the full side and live slots of the Mamba side."""
        return (len(self.universe) - self.model.num_free, len(self.mamba_universe) - self.mamba.num_free)

    def _fits(self, full: int, mamba: int) -> bool:
        f, m = self._held()
        f, m = f + full, m + mamba
        return self.arena.fits(f, m) if self.arena.low.name.startswith("full") else self.arena.fits(m, f)

    def _short(self, pages: int) -> bool:
        return self.model.num_free < pages or not self._fits(pages, 0)

    def _full_room(self) -> int:
        """The most pages the full side can take now: free ids that the arena holds."""
        return min(self.model.num_free, self._arena_room(full=True))

    def _mamba_room(self) -> int:
        """The most slots the Mamba side can take now."""
        return min(self.mamba.num_free, self._arena_room(full=False))

    def _arena_room(self, *, full: bool) -> int:
        f, m = self._held()
        if self.arena.low.name.startswith("full"):
            return self.arena.room(f, m, low=full)
        return self.arena.room(m, f, low=not full)

    # -- Mamba steps --

    @step
    def mamba_alloc(self, n: int) -> None:
        """A request's Mamba state (``n`` > 1: with its track slots):
        ``alloc(n)`` on the slot allocator; inside an allocation group
        ``alloc(1)`` draws a pre-allocated slot."""
        slots = self.allocator.mamba_slots
        from_group = n == 1 and bool(self.mamba.reserved)
        short = not from_group and n > self._mamba_room()
        what = f"mamba alloc({n})"
        sched = getattr(slots, "schedulable_available_size", None)
        promised = self._count("mamba schedulable_available_size()", sched) if callable(sched) else 0
        out = self._call(what, slots.alloc, n)
        if out is None:
            self._judge(ru.schedulable_promise_kept, what, promised, n, True, name="mamba_schedulable_promise_kept")
            self._judge(invariants.alloc_none_iff_short, what, True, 0, short, self._mamba_room(), n)
            return
        got = ids(out)
        self._judge(invariants.alloc_none_iff_short, what, False, len(got), short, self._mamba_room(), n)
        self._judge(invariants.slots_were_available, got, self.mamba, name="mamba_slots_were_available")
        made = self.mamba.new_request(-1, [])
        self.mamba.take(made.rid, got)
        self.states[made.rid] = got

    @step
    def mamba_free(self, state: int) -> None:
        """The request owning Mamba state ``state`` (an index into the live
        ones, in order) ends: ``free`` of its slots."""
        rid = sorted(self.states)[state]
        got = self.states.pop(rid)
        self._call(f"mamba free({got})", self.allocator.mamba_slots.free,
                   torch.tensor(got, dtype=torch.int64, device=self.rows.device))
        self.mamba.finish(rid)

    @step
    def mamba_group_begin(self, n: int) -> None:
        """``alloc_group_begin(n)``: pre-allocate ``n`` slots, or none when
        the arena cannot hold them."""
        room = self._mamba_room()
        self._call(f"mamba alloc_group_begin({n})", self.allocator.mamba_slots.alloc_group_begin, n)
        census = self._call("mamba census", lambda: twins.census(self.allocator.mamba_allocator.free_virtual_ids, self.mamba))
        taken, back = as_census(census).change(self.mamba)
        self._judge(invariants.alloc_group_reserves, n, taken, back, room, name="mamba_alloc_group_reserves")
        self.mamba.group_begin(taken)

    @step
    def mamba_group_end(self) -> None:
        """``alloc_group_end()``: the slots no alloc drew go back."""
        self._call("mamba alloc_group_end()", self.allocator.mamba_slots.alloc_group_end)
        self.mamba.group_end()

    @step
    def idle_flush(self) -> None:
        """``flush_opportunistic()``, as the scheduler calls it when idle
        (``scheduler.py``): a lazy pool compacts some holes; no id changes hands."""
        self._call("flush_opportunistic()", self.allocator.flush_opportunistic)

    @step
    def prepare_mamba(self, n: int) -> None:
        """The radix cache's Mamba eviction (``unified_radix_cache.py``
        ``evict`` / ``_target_met``): ``full_tokens_before_mamba_recheck(n)``
        (0 exactly when ``n`` Mamba slots are schedulable), then
        ``prepare_mamba_allocation(n)``, which applies the frees an open free
        group holds (ends and reopens it) and, where the Mamba side needs
        them, compacts the full side's holes.  Nothing changes owner."""
        schedulable = self._count("mamba schedulable_available_size()",
                                     self.allocator.mamba_slots.schedulable_available_size)
        judge_mamba_donor(self, n, schedulable)
        if self.in_group:
            # The queued frees apply now; the group stays open.
            self.model.end()
            self.model.begin()

    def teardown(self) -> None:
        if self.in_alloc_group:
            self.mamba_group_end()
        super().teardown()

    def step_not_applicable(self, rule: str, args: dict) -> str | None:
        if rule == "mamba_group_begin" and self.in_alloc_group:
            return "an allocation group is already open"
        if rule == "mamba_free" and args.get("state", 0) >= len(self.states):
            return "no such live Mamba state"
        return None


class UnifiedMambaMachine(FreeNothingRules, ClearRules, FreeGroupMachine):
    """The core rules on the full side, Mamba states with allocation groups, and the scheduler's ``clear``."""

    @draws(n=(1, 3))
    def mamba_alloc(self, n):
        self._do("mamba_alloc", n)

    @draws(guard=lambda s: s.states, which=PICKS)
    def mamba_free(self, which):
        self._do("mamba_free", which % len(self.state.states))

    @draws(guard=lambda s: not s.in_alloc_group, n=(0, MAX_PAGES + 2))
    def mamba_group_begin(self, n):
        self._do("mamba_group_begin", n)

    @draws()
    def mamba_group_end(self):
        self._do("mamba_group_end")

    @draws(guard=lambda s: s.runs("idle_flush"))
    def idle_flush(self):
        self._do("idle_flush")

    @draws(guard=lambda s: s.runs("prepare_mamba"), n=(1, 3))
    def prepare_mamba(self, n):
        self._do("prepare_mamba", n)


def is_unified_mamba(allocator) -> bool:
    """Whether an allocator has a full sub-pool with virtual ids and a Mamba sub-pool."""
    return hasattr(getattr(allocator, "mamba_allocator", None), "virtual_to_physical") and not hasattr(
        allocator, "swa_attn_allocator"
    )
