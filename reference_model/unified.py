"""Virtual ids over physical pages, in plain Python (no torch).

sglang's unified allocators (``unified_sub_pool.py`` since 0.5.20) hand out
*virtual* page ids and keep, per sub-pool, a virtual→physical table
(``v2p``) and its inverse (``p2v``) over one byte arena.  The core
``OwnershipModel`` owns the virtual ids (who holds each one, as for any
pool); what this module adds is the physical side, read off the allocator
as a ``PageTables`` census after every step:

- every live virtual page maps to one physical page and back, and nothing
  else is mapped (``tables_bijective``);
- every physical page of the sub-pool has exactly one role: bound to a live
  virtual page, a hole (freed, awaiting compaction), pending reuse, lent
  out by ``alloc_physical`` (``Loans``), or beyond the watermark, unused
  (``physical_pages_owned_once``);
- the span the watermark covers stays inside the sub-pool's bytes of the
  arena, and is exactly what lies in it (``span_within_arena``);
- physical pages bound = virtual pages held: a logical free freed exactly
  one physical page (``physical_frees_match_logical``);
- the KV bytes follow the mapping across compaction moves
  (``kv_follows_mapping``), and ``available_size()`` is the free virtual
  pages less those lent out (``available_counts_lent``).

Each predicate returns ``None`` when it holds, else a message naming both
sides.  The predicates take plain values, so any family whose allocator
keeps such tables (the unified SWA / Mamba composites) can judge with them.
"""

from __future__ import annotations

from collections import Counter

from attrs import define, field, frozen

from reference_model.invariants import _show
from reference_model.model import FREE, OwnershipModel

UNMAPPED = -1
# The roles a physical page can have (``PageTables.roles``).
BOUND, HOLE, PENDING, LENT = "bound", "hole", "pending", "lent"


@frozen
class PageTables:
    """One sub-pool's tables and physical free state, as plain ints.

    ``v2p[v]`` is virtual page ``v``'s physical page (``UNMAPPED`` for none),
    ``p2v[p]`` the inverse; each table's last row is a sentinel.  Physical
    pages below ``first_page`` are reserved (page 0 is the padding anchor,
    mapped to itself).  ``span`` is the ``[lo, hi)`` range the watermark
    covers; ``holes`` and ``pending`` are freed pages inside it, not yet
    compacted away or not yet safe to reuse."""

    v2p: tuple[int, ...]
    p2v: tuple[int, ...]
    first_page: int
    num_pages: int
    span: tuple[int, int]
    holes: tuple[int, ...]
    pending: tuple[int, ...] = ()

    def bound(self) -> dict[int, int]:
        """Physical page -> the virtual page it holds, above the reserved pages."""
        return {p: v for p, v in enumerate(self.p2v[: self.num_pages]) if p >= self.first_page and v != UNMAPPED}

    def mapped(self) -> dict[int, int]:
        """Virtual page -> its physical page, above the reserved pages."""
        return {v: p for v, p in enumerate(self.v2p[:-1]) if v >= self.first_page and p != UNMAPPED}

    def page_of(self, v) -> int:
        """``mapped().get(v, UNMAPPED)``, without building the map."""
        return self.v2p[v] if type(v) is int and 0 <= v < len(self.v2p) - 1 and v >= self.first_page else UNMAPPED


@define
class Loans:
    """Physical pages lent out by ``alloc_physical`` (HiCache load-back):
    each loan's pages, by a handle the harness names them by, until
    ``free_physical`` (or ``cancel_physical_reservation``) returns them."""

    loans: dict[int, tuple[int, ...]] = field(factory=dict)
    _next: int = 0

    def lend(self, pages: list[int]) -> int:
        handle, self._next = self._next, self._next + 1
        self.loans[handle] = tuple(pages)
        return handle

    def give_back(self, handle: int) -> tuple[int, ...]:
        return self.loans.pop(handle)

    def pages(self) -> list[int]:
        return [p for pages in self.loans.values() for p in pages]

    def handles(self) -> list[int]:
        return sorted(self.loans)


def live_virtual(model: OwnershipModel) -> set[int]:
    """The virtual pages an allocator must keep mapped: every page the model
    says is held (by a request, the cache, or queued in an open group,
    whose free has not run yet)."""
    held = getattr(model.owner, "held", None)
    if held is not None:
        # An OwnerMap keeps them (``OwnerMap.held``).
        return set(held)
    return {p for p, o in model.owner.items() if o.kind != FREE}


# --------------------------------------------------------------------------- #
# the predicates


def tables_bijective(tables: PageTables, live: set[int]) -> str | None:
    """Every live virtual page maps to its own physical page and back;
    no other virtual page is mapped and no other physical page bound."""
    mapped, bound = tables.mapped(), tables.bound()
    problems = []
    if unmapped := sorted(v for v in live if v not in mapped):
        problems.append(f"live virtual pages {_show(unmapped)} map to no physical page")
    if stale := sorted(set(mapped) - live):
        problems.append(f"virtual pages {_show(stale)} are mapped but not held (freed or never handed out)")
    shared = sorted(p for p, n in Counter(mapped.values()).items() if n > 1)
    if shared:
        problems.append(f"physical pages {_show(shared)} back more than one virtual page")
    broken = sorted(v for v, p in mapped.items() if not (tables.first_page <= p < tables.num_pages) or tables.p2v[p] != v)
    if broken:
        problems.append(f"v2p and p2v disagree for virtual pages {_show(broken)}")
    orphans = sorted(p for p, v in bound.items() if v >= len(tables.v2p) - 1 or tables.v2p[v] != p)
    if orphans:
        problems.append(f"physical pages {_show(orphans)} name a virtual page in p2v that does not map back")
    if not problems:
        return None
    return f"allocator tables ({len(mapped)} mapped) / model live virtual pages ({len(live)}): " + "; ".join(problems)


def physical_pages_owned_once(tables: PageTables, lent: list[int]) -> str | None:
    """Inside the span every physical page has one role (bound, hole,
    pending, lent); outside it none."""
    roles: dict[int, list[str]] = {}
    for p in tables.bound():
        roles.setdefault(p, []).append(BOUND)
    for name, pages in ((HOLE, tables.holes), (PENDING, tables.pending), (LENT, lent)):
        for p in pages:
            roles.setdefault(p, []).append(name)
    lo, hi = tables.span
    twice = sorted(p for p, r in roles.items() if len(r) > 1)
    outside = sorted(p for p in roles if not lo <= p < hi)
    idle = sorted(p for p in range(lo, hi) if p not in roles)
    problems = []
    if twice:
        problems.append(f"pages {_show(twice)} have two roles ({', '.join('/'.join(roles[p]) for p in twice[:4])})")
    if outside:
        problems.append(f"pages {_show(outside)} outside the span have a role ({', '.join('/'.join(roles[p]) for p in outside[:4])})")
    if idle:
        problems.append(f"pages {_show(idle)} inside the span have no role (lost)")
    if not problems:
        return None
    return f"allocator span [{lo}, {hi}) / model: one role per page inside it: " + "; ".join(problems)


def span_within_arena(tables: PageTables, bytes_per_page: int, total_bytes: int) -> str | None:
    """The watermark span lies inside the sub-pool's pages and its bytes
    inside the arena."""
    lo, hi = tables.span
    if tables.first_page <= lo <= hi <= tables.num_pages and hi * bytes_per_page <= total_bytes:
        return None
    return (
        f"allocator span [{lo}, {hi}) pages = bytes [{lo * bytes_per_page}, {hi * bytes_per_page})"
        f" / model: within pages [{tables.first_page}, {tables.num_pages}) and {total_bytes} bytes"
    )


def physical_frees_match_logical(tables: PageTables, model: OwnershipModel) -> str | None:
    """Physical pages bound = virtual pages held: each logical free (and
    eviction) released exactly one physical page, each alloc bound one."""
    bound = len(tables.bound())
    held = len(live_virtual(model))
    if bound == held:
        return None
    ledger = model.ledger
    return (
        f"physical pages bound {bound} / virtual pages held {held}"
        f" (allocated {ledger.allocated}, freed {ledger.freed}, evicted {ledger.evicted})"
    )


def kv_follows_mapping(stamps: dict[int, int], tables: PageTables, written: set[int]) -> str | None:
    """Each virtual page whose KV was written still finds it: the physical
    page it maps to holds what was written for it (``stamps``: physical
    page -> the virtual page whose KV it holds)."""
    lost = sorted(v for v in written if (p := tables.page_of(v)) != UNMAPPED and stamps.get(p) != v)
    if not lost:
        return None
    mapped = tables.mapped()
    shown = ", ".join(f"v{v}->p{mapped[v]} holds v{stamps.get(mapped[v])}" for v in lost[:4])
    return f"allocator's mapping / KV written: virtual pages {_show(lost)} map to pages holding other KV ({shown})"


def available_counts_lent(available: int, free_virtual: int, lent: int, page_size: int) -> str | None:
    """``available_size()`` = (free virtual pages - pages lent out) x page size:
    a lent page has no virtual id, but takes a physical page."""
    want = (free_virtual - lent) * page_size
    if available == want:
        return None
    return f"available_size() {available} / (free virtual {free_virtual} - lent {lent}) x {page_size} = {want}"


def allocator_accounting_clean(violations: list[str]) -> str | None:
    """The allocator's own byte-accounting diagnostic reports nothing."""
    return "; ".join(violations) if violations else None


def translation_follows_tables(probes: list[int], got: list[int], v2p: tuple[int, ...], page_size: int) -> str | None:
    """The reader's view: virtual token ``t`` translates to physical token
    ``v2p[t // page_size] * page_size + t % page_size``, and a token of an
    unmapped page to 0, the padding sink every kernel skips."""
    def want(t: int) -> int:
        p = v2p[t // page_size] if 0 <= t // page_size < len(v2p) - 1 else UNMAPPED
        return p * page_size + t % page_size if p != UNMAPPED else 0

    wrong = [(t, g, want(t)) for t, g in zip(probes, got) if g != want(t)]
    if not wrong:
        return None
    shown = ", ".join(f"t{t}->{g} (tables say {w})" for t, g, w in wrong[:4])
    return f"allocator translate_kv_loc / model's page tables: {len(wrong)} token(s) disagree: {shown}"


def slot_allocated_agrees(said: dict[int, bool], live: set[int]) -> str | None:
    """``is_slot_allocated`` of a page's first token is True exactly for the
    live virtual pages (``said``: virtual page -> the allocator's answer)."""
    wrong_live = sorted(v for v, yes in said.items() if not yes and v in live)
    wrong_free = sorted(v for v, yes in said.items() if yes and v not in live)
    if not wrong_live and not wrong_free:
        return None
    return (f"allocator is_slot_allocated / model: live pages said free {_show(wrong_live)};"
            f" free pages said allocated {_show(wrong_free)}")


def capacity_view_within_room(what: str, view: int, room: int) -> str | None:
    """A capacity view the scheduler plans with (``available_size()``,
    ``schedulable_available_size()``) never promises more than the arena,
    compacted, can hold (``room``, from the model's live counts)."""
    if view <= room:
        return None
    return f"allocator {what} = {view} / model room {room}: it promises more than fits"


def schedulable_promise_kept(what: str, schedulable: int, need: int, refused: bool) -> str | None:
    """``schedulable_available_size() >= need`` promises that ``alloc(need)``
    succeeds (``UnifiedMambaSlotAllocator``'s contract: flushing the peer
    first is the allocator's job)."""
    if not (refused and schedulable >= need):
        return None
    return f"allocator {what} returned None / schedulable_available_size() {schedulable} >= {need} promised it"


def size_balances(size: int, available: int, held_tokens: int) -> str | None:
    """The leak check's identity: ``size - available_size()`` is the tokens
    held (``size`` is defined from the same available view, so a leak shows)."""
    if size - available == held_tokens:
        return None
    return f"allocator size {size} - available {available} = {size - available} / model held tokens {held_tokens}"


def recheck_bound_zero_iff_room(bound: int, schedulable: int, target: int) -> str | None:
    """``full_tokens_before_mamba_recheck(target)`` is 0 exactly when the
    Mamba side's schedulable slots already reach ``target``, else positive:
    the radix cache evicts that many full tokens before it looks again."""
    if (bound == 0) == (schedulable >= target) and bound >= 0:
        return None
    return (f"allocator full_tokens_before_mamba_recheck({target}) = {bound}"
            f" / model: 0 iff Mamba schedulable {schedulable} >= {target}, else > 0")


def slot_cost_covers_state(cost: int, state_bytes: int, token_bytes: int) -> str | None:
    """``mamba_slot_full_token_cost()``: the full tokens the prefill planner
    reserves per new Mamba state, so admission stays inside the arena's
    joint budget: the fewest whose bytes (``token_bytes`` each, every
    attention side's) hold one state's ``state_bytes``."""
    want = -(-state_bytes // token_bytes)
    if cost == want:
        return None
    return (f"allocator mamba_slot_full_token_cost() = {cost} / model: a state's {state_bytes} bytes"
            f" need {want} tokens of {token_bytes} bytes")
