"""The shortest trace known to trigger each bug, written by hand once.

Each is a program of ``Lockstep`` steps the machine's own rules can produce
(an alloc takes at most a row's slots; the walk draws ``MAX_PAGES`` pages
a step, and its fill asks for more), with the invariant it breaks
and why nothing shorter can.  The bench sets Hypothesis's shrunk length
beside it; ``tests/test_known_shortest.py`` replays each one.
"""

from __future__ import annotations

import attrs
from attrs import frozen

from state_machines.config import Config
from state_machines.harness import Step
from state_machines.runs.trace import Trace


def bug_name(config: Config) -> str:
    """A configuration's name in the bench: its label, and the sglang
    checkout it loads, if any (two sglang releases share a label)."""
    return config.label() + (f" @ {config.sglang_path}" if config.sglang_path else "")


def _s(rule: str, returns: str | None = None, **args) -> Step:
    return Step(rule, args, returns)


def _decode(*reqs: str) -> Step:
    """A ``decode`` step of the batch ``reqs``, in batch order; the one place
    that spells how a trace writes the batch."""
    return _s("decode", reqs=list(reqs))


def _extend(reqs: list[str], tokens: list[int]) -> Step:
    """An ``extend`` step: ``reqs[i]`` grows by ``tokens[i]`` tokens."""
    return _s("extend", reqs=list(reqs), tokens=list(tokens))


# The aliasing story: a view of row 0 is queued, the row changes, the group ends.
_ALIAS_TOKEN = (_s("begin"), _s("alloc", "req_0", n=1), _s("finish", req="req_0"), _s("overwrite_row", row=0), _s("end"))
_ALIAS_PAGED = (_s("begin"), _s("alloc", "req_0", n=4), _s("finish", req="req_0"), _s("overwrite_row", row=0), _s("end"))
# The flag-drift story: a group queues a free, and end() runs twice.
_DRIFT_TOKEN = (_s("begin"), _s("alloc", "req_0", n=1), _s("finish", req="req_0"), _s("end"), _s("end"))
# A page allocated and freed: the story of every bug in a plain free.
_PAGE_FREED = (_s("alloc", "req_0", n=4), _s("finish", req="req_0"))
_DRIFT_PAGED = (_s("begin"), _s("alloc", "req_0", n=4), _s("finish", req="req_0"), _s("end"), _s("end"))

_WHY_ALIAS = (
    "a group must be opened, a slot allocated, freed as a view, the row changed, the group ended: "
    "five distinct actions, none of which can double as another"
)
_WHY_DRIFT = "begin, an alloc, a free queued in the group, then end twice; the first end is correct"

# The configuration a hand-written trace fails on, and where it must pass.
_TOKEN = Config(target="builtin:token")
_PAGED = Config(target="builtin:paged", page_size=4)
_SWA = Config(target="builtin:swa", page_size=4)
_PURE_SWA = Config(target="builtin:pure-swa")
_HISPARSE = Config(target="builtin:hisparse", page_size=4)
_NPU = Config(target="builtin:npu", page_size=4)
_MAMBA = Config(target="builtin:mamba")
_INTERLEAVE = Config(target="builtin:page-interleave", page_size=4)
_DSV4 = Config(target="builtin:dsv4-hisparse", page_size=4)
_DSV4_8 = Config(target="builtin:dsv4-hisparse", page_size=8)
_MULTI = Config(target="builtin:multi-ended", page_size=4)
_UNI_MAMBA = Config(target="builtin:unified-mamba", page_size=4)
_UNI_SWA = Config(target="builtin:unified-swa", page_size=4)


@frozen
class KnownShortest:
    """A hand-written shortest failing trace for one bug."""

    config: Config
    steps: tuple[Step, ...]
    # The invariant its last step breaks.
    invariant: str
    # Why no shorter trace can trigger the bug.
    why: str
    # Targets without the bug, where the same steps must pass.
    fixed: tuple[Config, ...]
    # The pool size the steps run on, where the bug needs one its
    # configuration does not pin (an example draws it; see ``pool_sizes``).
    size: int | None = None

    @property
    def name(self) -> str:
        return bug_name(self.config)

    def trace(self) -> Trace:
        return Trace(self.on(self.config), self.steps, self.invariant)

    def on(self, config: Config) -> Config:
        """``config`` on the pool the steps need."""
        return config if self.size is None else attrs.evolve(config, size=self.size)


def _mutant(base: Config, mutant: str, steps, invariant: str, why: str, **needs) -> KnownShortest:
    config = Config(target=base.target, mutant=mutant, page_size=base.page_size, **needs)
    return KnownShortest(config, tuple(steps), invariant, why, (Config(target=base.target, page_size=base.page_size, **needs),))


def _hard(name: str, fixed: Config, steps, invariant: str, why: str, size: int | None = None) -> KnownShortest:
    """A bench bug of ``bench/bugs.py``; ``fixed`` is the built-in it subclasses."""
    config = Config(target=f"bench.bugs:{name}", page_size=fixed.page_size)
    return KnownShortest(config, tuple(steps), invariant, why, (fixed,), size)


def _sglang(version: str, steps, invariant: str, why: str) -> KnownShortest:
    return KnownShortest(
        Config(target="sglang:token", sglang_path=f".sglang/{version}"),
        tuple(steps),
        invariant,
        why,
        # Fixed: the built-in token allocator, and sglang 0.5.23 where installed.
        (_TOKEN, Config(target="sglang:token", sglang_path=".sglang/0.5.23")),
    )


KNOWN: tuple[KnownShortest, ...] = (
    _mutant(_TOKEN, "alias", _ALIAS_TOKEN, "free_sets_agree", _WHY_ALIAS),
    _mutant(_TOKEN, "flag-drift", _DRIFT_TOKEN, "no_page_freed_twice", _WHY_DRIFT),
    _mutant(
        _TOKEN,
        "alloc-off-by-one",
        [_s("alloc", "req_0", n=1)],
        "free_sets_agree",
        "the first alloc leaves its last slot in the free list",
    ),
    _mutant(
        _TOKEN,
        "merge-drops-release",
        [_s("alloc", "req_0", n=4), _s("finish", req="req_0"), _s("alloc", n=1)],
        "alloc_none_iff_short",
        "the merge runs only when free_pages runs short, and must find release_pages filled: on a "
        "4-slot pool (--size 4, a size examples draw) an alloc of all of it, its free, "
        "then any alloc",
        need_sort=True, size=4,
    ),
    _mutant(_PAGED, "alias", _ALIAS_PAGED, "free_sets_agree", _WHY_ALIAS),
    _mutant(
        _PAGED,
        "reps-alias",
        [_s("begin"), _s("alloc", "req_0", n=4), _s("free_segment", req="req_0", start=0, n=4), _s("overwrite_row", row=0), _s("end")],
        "free_sets_agree",
        _WHY_ALIAS.replace("freed as a view", "freed by free_segment as a view"),
    ),
    _mutant(_PAGED, "flag-drift", _DRIFT_PAGED, "no_page_freed_twice", _WHY_DRIFT),
    _mutant(
        _PAGED,
        "segment-drops-tail",
        [_s("alloc", "req_0", n=4), _s("free_segment", req="req_0", start=0, n=3)],
        "free_sets_agree",
        "an alloc, then a segment ending mid-page",
    ),
    _mutant(
        _PAGED,
        "free-no-dedup",
        _PAGE_FREED,
        "no_page_freed_twice",
        "an alloc of one page, then a free of its slots",
    ),
    _mutant(_SWA, "alias-full", _ALIAS_PAGED, "free_sets_agree", _WHY_ALIAS),
    _mutant(_SWA, "alias-swa", _ALIAS_PAGED, "swa_free_sets_agree", _WHY_ALIAS),
    _mutant(
        _SWA,
        "swa-keeps-mapping",
        [_s("alloc", "req_0", n=4), _s("slide", req="req_0", pages=1, segment=False)],
        "swa_mapping_consistent",
        "an alloc maps a page, then its window slides: free_swa releases the SWA page and leaves it mapped",
    ),
    _mutant(
        _SWA,
        "end-resolves-swa",
        [_s("alloc", "req_0", n=4), _s("begin"), _s("slide", req="req_0", pages=1, segment=False),
         _s("rematch", "cache_0", req="req_0", dup=0), _s("remap", entry="cache_0"), _s("end")],
        "swa_free_sets_agree",
        "a page, a group, its window slides (queued), the cache takes the page and loads its SWA side back"
        " onto a fresh page, then end: the release must be queued, slid and remapped in between",
    ),
    _mutant(
        _SWA,
        "unmap-per-token",
        [_s("alloc", "req_0", n=4), _s("slide", req="req_0", pages=1, segment=True)],
        "swa_mapping_consistent",
        "an alloc maps a page, then free_swa_segment of it unmaps only its representative slot",
    ),
    _mutant(
        _SWA,
        "swa-tail-stale",
        [_s("alloc", "req_0", n=4), _s("slide", req="req_0", pages=1, segment=True)],
        "swa_mapping_consistent",
        "its per-token unmapping shows as soon as a mapped page slides by segment",
    ),
    _mutant(_PURE_SWA, "alias", _ALIAS_TOKEN, "free_sets_agree", _WHY_ALIAS),
    _mutant(
        _PURE_SWA,
        "end-requeues",
        [_s("begin"), _s("alloc", "req_0", n=1), _s("finish", req="req_0"), _s("end")],
        "free_sets_agree",
        "begin, an alloc, a free queued in the group, then the end that queues it again instead of releasing it",
    ),
    _mutant(
        _HISPARSE,
        "queues-anyway",
        [_s("begin"), _s("alloc", "req_0", n=4), _s("finish", req="req_0")],
        "free_sets_agree",
        "a free inside a group: begin, an alloc, a free; the model releases at once, the mutant queues",
    ),
    _mutant(
        _PURE_SWA,
        "free-full-releases",
        [_s("alloc", "req_0", n=1), _s("slide", req="req_0", pages=1, segment=False), _s("finish", req="req_0")],
        "no_page_freed_twice",
        "a slot must be allocated, leave the window, and its request finish, which hands the slid span to free_full",
    ),
    _mutant(
        _PURE_SWA,
        "segment-frees-twice",
        [_s("alloc", "req_0", n=1), _s("free_segment", req="req_0", start=0, n=1)],
        "no_page_freed_twice",
        "an alloc, then a free_segment of it",
    ),
    _mutant(
        _HISPARSE,
        "mapping-cleared-first",
        _PAGE_FREED,
        "device_free_sets_agree",
        "an alloc maps a device page, then a free leaks it",
    ),
    _mutant(
        _HISPARSE,
        "buffer-keeps-mapping",
        [_s("alloc", "req_0", n=4), _s("device_buffer", req="req_0", n=4)],
        "hisparse_mapping_consistent",
        "an alloc maps a device page, then the request's device buffer takes it and leaves it mapped",
    ),
    _mutant(
        _HISPARSE,
        "buffer-drops-surplus",
        [_s("alloc", "req_0", n=8), _s("device_buffer", req="req_0", n=4)],
        "device_free_sets_agree",
        "an alloc maps two device pages, then a one-page buffer must free the second",
    ),
    _mutant(
        _HISPARSE,
        "short-leaks",
        [_s("alloc", "req_0", n=12)],
        "free_sets_agree",
        "the device pool (half the logical pool) must run short: on a 2-page pool (--size 8, a pool the "
        "minimiser halves down to) its one device page is short of the first alloc of 3 pages",
        size=8,
    ),
    _mutant(
        _MAMBA,
        "end-keeps-leftovers",
        [_s("alloc_group_begin", n=1), _s("alloc_group_end")],
        "free_sets_agree",
        "a group must reserve a slot and end with it undrawn",
    ),
    _mutant(
        _MAMBA,
        "end-repeats",
        [_s("alloc_group_begin", n=1), _s("alloc_group_end"), _s("alloc_group_end")],
        "no_page_freed_twice",
        "a group reserves a slot, ends, and ends again; the first end is correct",
    ),
    _mutant(
        _MAMBA,
        "reserve-not-taken",
        [_s("alloc_group_begin", n=1)],
        "alloc_group_reserves",
        "the first reserve leaves its slot free",
    ),
    _mutant(
        _MAMBA,
        "free-keeps-view",
        [_s("alloc", "req_0", n=1), _s("finish", req="req_0"), _s("overwrite_row", row=0)],
        "free_sets_agree",
        "a slot is allocated, freed as a view of its row, and the row changed before the free list is read",
    ),
    _mutant(_NPU, "alias", _ALIAS_PAGED, "free_sets_agree", _WHY_ALIAS),
    _mutant(
        _NPU,
        "decode-one-past",
        [_s("alloc", "req_0", n=4), _decode("req_0")],
        "free_sets_agree",
        "an alloc fills a page, then a decode takes a new one: the mutant takes one page off the free list "
        "and hands out the next, which stays free",
    ),
    _mutant(
        _NPU,
        "decode-boundary",
        [_s("alloc", "req_0", n=4), _decode("req_0")],
        "free_sets_agree",
        "an alloc fills a page, then a decode must take a new one: the mutant takes none and hands out "
        "the slot past the page, whose page stays free",
    ),
    _mutant(
        _PAGED,
        "extend-early",
        [_s("admit", "req_0"), _extend(["req_0"], [1]), _extend(["req_0"], [1])],
        "extend_continues_last_page",
        "a request must hold a partly used page before an extend can continue it: an admit, an extend of "
        "fewer tokens than a page, then the extend the mutant starts one slot early",
    ),
    _mutant(
        _PAGED,
        "extend-floor",
        [_s("admit", "req_0"), _extend(["req_0"], [1])],
        "free_sets_agree",
        "an admit, then an extend that ends mid-page: floor counts no new page, so the page handed out stays free",
    ),
    _mutant(
        _NPU,
        "extend-wrong-end",
        [_s("admit", "req_0"), _extend(["req_0"], [1])],
        "free_sets_agree",
        "an admit, then an extend taking a page: the mutant hands out the free list's last page and takes its first",
    ),
    _mutant(
        _INTERLEAVE,
        "free-wrong-class",
        _PAGE_FREED,
        "free_pages_in_own_class",
        "a page must be handed out before a free can file it under the wrong class",
    ),
    _mutant(
        _INTERLEAVE,
        "base-keeps-page",
        [_s("load_back", "req_0", n=4, start=0)],
        "free_sets_agree",
        "the first chain loaded back at a given class continues from its base, whose page stays free",
    ),
    _mutant(
        _INTERLEAVE,
        "rotation-from-extend",
        [_s("alloc", "req_0", n=4), _s("alloc", req="req_0", n=4)],
        "pages_follow_rotation",
        "a chain must hold a page before an extend can restart its cycle at the wrong class",
    ),
    _mutant(
        _INTERLEAVE,
        "base-not-written",
        [_s("alloc", "req_0", n=4)],
        "rotation_bases_resolved",
        "the first new chain's base is not written back",
    ),
    _mutant(
        _INTERLEAVE,
        "merge-on-total",
        [_s("alloc", "req_0", n=4), _s("finish", req="req_0"), _s("alloc", "req_1", n=16)],
        "allocator_raised",
        "with 2 pages a class (--size 8), a released class-0 page, then a chain drawing class 0 twice: "
        "its free list alone holds one, and the free lists together hold enough, so nothing is merged",
        need_sort=True, size=8,
    ),
    _mutant(_INTERLEAVE, "alias", _ALIAS_PAGED, "free_sets_agree", _WHY_ALIAS),
    _mutant(
        _DSV4,
        "free-keeps-device",
        _PAGE_FREED,
        "device_free_sets_agree",
        "an alloc maps a device page, then a free keeps it",
    ),
    _mutant(_DSV4, "group-queues-view", _ALIAS_PAGED, "free_sets_agree", _WHY_ALIAS),
    _mutant(
        _DSV4_8,
        "last-loc-floor",
        [_s("admit", "req_0"), _extend(["req_0"], [5]), _extend(["req_0"], [3])],
        "compressed_mapping_consistent",
        "a request must hold a partly used page and an extend then fill it: admit, an extend ending mid-page, "
        "the extend whose last location the mutant rounds down",
    ),
    _mutant(
        _DSV4_8,
        "surplus-frees-shared",
        [_s("alloc", "req_0", n=16), _s("device_buffer_pages", req="req_0", pages=1)],
        "device_free_sets_agree",
        "a request must hold more device pages than its buffer keeps: an alloc of two pages, then a one-page buffer",
    ),
    _mutant(
        _MULTI,
        "segment-view",
        [_s("begin"), _s("alloc", "req_0", n=12), _s("free_segment", req="req_0", start=4, n=5),
         _s("overwrite_row", row=0), _s("end")],
        "no_page_freed_twice",
        _WHY_ALIAS.replace("freed as a view", "freed by free_segment as a view"),
        row_dtype="int64",
    ),
    _mutant(
        _MULTI,
        "reps-drift",
        [_s("begin"), _s("alloc", "req_0", n=12), _s("free_segment", req="req_0", start=4, n=5), _s("end"), _s("end")],
        "no_page_freed_twice",
        _WHY_DRIFT.replace("a free queued", "a free_segment queued"),
    ),
    _mutant(
        _MULTI,
        "lazy-no-dedup",
        _PAGE_FREED,
        "no_page_freed_twice",
        "an alloc of one page, then a free of its slots",
    ),
    _mutant(
        _MULTI,
        "move-keeps-mapping",
        [_s("alloc_physical", n=4), _s("alloc", "req_0", n=4), _s("free_physical", loan=0), _s("flush", urgent=True)],
        "tables_bijective",
        "a physical loan, a logical page behind it, the loan freed (a move pending), and the urgent flush "
        "that moves the page and keeps its old mapping",
    ),
    _mutant(
        _MULTI,
        "clear-keeps-free-ids",
        [_s("alloc", "req_0", n=4), _s("rematch", "cache_0", req="req_0", dup=0), _s("finish", req="req_0"),
         _s("clear")],
        "free_sets_agree",
        "a clear runs only idle, so a page must be held by the cache (a page, its rematch, the request's "
        "finish) for the kept free ids to lack it",
    ),
    _mutant(
        _UNI_MAMBA,
        "clear-keeps-mamba",
        [_s("mamba_alloc", n=1), _s("clear")],
        "mamba_free_sets_agree",
        "a Mamba state the cache holds, then the clear that leaves it taken",
    ),
    _mutant(
        _UNI_SWA,
        "clear-keeps-swa",
        [_s("alloc", "req_0", n=4), _s("rematch", "cache_0", req="req_0", dup=0), _s("finish", req="req_0"),
         _s("clear")],
        "swa_free_sets_agree",
        "a clear runs only idle, so a page must be held by the cache (a page, its rematch, the request's "
        "finish) for its SWA side to stay bound",
    ),
    _mutant(
        _UNI_MAMBA,
        "reps-not-flushed",
        [_s("begin"), _s("alloc", "req_0", n=4), _s("free_segment", req="req_0", start=0, n=1), _s("end")],
        "free_sets_agree",
        "a group, a page, a free_segment queued in the group, and the end that does not release it",
    ),
    _mutant(
        _UNI_MAMBA,
        "bytes-not-shared",
        [_s("mamba_alloc", n=3), _s("alloc", "req_0", n=12)],
        "alloc_none_iff_short",
        "the shared bytes must run short on the KV side: on a 4-page pool (--size 16) state slots "
        "taken, then the alloc the mutant refuses though room is left; no alloc alone is refused",
        size=16,
    ),
    _mutant(
        _UNI_MAMBA,
        "group-end-keeps-leftovers",
        [_s("mamba_group_begin", n=1), _s("mamba_group_end")],
        "mamba_free_sets_agree",
        "a group must reserve a state slot and end with it undrawn",
    ),
    _mutant(
        _UNI_MAMBA,
        "prepare-closes-group",
        [_s("begin"), _s("alloc", "req_0", n=8), _s("free", req="req_0", n=4), _s("prepare_mamba", n=1),
         _s("finish", req="req_0")],
        "free_sets_agree",
        "a free queued in a group, prepare_mamba (which the mutant lets close the group), and a free after "
        "it: the group must hold a queued free before prepare, and a free after, so the request takes two "
        "pages at once and frees one before, one after",
    ),
    _mutant(
        _UNI_MAMBA,
        "schedulable-overpromises",
        [_s("alloc", "req_0", n=4)],
        "mamba_capacity_view_within_room",
        "the first alloc's capacity view is already over-promised",
    ),
    _mutant(
        _UNI_SWA,
        "no-tombstone-filter",
        [_s("alloc", "req_0", n=4), _s("slide", req="req_0", pages=1), _s("finish", req="req_0")],
        "swa_compacted",
        "a page, its window slid (a tombstone), and the free that hands the tombstone back",
    ),
    _mutant(
        _UNI_SWA,
        "full-queue-not-flushed",
        [_s("begin"), _s("alloc", "req_0", n=4), _s("rematch", "cache_0", req="req_0", dup=0), _s("finish", req="req_0"),
         _s("evict_swa", entry="cache_0"), _s("evict", entry="cache_0"), _s("end")],
        "free_sets_agree",
        "the full side's free must be queued in a group by an eviction: a cached, unlocked page "
        "(alloc, rematch, finish), its SWA side and then itself evicted in the group, then end",
    ),
    _mutant(
        _UNI_SWA,
        "segment-queues-view",
        [_s("alloc", "req_0", n=12), _s("begin"), _s("free_segment", req="req_0", start=0, n=9),
         _s("overwrite_row", row=0), _s("end")],
        "no_page_freed_twice",
        _WHY_ALIAS.replace("freed as a view", "freed by free_segment as a view"),
    ),
    _mutant(
        _UNI_SWA,
        "slide-keeps-binding",
        [_s("alloc", "req_0", n=4), _s("slide", req="req_0", pages=1)],
        "swa_free_sets_agree",
        "a page, then its window slides",
    ),
    _mutant(
        _UNI_SWA,
        "admission-ignores-swa",
        [_s("reserve", full=3, swa=3, evict_full=0, evict_swa=0, prefer_swa=False)],
        "unified_reclaim_plan_agrees",
        "one admission question that needs more SWA than is free: on a 4-page pool (--size 16) "
        "3 pages of each do, where the rule draws at most MAX_PAGES of each (on the default pool "
        "it takes an alloc first)",
        size=16,
    ),
    _mutant(
        _UNI_SWA,
        "tombstone-read-wraps",
        [_s("alloc", "req_0", n=4), _s("slide", req="req_0", pages=1)],
        "swa_read_path_agrees",
        "a page, then its window slides and the read path meets the tombstone",
    ),
    _hard(
        "ExactlyFull",
        _TOKEN,
        [_s("alloc", "req_0", n=2)],
        "free_sets_agree",
        "the pool must be taken whole by one call: on a 2-slot pool (--size 2, a pool the minimiser "
        "halves down to) the first alloc of both; on the default 10-slot pool it takes three steps",
        size=2,
    ),
    _hard(
        "ThirdGroup",
        _TOKEN,
        [_s("alloc", "req_0", n=3), *[x for _ in range(3) for x in (_s("begin"), _s("free", req="req_0", n=1), _s("end"))]],
        "free_sets_agree",
        "three groups, each begin, a free and end (9 steps), after an alloc that gives them something to free",
    ),
    _hard(
        "BigFree",
        _TOKEN,
        [_s("alloc", "req_0", n=9), _s("finish", req="req_0")],
        "free_sets_agree",
        "one free of 9 slots: an alloc of 9 and its finish (the walk's fill asks for as many)",
    ),
    _hard(
        "BigPool",
        _TOKEN,
        [_s("alloc", "req_0", n=1)],
        "free_sets_agree",
        "on a pool of 64 slots (an example draws one), the first alloc",
        size=64,
    ),
    _hard(
        "OffsetThree",
        _PAGED,
        [_s("alloc", "req_0", n=4), _s("free_segment", req="req_0", start=0, n=3)],
        "free_sets_agree",
        "an alloc, then a segment ending 3 slots into its page",
    ),
    _hard(
        "TenthAlloc",
        _TOKEN,
        [_s("alloc", "req_0", n=1), *[_decode("req_0")] * 9],
        "free_sets_agree",
        "ten calls that allocate: each step makes at most one",
    ),
    # sglang 0.5.17 has both bugs (a flag beside the queue, and a queue of
    # views); flag drift shows in as few steps as aliasing.
    _sglang("0.5.17", _DRIFT_TOKEN, "no_page_freed_twice", _WHY_DRIFT),
    _sglang("0.5.18", _DRIFT_TOKEN, "no_page_freed_twice", _WHY_DRIFT),
    # sglang 0.5.18's NPU alloc_decode, free groups kept out (bench/bugs.py):
    # a batch's first request takes the one free page, and the index of a
    # later one that takes none runs past it (allocator_npu.py:129).
    KnownShortest(
        Config(target="bench.bugs:npu_without_free_groups", page_size=4, sglang_path=".sglang/0.5.18"),
        (_s("alloc", "req_0", n=16), _decode("req_0"), _s("alloc", "req_1", n=16), _decode("req_1", "req_0")),
        "allocator_raised",
        "two requests (two allocs); a request part-way into a page, which only a decode makes here (an alloc"
        " hands out whole pages, extend does not run); the decode that fails: 4 + 1 + 4 pages leave one free",
        tuple(Config(target="bench.bugs:npu_without_free_groups", page_size=4, sglang_path=f".sglang/{v}")
              for v in ("0.5.19", "0.5.23")),
    ),
    # sglang 0.5.17's PureSWATokenToKVPoolAllocator.free queues the caller's view.
    KnownShortest(
        Config(target="sglang:pure-swa", sglang_path=".sglang/0.5.17"),
        _ALIAS_TOKEN,
        "free_sets_agree",
        _WHY_ALIAS,
        (_PURE_SWA, Config(target="sglang:pure-swa", sglang_path=".sglang/0.5.23")),
    ),
    # sglang 0.5.18's free_swa in a group queues the full slots and reads
    # their mapping at free_group_end() (allocator/swa.py:353, 375).
    KnownShortest(
        Config(target="sglang:swa", sglang_path=".sglang/0.5.18", page_size=4),
        (_s("alloc", "req_0", n=4), _s("rematch", "cache_0", req="req_0", dup=0), _s("finish", req="req_0"),
         _s("begin"), _s("evict_swa", entry="cache_0"), _s("remap", entry="cache_0"), _s("end")),
        "swa_free_sets_agree",
        "a cached page (alloc, rematch, finish: unlocked), then in a group its SWA side is dropped and loaded"
        " back onto a fresh page before end",
        (_SWA, Config(target="sglang:swa", sglang_path=".sglang/0.5.23", page_size=4)),
    ),
    # sglang 0.5.12's free_swa unmaps only the slots it is passed
    # (swa_memory_pool.py:614-618): a free ending mid-page leaves the rest mapped.
    KnownShortest(
        Config(target="sglang:swa", sglang_path=".sglang/0.5.12", page_size=4),
        (_s("alloc", "req_0", n=4), _s("free_segment", req="req_0", start=0, n=3)),
        "swa_mapping_consistent",
        "an alloc maps a page, then a free of three of its four slots",
        (_SWA, Config(target="sglang:swa", sglang_path=".sglang/0.5.23", page_size=4)),
    ),
)

BY_NAME = {k.name: k for k in KNOWN}
