"""One allocator and the ownership model, driven side by side.

``Lockstep`` owns a real ``req_to_token`` tensor and passes *views* of its
rows to the allocator, as sglang's callers do: that is how a queue that
aliases the caller's tensor shows up.  Each ``@step`` method drives the
allocator and the model; the seam (``steps.py``) records it and then runs
``check()``, every invariant, in one place.  A printed trace is a program
of these calls, so it can be pasted and run.

A family (``swa.py``) extends the steps: it overrides one with ``@step`` and
calls ``super()``, or overrides the hooks every free goes through
(``_give_back``, ``_evict_slots``), and adds its pools to ``pools()``.
"""

from __future__ import annotations

import _signal
import atexit
import collections
import collections.abc
import ctypes
import functools
import os
import signal
import threading
import time
import traceback
import weakref
from contextlib import contextmanager
from typing import Any, Callable

import torch
from attrs import define, field, frozen

try:
    import numpy
except ImportError:  # torch runs without NumPy: the rows are indexed in torch, the tables read page by page (``NUMPY_BRIDGE``)
    numpy = None

from reference_model import CHECKS, OwnershipModel, invariants, mirrors
from reference_model import hooks as hook_checks
from reference_model.census import Census
from reference_model.unified_hybrid import SubPool
from state_machines import orphans
from state_machines.config import Config
from state_machines.harness import hooks
from state_machines.harness.alarm import alarm_is_private, cancel_alarm, set_alarm, shared_alarm_is_ours
from state_machines.harness.steps import EntryRef, ReqRef, Step, StepSpec, step
from state_machines.orphans import calls_user_code, leave_if_a_copy
from state_machines.targets import probe
from state_machines.targets.base import TargetError, exception_text, is_passed

# An allocator call that takes longer than this is reported as a hang.
CALL_TIMEOUT_S = 10.0

# What ``observe()`` charges a call to.
ALLOCATOR = "allocator calls"
CENSUS = "census (get_all_free_pages, available_size)"


class InvariantViolation(AssertionError):
    """An invariant failed, or the allocator raised or hung.

    Each invariant has its own subclass (see ``violation_type``), so
    Hypothesis tells distinct bugs apart and shrinks each one.
    """

    invariant = "invariant"

    def __init__(self, detail: str, steps: list[Step], config: Config):
        super().__init__(f"{self.invariant}: {detail}")
        self.detail = detail
        self.steps = list(steps)
        self.config = config


_VIOLATION_TYPES: dict[str, type[InvariantViolation]] = {}


def violation_type(invariant: str) -> type[InvariantViolation]:
    if invariant not in _VIOLATION_TYPES:
        name = "".join(part.title() for part in invariant.split("_")) + "Violation"
        _VIOLATION_TYPES[invariant] = type(name, (InvariantViolation,), {"invariant": invariant})
    return _VIOLATION_TYPES[invariant]


# At most this much of an exception's text goes into a failure's detail:
# a trace keeps a detail of 100,000 characters at most (``trace.py``), and
# a message of 5 MB made a trace that ``replay`` refused.
RAISED_TEXT_MAX = 2000


def raised_text(exc: BaseException) -> str:
    """``Name: text`` (``Name`` where the text is empty) for an exception the
    allocator raised, the text cut to ``RAISED_TEXT_MAX`` characters; where
    ``str()`` itself raises, says so (``exception_text``)."""
    name, text = type(exc).__name__, exception_text(exc)
    if len(text) > RAISED_TEXT_MAX:
        text = f"{text[:RAISED_TEXT_MAX]}... ({len(text) - RAISED_TEXT_MAX:,} more characters)"
    return f"{name}: {text}" if text else name


def ids(t) -> list[int]:
    """A tensor's values, flattened, as Python ints (floats for a float tensor)."""
    # ``is_cpu``: a fifth of what ``device.type`` costs, and ids() reads every call's answer.
    if not t.is_cpu:
        t = t.to("cpu")
    return (t if t.dim() == 1 else t.reshape(-1)).tolist()


@functools.cache
def _device_type(device: str) -> str:
    """``torch.device(device).type`` (1.3 µs a call; every alloc asks)."""
    return torch.device(device).type


def _census_parts(allocator) -> list:
    """What ``census_of`` reads: ``get_all_free_pages()`` where it has one
    (and it returns something), else the ``free_pages``, ``release_pages``,
    ``staged_pages`` and ``free_slots`` (a Mamba slot list) containers, each
    a tensor, or a list, tuple or set of tensors or of page ids (a census
    of plain ints was read as tensors: a correct allocator failed with the
    harness's own ``AttributeError``), each list of ids made one tensor."""
    get_all = getattr(allocator, "get_all_free_pages", None)
    if callable(get_all):
        pages = get_all()
        if pages is not None:
            return _tensors(pages)  # a fresh answer: a generator is read once, here
    parts = []
    for name in CENSUS_ATTRIBUTES:
        part = getattr(allocator, name, None)
        if part is not None:
            if isinstance(part, collections.abc.Iterator):
                raise CensusUnreadable(f"{type(allocator).__name__}.{name} is an iterator: reading it would empty it; keep"
                                  " the free pages in a tensor, a list, a tuple or a set")
            parts += _tensors(part)
    return parts


class CensusUnreadable(TargetError):
    """The harness cannot read a census without changing the allocator:
    bad input, raised from inside the census's call, which passes it on."""


# The containers a census is read from where there is no get_all_free_pages().
CENSUS_ATTRIBUTES = ("free_pages", "release_pages", "staged_pages", "free_slots")


@functools.lru_cache(maxsize=64)
def factory_takes_size(config: Config) -> bool:
    """Whether the target's factory is passed the pool's ``size``
    (``is_passed``).  A factory that takes none sized its pool itself: its
    pages are not ``size // page_size`` (``fresh_pool_lists_every_page``)."""
    from state_machines import targets

    return is_passed(targets.resolve(config.target, config.mutant, config.sglang_path).factory, "size")


def has_census(allocator) -> bool:
    """Whether ``_census_parts`` has anything to read on ``allocator``."""
    return callable(getattr(allocator, "get_all_free_pages", None)) or any(
        getattr(allocator, name, None) is not None for name in CENSUS_ATTRIBUTES)


def _tensors(part) -> list:
    """A census container as tensors: a tensor, or a NumPy array, as is;
    in any other iterable (a list, a set, a generator, a dict's keys: read
    once), its tensors and arrays as they are and its other entries (page
    ids) as one int64 tensor; a string, a mapping or a scalar, nothing."""
    if isinstance(part, torch.Tensor):
        return [part]
    if hasattr(part, "__array__"):
        return [torch.as_tensor(part)]
    if isinstance(part, (str, bytes, collections.abc.Mapping)) or not isinstance(part, collections.abc.Iterable):
        return []
    tensors, pages = [], []
    for p in part:
        if isinstance(p, torch.Tensor):
            tensors.append(p)
        elif hasattr(p, "__array__"):
            tensors.append(torch.as_tensor(p))
        else:
            pages.append(p)
    if pages:
        tensors.append(torch.tensor(sorted(pages), dtype=torch.int64))
    return tensors


def census_of(allocator) -> list[int]:
    """The allocator's free pages, with repeats (see ``_census_parts``)."""
    return [page for part in _census_parts(allocator) for page in ids(part)]


class TensorCensus(Census):
    """A census kept as one int64 tensor on the CPU.  Its one question in
    torch: does it list each of ``model``'s free pages once and nothing
    else, its per-id counts equal to the model's ``free_flags``?  Then every
    answer follows without visiting a page (no repeats, ``len`` distinct
    pages, the model's free set, inside its pool).  Otherwise some check
    fails, and ``Census``'s answers, from the page list, stand: the same
    values and messages, whatever ``model`` is."""

    def __init__(self, pages: torch.Tensor, model=None):
        super().__init__(())
        self._tensor = pages
        self._list: list[int] | None = None
        self._model = model
        self._exact: bool | None = None

    @property
    def pages(self) -> list[int]:
        if self._list is None:
            self._list = self._tensor.tolist()
        return self._list

    def __len__(self) -> int:
        return self._tensor.numel()

    def exact(self) -> bool:
        """Whether the census lists each of ``model``'s free pages once and
        no other page (False also where that cannot be had in torch)."""
        if self._exact is None:
            self._exact = self._lists_each_free_page_once()
        return self._exact

    def _lists_each_free_page_once(self) -> bool:
        flags = getattr(self._model, "free_flags", None)
        if not flags or not self._tensor.numel():
            return False
        counts = self._counts(len(flags))
        # A zero-copy view: the model stays torch-free, and no page is visited in Python.
        return counts is not None and equal(counts, torch.frombuffer(flags, dtype=torch.int64))

    def _counts(self, size: int) -> torch.Tensor | None:
        """How many times the census lists each id below ``size`` (in
        ``_zeroed``'s buffer: good until this thread's next call); None
        where it lists one below 0 or past it, or where torch cannot count
        it as ids (another dtype, another device).  ``index_add_`` checks each
        id against the size as it counts it (one read of the census, where
        ``aminmax`` and then ``bincount`` read it twice: 58-62 µs against
        37-42 in a Mamba step at 16,384 slots), and nothing sized by the
        allocator's largest id is made (a garbage id of 2**40 would ask
        ``bincount`` for terabytes)."""
        counts = _zeroed(size)
        try:
            counts.index_add_(0, self._tensor, _ONE.expand(self._tensor.numel()))
        except (IndexError, RuntimeError):
            return None
        return counts

    def num_distinct(self) -> int:
        return len(self) if self.exact() else super().num_distinct()

    def repeats(self) -> list[int]:
        return [] if self.exact() else super().repeats()

    def lists_free_of(self, model) -> bool:
        return True if model is self._model and self.exact() else super().lists_free_of(model)

    def change(self, model) -> tuple[list[int], list[int]]:
        # Per id, from the model's free flags: no set of the pool is built.
        # An id below 0 or past the flags (whatever the allocator lists) is
        # left to the sets, which take any id.
        flags = getattr(model, "free_flags", None)
        counts = self._counts(len(flags)) if flags else None
        if counts is None:
            return super().change(model)
        listed = counts > 0
        free = torch.frombuffer(flags, dtype=torch.int64) == 1
        return (torch.nonzero(free & ~listed).reshape(-1).tolist(),
                torch.nonzero(listed & ~free).reshape(-1).tolist())

    def within(self, model) -> bool:
        # The model's free pages are keys of its owner map (OwnerMap.free);
        # a side pool's says whether its are inside its pool (``free_in_pool``).
        if model is self._model and self.exact():
            inside = getattr(model, "free_in_pool", None)
            if inside is None or inside():
                return True
        return super().within(model)


# What ``TensorCensus._counts`` adds per id listed, expanded.
_ONE = torch.ones(1, dtype=torch.int64)
# The buffer ``_zeroed`` hands out views of, one per thread (a harness may
# run off the main thread, and torch ops let go of the GIL), grown as needed.
_SCRATCH = threading.local()


def _zeroed(size: int) -> torch.Tensor:
    """``size`` int64 zeros in this thread's buffer, kept between calls:
    the next call in the thread overwrites them, so the caller reads them
    before then.  At 16,384 ids a fresh ``torch.zeros`` took 18 µs of a
    Mamba step (2 µs in a loop of its own), zeroing these 3-7."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < size:
        buf = _SCRATCH.buf = torch.empty(size, dtype=torch.int64)
    return buf[:size].zero_()


# Below this many pages a Python set beats the torch ops' fixed cost.
TENSOR_CENSUS_PAGES = 512


def pool_ids(census) -> tuple[tuple[int, ...], frozenset[int]]:
    """A fresh pool's census as its distinct ids, sorted, and as a set.
    Every example of a run starts on the same census, so these are the
    very objects the last example with it got (kept as ``mirrors.fresh``
    keeps a fresh pool's models; never changed): 16,384 ids are not sorted
    and put in sets every example (1.3 ms a unified example), and the
    examples' universes are one object, found by identity
    (``twins.universe_tensor``).  As there, only ids all ``int`` are kept,
    and ids equal to kept ones but of another type (a float census) are
    handed the ints, which read as the same pages."""
    return mirrors.fresh(_POOL_IDS, census, _sorted_and_set, _as_is)


def _sorted_and_set(ids: tuple) -> tuple[tuple[int, ...], frozenset[int]]:
    return tuple(sorted(set(ids))), frozenset(ids)


def _as_is(ids):
    return ids


# The last few fresh pools' ids (``pool_ids``), by census.
_POOL_IDS: dict = {}


def integral(t: torch.Tensor) -> bool:
    """Whether ``t`` holds integers (no float, complex or bool) that the
    torch fast paths compare as int64 without changing a value (not
    uint64, whose top half int64 would read as negative: 2**64 - 1 as -1)."""
    return not t.is_floating_point() and not t.is_complex() and t.dtype not in (torch.bool, torch.uint64)


def to_numpy(t: torch.Tensor, dtype: torch.dtype = torch.int64):
    """``t`` flat, on the CPU, as ``dtype``, as a NumPy array: over
    ``t``'s own memory where it is that already (never write into it).
    Only where ``NUMPY_BRIDGE`` says this torch hands tensors to NumPy."""
    flat = t.to("cpu", dtype).reshape(-1)
    return (flat.resolve_neg() if flat.is_neg() else flat).numpy()


def _bridged() -> bool:
    """Whether NumPy is here and this torch hands its tensors to it (``to_numpy``)."""
    try:
        return numpy is not None and to_numpy(torch.zeros(1, dtype=torch.int64)).shape == (1,)
    except (RuntimeError, TypeError):
        return False


# Whether the tables are judged in NumPy (``to_numpy``): at 16,384 entries a
# NumPy op costs a third to a quarter of the torch op, whose dispatch
# alone is several µs.  Without it the checks that would read them there
# read every page in Python: the same verdicts, slower.
NUMPY_BRIDGE = _bridged()


def rows_to_read(got: torch.Tensor, page_size: int, full, side, *, sentinel: bool,
                 free_census: Census | None = None) -> list[int] | None:
    """Which of ``full``'s pages a mapping predicate must still read in
    ``got`` (a full-to-side mapping: ``page_size`` entries per page, and
    with ``sentinel`` a -1 past them), from the model's mirrors in NumPy:

    - ``[]``: every page's entries are what ``side`` says (its peer's
      slots, up to its ``filled`` count, then 0; 0 for a page with no
      peer), the sentinel is -1, and (given ``free_census``, the side
      pool's) no peer is free in it: the predicate would find nothing;
    - else the pages that differ (a page with a release queued may still
      name its queued peer, which only the predicate judges; any other
      page that differs fails there): the predicate reads only those, and
      finds what it would find reading every page;
    - None: read every page (a small pool, a mapping not of integers, a
      mirror lost, pages not 1 to ``len(full.owner)``, a census not exact,
      a sentinel not -1, a peer free, no NumPy).
    """
    codes, mapped, peers = full.owner.codes, side.mapping.mapped, side.mapping.peers
    n, ps = len(full.owner), page_size
    if (n < TENSOR_CENSUS_PAGES or codes is None or mapped is None or len(codes) < n + 1
            or codes.find(0, 1, n + 1) >= 0 or got.dim() != 1 or got.numel() < (n + 1) * ps + sentinel
            or not integral(got)):
        return None
    if free_census is not None and not (isinstance(free_census, TensorCensus) and free_census.exact()):
        return None
    if not NUMPY_BRIDGE:
        return None
    # In NumPy, over the tensor's own memory (``to_numpy``).
    got = to_numpy(got)
    if sentinel and int(got[-1]) != -1:
        return None
    # The mirrors through zero-copy views (the model stays torch-free),
    # zero past their end.
    k = min(len(mapped), n + 1)
    live, peer = numpy.zeros(n + 1, dtype=bool), numpy.zeros(n + 1, dtype=numpy.int64)
    live[:k] = numpy.frombuffer(mapped, dtype=numpy.uint8)[:k] != 0
    peer[:k] = numpy.frombuffer(peers, dtype=numpy.int64)[:k]
    # Laid out (slot, page), so NumPy loops over the pages innermost (pages
    # outermost cost it a loop per page, twice the time): a page's slots
    # where it is live, else 0, and 0 past its filled count.
    want = (peer * ps + numpy.arange(ps)[:, None]) * live
    for page, fill in side.filled.items():
        if type(page) is int and 0 <= page <= n and fill < ps:
            want[max(fill, 0):, page] = 0
    rows = got[: (n + 1) * ps].reshape(n + 1, ps).T
    differ = numpy.flatnonzero((rows[:, 1:] != want[:, 1:]).any(axis=0)) + 1
    if free_census is not None and (flags := side.free_flags):
        held = peer[live]
        held = held[(held >= 0) & (held < len(flags))]
        if held.size and numpy.frombuffer(flags, dtype=numpy.int64).take(held).any():
            return None
    return differ.tolist()


# What ``_kept`` makes of an input it cannot copy faithfully: equal to
# nothing, so the twin runs again.
_UNKEPT = object()

# Tensors the harness makes once and never writes again (``unchanging``):
# id -> (a weak reference to the tensor, its version counter then).  A memo
# keeps such a one as it is, and takes it for itself by identity, with no
# compare (a universe of 16,384 pages cost 17 µs a compare in a unified
# step, four compares a step), while torch counts no write to it.
_UNCHANGING: dict[int, tuple[weakref.ref, int]] = {}


def unchanging(t: torch.Tensor) -> torch.Tensor:
    """``t``, marked as one no one writes again (a memo of twin inputs
    keeps it by identity); only for a tensor the harness made and owns.
    A write torch counts (in place, through a view) ends the mark; one
    torch does not count (through NumPy) would go unseen: never write it."""
    key = id(t)

    def gone(ref: weakref.ref, marks: dict = _UNCHANGING) -> None:
        # ``marks`` bound now: at interpreter exit the module's globals may be gone.
        if marks.get(key, (None,))[0] is ref:
            del marks[key]

    _UNCHANGING[key] = (weakref.ref(t, gone), t._version)
    return t


def _is_unchanging(t: torch.Tensor) -> bool:
    return _mark(t) is True


def _mark(t: torch.Tensor) -> bool | None:
    """None where ``t`` was never marked ``unchanging``; else whether it is
    still (no write to it counted since)."""
    mark = _UNCHANGING.get(id(t))
    if mark is None or mark[0]() is not t:
        return None
    return mark[1] == t._version


def _libc_memcmp():
    """libc's ``memcmp``, or None where ctypes cannot reach it."""
    try:
        # PyDLL: the call keeps the GIL, so no other thread frees a tensor's
        # storage while it reads it (CDLL lets go of it).
        memcmp = ctypes.PyDLL(None).memcmp
    except (OSError, AttributeError, TypeError):
        return None
    memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    memcmp.restype = ctypes.c_int
    return memcmp


_MEMCMP = _libc_memcmp()
# Below this many bytes ``torch.equal`` costs no more than ``_plain``'s questions.
MEMCMP_BYTES = 1024
# The dtypes whose values are their bytes: equal bytes exactly where
# ``torch.equal`` says equal (a bool byte other than 0 or 1 aside).
_BYTES_ARE_VALUES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


def _plain(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many bytes ``a`` and ``b`` hold where both are dense,
    contiguous CPU tensors of one dtype and shape, read as they lie (no
    negated or conjugated view, not quantized: a scale the bytes do not
    hold) and at least ``MEMCMP_BYTES`` long; else 0."""
    if _MEMCMP is None or a.dtype != b.dtype or a.shape != b.shape:
        return 0
    n = a.numel() * a.element_size()
    if (n < MEMCMP_BYTES or a.layout != torch.strided or b.layout != torch.strided or a.device.type != "cpu"
            or b.device.type != "cpu" or not (a.is_contiguous() and b.is_contiguous())
            or a.is_neg() or b.is_neg() or a.is_conj() or b.is_conj() or a.is_quantized or b.is_quantized):
        return 0
    return n


def equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal(a, b)`` for a twin's verdict: a memcmp where both are
    ``_plain`` integers or bools of one dtype (at 16,384 int64 3.7 µs
    against 14), which may say two unequal where ``torch.equal`` would
    not only for a bool byte other than 0 or 1: a twin that then does not
    hold leaves the verdict to its predicate."""
    if a.dtype in _BYTES_ARE_VALUES and (n := _plain(a, b)):
        return _MEMCMP(a.data_ptr(), b.data_ptr(), n) == 0
    return torch.equal(a, b)


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as int64 words where its layout allows (contiguous on
    the CPU, a whole number of aligned words), else ``t``: ``torch.equal``
    costs per element, and a bool mask of 16,384 pages compares as 2,048
    words in a third of the time.  Two tensors of one dtype and shape with
    equal words hold the same bytes, so a twin reads the same values in
    both; unequal words may still be equal values (-0.0 and 0.0, a bool
    byte other than 0 or 1), which costs only a run of the twin."""
    if (t.dtype.itemsize >= 8 or t.device.type != "cpu" or t.is_quantized or not t.is_contiguous()
            or t.numel() * t.dtype.itemsize % 8):
        return t
    try:
        return t.reshape(-1).view(torch.int64)
    except RuntimeError:  # an offset not on a word
        return t


def _kept(x):
    """A twin's input as ``_twin_holds`` remembers it: a copy of what can
    change in place (a tensor, a bytearray, a list; an ``unchanging``
    tensor itself), values as they are
    (numbers, strings, None, a sub-pool's geometry), tuples item by item,
    and anything else as ``_UNKEPT``."""
    if isinstance(x, torch.Tensor):
        return x if _is_unchanging(x) else x.clone()
    if isinstance(x, bytearray):
        return bytes(x)
    if type(x) in (list, tuple):
        return type(x)(map(_kept, x))
    if x is None or type(x) in (int, float, bool, str, bytes, SubPool):
        return x
    return _UNKEPT


def _same_inputs(last: tuple, inputs: tuple) -> bool:
    """Whether ``inputs`` are ``last`` (``_kept`` copies) again: each tensor
    equal in shape, dtype and device, and in every byte where ``_words``
    views it as words, else in every element (an ``unchanging`` one: the
    very tensor kept), each list or tuple item by item, the rest ``==`` and
    of the same type."""
    return _same(last, inputs)


def _same(was, now) -> bool:
    if isinstance(now, torch.Tensor):
        if isinstance(was, torch.Tensor) and (unchanged := _mark(was)) is not None:
            # Kept as itself: it stands for what the twin held on only while
            # no write to it is counted (a written one would pass against
            # itself, or against a tensor equal to what it now holds).
            if not unchanged:
                return False
            if was is now:
                return True
        if not (isinstance(was, torch.Tensor) and was.dtype == now.dtype and was.device == now.device
                and was.shape == now.shape):
            return False
        if n := _plain(was, now):
            # Equal bytes, whatever the dtype: a twin reads the same values in both.
            return _MEMCMP(was.data_ptr(), now.data_ptr(), n) == 0
        words = _words(was), _words(now)
        # Both as words, or both as they are (one may lie off a word's edge).
        return torch.equal(*words) if words[0].dtype == words[1].dtype else torch.equal(was, now)
    if isinstance(now, bytearray):
        return type(was) is bytes and was == now
    if was is _UNKEPT or type(was) is not type(now):
        return False
    if type(now) in (list, tuple):
        return len(was) == len(now) and all(map(_same, was, now))
    return was == now


def read_census(allocator, model=None) -> Census:
    """The allocator's census, as the checks read it (against ``model``):
    a ``TensorCensus`` of its integer tensors where it lists at least
    ``TENSOR_CENSUS_PAGES``, else a ``Census`` of ``census_of``'s list."""
    parts = _census_parts(allocator)
    if len(parts) == 1 and isinstance(parts[0], torch.Tensor) and parts[0].numel() < TENSOR_CENSUS_PAGES:
        # One small tensor (``get_all_free_pages()``'s): its list as is.
        return Census(ids(parts[0]))
    # The size first: a small pool (every step of a default run) skips the dtype tests.
    if (
        parts
        and all(isinstance(t, torch.Tensor) for t in parts)
        and sum(t.numel() for t in parts) >= TENSOR_CENSUS_PAGES
        and all(map(integral, parts))
    ):
        flat = [t.detach().to("cpu").reshape(-1).to(torch.int64) for t in parts]
        return TensorCensus(flat[0] if len(flat) == 1 else torch.cat(flat), model)
    return Census([page for part in parts for page in ids(part)])


# The deadline (``time.monotonic()``) of the outermost timed call running
# now, and its limit in seconds; None between calls (``_with_deadline``).
_deadline: float | None = None
_limit = CALL_TIMEOUT_S
# When the timer is next due (``time.monotonic()``), as set for a call; None
# where that is not known: off, or due once already (it then repeats every
# call limit), or ``_on_alarm`` is not the handler.  ``_every``: the limit
# it repeats at, set with it.
_fires_at: float | None = None
_every = 0.0


class CallTimedOut(TimeoutError):
    """A timed call ran past its deadline (``_on_alarm``): the harness's
    own, told apart from a ``TimeoutError`` the allocator raises, which is
    ``allocator_raised`` (it was reported as a hang).  A ``TimeoutError``
    still, for code that catches those."""


def _on_alarm(signum, frame):
    """SIGALRM: a timed call past its deadline raises ``CallTimedOut``.  The
    timer outlives the calls (``_with_deadline``): between calls it is
    switched off (once due, it repeats: ``alarm.set_alarm``), and inside a
    call whose deadline is still ahead (the timer set for an earlier call's)
    it is set again for the rest.  A call that catches ``CallTimedOut`` and
    goes on gets it again every call limit, its clean-up code included,
    until it returns."""
    global _fires_at, _every
    _fires_at = None
    if _deadline is None:
        cancel_alarm()
        return
    left = _deadline - time.monotonic()
    if left > 0:
        _fires_at, _every = _deadline, _limit
        set_alarm(left, _limit)
        return
    raise CallTimedOut(f"no return within {_limit:g} s")


_HAS_TIMER = hasattr(signal, "setitimer")


def _with_deadline(seconds: float, fn, args: tuple):
    """``fn(*args)``, interrupted with ``TimeoutError`` past ``seconds`` (main
    thread only; elsewhere, no limit).  A plain function, not a context
    manager: it wraps every allocator call, and a generator's enter and exit
    cost more than the timer.

    The timer is set only where it would not fire by this call's deadline,
    or would fire within half of ``seconds`` (then to ``seconds``), and is
    not switched off after the call (``fuzz`` and ``replay`` switch it off
    as they return, ``disarm_call_timer``, and the command as it ends and
    after what it builds itself, and the handler when it fires between
    calls; a ``Lockstep`` driven directly leaves it set until then, or
    until the interpreter exits): while calls come often it never fires,
    and one that fires early is set again for the rest (``_on_alarm``).
    Once due, it repeats every ``seconds`` (``alarm.set_alarm``: a
    SIGALRM can be lost).  Its signal goes to the main thread, not to whichever
    thread the kernel picks (``alarm``).  A forked child, which inherits
    no timer, forgets it (``_forget_call_timer``).  Setting it on
    every call and switching it off after (as before) took 26 µs of a
    builtin:token walk step (183 µs against 157 µs with no timer, CPU time,
    median of 8 alternating runs on the 2-core bench machine, where a timer
    syscall costs several µs); setting it on every call alone, 12 µs."""
    global _deadline, _limit, _fires_at, _every
    if not _HAS_TIMER or threading.get_ident() != threading.main_thread().ident:
        return fn(*args)
    if _deadline is not None:
        # Called from inside a timed call (an allocator calling back into the
        # harness, e.g. its cache evicting): the outer deadline stands.
        return fn(*args)
    # Installed once; restoring another handler per call costs more than the
    # call.  _signal's getsignal returns the handler as is (signal's wraps it
    # in an enum lookup that costs more than the check).
    if _signal.getsignal(signal.SIGALRM) is not _on_alarm:
        signal.signal(signal.SIGALRM, _on_alarm)
        _fires_at = None
    now = time.monotonic()
    deadline = now + seconds
    try:
        # The deadline first: an alarm from here on finds the call running
        # and sets the timer again for the rest (``_on_alarm``).
        _deadline, _limit = deadline, seconds
        fires = _fires_at
        if fires is None or fires > deadline or fires - now < seconds / 2 or _every != seconds:
            _fires_at, _every = deadline, seconds
            set_alarm(seconds, seconds)
        return fn(*args)
    finally:
        _deadline = None


def disarm_call_timer() -> None:
    """Switch off the call timer ``_with_deadline`` leaves running.
    ``fuzz`` and ``replay`` call it as they return, the command as it ends
    and after what it builds itself, and an exit handler as the interpreter
    exits, so no alarm of theirs reaches code that runs after them (a
    handler it installs, or SIGALRM's default, which the interpreter puts
    back as it exits and which ends the process).  Where the timer is
    ``setitimer``'s (``alarm``: off 64-bit Linux, or where no timer of the
    harness's own could be made), which other code shares, it is left as
    it is once another handler has been installed, unless it still repeats
    as the harness set it (``shared_alarm_is_ours``): else it may be that
    handler's own."""
    global _fires_at
    if alarm_is_private() or _signal.getsignal(signal.SIGALRM) is _on_alarm or shared_alarm_is_ours():
        # Set or not (a SIGALRM between calls clears _fires_at, and the
        # handler switched the timer off; it may be set since).
        cancel_alarm()
    _fires_at = None


atexit.register(disarm_call_timer)


def _forget_call_timer() -> None:
    """In a forked child: no timer is set there (fork copies none), and
    a child that believed the parent's would time no call until it was due."""
    global _deadline, _fires_at
    _deadline = _fires_at = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_call_timer)


# Who watches the harness's calls (``watch_calls``); None costs one test per call.
_observer = None


def watch_calls(observer) -> None:
    """From now on, in this process, every allocator call and every
    predicate the harness judges is shown to ``observer``, through those of
    these methods it has: ``call_started(state, what)`` before a call,
    ``call_ended(category, seconds)`` after it (``ALLOCATOR`` or
    ``CENSUS``), ``judged(name, seconds)`` after a predicate,
    ``building(what, since)`` while the target's own code runs outside any
    allocator call (``building``).  The bench's cost breakdown and the
    watchdog's per-call beacon are observers.  ``None`` stops watching."""
    global _observer
    _observer = None if observer is None else _Observer(
        getattr(observer, "call_started", None), getattr(observer, "call_ended", None), getattr(observer, "judged", None),
        getattr(observer, "building", None),
    )


@contextmanager
def observe(observer):
    """``watch_calls(observer)`` while the block runs."""
    global _observer
    saved = _observer
    watch_calls(observer)
    try:
        yield
    finally:
        _observer = saved


@frozen
class _Observer:
    call_started: Callable | None
    call_ended: Callable | None
    judged: Callable | None
    building: Callable | None = None


# What ``building`` says is running now, and since when (``time.monotonic``);
# None: nothing of the target's outside a call.
_building: tuple[str, float] | None = None


@contextmanager
def building(what: str):
    """While the block runs, the observer's ``building(what, since)`` knows
    that the target's own code runs outside any allocator call, and since
    when: its factory (``family.build``), or the capability probe of its
    optional methods or of its scheduler hooks (``Lockstep.create``).  The
    watchdog tells a worker that dies there (bad input: a factory that
    exits) from one that dies in an allocator call (a failure), and kills
    one that stays there past the build limit.  Nested blocks restore the
    outer one's ``what`` and its start as they end (``building(None,
    None)`` after the outermost)."""
    global _building
    observer = _observer
    if observer is None or observer.building is None:
        yield
        return
    outer = _building
    _building = (what, time.monotonic())
    observer.building(*_building)
    try:
        yield
    finally:
        _building = outer
        observer.building(*(outer or (None, None)))


@frozen
class Pool:
    """One pool ``check()`` compares with a model: the invariants' names
    get ``prefix`` and their messages ``label``."""

    allocator: Any
    model: Any
    prefix: str = ""
    label: str = ""
    # Its page size, where not the configuration's (a compressed pool's).
    page_size: int | None = None


@define
class Lockstep:
    """The harness state: allocator, model, real rows, recorded steps."""

    config: Config
    allocator: Any
    model: OwnershipModel
    # req_to_token: one row per request slot, holding its kv slot ids.
    rows: torch.Tensor
    # Which request holds each row; None when the row is unused.
    row_holder: list[int | None]
    # The cache's own copy of each entry's slot ids.
    entry_slots: dict[int, torch.Tensor] = field(factory=dict)
    steps: list[Step] = field(factory=list)
    in_group: bool = False
    has_free_segment: bool = True
    # The optional frees the target raises NotImplementedError from, with
    # the reason (``hooks.frees_not_provided``): ``provides`` says no.
    not_provided: dict[str, str] = field(factory=dict)
    # Steps the target cannot run here, with the reason (targets.probe).
    disabled_rules: dict[str, str] = field(factory=dict)
    # How deep inside step calls we are: a family's override calls super().
    step_depth: int = 0
    # The hooks ``ask`` leaves out here, each with the reason (probed).
    hooks_off: dict[str, str] = field(factory=dict)
    # ``runs()``'s answers, kept once ``create`` has settled what runs (None
    # before: a family's ``start_models`` may still disable steps).  Every
    # rule guard asks before every step, and ``why_not`` costs a µs or more.
    _runs: dict[str, bool] | None = field(default=None, init=False, repr=False, eq=False)
    # ``rows`` as a NumPy array over the same memory (``_rows_host``); False
    # where there is none; None until first asked.
    _host: Any = field(default=None, init=False, repr=False, eq=False)
    # The one pool ``pools()`` gives, made once for this allocator and model.
    _pool: Any = field(default=None, init=False, repr=False, eq=False)
    # The inputs each twin last held on, by name (``_twin_holds``).
    _held_on: dict = field(factory=dict, init=False, repr=False, eq=False)
    # name -> (the ``_held_on`` entry, what was derived from its inputs) (``_while_held``).
    _derived: dict = field(factory=dict, init=False, repr=False, eq=False)

    # The batched steps sglang's scheduler drives (decode, extend) that this
    # harness models; a family whose other pools they would not update sets ().
    caller_steps = ("decode", "extend")
    # Whether ``alloc`` goes to ``alloc_extend`` above page size 1: a family
    # whose allocators' alloc() is page-size-1 only (sglang's SWA, HiSparse).
    alloc_extends = False
    # The scheduler-hook steps (hooks.py) this harness models.  Read from a
    # class's own body only: a family that subclasses this one models them
    # where it says so itself.
    hook_steps = hooks.HOOK_STEPS
    # The hooks ``ask`` asks, where the allocator has them.
    asked_hooks = hooks.CORE_HOOKS
    # The frees a caller sends an empty span to (``free_empty_span``), where the
    # allocator has them; a family with more free methods names them, one
    # with its own empty-free step (the unified ones: ``free_nothing``) none.
    empty_frees = ("free", "free_segment")
    # Whether a fresh pool lists pages 1..size // page_size, each once
    # (``fresh_pool_lists_every_page``), as sglang's token, paged and NPU
    # allocators start.  Read from a class's own body only: a family that
    # subclasses this one lays its pools out otherwise (HiSparse's logical
    # pool is twice the size asked) and checks them itself.
    fresh_pool_is_pages_1_to_n = True

    @classmethod
    def create(cls, config: Config, allocator, *, defers_frees: bool, disabled: dict[str, str]) -> Lockstep:
        """A fresh state around a freshly built ``allocator``; the model
        starts from the allocator's own first census."""
        state = cls(
            config=config,
            allocator=allocator,
            model=OwnershipModel.from_census([], defers_frees=defers_frees),
            rows=torch.zeros(
                (config.rows, config.row_pages * config.page_size), dtype=getattr(torch, config.row_dtype), device=config.device
            ),
            row_holder=[None] * config.rows,
            disabled_rules=dict(disabled),
        )
        with building("the probe of its optional frees (called once on a copy)"):
            state.not_provided = hooks.frees_not_provided(allocator)
        state.has_free_segment = state.provides("free_segment")
        state.start_models(defers_frees)
        if state.models_hooks():
            # The target's own code, outside any allocator call, as the probe
            # of its optional methods (``family.build``) is: a worker that
            # dies here is bad input, not ``worker_died`` between calls.
            with building("the probe of its scheduler hooks (called once on a copy)"):
                state.hooks_off = hooks.disabled_hooks(allocator, state.asked_hooks, config.page_size)
                off = hooks.disabled_steps(allocator, state.hooks_off, state.asked_hooks)
            for name, reason in off.items():
                state.disabled_rules.setdefault(name, reason)
        state.check()
        state._runs = {}
        return state

    def provides(self, method: str) -> bool:
        """Whether the allocator has ``method`` and provides it (not a
        ``NotImplementedError`` stub: ``not_provided``)."""
        return callable(getattr(self.allocator, method, None)) and method not in self.not_provided

    def models_hooks(self) -> bool:
        """Whether this harness's own class body names the hook steps."""
        return "hook_steps" in type(self).__dict__

    def start_models(self, defers_frees: bool) -> None:
        if not has_census(self.pools()[0].allocator):
            # Else an empty census: a correct allocator failed available_size_agrees.
            raise TargetError(
                f"{self.config.target} has no census: give it get_all_free_pages(), or one of"
                f" {', '.join(CENSUS_ATTRIBUTES)} (a tensor or a list of free page ids)")
        initial = self._call("get_all_free_pages()", census_of, self.pools()[0].allocator)
        if "fresh_pool_is_pages_1_to_n" in type(self).__dict__:
            pages = self.config.pool_size // self.page_size if factory_takes_size(self.config) else None
            self._judge(invariants.fresh_pool_lists_every_page, initial, pages)
        self.model = OwnershipModel.from_census(pool_ids(initial)[0], defers_frees=defers_frees)

    @property
    def page_size(self) -> int:
        return self.config.page_size

    def why_not(self, step: str) -> str | None:
        """Why ``step`` does not run on this target here, or None when it
        does: the harness does not model it, the probe disabled it, or the
        allocator lacks the method the caller sends it to
        (``probe.caller_sends``: at page size 1, ``alloc()``).  ``admit``
        runs where ``extend`` does: it only readies a request for one."""
        if step == "admit":
            return self.why_not("extend")
        if step in probe.OPTIONAL and step not in self.caller_steps:
            return f"the {type(self).__name__} harness does not model {step}"
        if step in hooks.HOOK_STEPS and not self.models_hooks():
            return f"the {type(self).__name__} harness does not model {step}"
        if step in self.disabled_rules:
            return self.disabled_rules[step]
        if step == "free_empty_span" and not self.empty_frees:
            return f"the {type(self).__name__} harness frees an empty span in its own step, free_nothing"
        method = probe.caller_sends(step, self.page_size, self.config.latent)
        if method is not None and not callable(getattr(self.allocator, method, None)):
            return f"{self.config.target} has no {method}"
        return None

    def runs(self, step: str) -> bool:
        """``why_not(step) is None``; once the state is made, answered once a
        step (what runs on a target does not change as it runs)."""
        if self._runs is None:
            return self.why_not(step) is None
        if step not in self._runs:
            self._runs[step] = self.why_not(step) is None
        return self._runs[step]

    # -- what a rule may act on --

    def free_rows(self) -> list[int]:
        return [r for r, holder in enumerate(self.row_holder) if holder is None]

    def live(self) -> list[ReqRef]:
        return [ReqRef(rid) for rid in self.model.requests]

    def decodable(self) -> list[ReqRef]:
        """Live requests holding tokens: a request decodes after its prefill."""
        return [ReqRef(r.rid) for r in self.model.requests.values() if r.pages]

    def extendable(self) -> list[ReqRef]:
        """Live requests an ``alloc`` or ``extend`` may grow (all of them
        here; a family whose callers grow fewer narrows it)."""
        return self.live()

    def allocatable(self) -> list[ReqRef]:
        """Live requests an ``alloc`` may grow from their page-aligned end
        (``extendable()`` here; a family whose caller never skips the rest
        of a partly used page narrows it)."""
        return self.extendable()

    def with_own_pages(self) -> list[ReqRef]:
        return [ReqRef(r.rid) for r in self.model.requests.values() if r.own]

    def entries(self) -> list[EntryRef]:
        return [EntryRef(eid) for eid in self.model.cache]

    def evictable(self) -> list[EntryRef]:
        return [EntryRef(eid) for eid in self.model.evictable()]

    # Whether ``live()``, ``with_own_pages()`` or ``evictable()`` would list
    # anything, for the rule guards, which ask before every step (Hypothesis
    # asks every rule's): without making a ref per request (0.6 µs each).  A
    # family that overrides the list is asked for it.

    def any_live(self) -> bool:
        if type(self).live is Lockstep.live:
            return bool(self.model.requests)
        return bool(self.live())

    def any_with_own_pages(self) -> bool:
        if type(self).with_own_pages is Lockstep.with_own_pages:
            return any(r.own for r in self.model.requests.values())
        return bool(self.with_own_pages())

    def any_evictable(self) -> bool:
        if type(self).evictable is Lockstep.evictable:
            return bool(self.model.evictable())
        return bool(self.evictable())

    def stale_rows(self) -> list[int]:
        """Rows holding slot ids past what a live request uses."""
        # One read of the (small) row table: a rule guard asks this before
        # every step, and a torch op per row costs more than the whole read.
        stale = []
        host = self._rows_host()
        table = host.tolist() if host is not None else self.rows.tolist()
        for row, (holder, slots) in enumerate(zip(self.row_holder, table)):
            used = len(self.model.requests[holder].pages) * self.page_size if holder is not None else 0
            if any(slots[used:]):
                stale.append(row)
        return stale

    def decode_fits(self, reqs: list[ReqRef]) -> bool:
        """Whether the caller would send this decode batch (a family whose
        caller retracts requests first, rather than meet a short pool, says no)."""
        return True

    def room(self, req: ReqRef) -> int:
        """Pages the request's row can still take."""
        return self.config.row_pages - len(self.model.requests[req.rid].pages)

    # -- the harness's own reads and writes of req_to_token --

    def _rows_host(self):
        """``rows`` as a NumPy array sharing its memory, where ``rows`` is on
        the CPU (and NumPy is there); else None.  The harness reads and
        writes its rows through it: an index write costs 0.9 µs there
        against 10-13 µs on the tensor, a read 0.2 against 4.7 (bench
        machine).  The allocator still gets views of the tensor, and sees
        every write at once: it is one memory."""
        host = self._host
        if host is None:
            try:
                host = self.rows.numpy() if numpy is not None and self.rows.is_cpu else False
            except (RuntimeError, TypeError):  # a NumPy torch was not built against: the tensor's path
                host = False
            self._host = host
        return host if host is not False else None

    def _slot_at(self, row: int, i: int) -> int:
        """``int(rows[row, i])``."""
        host = self._rows_host()
        return int(host[row, i]) if host is not None else int(self.rows[row, i])

    def _set_row(self, row: int, start: int, values: torch.Tensor) -> None:
        """``rows[row, start : start + len(values)] = values``, cast to the
        rows' dtype (wrapping as torch's ``to`` does)."""
        end = start + values.shape[0]
        host = self._rows_host()
        if host is not None and values.is_cpu:
            host[row, start:end] = values.numpy()
        else:
            self.rows[row, start:end] = values.to(self.rows.device, self.rows.dtype)

    def _set_run(self, row: int, start: int, end: int, first: int) -> None:
        """``rows[row, start:end] = first, first + 1, ...``."""
        host = self._rows_host()
        if host is not None:
            host[row, start:end] = numpy.arange(first, first + end - start, dtype=numpy.int64)
        else:
            self.rows[row, start:end] = first + torch.arange(end - start, dtype=self.rows.dtype, device=self.rows.device)

    def _zero_row(self, row: int, start: int) -> None:
        """``rows[row, start:] = 0``."""
        host = self._rows_host()
        if host is not None:
            host[row, start:] = 0
        else:
            self.rows[row, start:] = 0

    # -- steps --

    @step
    def alloc(self, n: int, req: ReqRef | None = None, prefix: EntryRef | None = None) -> ReqRef | None:
        """A new request of ``n`` slots (after ``prefix``'s, if given), or an
        extend of ``req`` by ``n`` slots.  Returns the new request (None for
        an extend, or when the pool is short)."""
        ps = self.page_size
        want_pages = n // ps
        what, out = self._alloc_call(n, req, prefix)
        slots = self._index_tensor(what, out, n, want_pages)
        if slots is None:
            return None
        self._judge(invariants.alloc_returns_whole_pages, n, slots, ps)
        pages = [slots[i] // ps for i in range(0, n, ps)]
        self._judge_handout(pages)
        made = None
        if req is None:
            row = self.free_rows()[0]
            entry = self.model.cache[prefix.eid] if prefix is not None else None
            start = len(entry.pages) * ps if entry else 0
            if entry:
                self._set_row(row, 0, self.entry_slots[prefix.eid])
            made = self.model.new_request(row, pages, prefix.eid if prefix is not None else None)
            self.row_holder[row] = made.rid
        else:
            self.model.take(req.rid, pages)
            row = self.model.requests[req.rid].row
            start = (len(self.model.requests[req.rid].pages) - want_pages) * ps
        self._set_row(row, start, out)
        return ReqRef(made.rid) if made is not None else None

    @step
    def decode(self, reqs: list[ReqRef]) -> None:
        """Each request in the batch (in batch order) grows by one token; a
        request takes a new page exactly when its length crosses a page
        boundary, else it gets the next slot of its last page.  As sglang's
        ``alloc_for_decode`` does: ``alloc_decode`` at page size > 1
        (``last_loc`` read off the rows, in their dtype), ``alloc(len(reqs))``
        at page size 1 (``alloc_decode`` there only with ``latent``)."""
        ps = self.page_size
        lengths = [self.model.tokens(r.rid, ps) for r in reqs]
        rows = [self.model.requests[r.rid].row for r in reqs]
        last = [self._slot_at(row, n - 1) if n else -1 for row, n in zip(rows, lengths)]
        needs = [self.model.decode_needs_page(r.rid, ps) for r in reqs]
        if probe.caller_sends("decode", ps, self.config.latent) is None:
            what = f"alloc({len(reqs)})"
            out = self._call(what, self.allocator.alloc, len(reqs))
        else:
            seq_lens_cpu = torch.tensor([n + 1 for n in lengths], dtype=torch.int64)
            seq_lens = seq_lens_cpu.to(self.rows.device)
            last_loc = torch.tensor(last, dtype=self.rows.dtype, device=self.rows.device)
            what = f"alloc_decode(seq_lens={seq_lens_cpu.tolist()}, last_loc={last})"
            out = self._call(what, self.allocator.alloc_decode, seq_lens, seq_lens_cpu, last_loc)
        slots = self._index_tensor(what, out, len(reqs), sum(needs))
        if slots is None:
            return
        self._judge(invariants.decode_takes_page_boundary, what, [repr(r) for r in reqs], needs, last, slots, ps)
        new_pages = [slot // ps for need, slot in zip(needs, slots) if need]
        self._judge(invariants.no_slot_handed_out_twice, new_pages, self.model)
        for ref, need, slot in zip(reqs, needs, slots):
            request = self.model.requests[ref.rid]
            if need:
                # The row holds whole pages; later decodes fill the rest of this one.
                self._set_run(request.row, len(request.pages) * ps, (len(request.pages) + 1) * ps, slot)
            self.model.decode(ref.rid, slot // ps if need else None, ps)

    @step
    def admit(self, prefix: EntryRef | None = None) -> ReqRef | None:
        """A request takes a free row (sglang's ``alloc_req_slots``) and no
        KV slots yet: the next ``extend`` allocates them.  On ``prefix``, the
        cache entry's slots are written into its row and the entry locked.
        No allocator call.  Returns the new request."""
        row = self.free_rows()[0]
        made = self.model.new_request(row, [], prefix.eid if prefix is not None else None)
        if prefix is not None:
            self._set_row(row, 0, self.entry_slots[prefix.eid])
        self.row_holder[row] = made.rid
        return ReqRef(made.rid)

    @step
    def extend(self, reqs: list[ReqRef], tokens: list[int]) -> None:
        """Request ``reqs[i]`` grows by ``tokens[i]`` tokens, in one batch as
        sglang's ``alloc_for_extend`` sends it: at page size > 1 one
        ``alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
        last_loc, extend_num_tokens)``, ``prefix_lens`` each request's length
        and ``last_loc`` its last slot (-1 with none); at page size 1
        ``alloc(extend_num_tokens)`` (``alloc_extend`` there only with
        ``latent``).  A request first fills its last page, then takes
        ``ceil(seq_len / page_size) - ceil(prefix_len / page_size)`` new
        pages; ``None`` exactly when the pool has fewer free pages than the
        batch takes."""
        ps = self.page_size
        model = self.model
        prefix_lens = [model.tokens(r.rid, ps) for r in reqs]
        seq_lens = [p + k for p, k in zip(prefix_lens, tokens)]
        rows = [model.requests[r.rid].row for r in reqs]
        last = [self._slot_at(row, p - 1) if p else -1 for row, p in zip(rows, prefix_lens)]
        new_counts = [model.extend_new_pages(r.rid, k, ps) for r, k in zip(reqs, tokens)]
        total = sum(tokens)
        what, out = self._extend_call(prefix_lens, seq_lens, last, total)
        slots = self._index_tensor(what, out, total, sum(new_counts))
        if slots is None:
            return
        names = [repr(r) for r in reqs]
        ends = [sum(tokens[: i + 1]) for i in range(len(tokens))]
        per = [slots[end - k : end] for end, k in zip(ends, tokens)]
        self._judge(invariants.extend_continues_last_page, what, names, prefix_lens, last, per, ps)
        self._judge(invariants.extend_takes_whole_new_pages, what, names, prefix_lens, per, ps)
        # Each request's new pages: the page of every page_size-th slot past its last page.
        new_pages = []
        for got, prefix_len in zip(per, prefix_lens):
            rest = got[min(len(got), -prefix_len % ps):]
            new_pages.append([rest[j] // ps for j in range(0, len(rest), ps)])
        self._judge(invariants.no_slot_handed_out_twice, [p for pages in new_pages for p in pages], model)
        start = 0
        for ref, row, prefix_len, k, pages in zip(reqs, rows, prefix_lens, tokens, new_pages):
            self._set_row(row, prefix_len, out[start : start + k])
            start += k
            model.extend(ref.rid, pages, k, ps)
            end = len(model.requests[ref.rid].pages) * ps
            if pages and end > prefix_len + k:
                # The row holds whole pages; later steps fill the rest of this one.
                self._set_run(row, prefix_len + k, end, pages[-1] * ps + prefix_len + k - (end - ps))

    @step
    def begin(self) -> None:
        self._call("free_group_begin()", self.allocator.free_group_begin)
        self.model.begin()
        self.in_group = True

    @step
    def end(self) -> None:
        """``free_group_end()``, also when no group is open."""
        self._call("free_group_end()", self.allocator.free_group_end)
        self.model.end()
        self.in_group = False

    @step
    def free(self, req: ReqRef, n: int) -> None:
        """``free()`` of a view of the request's last ``n`` own slots."""
        row, length = self._row_of(req)
        own = self.model.requests[req.rid].own
        self._give_back(row, length - n, length, own[len(own) - n // self.page_size :], segment=False)
        self.model.release_tail(req.rid, n // self.page_size)

    @step
    def free_segment(self, req: ReqRef, start: int, n: int) -> None:
        """``free_segment()`` of a view ``row[start : start + n]``: ``start``
        is page-aligned and the segment runs to the request's last page,
        perhaps ending mid-page."""
        ps = self.page_size
        row, length = self._row_of(req)
        self._give_back(row, start, start + n, self.model.requests[req.rid].pages[start // ps :], segment=True)
        self.model.release_tail(req.rid, length // ps - start // ps)

    @step
    def free_empty_span(self, req: ReqRef, how: int) -> None:
        """A caller frees an empty span: ``row[end:end]`` at the request's
        cached-prefix end (page-aligned), as ``cache_finished_req`` frees the
        span its insert found already cached (``radix_cache.py``), empty when
        none was.  The method is the ``how``-th (modulo) of ``empty_frees``
        the allocator has; a segment free gets ``start_pos=end``.  Nothing
        is released, inside a group or out: the checks after the step see
        every pool as it was."""
        methods = self.empty_free_methods()
        name = methods[how % len(methods)]
        row, end = self.model.requests[req.rid].row, len(self.model.requests[req.rid].prefix) * self.page_size
        view, fn = self.rows[row, end:end], getattr(self.allocator, name)
        what = f"{name}(req_to_token[{row}, {end}:{end}]{f', start_pos={end}' if 'segment' in name else ''})"
        self._call(what, (lambda: fn(view, start_pos=end)) if "segment" in name else (lambda: fn(view)))

    def empty_free_methods(self) -> list[str]:
        """The ``empty_frees`` the allocator has (``free`` always)."""
        return [n for n in self.empty_frees if self.provides(n)] or ["free"]

    @step
    def overwrite_row(self, row: int) -> None:
        """Zero the part of ``row`` no live request uses, as sglang's tests do
        after queuing a free (the whole row when it is unused)."""
        holder = self.row_holder[row]
        used = len(self.model.requests[holder].pages) * self.page_size if holder is not None else 0
        self._zero_row(row, used)

    @step
    def rematch(self, req: ReqRef, dup: int, entry: EntryRef | None = None) -> EntryRef | None:
        """``cache_unfinished_req``: insert the request's own pages into the
        cache; the first ``dup`` of them the cache already held (in ``entry``),
        so free that span as a view, overwrite it with the cache's slots, and
        move the lock.  Returns the new cache entry, if any."""
        ps = self.page_size
        request = self.model.requests[req.rid]
        row, length = self._row_of(req)
        protected = len(request.prefix) * ps
        dup_end = protected + dup * ps
        new_slots = self.rows[row, dup_end:length].clone()
        if dup:
            self._give_back(row, protected, dup_end, request.own[:dup], segment=True)
            self._set_row(row, protected, self.entry_slots[entry.eid][: dup * ps])
        made = self.model.rematch(req.rid, dup, entry.eid if entry is not None else None)
        if made is None:
            return None
        self.entry_slots[made.eid] = new_slots
        return EntryRef(made.eid)

    @step
    def evict(self, entry: EntryRef) -> None:
        """The cache evicts an unlocked entry: ``free()`` of its own tensor."""
        self._evict_entry(entry)

    def _evict_entry(self, entry: EntryRef) -> None:
        """``evict``'s work, outside the step seam (a cache stand-in that
        evicts from inside an allocator call runs it too)."""
        self._evict_slots(entry, self.entry_slots.pop(entry.eid), self.model.cache[entry.eid].pages)
        self.model.evict(entry.eid)

    @step
    def finish(self, req: ReqRef) -> None:
        """The request ends: ``free()`` of a view of its own slots; its row is
        left as it is, for the next request to reuse."""
        request = self.model.requests[req.rid]
        row, length = self._row_of(req)
        self._give_back(row, len(request.prefix) * self.page_size, length, request.own, segment=False)
        self.model.finish(req.rid)
        self.row_holder[row] = None

    # -- the scheduler's hooks (hooks.py) --

    @step
    def ask(self, tokens: int) -> None:
        """The scheduler's questions about ``tokens`` tokens, each hook the
        allocator has (``asked_hooks``, less ``hooks_off``), with a prefix
        cache that has nothing to evict; each answer is judged against the
        model's counts (``reference_model/hooks.py``).  Changes no ownership."""
        ps = self.page_size
        full, swa = self._available_tokens()
        cache = hooks.CacheStandIn(self.allocator)
        slots, want_ids = self._transfer_ids()
        for hook in self.asked_hooks:
            if hook in self.hooks_off:
                continue
            cache.asked.clear()
            got = self._call(f"{hook}({tokens})", hooks.ask_call, self.allocator, hook, tokens, ps, slots, cache,
                             (full, swa))
            self._judge_hook(hook, got, tokens, full, swa, cache.asked, want_ids)
        if "check_decode_capacity" not in self.hooks_off:
            # A chunk cache shares no prefix: nothing to evict, so nothing asked.
            chunk = hooks.CacheStandIn(self.allocator, sharing=False)
            got = self._call(f"check_decode_capacity({tokens}, chunk cache)", hooks.ask_call, self.allocator,
                             "check_decode_capacity", tokens, ps, slots, chunk)
            self._judge(hook_checks.decode_capacity_agrees, got, tokens, full if swa is None else min(full, swa))
            self._judge(hook_checks.eviction_asks_shortfall, "check_decode_capacity (chunk cache)", chunk.asked, [])

    def _available_tokens(self) -> tuple[int, int | None]:
        """Free slots by the model: (full pool, SWA pool or None)."""
        return self.model.num_free * self.page_size, None

    def _transfer_ids(self):
        """Every live request's token ids (a tensor) and what a transfer
        addresses them as, by the model: the same ids in a static pool."""
        parts = [self.rows[r.row, : self.model.tokens(r.rid, self.page_size)] for r in self.model.requests.values()]
        slots = torch.cat(parts).to(torch.int64) if parts else torch.empty((0,), dtype=torch.int64)
        return slots, ids(slots)

    def _judge_hook(self, hook: str, got, tokens: int, full: int, swa: int | None, asked, want_ids) -> None:
        """Judge one hook's answer (see ``ask``)."""
        ps = self.page_size
        available = full if swa is None else min(full, swa)
        shortfall = [] if tokens <= available else [(max(0, tokens - full), 0 if swa is None else max(0, tokens - swa))]
        capacity = self.model.capacity * ps
        if hook == "check_decode_capacity":
            self._judge(hook_checks.decode_capacity_agrees, got, tokens, available)
            self._judge(hook_checks.eviction_asks_shortfall, hook, asked, shortfall)
        elif hook == "max_new_tokens_for_memory":
            self._judge(hook_checks.max_new_tokens_fit, got, tokens, tokens, capacity, ps)
        elif hook == "prealloc_fits":
            self._judge(hook_checks.prealloc_fits_agrees, got, tokens, tokens, full, swa)
        elif hook == "get_extend_allocation_demand":
            self._judge(hook_checks.extend_demand_covers, got, -(-tokens // ps) * ps, tokens + ps)
        elif hook in ("verify_byte_accounting", "translate_kv_indices_for_transfer", "size_full"):
            want = {"verify_byte_accounting": [], "size_full": capacity}.get(hook, want_ids)
            got = ids(got) if isinstance(got, torch.Tensor) else got
            self._judge(hook_checks.hook_answer_agrees, hook, got, want)
        elif hook == "create_prefill_budget":
            # Nothing evictable: what the budget has left is what the pool has free.
            got = getattr(got, "remaining_total", None)
            self._judge(hook_checks.hook_answer_agrees, f"{hook}().remaining_total", got, full)
        elif not self._judge_family_hook(hook, got, tokens, full, swa, asked):
            # A static pool lends no Full KV to Mamba, and records no transfer event.
            kinds = {"prealloc_fits_assumes_reclaim": (bool,), "prealloc_ceiling_fits": (bool, type(None)),
                     "request_slot_reserve": (int,), "mamba_full_cache_donor": (type(None),),
                     "set_hicache_transfer_done_event": (type(None),)}[hook]
            self._judge(hook_checks.hook_answer_kind, hook, got, kinds)

    def _judge_family_hook(self, hook: str, got, tokens: int, full: int, swa: int | None, asked) -> bool:
        """Judge a hook a family adds to ``asked_hooks``; False when it is not one."""
        return False

    @step
    def offload(self, req: ReqRef) -> None:
        """Retraction to CPU and back (``Req.offload_kv_cache`` /
        ``load_kv_cache``, backend ``cpu_tensor``): ``get_cpu_copy`` of a
        view of the request's token ids, then ``load_cpu_copy`` of that copy
        into the same ids.  The KV pool (a stand-in, one stamp per slot)
        must see exactly those ids, both times, and end as it began;
        ownership does not change."""
        request = self.model.requests[req.rid]
        n = self.model.tokens(req.rid, self.page_size)
        view = self.rows[request.row, :n]
        want = ids(view)
        kv = self.allocator.get_kvcache()
        before = kv.kv_lockstep_stamps.clone()
        kv.kv_lockstep_copies.clear()
        get, load = self.allocator.get_cpu_copy, self.allocator.load_cpu_copy
        kw = dict(mamba_indices=None, req_pool_index=request.row)
        cpu = self._call(f"get_cpu_copy(req_to_token[{request.row}, :{n}])", lambda: get(view, **hooks.taking(get, **kw)))
        self._call(f"load_cpu_copy(copy, req_to_token[{request.row}, :{n}])",
                   lambda: load(cpu, view, **hooks.taking(load, **kw)))
        self._judge(hook_checks.hook_answer_agrees, "get_cpu_copy / load_cpu_copy: the KV pool's calls",
                    list(kv.kv_lockstep_copies), [("get", want), ("load", want)])
        self._judge(hook_checks.hook_answer_agrees, "the KV pool after the round trip (slots changed)",
                    ids((kv.kv_lockstep_stamps != before).nonzero().reshape(-1)), [])

    @step
    def finish_segments(self, req: ReqRef, cut: int) -> None:
        """The request ends and its row goes back as ``free_kv_row`` gives it
        (``mem_cache/base_prefix_cache.py``): ``free_segments`` of views of
        its own span, split ``cut`` pages in (0: one segment), each start
        page-aligned, the last perhaps ending mid-page."""
        request = self.model.requests[req.rid]
        row, length = self._row_of(req)
        self._give_back_segments(row, len(request.prefix) * self.page_size, length, request.own, cut)
        self.model.finish(req.rid)
        self.row_holder[row] = None

    def _give_back_segments(self, row: int, start: int, end: int, pages: list[int], cut: int) -> None:
        """``free_segments`` of ``row[start:end]`` as two views split ``cut``
        pages in (one when ``cut`` is 0); a family splits off what its pools
        free otherwise."""
        self._free_segments("free_segments", row, start, end, cut)

    def _free_segments(self, method: str, row: int, start: int, end: int, cut: int) -> None:
        if end <= start:
            return
        mid = min(start + cut * self.page_size, end)
        spans = [(lo, hi) for lo, hi in ((start, mid), (mid, end)) if hi > lo]
        segments = [(self.rows[row, lo:hi], lo) for lo, hi in spans]
        shown = ", ".join(f"(req_to_token[{row}, {lo}:{hi}], {lo})" for lo, hi in spans)
        self._call(f"{method}([{shown}])", getattr(self.allocator, method), segments)

    @step
    def resize(self, pages: int) -> None:
        """Post-capture KV resizing (``kv_pool_runtime.py``: the allocator's
        ``resize(config)`` once the pool's real budget is known, before any
        request, capped at the pool's first size): afterwards pages
        ``1 .. pages`` are free, the rest gone."""
        what = f"resize(max_total_num_tokens={pages * self.page_size})"
        self._call(what, self.allocator.resize, hooks.resize_config(pages, self.page_size))
        self._rebuilt(list(range(1, pages + 1)))

    def _rebuilt(self, free_pages: list[int]) -> None:
        """The models after a resize: every pool rebuilt around ``free_pages``."""
        self.model.rebuild(free_pages)

    def resizable(self) -> bool:
        """A resize comes before any request: nothing live, cached or queued."""
        return not self.model.requests and not self.model.cache and not self.in_group

    # -- the hooks every alloc goes through --

    def _extend_call(self, prefix_lens: list[int], seq_lens: list[int], last: list[int], total: int):
        """The allocator call behind ``extend``: (what it is called, what it
        returned).  A family may route it elsewhere (``alloc_extend_swa_tail``)."""
        if probe.caller_sends("extend", self.page_size, self.config.latent) is None:
            return f"alloc({total})", self._call(f"alloc({total})", self.allocator.alloc, total)
        device = self.rows.device

        def host(values):
            return torch.tensor(values, dtype=torch.int64)

        what = f"alloc_extend(prefix_lens={prefix_lens}, seq_lens={seq_lens}, last_loc={last}, extend_num_tokens={total})"
        return what, self._call(
            what, self.allocator.alloc_extend, host(prefix_lens).to(device), host(prefix_lens),
            host(seq_lens).to(device), host(seq_lens), host(last).to(device), total,
        )

    def _alloc_call(self, n: int, req: ReqRef | None, prefix: EntryRef | None):
        """The allocator call behind ``alloc``: (what it is called, what it
        returned).  Above page size 1 a family with ``alloc_extends`` sends
        it to ``alloc_extend`` of one request, where the allocator has one."""
        if self.alloc_extends and self.page_size > 1 and callable(getattr(self.allocator, "alloc_extend", None)):
            return self._alloc_extend_call(n, req, prefix)
        return f"alloc({n})", self._call(f"alloc({n})", self.allocator.alloc, n)

    def _alloc_start(self, req: ReqRef | None, prefix: EntryRef | None) -> tuple[int, int]:
        """Where an ``alloc`` of ``req`` (or of a new request on ``prefix``)
        starts: (tokens before it, the last slot before it, -1 with none)."""
        if req is not None:
            request = self.model.requests[req.rid]
            before = len(request.pages) * self.page_size
            return before, self._slot_at(request.row, before - 1) if before else -1
        if prefix is not None:
            before = len(self.model.cache[prefix.eid].pages) * self.page_size
            return before, int(self.entry_slots[prefix.eid][-1]) if before else -1
        return 0, -1

    def _alloc_extend_call(self, n: int, req: ReqRef | None, prefix: EntryRef | None):
        """``alloc_extend`` of one request by ``n`` slots from its
        page-aligned end (a new request's from its ``prefix``'s)."""
        before, last = self._alloc_start(req, prefix)
        device = self.rows.device
        lens = [torch.tensor([v], dtype=torch.int64) for v in (before, before + n, last)]
        what = f"alloc_extend(prefix_lens=[{before}], seq_lens=[{before + n}], last_loc=[{last}], extend_num_tokens={n})"
        return what, self._call(what, self.allocator.alloc_extend, lens[0].to(device), lens[0], lens[1].to(device),
                                lens[1], lens[2].to(device), n)

    def _judge_handout(self, pages: list[int]) -> None:
        """Judge the pages an alloc handed out, before the model takes them."""
        self._judge(invariants.no_slot_handed_out_twice, pages, self.model)

    # -- the hooks every free goes through --

    def _give_back(self, row: int, start: int, end: int, pages: list[int], *, segment: bool) -> None:
        """Free ``row[start:end]``, a view, holding ``pages``: ``free_segment``
        (where the allocator has it) or ``free``."""
        if end <= start:
            return
        view = self.rows[row, start:end]
        if segment and self.has_free_segment:
            self._call(
                f"free_segment(req_to_token[{row}, {start}:{end}], start_pos={start})",
                lambda: self.allocator.free_segment(view, start_pos=start),
            )
        else:
            self._call(f"free(req_to_token[{row}, {start}:{end}])", self.allocator.free, view)

    def _evict_slots(self, entry: EntryRef, slots, pages) -> None:
        """The cache frees an evicted entry's own tensor."""
        self._call(f"free({entry!r} slots)", self.allocator.free, slots)

    # -- checks --

    def pools(self) -> list[Pool]:
        """The pools ``check()`` compares with their models."""
        # Kept while the allocator and the model stay the same objects (a
        # resize or a family's start rebuilds the model): check() asks each step.
        pool = self._pool
        if pool is None or pool.allocator is not self.allocator or pool.model is not self.model:
            pool = self._pool = Pool(self.allocator, self.model)
        return [pool]

    def check(self) -> None:
        """Every invariant on every pool, in ``CHECKS`` order; the first
        failure raises."""
        censuses = []
        # Each predicate called here, not through ``_judge`` (which times it
        # for an observer): its keyword call cost about 2 µs a predicate, a
        # sixth of what the six cost on a 10-page pool.  Same predicates, same
        # order, the same name and message on failure.
        timed = _observer is not None and _observer.judged is not None
        for pool in self.pools():
            census = self._call(f"{pool.prefix}census", read_census, pool.allocator, pool.model)
            available = self._count(f"{pool.prefix}available_size()", pool.allocator.available_size)
            page_size, model = pool.page_size or self.page_size, pool.model
            with model.unchanging():
                for predicate in CHECKS:
                    if timed:
                        self._judge(predicate, census, available, page_size, model,
                                    name=pool.prefix + predicate.__name__, label=pool.label)
                    elif problem := predicate(census, available, page_size, model):
                        self._fail(pool.prefix + predicate.__name__, pool.label + problem)
            censuses.append(census)
        self.check_joint(censuses)

    def check_joint(self, censuses: list[Census]) -> None:
        """Checks across pools, after each pool's own (one pool: none)."""

    def teardown(self) -> None:
        """Close any open group; the final state must still check out."""
        if self.in_group:
            self.end()

    # -- the seam's side (see steps.step) --

    def _start_step(self, spec: StepSpec, call: dict) -> None:
        self.steps.append(Step(spec.name, spec.record(call)))

    def _finish_step(self, result) -> None:
        if isinstance(result, (ReqRef, EntryRef)):
            last = self.steps[-1]
            self.steps[-1] = Step(last.rule, last.args, repr(result))
        self.check()

    # -- helpers --

    def _judge(self, predicate: Callable[..., str | None], *args, name: str | None = None, label: str = "") -> None:
        """Run a named predicate from ``reference_model``; fail the run
        under its name when it says what is wrong."""
        if _observer is None or _observer.judged is None:
            problem = predicate(*args)
        else:
            t0 = time.perf_counter()
            problem = predicate(*args)
            _observer.judged(predicate.__name__, time.perf_counter() - t0)
        if problem:
            self._fail(name or predicate.__name__, label + problem)

    def _twin_holds(self, predicate: Callable[..., str | None], name: str, twin: Callable[..., bool], *inputs) -> bool:
        """Whether ``predicate``'s twin (``twins``), ``twin(*inputs)``,
        says it holds; an observer counts its time as the predicate's, as
        ``_judge`` does.

        The twin is called on exactly ``inputs``, so they are every input it
        reads (tensors compared element by element, the rest by ``==``).  A
        twin is a pure function of its inputs, so where they are those it
        last held on under ``name`` it holds again, unrun: a step that leaves
        one side's tables as they were pays a compare (memcmp) for them, not
        the twin.  The compare counts as the predicate's time too."""
        if _observer is None or _observer.judged is None:
            return self._remembered(name, twin, inputs)
        t0 = time.perf_counter()
        try:
            return self._remembered(name, twin, inputs)
        finally:
            _observer.judged(predicate.__name__, time.perf_counter() - t0)

    def _remembered(self, name: str, twin: Callable[..., bool], inputs: tuple) -> bool:
        """True where ``inputs`` are those the twin last held on under
        ``name``; else ``twin(*inputs)``, remembering ``inputs`` where it holds."""
        last = self._held_on.pop(name, None)
        if last is not None and _same_inputs(last, inputs):
            self._held_on[name] = last
            return True
        # What was derived from the inputs held on before (``_while_held``) goes with them.
        self._derived.pop(name, None)
        if not twin(*inputs):
            return False
        # Copies: the allocator (and the model) change their tensors and lists in place.
        self._held_on[name] = tuple(map(_kept, inputs))
        return True

    def _while_held(self, name: str, derive: Callable[[], Any]) -> Any:
        """``derive()``, kept for as long as the inputs of the twin
        remembered under ``name`` stay those it held on: the memo keeps its
        entry (the very tuple) only while they do.  Call it right after
        ``_twin_holds`` under ``name`` said True, with one ``derive`` per
        name: a pure function of those inputs whose result no one writes
        (a unified step's live physical pages, a gather of 16,384 entries,
        where a step left the tables as they were)."""
        held = self._held_on.get(name)
        kept = self._derived.get(name)
        if held is not None and kept is not None and kept[0] is held:
            return kept[1]
        value = derive()
        if held is not None:
            self._derived[name] = (held, value)
        return value

    def _judge_mapping(self, predicate: Callable[..., str | None], mapping: torch.Tensor, page_size: int, side,
                       *more, sentinel: bool = False, free_census: Census | None = None) -> None:
        """``_judge(predicate, ids(mapping), page_size, self.model, side,
        *more)``, reading in Python only the pages ``rows_to_read`` leaves."""
        def judged() -> str | None:
            pages = rows_to_read(mapping, page_size, self.model, side, sentinel=sentinel, free_census=free_census)
            if pages == []:
                return None
            return predicate(ids(mapping), page_size, self.model, side, *more, pages=pages)

        judged.__name__ = predicate.__name__
        self._judge(judged)

    def _short(self, pages: int) -> bool:
        """Whether an alloc of ``pages`` pages must return None."""
        return self.model.num_free < pages

    def _index_tensor(self, what: str, out, length: int, want_pages: int) -> list[int] | None:
        """What an alloc returned, judged: ``None`` exactly when the pool is
        short of ``want_pages``, else an int32/int64 tensor on the pool's
        device of ``length`` slots.  Returns its slot ids, or None."""
        short = self._short(want_pages)
        if out is None:
            self._judge(invariants.alloc_none_iff_short, what, True, 0, short, self.model.num_free, want_pages)
            return None
        device = _device_type(self.config.device)
        want = f"an int32 or int64 tensor on {device} of {length} slots"
        if not isinstance(out, torch.Tensor):
            got = f"a {type(out).__name__}"
        elif out.dtype not in (torch.int32, torch.int64) or out.device.type != device or out.dim() != 1 or out.numel() != length:
            got = f"a {str(out.dtype).removeprefix('torch.')} tensor on {out.device.type} of shape {list(out.shape)}"
        else:
            got = want
        self._judge(invariants.alloc_returns_index_tensor, what, got, want)
        slots = ids(out)
        self._judge(invariants.alloc_none_iff_short, what, False, len(slots), short, self.model.num_free, want_pages)
        return slots

    def _row_of(self, req: ReqRef) -> tuple[int, int]:
        request = self.model.requests[req.rid]
        return request.row, len(request.pages) * self.page_size

    @calls_user_code
    def _call(self, what: str, fn, *args):
        observer = _observer
        if observer is not None and observer.call_started is not None:
            observer.call_started(self, what)
        t0 = time.perf_counter() if observer is not None else 0.0
        limit = self.config.call_timeout_s
        try:
            # Inline, not ``call_user_code``: every step's calls pass here.
            try:
                result = _with_deadline(limit, fn, args)
            except BaseException as exc:
                if orphans.copied:
                    leave_if_a_copy(exc)
                raise
            if orphans.copied:
                leave_if_a_copy()
            return result
        except (InvariantViolation, CensusUnreadable):
            raise
        except CallTimedOut:
            self._fail("allocator_hung", f"{what} hung: no return within {limit:g} s")
        except BaseException as exc:
            # The allocator's own KeyboardInterrupt or SystemExit is its failure too,
            # as is any class of its own derived from BaseException; only where
            # SIGINT has Python's default handler can a real Ctrl-C land inside
            # the call, and that stops the run.  Hypothesis's own control flow
            # passes through.
            probe.real_interrupt(exc)
            if type(exc).__module__.partition(".")[0] == "hypothesis":
                raise
            where = traceback.extract_tb(exc.__traceback__)[-1]
            self._fail("allocator_raised", f"{what} raised {raised_text(exc)} (at {where.filename}:{where.lineno})")
        finally:
            if observer is not None and observer.call_ended is not None:
                census = fn in (census_of, read_census) or getattr(fn, "__name__", "") == "available_size"
                observer.call_ended(CENSUS if census else ALLOCATOR, time.perf_counter() - t0)

    def _count(self, what: str, fn, *args) -> int:
        """``int(fn(*args))``, an allocator's count, called as ``_call``
        calls; an answer ``int()`` refuses (``None``, ``"many"``) fails
        ``answer_is_a_count``, not the harness (a traceback and no trace)."""
        got = self._call(what, fn, *args)
        if type(got) is not int:
            self._judge(invariants.answer_is_a_count, what, got)
        return int(got)

    def _fail(self, invariant: str, detail: str):
        raise violation_type(invariant)(detail, self.steps, self.config)
