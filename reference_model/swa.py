"""The SWA side of a sliding-window hybrid pool, in plain Python (no torch).

The full pool is an ``OwnershipModel``; this tracks the SWA pool beside it:
which full page maps to which live SWA page, which SWA pages are free or
queued, and the logical frees and evictions.  It offers the views the
named invariants read (``free_pages``, ``owner``, ``counts()``, the
counters), so every check on the full pool runs on the SWA pool too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from attrs import define, field

from reference_model import mirrors
from reference_model.ledger import Ledger
from reference_model.mirrors import FlagSet, PeerMap
from reference_model.model import CACHE, FREE, FREE_OWNER, KIND_CODES, QUEUED, REQUEST, Owner, OwnershipModel

# ``bytes.translate`` tables: an owner code to 1 where it is that kind, else 0.
_ONE_WHERE = {kind: bytes(int(code == KIND_CODES[kind]) for code in range(256)) for kind in (REQUEST, CACHE)}


class SideOwners(Mapping):
    """A side pool's ``page -> Owner``, built only when a page's owner is
    read (a message); membership of a pool page, what the checks ask
    after every alloc, answers from the pool's pages without building it."""

    def __init__(self, side: SWASide):
        self._side = side
        self._built: dict[int, Owner] | None = None

    def _dict(self) -> dict[int, Owner]:
        if self._built is None:
            self._built = self._side.owner_map()
        return self._built

    def __contains__(self, page) -> bool:
        return page in self._side.universe or page in self._dict()

    def __getitem__(self, page) -> Owner:
        return self._dict()[page]

    def __iter__(self) -> Iterator[int]:
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self._dict())

    def keys(self):
        return self._dict().keys()


def _fresh_side(pages: tuple) -> tuple:
    """A fresh side pool's free set, its pages, and their lanes (``mirrors.lanes``)."""
    free = FlagSet(pages)
    return free, frozenset(free), mirrors.lanes(free.bits)


def _side_copy(kept: tuple) -> tuple:
    # The pages and their lanes never change: shared.
    free, universe, lanes = kept
    return free._copy(), universe, lanes


_FRESH_SIDES: dict = {}


@define
class SWASide:
    """SWA pages: free, queued in a group, or the live peer of a held full page."""

    full: OwnershipModel
    universe: frozenset[int]
    free: FlagSet = field(converter=lambda pages: pages if isinstance(pages, FlagSet) else FlagSet(pages))
    # The SWA pool's counts and open group; it defers when the full pool does.
    ledger: Ledger
    # Full page -> its live SWA page.  A full page whose window slid, or
    # which is free or queued, maps to nothing.
    mapping: PeerMap = field(factory=PeerMap)
    # Full page -> the SWA page its queued release will free.  Until the group
    # ends an allocator may still read that mapping (sglang <= 0.5.18 do).
    pending_map: dict[int, int] = field(factory=dict)
    # Full page -> how many of its leading slots are mapped, where fewer than
    # a page: a partly used last page (page size > 1) maps only the slots its
    # tokens use, and the rest must map to nothing until a decode or an
    # extend fills them.
    filled: dict[int, int] = field(factory=dict)
    # The pool's pages as lanes (``mirrors.lanes``): what free, held and
    # queued pages sum to, id by id, when each page is exactly one of them.
    _universe_lanes: int | None = field(default=None, init=False, eq=False, repr=False)
    # Inside ``unchanging()``: the partition counts, once computed.
    _memo: list | None = field(default=None, init=False, eq=False, repr=False)

    @classmethod
    def from_census(cls, full: OwnershipModel, free_pages: list[int]) -> SWASide:
        free, universe, universe_lanes = mirrors.fresh(_FRESH_SIDES, free_pages, _fresh_side, _side_copy)
        ledger = Ledger(len(universe), defers=full.defers_frees)
        top, peer_top = (len(ids) - 1 if ids else 0 for ids in (full.owner.codes, free.flags))
        mapping = PeerMap(top=top, peer_top=peer_top)
        side = cls(full=full, universe=universe, free=free, ledger=ledger, mapping=mapping)
        side._universe_lanes = universe_lanes
        return side

    # -- the views the invariants read --

    @property
    def capacity(self) -> int:
        return len(self.universe)

    @property
    def free_pages(self) -> set[int]:
        return set(self.free)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def free_flags(self):
        """Per page id, 1 when free, else 0 (``FlagSet.flags``)."""
        return self.free.flags

    @property
    def owner(self) -> SideOwners:
        return SideOwners(self)

    def owner_map(self) -> dict[int, Owner]:
        """Each page's owner: a peer's is its full page's."""
        out = {p: FREE_OWNER for p in self.universe}
        for full_page, swa_page in self.mapping.items():
            out[swa_page] = self.full.owner.get(full_page, Owner("unknown"))
        for p in self.ledger.queued_pages():
            out[p] = Owner(QUEUED)
        return out

    def free_in_pool(self) -> bool:
        """Whether every free page is a page of the pool (from the mirrors,
        where they say so; False leaves the question to the owner map)."""
        free = self.free.bits
        return free is not None and self._universe_lanes is not None and not (
            int.from_bytes(free, "little") & ~self._universe_lanes)

    def counts(self) -> Counter:
        if (fast := self._partition_counts()) is not None:
            return fast
        return Counter(o.kind for o in self.owner_map().values())

    # -- the fast path: the mirrors, summed in C --

    def _held_lanes(self) -> list:
        """Per page id, how many holders a page has besides the free set and the group."""
        return [self.mapping.held]

    def _buffered(self) -> int:
        """Pages held for a request outside the mapping (a device buffer's)."""
        return 0

    @contextmanager
    def unchanging(self):
        """A block in which the side does not change (one step's checks):
        its counts, which ``counts()`` and ``violations()`` both read, are
        summed once."""
        self._memo = []
        try:
            yield
        finally:
            self._memo = None

    def _partition_counts(self) -> Counter | None:
        """``counts()`` from the mirrors, where every page of the pool is
        exactly one of free, held or queued and every peer's page is a
        request's or the cache's; None otherwise (the slow way then says
        what is wrong, by the same counts it always gave)."""
        memo = self._memo
        if memo:
            return None if memo[0] is None else Counter(memo[0])
        counts = self._partition()
        if memo is not None:
            memo.append(counts)
        return None if counts is None else Counter(counts)

    def _partition(self) -> Counter | None:
        queued = self.ledger.queued_pages()
        codes = self.full.owner.codes
        if self._universe_lanes is None or codes is None or self.mapping.mapped is None:
            return None
        queued_lanes = mirrors.count(bytearray(), queued, 1, self.free.most)
        if queued_lanes is None:
            return None
        if mirrors.lanes(self.free.bits, *self._held_lanes(), queued_lanes) != self._universe_lanes:
            return None
        mapped = int.from_bytes(self.mapping.mapped, "little")
        # Only the mapped ids' codes matter: past the map's last id, none.
        codes = codes[: len(self.mapping.mapped)]
        kinds = {kind: (mapped & int.from_bytes(codes.translate(_ONE_WHERE[kind]), "little")).bit_count() for kind in _ONE_WHERE}
        if kinds[REQUEST] + kinds[CACHE] != len(self.mapping):
            return None
        kinds[REQUEST] += self._buffered()
        counts = Counter({FREE: len(self.free), QUEUED: len(queued), **kinds})
        return +counts

    def live(self, full_page: int) -> bool:
        return full_page in self.mapping

    def filled_slots(self, full_page: int, page_size: int) -> int:
        """How many leading slots of a live or queued full page are mapped."""
        return self.filled.get(full_page, page_size)

    # -- steps --

    def take(self, full_pages: list[int], swa_pages: list[int], filled: list[int] | None = None) -> None:
        """Each of ``full_pages`` now maps to its fresh SWA page; ``filled``
        says how many leading slots of each are mapped (None: all)."""
        for i, (full_page, swa_page) in enumerate(zip(full_pages, swa_pages, strict=True)):
            self.mapping[full_page] = swa_page
            self.free.discard(swa_page)
            self.filled.pop(full_page, None)
            if filled is not None:
                self.filled[full_page] = filled[i]
        self.ledger.allocated += len(swa_pages)

    def fill(self, full_page: int, slots: int, page_size: int) -> None:
        """``slots`` more slots of a live, partly used full page are mapped."""
        if full_page in self.mapping:
            self.filled[full_page] = self.filled_slots(full_page, page_size) + slots

    def release(self, full_pages, source: str, *, defer: bool = True) -> list[int]:
        """The SWA peers of ``full_pages`` that are still live go (or queue,
        when a group is open and ``defer``); ``source`` is "free" for a
        request's release, "evict" for a window slide or a cache eviction."""
        pairs = [(p, self.mapping.pop(p)) for p in full_pages if p in self.mapping]
        pages = [swa for _, swa in pairs]
        if not pages:
            return pages
        if defer and self.ledger.queue(pages, source):
            # The fill stays: until end() the queued peer may still be read.
            self.pending_map.update(pairs)
        else:
            self._to_free(pages, source)
            for p, _ in pairs:
                self.filled.pop(p, None)
        return pages

    def begin(self) -> None:
        self.ledger.begin()

    def end(self) -> None:
        for p in self.pending_map:
            if p not in self.mapping:
                self.filled.pop(p, None)
        self.pending_map.clear()
        for queued in self.ledger.end():
            self._to_free(queued.pages, queued.source)

    def _to_free(self, pages, source: str) -> None:
        self.free.update(pages)
        self.ledger.gave_back(len(pages), source)

    # -- self-check --

    def violations(self) -> list[str]:
        if self._partition_counts() is not None and self.ledger.balance_problem(len(self.free), "SWA ") is None:
            return []
        return self.violations_found()

    def violations_found(self) -> list[str]:
        """``violations()``, page by page: what says what is wrong."""
        out = []
        queued = self.ledger.queued_pages()
        mapped = list(self.mapping.values())
        seen = Counter(mapped + queued + list(self.free))
        if twice := sorted(p for p, n in seen.items() if n > 1):
            out.append(f"SWA pages {twice} are mapped, queued or free more than once")
        if set(seen) != set(self.universe):
            out.append(f"SWA pages tracked {len(seen)} / SWA pool {len(self.universe)}")
        for full_page in self.mapping:
            kind = self.full.owner.get(full_page, Owner("outside the pool")).kind
            if kind not in (REQUEST, CACHE):
                out.append(f"full page {full_page} is {kind} but still maps to SWA page {self.mapping[full_page]}")
        if problem := self.ledger.balance_problem(len(self.free), "SWA "):
            out.append(problem)
        return out
