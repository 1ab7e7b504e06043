"""Page ownership: free, a request, the prefix cache, or queued in a group."""

from __future__ import annotations

from array import array
from collections import Counter
from contextlib import nullcontext
from functools import lru_cache
from operator import attrgetter, countOf

from attrs import define, field, frozen

from reference_model.ledger import Ledger
from reference_model.mirrors import fresh, limit

FREE = "free"
REQUEST = "request"
CACHE = "cache"
QUEUED = "queued"


@frozen
class Owner:
    """Who holds a page: ``kind`` is free, request, cache or queued; ``ident``
    names the request or cache entry (or the source of a queued free)."""

    kind: str
    ident: int | None = None

    def __str__(self) -> str:
        if self.kind == REQUEST:
            return f"req_{self.ident}"
        if self.kind == CACHE:
            return f"cache_{self.ident}"
        return self.kind


FREE_OWNER = Owner(FREE)

# ``OwnerMap.codes``: a byte per kind (0: no owner); any other kind is OTHER_CODE.
KIND_CODES = {FREE: 1, REQUEST: 2, CACHE: 3, QUEUED: 4}
OTHER_CODE = 5
_FREE_CODE = KIND_CODES[FREE]



@lru_cache(maxsize=1024)
def owner(kind: str, ident: int | None = None) -> Owner:
    """``Owner(kind, ident)``, the same object for the same holder while it
    stays among the recent ones: the model's self-check then compares its
    claims with the owner map by identity, in C (an equal but distinct
    Owner still compares equal)."""
    return Owner(kind, ident)


def _refused(self, *args, **kwargs):
    raise TypeError("an OwnerMap changes only by owner[page] = who, so its bookkeeping stays exact")


class OwnerMap(dict):
    """``page -> Owner``, and what the checks read off it, kept current by
    the one way it changes, ``owner[page] = who`` (the dict's other
    mutators are refused), so each is exact at every step:

    - ``free``: the pages whose owner is free (a live set: do not mutate);
    - ``held``: the other pages;
    - ``kinds``: kind -> how many pages have an owner of that kind (no zeros);
    - ``flags``: a signed 64-bit integer per page id, 0 up to the largest:
      1 for a free page, 0 otherwise; what a census of the free pages
      counts per id when it lists each once (a tensor census compares its
      counts against it without a Python loop).  None when an id is
      negative or far past the rest.
    - ``codes``: a byte per page id, as long as ``flags``: its owner's kind
      (``KIND_CODES``), 0 for an id the map lacks; what a side pool's
      model counts its peers' kinds by without a Python loop.  None with
      ``flags``.
    """

    __slots__ = ("free", "held", "kinds", "flags", "codes")

    def __init__(self, items=()):
        super().__init__(items)
        if not self:
            # Empty (a harness's model before its first census): what the
            # passes below make of no pages, without them.
            self.kinds, self.free, self.held, self.flags, self.codes = {}, set(), set(), array("q"), bytearray()
            return
        # Built once per example, for every page of the pool: C-level passes
        # (map, set, Counter, slices) wherever the pages allow.
        keys = dict.keys(self)
        if countOf(dict.values(self), FREE_OWNER) == len(self):
            # Every page free (a fresh pool's, a clear's): one owner, by identity.
            self.kinds: dict[str, int] = {FREE: len(self)}
            self.free: set[int] = set(keys)
            self.held: set[int] = set()
        else:
            self.kinds = dict(Counter(map(attrgetter("kind"), dict.values(self))))
            self.free = {p for p, who in dict.items(self) if who.kind == FREE}
            self.held = keys - self.free
        self.flags: array | None = None
        self.codes: bytearray | None = None
        if set(map(type, keys)) <= {int} and (least := min(self)) >= 0:
            top = max(self)
            if top < limit(len(self)):
                flags = array("q", bytes(8 * (top + 1)))
                codes = bytearray(top + 1)
                low = min(self.free, default=0) if self.held else least
                high = max(self.free, default=-1) if self.held else top
                if self.free and high - low + 1 == len(self.free):
                    # A run of free ids (a fresh pool's): one slice assignment.
                    flags[low : low + len(self.free)] = array("q", [1]) * len(self.free)
                    codes[low : low + len(self.free)] = bytes([_FREE_CODE]) * len(self.free)
                else:
                    for p in self.free:
                        flags[p] = 1
                        codes[p] = _FREE_CODE
                for p in self.held:
                    codes[p] = KIND_CODES.get(dict.__getitem__(self, p).kind, OTHER_CODE)
                self.flags, self.codes = flags, codes

    @classmethod
    def all_free(cls, pages) -> OwnerMap:
        """The map of a pool whose ``pages`` are all free (``mirrors.fresh``)."""
        return fresh(_FRESH_OWNERS, pages, lambda ids: cls(dict.fromkeys(ids, FREE_OWNER)), cls._copy)

    def _copy(self) -> OwnerMap:
        """A copy, mirrors and all (``mirrors.fresh``)."""
        new = type(self).__new__(type(self))
        dict.update(new, self)  # dict's own: no __setitem__ per page
        new.free, new.held, new.kinds = set(self.free), set(self.held), dict(self.kinds)
        new.flags = None if self.flags is None else array("q", self.flags)
        new.codes = None if self.codes is None else bytearray(self.codes)
        return new

    def __setitem__(self, page: int, who: Owner) -> None:
        # The old owner's accounting undone and the new one's done in one
        # body, and the page's flag written once (to the new owner's): a
        # helper call per side cost about a third of an alloc's model update.
        kinds = self.kinds
        old = dict.get(self, page)
        if old is not None:
            n = kinds.get(old.kind, 0) - 1
            if n:
                kinds[old.kind] = n
            else:
                del kinds[old.kind]
            (self.free if old.kind == FREE else self.held).discard(page)
        dict.__setitem__(self, page, who)
        kinds[who.kind] = kinds.get(who.kind, 0) + 1
        if who.kind == FREE:
            self.free.add(page)
            self._flag(page, 1, _FREE_CODE)
        else:
            self.held.add(page)
            self._flag(page, 0, KIND_CODES.get(who.kind, OTHER_CODE))

    def _flag(self, page: int, value: int, code: int) -> None:
        flags = self.flags
        if flags is None:
            return
        if not isinstance(page, int) or page < 0 or page >= limit(len(self)):
            self.flags = self.codes = None
            return
        if page >= len(flags):
            flags.frombytes(bytes(8 * (page + 1 - len(flags))))
            self.codes.extend(bytes(page + 1 - len(self.codes)))
        flags[page] = value
        self.codes[page] = code

    __delitem__ = pop = popitem = clear = update = setdefault = __ior__ = _refused


_FRESH_OWNERS: dict = {}


def _owner_map(owners) -> OwnerMap:
    return owners if isinstance(owners, OwnerMap) else OwnerMap(owners)


@define
class Request:
    """A live request.  Its kv row is ``prefix`` (cache pages it holds a lock
    on) followed by ``own`` (pages it owns), one page per ``page_size`` slots."""

    rid: int
    row: int
    prefix: list[int] = field(factory=list)
    own: list[int] = field(factory=list)
    # Cache entries this request holds a lock on.
    locks: list[int] = field(factory=list)
    # Slots of the last page past the request's last token: its length is
    # len(pages) * page_size - spare.  Decode and extend leave it mid-page;
    # an alloc, a free or a rematch leaves it page-aligned (0).
    spare: int = 0

    @property
    def pages(self) -> list[int]:
        return self.prefix + self.own


@define
class CacheEntry:
    """A prefix-cache entry that owns ``pages`` until it is evicted."""

    eid: int
    pages: tuple[int, ...]
    lock_count: int = 0


@define
class OwnershipModel:
    """What a correct allocator's pool must look like after each step.

    Start it from the allocator's own first census, so it assumes nothing
    about which pages a pool reserves.  Queued frees are snapshots taken when
    queued: that is the ownership rule, so ``end()`` releases exactly them.
    """

    owner: OwnerMap = field(converter=_owner_map)
    # The counts and the open group's snapshots.
    ledger: Ledger
    requests: dict[int, Request] = field(factory=dict)
    cache: dict[int, CacheEntry] = field(factory=dict)
    _next_rid: int = 0
    _next_eid: int = 0

    @classmethod
    def from_census(cls, free_pages: list[int], *, defers_frees: bool = True) -> OwnershipModel:
        return cls(owner=OwnerMap.all_free(free_pages), ledger=Ledger(len(free_pages), defers=defers_frees))

    @property
    def defers_frees(self) -> bool:
        return self.ledger.defers

    # -- views --

    @property
    def capacity(self) -> int:
        return len(self.owner)

    def pages_owned_by(self, kind: str) -> set[int]:
        return {p for p, o in self.owner.items() if o.kind == kind}

    @property
    def free_pages(self) -> set[int]:
        """A copy of the free pages."""
        return set(self.owner.free)

    @property
    def free(self) -> set[int]:
        """The free pages, live (do not mutate): what the checks read."""
        return self.owner.free

    @property
    def free_flags(self) -> array | None:
        """Per page id, 1 when free, else 0 (``OwnerMap.flags``)."""
        return self.owner.flags

    @property
    def num_free(self) -> int:
        return len(self.owner.free)

    def unchanging(self):
        """A block in which the model does not change (one step's checks):
        a side pool's model computes its counts once in it (``SWASide``);
        this one keeps them current as it goes."""
        return nullcontext()

    def counts(self) -> Counter:
        counts = Counter()
        # dict's own update: Counter's adds its mapping key by key in Python.
        dict.update(counts, self.owner.kinds)
        return counts

    # -- requests --

    def new_request(self, row: int, pages: list[int], prefix_entry: int | None = None) -> Request:
        rid, self._next_rid = self._next_rid, self._next_rid + 1
        req = Request(rid=rid, row=row)
        if prefix_entry is not None:
            req.prefix = list(self.cache[prefix_entry].pages)
            self._lock(req, prefix_entry)
        self.requests[rid] = req
        self.take(rid, pages)
        return req

    def rebuild(self, free_pages: list[int]) -> None:
        """The pool was rebuilt around ``free_pages``, all free (a resize,
        with nothing live): ownership and counts start again; request and
        entry numbers go on, so a trace never names one twice."""
        assert not self.requests and not self.cache and self.ledger.group is None, "a rebuild with something live"
        self.owner = OwnerMap.all_free(free_pages)
        self.ledger = Ledger(len(free_pages), defers=self.ledger.defers)

    def clear(self) -> None:
        """The scheduler's ``flush_cache`` with no request live and no group
        open: the prefix cache's entries are dropped (not freed one by one),
        and every page of the pool is free again, the counts started again.
        Request and entry numbers go on."""
        assert not self.requests and self.ledger.group is None, "a clear with a request live or a group open"
        self.cache.clear()
        self.rebuild(sorted(self.owner))

    def take(self, rid: int, pages: list[int]) -> None:
        """``pages`` were handed out to request ``rid`` (checked beforehand)."""
        who = owner(REQUEST, rid)
        for p in pages:
            self.owner[p] = who
        self.requests[rid].own.extend(pages)
        self.requests[rid].spare = 0
        self.ledger.allocated += len(pages)

    def tokens(self, rid: int, page_size: int) -> int:
        """The request's length in tokens."""
        req = self.requests[rid]
        return len(req.pages) * page_size - req.spare

    def decode_needs_page(self, rid: int, page_size: int) -> bool:
        """A decode step takes a page exactly when the new token starts one."""
        return self.tokens(rid, page_size) % page_size == 0

    def extend_new_pages(self, rid: int, tokens: int, page_size: int) -> int:
        """Pages an extend by ``tokens`` takes: the tokens past the last
        page's spare slots, in whole pages, the last perhaps partly used;
        ``ceil(seq_len / page_size) - ceil(prefix_len / page_size)``."""
        past = tokens - self.requests[rid].spare
        return max(0, -(-past // page_size))

    def extend(self, rid: int, pages: list[int], tokens: int, page_size: int) -> None:
        """``tokens`` more tokens: they fill the last page's spare slots,
        then ``pages`` (new, as ``extend_new_pages`` says)."""
        req = self.requests[rid]
        length = self.tokens(rid, page_size) + tokens
        if pages:
            self.take(rid, pages)
        req.spare = len(req.pages) * page_size - length
        assert 0 <= req.spare < page_size, f"req_{rid}: {length} tokens on {len(req.pages)} pages of {page_size}"

    def decode(self, rid: int, page: int | None, page_size: int) -> None:
        """One decode token: on a new ``page``, or in the last page's spare slots."""
        if page is None:
            assert self.requests[rid].spare > 0, f"req_{rid} decodes into a full page"
            self.requests[rid].spare -= 1
            return
        self.take(rid, [page])
        self.requests[rid].spare = page_size - 1

    def release_tail(self, rid: int, num_pages: int) -> list[int]:
        """The request frees its last ``num_pages`` own pages."""
        req = self.requests[rid]
        cut = len(req.own) - num_pages
        released, req.own = req.own[cut:], req.own[:cut]
        if released:
            req.spare = 0
        self._release(released, "free")
        return released

    def finish(self, rid: int) -> list[int]:
        """The request ends: its own pages are freed, its locks dropped."""
        req = self.requests.pop(rid)
        self._release(req.own, "free")
        for eid in req.locks:
            self.cache[eid].lock_count -= 1
        return req.own

    def rematch(self, rid: int, dup: int, entry: int | None) -> CacheEntry | None:
        """``cache_unfinished_req``: the request's own pages go to the cache.

        The first ``dup`` own pages duplicate what ``entry`` already holds, so
        they are freed and the row now points at the entry's pages; the rest
        become a new entry.  The request takes a lock on both entries.
        """
        req = self.requests[rid]
        dup_pages, rest = req.own[:dup], req.own[dup:]
        new_entry = self.insert(rest) if rest else None
        self._release(dup_pages, "free")
        # Old locks stay: the row still points at those pages, as a radix
        # node's lock covers its ancestors.
        if dup:
            req.prefix.extend(self.cache[entry].pages[:dup])
            self._lock(req, entry)
        if new_entry is not None:
            req.prefix.extend(new_entry.pages)
            self._lock(req, new_entry.eid)
        req.own = []
        req.spare = 0
        return new_entry

    def _lock(self, req: Request, eid: int) -> None:
        req.locks.append(eid)
        self.cache[eid].lock_count += 1

    # -- prefix cache --

    def insert(self, pages: list[int]) -> CacheEntry:
        eid, self._next_eid = self._next_eid, self._next_eid + 1
        entry = self.cache[eid] = CacheEntry(eid=eid, pages=tuple(pages))
        who = owner(CACHE, eid)
        for p in pages:
            self.owner[p] = who
        return entry

    def evictable(self) -> list[int]:
        return [e.eid for e in self.cache.values() if e.lock_count == 0]

    def evict(self, eid: int) -> tuple[int, ...]:
        entry = self.cache.pop(eid)
        assert entry.lock_count == 0, f"evicting cache_{eid} with {entry.lock_count} locks"
        self._release(list(entry.pages), "evict")
        return entry.pages

    # -- free groups --

    def begin(self) -> None:
        self.ledger.begin()

    def end(self) -> None:
        """Release every queued snapshot.  With no group open: nothing."""
        for queued in self.ledger.end():
            self._to_free(queued.pages, queued.source)

    def _release(self, pages: list[int], source: str) -> None:
        if not pages:
            return
        if not self.ledger.queue(pages, source):
            self._to_free(pages, source)
            return
        queued = owner(QUEUED)
        for p in pages:
            self.owner[p] = queued

    def _to_free(self, pages, source: str) -> None:
        for p in pages:
            self.owner[p] = FREE_OWNER
        self.ledger.gave_back(len(pages), source)

    # -- self-check --

    def _structures_agree(self) -> bool:
        """Whether ``violations`` finds nothing in the requests, the cache and
        the queue against the owner map (its counts and ledger aside): each
        held page claimed once, by its owner, and nothing else claimed; each
        lock on a live entry, each entry's lock count its holders.  Exact,
        with C-level passes where it can; false sends ``violations`` down its
        page-by-page path, which says what is wrong."""
        want: dict[int, Owner] = {}
        claims = 0
        locks: list[int] = []
        # A request with no own pages (admitted, or all rematched) or no
        # locks adds nothing: skipped without a call.
        for req in self.requests.values():
            if req.own:
                want.update(dict.fromkeys(req.own, owner(REQUEST, req.rid)))
                claims += len(req.own)
            if req.locks:
                locks += req.locks
        for entry in self.cache.values():
            want.update(dict.fromkeys(entry.pages, owner(CACHE, entry.eid)))
            claims += len(entry.pages)
        # The ledger's own list: a family's may hold more than the free group
        # (Mamba's open allocation reserve).
        if queued := self.ledger.queued_pages():
            want.update(dict.fromkeys(queued, owner(QUEUED)))
            claims += len(queued)
        if len(want) != claims or want.keys() != self.owner.held:
            return False
        # A handful of requests and entries: counting in the list beats a Counter.
        if self.cache and not (self.cache.keys() >= set(locks)
                               and all(locks.count(e.eid) == e.lock_count for e in self.cache.values())):
            return False
        if locks and not self.cache:
            return False
        return want.items() <= self.owner.items()

    def violations(self) -> list[str]:
        """What is inconsistent inside the model; empty when healthy."""
        if self._structures_agree():
            counts = self.owner.kinds
            free = counts.get(FREE, 0)
            held = counts.get(REQUEST, 0) + counts.get(CACHE, 0) + counts.get(QUEUED, 0)
            problem = self.ledger.balance_problem(free)
            if free + held == self.capacity and problem is None:
                return []
        out = []
        want: dict[int, Owner] = {}

        def claim(page: int, who: Owner) -> None:
            if page in want:
                out.append(f"page {page} claimed by {want[page]} and {who}")
            want[page] = who

        # One Owner per holder, not per page: this runs after every step.
        for req in self.requests.values():
            who = Owner(REQUEST, req.rid)
            for p in req.own:
                claim(p, who)
            for eid in req.locks:
                if eid not in self.cache:
                    out.append(f"req_{req.rid} locks evicted cache_{eid}")
        for entry in self.cache.values():
            who = Owner(CACHE, entry.eid)
            for p in entry.pages:
                claim(p, who)
            holders = sum(r.locks.count(entry.eid) for r in self.requests.values())
            if holders != entry.lock_count:
                out.append(f"cache_{entry.eid} lock count {entry.lock_count} / held by {holders} requests")
        queued = Owner(QUEUED)
        for p in self.ledger.queued_pages():
            claim(p, queued)
        # Only held pages can disagree: a free page is claimed by no structure.
        for p in sorted(self.owner.held):
            who = self.owner[p]
            if want.get(p) != who:
                out.append(f"page {p} owned by {who} / structures say {want.get(p, 'nobody')}")
        for p in sorted(p for p in want if p not in self.owner):
            out.append(f"page {p} is outside the pool")
        counts = self.counts()
        held = counts[REQUEST] + counts[CACHE] + counts[QUEUED]
        if counts[FREE] + held != self.capacity:
            out.append(f"free {counts[FREE]} + held {held} / capacity {self.capacity}")
        if problem := self.ledger.balance_problem(counts[FREE]):
            out.append(problem)
        return out
