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

``UnifiedSWALockstep`` runs the SWA family's steps as they are (a slide, an
SWA eviction, ``free_full`` for slid spans), with the SWA model keyed by
virtual page (``reference_model/unified_hybrid.py``).  What it checks
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

from attrs import define

from reference_model import CHECKS, OwnershipModel, SWASide
from reference_model.invariants import available_size_agrees
from reference_model.unified_hybrid import (
    Arena,
    SubPool,
    unified_bands_disjoint,
    unified_compacted,
    unified_page_table_bijective,
)
from state_machines.harness.lockstep import Lockstep, Pool, ids
from state_machines.harness.steps import EntryRef, ReqRef, step
from state_machines.harness.swa import SWALockstep, SWAMachine
from state_machines.targets import probe

# The census checks that hold on a unified pool (see the module docstring).
UNIFIED_CHECKS = tuple(c for c in CHECKS if c is not available_size_agrees)


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
class UnifiedSWALockstep(SWALockstep):
    arena: Arena | None = None
    universe: frozenset[int] = frozenset()
    # Whether the pools compact lazily (holes allowed): compaction is then not checked.
    lazy: bool = False

    def start_models(self, defers_frees: bool) -> None:
        a = self.allocator
        fa, sa = a.full_attn_allocator, a.swa_attn_allocator
        full, swa = sub_pool(fa), sub_pool(sa)
        # A float SWA pool (the Mamba variant's chain middle) sits below full,
        # above the Mamba pool's empty low end: the arena is still two bands.
        self.arena = Arena(low=full, high=swa) if full.grows == "up" else Arena(low=swa, high=full)
        self.lazy = bool(getattr(a, "lazy_compaction", False))
        free = sorted(set(self._call("free_virtual_ids", self._full_census)))
        self.model = OwnershipModel.from_census(free, defers_frees=defers_frees)
        self.universe = frozenset(free)
        self.swa = SWASide.from_census(self.model, free)
        # free_swa() and free_swa_segment() release at once, inside a group too.
        self.swa_defers = False

    def why_not(self, step: str) -> str | None:
        # A probed reason (a Triton kernel on CPU) says more than "not modelled".
        if step in probe.OPTIONAL and step in self.disabled_rules:
            return self.disabled_rules[step]
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
        censuses = [
            self._call("full census (free_virtual_ids)", self._full_census),
            self._call("SWA census (virtual_to_physical == -1)", self._swa_census),
        ]
        for pool, census in zip(self.pools(), censuses):
            for predicate in UNIFIED_CHECKS:
                self._judge(predicate, census, len(census) * self.page_size, self.page_size, pool.model,
                            name=pool.prefix + predicate.__name__, label=pool.label)
        self.check_joint(censuses)

    def _live(self) -> tuple[set[int], set[int]]:
        """The model's live virtual pages of the full side and of the SWA side."""
        full = self.universe - self.model.free_pages
        swa = self.universe - self.swa.free_pages
        return full, swa

    def check_joint(self, censuses: list[list[int]]) -> None:
        a = self.allocator
        live = dict(zip(("full", "swa"), self._live()))
        physical = {}
        for name, sub in (("full", a.full_attn_allocator), ("swa", a.swa_attn_allocator)):
            pool = self.arena.low if self.arena.low.name.startswith(name) else self.arena.high
            v2p, p2v = ids(sub.virtual_to_physical), ids(sub.physical_to_virtual)
            self._judge(unified_page_table_bijective, pool, v2p, p2v, live[name], set(self.universe),
                        name=f"{name}_page_table_bijective")
            physical[pool.name] = [v2p[v] for v in live[name]]
            if not self.lazy and pool.grows != "float":
                tokens = int(self._call(f"{name} allocated_count()", sub.allocated_count))
                self._judge(unified_compacted, pool, physical[pool.name], tokens, self.page_size,
                            name=f"{name}_compacted")
        self._judge(unified_bands_disjoint, self.arena, physical[self.arena.low.name], physical[self.arena.high.name])

    # -- steps --

    def _short(self, pages: int) -> bool:
        """Short when the virtual ids run out, or the arena cannot hold
        ``pages`` more on each side (the model's live counts, compacted)."""
        full, swa = self._live()
        low, high = (len(full), len(swa)) if self.arena.low.name.startswith("full") else (len(swa), len(full))
        return self.model.num_free < pages or not self.arena.fits(low + pages, high + pages)

    @step
    def alloc(self, n: int, req: ReqRef | None = None, prefix: EntryRef | None = None) -> ReqRef | None:
        """As the core's ``alloc``: the full side mints ``n // page_size``
        virtual pages and the SWA side binds each of them."""
        pool_short = self._short(n // self.page_size)
        made = Lockstep.alloc(self, n, req, prefix)
        if pool_short:
            return None
        ps = self.page_size
        pages = self.model.requests[(made or req).rid].own[-(n // ps):]
        self.swa.take(pages, pages)
        return made


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


class UnifiedSWAMachine(SWAMachine):
    """The SWA family's rules over a unified pool."""


def is_unified_swa(allocator) -> bool:
    """Whether an allocator has two sub-pools with virtual page tables."""
    fa = getattr(allocator, "full_attn_allocator", None)
    sa = getattr(allocator, "swa_attn_allocator", None)
    return all(hasattr(x, "virtual_to_physical") for x in (fa, sa)) and hasattr(fa, "free_virtual_ids")
