"""A side pool's set and map with flat per-id mirrors, in plain Python.

A side pool (SWA, HiSparse device) keeps its free pages in a set and its
peers in a dict, which the checks would otherwise walk page by page in
Python after every step.  ``FlagSet`` and ``PeerMap`` keep, beside them, an
array per page id, changed by the one way each changes (the other mutators
are refused, as ``OwnerMap``'s are), so the arrays are exact at every step:
a tensor census compares against ``FlagSet.flags`` without a loop, and
``lanes`` sums several byte arrays as integers, one 8-bit lane per id, in
C.  A mirror is None once an id no flat array holds comes in (negative,
not an int, or far past the rest), or a count past ``LANE_MOST``; the
checks then read the set or dict.
"""

from __future__ import annotations

from array import array

# Ids past this many times the largest id a mirror starts with (and 1,024
# more) give up on it (``limit``).
_SPARSE = 4
# The most a byte lane counts: four such (a flag, two holder counts and a
# group's) sum below 256, so a sum of lanes never carries into the next.
LANE_MOST = 63


# Fresh pools kept by ``fresh``, per kind of mirror: a run's pool shapes,
# and at most this many pages in all (a kept pool doubles its models' memory).
FRESH_KEPT = 8
FRESH_KEPT_PAGES = 1 << 20


def fresh(kept: dict, pages, build, copy):
    """``copy`` of ``build(ids)``, ``ids`` the tuple of ``pages``, built
    once while ``kept`` (a dict of the pools last asked for: at most
    ``FRESH_KEPT``, ``FRESH_KEPT_PAGES`` pages in all) holds it.  Every
    example starts its models on the same fresh pool, and a clear starts
    them again: building the mirrors of 16,384 free pages (a set, the
    least and largest id, the type of each, flag arrays) took 2.5 ms, a
    copy of them 0.12 ms.  Only ids that are all ``int`` are kept (checked
    once, as they are built), and a pool past the page budget is built
    each time.  Ids equal to kept ones but of another type (``1.0``,
    ``True``) hash and compare as the ints do, and are handed the ints'
    copy: ints, with their mirrors, which read as the same pages."""
    ids = tuple(pages)
    if len(ids) > FRESH_KEPT_PAGES:
        return build(ids)
    pristine = kept.pop(ids, None)
    if pristine is None:
        pristine = build(ids)
        if not set(map(type, ids)) <= {int}:
            return pristine
        while kept and (len(kept) >= FRESH_KEPT or sum(map(len, kept)) + len(ids) > FRESH_KEPT_PAGES):
            del kept[next(iter(kept))]
    kept[ids] = pristine  # the last asked for, last out
    return copy(pristine)


def _refused(self, *args, **kwargs):
    raise TypeError(f"a {type(self).__name__} changes only through its own methods, so its mirrors stay exact")


def room(arr, page, limit: int) -> bool:
    """Whether ``arr`` can hold id ``page`` (grown with zeros to it)."""
    if type(page) is not int or page < 0 or page >= limit:
        return False
    if page >= len(arr):
        if isinstance(arr, bytearray):
            arr.extend(bytes(page + 1 - len(arr)))
        else:
            arr.frombytes(bytes(arr.itemsize * (page + 1 - len(arr))))
    return True


def lanes(*arrays: bytearray | None) -> int | None:
    """The byte arrays summed id by id, as one integer of 8-bit
    little-endian lanes: with at most four, each lane at most
    ``LANE_MOST``, two such sums are equal exactly when the per-id sums
    are.  None where one is None."""
    if any(a is None for a in arrays):
        return None
    return sum(int.from_bytes(a, "little") for a in arrays)


def limit(top: int) -> int:
    """The ids a mirror holds, for a pool whose largest id is ``top`` (for
    an ``OwnerMap``, ``top`` is its number of pages)."""
    return _SPARSE * max(top, 0) + 1024


def count(arr: bytearray | None, pages, step: int, most: int) -> bytearray | None:
    """``arr`` with ``step`` added at each of ``pages``' ids; None where
    one is not an id below ``most``, or a count leaves 0..``LANE_MOST``
    (or ``arr`` is None)."""
    if arr is None:
        return None
    for p in pages:
        if not room(arr, p, most) or not 0 <= arr[p] + step <= LANE_MOST:
            return None
        arr[p] += step
    return arr


class FlagSet(set):
    """A set of page ids with two mirrors, per id 0 up to the largest, 1
    for a member, 0 otherwise: ``flags``, an ``array('q')`` (what a tensor
    census counts against), and ``bits``, a byte each (a lane).  Changes
    through ``add``, ``discard``, ``update`` and ``difference_update`` only."""

    __slots__ = ("flags", "bits", "_limit")

    def __init__(self, pages=()):
        super().__init__(pages)
        self.flags: array | None = array("q")
        self.bits: bytearray | None = bytearray()
        self._limit = limit(0)
        if not self:
            return
        if not set(map(type, self)) <= {int} or min(self) < 0:
            self.flags = self.bits = None
            return
        low, high = min(self), max(self)
        self._limit = limit(high)
        self.flags = array("q", bytes(8 * (high + 1)))
        self.bits = bytearray(high + 1)
        if high - low + 1 == len(self):
            # A run of ids (a fresh pool's): one slice assignment each.
            self.flags[low:] = array("q", [1]) * len(self)
            self.bits[low:] = b"\x01" * len(self)
        else:
            for p in self:
                self.flags[p] = self.bits[p] = 1

    def _copy(self) -> FlagSet:
        """A copy, mirrors and all (``fresh``)."""
        new = type(self).__new__(type(self))
        set.__init__(new, self)
        new.flags = None if self.flags is None else array("q", self.flags)
        new.bits = None if self.bits is None else bytearray(self.bits)
        new._limit = self._limit
        return new

    @property
    def most(self) -> int:
        """The ids ``flags`` holds: those below this."""
        return self._limit

    def _set(self, page, value: int) -> None:
        if self.flags is not None:
            if room(self.flags, page, self._limit) and room(self.bits, page, self._limit):
                self.flags[page] = self.bits[page] = value
            else:
                self.flags = self.bits = None

    def add(self, page) -> None:
        set.add(self, page)
        self._set(page, 1)

    def discard(self, page) -> None:
        if page in self:
            set.discard(self, page)
            self._set(page, 0)

    def update(self, *others) -> None:
        for pages in others:
            for p in pages:
                self.add(p)

    def difference_update(self, *others) -> None:
        for pages in others:
            for p in pages:
                self.discard(p)

    remove = pop = clear = intersection_update = symmetric_difference_update = _refused
    __ior__ = __iand__ = __isub__ = __ixor__ = _refused


class PeerMap(dict):
    """``page -> peer`` (a full page's SWA page, a logical page's device
    page), with three mirrors:

    - ``mapped``: a byte per page id, 1 where the page has a peer;
    - ``peers``: an ``array('q')`` per page id, its peer (0 where none);
    - ``held``: a byte per peer id, how many pages map onto it (a lane).

    Changes through ``map[page] = peer`` and ``pop`` only."""

    __slots__ = ("mapped", "peers", "held", "_limit", "_peer_limit")

    def __init__(self, items=(), *, top: int = 0, peer_top: int = 0):
        """``top`` and ``peer_top``: the largest page and peer ids the pools have."""
        super().__init__()
        self._limit, self._peer_limit = limit(top), limit(peer_top)
        self.mapped: bytearray | None = bytearray()
        self.peers: array | None = array("q")
        self.held: bytearray | None = bytearray()
        for page, peer in dict(items).items():
            self[page] = peer

    def __setitem__(self, page, peer) -> None:
        if page in self and self.mapped is not None:
            self.held[dict.__getitem__(self, page)] -= 1
        dict.__setitem__(self, page, peer)
        if self.mapped is None:
            return
        if room(self.mapped, page, self._limit) and room(self.peers, page, self._limit) and room(
                self.held, peer, self._peer_limit) and self.held[peer] < LANE_MOST:
            self.mapped[page] = 1
            self.peers[page] = peer
            self.held[peer] += 1
        else:
            self.mapped = self.peers = self.held = None

    def pop(self, page, *default):
        if page not in self:
            return dict.pop(self, page, *default)
        peer = dict.pop(self, page)
        if self.mapped is not None:
            self.mapped[page] = 0
            self.peers[page] = 0
            self.held[peer] -= 1
        return peer

    __delitem__ = popitem = clear = update = setdefault = __ior__ = _refused
