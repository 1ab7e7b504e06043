"""What moves between sglang releases, in one place.

The scheduler helpers a real caller drives changed shape over the releases
(``prefix_indices`` became ``prefix_len``, ``inc_lock_ref`` became
``lock()``, ``cache_unfinished_req`` became ``checkpoint``, request state
moved under ``req.kv``).  Each API generation is one class here; the one a
release gets is chosen by probing what the release has (``generation_of``),
never by its version string.  The rest of ``callers/`` calls only these
methods.

The readers at the bottom (``tree_slots``, ``path_slots``,
``open_group_pages``) probe the objects they are given the same way.
"""

from __future__ import annotations

import functools
import inspect
from array import array
from types import SimpleNamespace

from state_machines.targets.base import TargetError


def ids(t) -> list[int]:
    return t.detach().to("cpu").reshape(-1).tolist()


@functools.cache
def _params(fn) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


class Generation:
    """One API generation of ``Req`` and the scheduler helpers.

    ``m`` is the release's modules (``release.Modules``).  Every method takes
    the real ``Req`` and does what the release's own scheduler does at that
    point, with the release's own functions where it has one.
    """

    name = ""
    # What a release needs for this generation: (description, probe(m) -> bool).
    needs: tuple = ()

    def __init__(self, m) -> None:
        self.m = m

    @classmethod
    def missing(cls, m) -> list[str]:
        return [what for what, probe in cls.needs if not probe(m)]

    # -- requests --

    def make_req(self, rid: str, tokens: list[int], max_new: int, vocab_size: int):
        """A real ``Req`` of ``tokens`` that stops after ``max_new`` tokens."""
        sampling = self.m.SamplingParams(max_new_tokens=max_new)
        sampling.normalize(None)
        kwargs = {"vocab_size": vocab_size} if "vocab_size" in _params(self.m.Req) else {}
        return self.m.Req(rid, "", array("q", tokens), sampling, **kwargs)

    def row(self, req) -> int | None:
        raise NotImplementedError

    def protected_len(self, req) -> int:
        raise NotImplementedError

    def allocated_len(self, req) -> int:
        raise NotImplementedError

    def committed_len(self, req) -> int:
        raise NotImplementedError

    def prefix_len(self, req) -> int:
        raise NotImplementedError

    def locked_node(self, req):
        """The tree node the request holds a lock on, or None."""
        raise NotImplementedError

    # -- the scheduler's steps --

    def lock(self, req, cache) -> None:
        """Admission: lock the matched prefix (``PrefillAdder``)."""
        raise NotImplementedError

    def unlock(self, req, cache) -> None:
        """Undo ``lock`` for a request admission turned away."""
        raise NotImplementedError

    def set_extend(self, req, end: int) -> None:
        """Admission: the request extends from its prefix to ``end``."""
        raise NotImplementedError

    def extend_len(self, req) -> int:
        raise NotImplementedError

    def after_extend(self, req, seq_len: int) -> None:
        """What ``prepare_for_extend`` does after ``alloc_for_extend``."""

    def after_decode(self, req) -> None:
        """What ``prepare_for_decode`` does after ``alloc_for_decode``: count
        the request's decode steps (a window slides from the first on)."""
        if hasattr(req, "decode_batch_idx"):
            req.decode_batch_idx += 1

    def cache_unfinished(self, req, cache) -> None:
        """A prefill result of a request that goes on decoding."""
        raise NotImplementedError

    # Why this generation drives no chunked prefill, or None when it does (every one here does).
    chunking: str | None = "this API generation has no chunked prefill adapter"

    def next_chunk(self, req) -> None:
        """A chunked request's next round (``init_next_round_input()``, no
        rematch: it resumes at its own ``prefix_len``)."""
        raise NotImplementedError

    def stash_chunk(self, req, cache) -> None:
        """``stash_chunked_request``: publish the chunk just computed and
        resume after it."""
        raise NotImplementedError

    def release(self, req, cache, *, insert: bool) -> None:
        """``release_kv_cache``: finished (``insert``) or retracted."""
        raise NotImplementedError

    def batch(self, **fields) -> SimpleNamespace:
        """The duck-typed ``ScheduleBatch``: only the fields the allocation
        helpers read (see ``release.STAND_INS``)."""
        return SimpleNamespace(
            model_config=SimpleNamespace(is_encoder_decoder=False),
            maybe_evict_swa=lambda: None,
            is_dllm=lambda: False,
            hisparse_coordinator=None,
            **fields,
        )


class PrefixIndicesGeneration(Generation):
    """Requests carry ``prefix_indices``, ``req_pool_idx`` and
    ``cache_protected_len``; the scheduler locks with ``inc_lock_ref``,
    publishes a prefill with ``cache_unfinished_req`` and releases with
    ``release_kv_cache(is_insert=...)`` (0.5.17, 0.5.18)."""

    name = "prefix_indices"
    needs = (
        ("mem_cache/common.py maybe_cache_unfinished_req", lambda m: hasattr(m.common, "maybe_cache_unfinished_req")),
        ("release_kv_cache(is_insert=...)", lambda m: "is_insert" in _params(m.common.release_kv_cache)),
        ("Req.set_extend_range", lambda m: hasattr(m.Req, "set_extend_range")),
    )

    def state(self, req):
        """The object holding the request's row and lengths: the ``Req`` itself here."""
        return req

    def row(self, req):
        return self.state(req).req_pool_idx

    def protected_len(self, req):
        return self.state(req).cache_protected_len

    def allocated_len(self, req):
        return req.kv.kv_allocated_len if req.kv is not None else 0

    def committed_len(self, req):
        return self.state(req).kv_committed_len

    def prefix_len(self, req):
        return len(req.prefix_indices)

    def locked_node(self, req):
        return req.last_node

    def lock(self, req, cache):
        result = cache.inc_lock_ref(req.last_node)
        # PrefillAdder._req_inc_lock_ref: an SWA tree says where the request's SWA lock ends.
        req.swa_uuid_for_lock = getattr(result, "swa_uuid_for_lock", None)
        if hasattr(req, "skip_lock_node_ids"):
            req.skip_lock_node_ids = {}

    def unlock(self, req, cache):
        if req.swa_uuid_for_lock is None:
            cache.dec_lock_ref(req.last_node)
            return
        cache.dec_lock_ref(req.last_node, self.m.DecLockRefParams(swa_uuid_for_lock=req.swa_uuid_for_lock))
        req.swa_uuid_for_lock = None

    def set_extend(self, req, end):
        req.set_extend_range(len(req.prefix_indices), end)

    def extend_len(self, req):
        return req.extend_range.length

    def after_extend(self, req, seq_len):
        self.state(req).kv_committed_len = seq_len
        req.is_retracted = False

    def after_decode(self, req):
        super().after_decode(req)
        self.state(req).kv_committed_len += 1

    def cache_unfinished(self, req, cache):
        self.m.common.maybe_cache_unfinished_req(req, cache)

    chunking = None

    def next_chunk(self, req):
        # Without a cache: prefix_indices (the tree's part and the chunk's own tail) stay.
        req.init_next_round_input()

    def stash_chunk(self, req, cache):
        # The scheduler's stash_chunked_request; a parked chunk computed nothing to publish.
        if self.extend_len(req) > 0:
            self.m.common.maybe_cache_unfinished_req(req, cache, chunked=True)

    def release(self, req, cache, *, insert):
        self.m.common.release_kv_cache(req, cache, is_insert=insert)


class PrefixIndicesKvGeneration(PrefixIndicesGeneration):
    """``prefix_indices`` as above, with the request's row and lengths moved
    under ``req.kv`` (``ReqKvInfo``) and kept by the allocation helpers
    (0.5.19, 0.5.20)."""

    name = "prefix_indices_kv"
    needs = PrefixIndicesGeneration.needs + (
        ("ReqKvInfo.req_pool_idx (request state under req.kv)",
         lambda m: hasattr(getattr(m, "ReqKvInfo", None), "req_pool_idx")),
    )

    def state(self, req):
        return req.kv

    # alloc_for_extend / alloc_for_decode keep kv_committed_len themselves here.
    def after_extend(self, req, seq_len):
        req.is_retracted = False

    def after_decode(self, req):
        Generation.after_decode(self, req)


class ExtendInputLenGeneration(PrefixIndicesGeneration):
    """``prefix_indices`` before the extend range: admission sets
    ``extend_input_len`` (``set_extend_input_len``) and ``fill_len``, the request keeps
    ``kv_allocated_len`` itself and ``prepare_for_extend`` / ``_decode`` set
    it (0.5.13)."""

    name = "extend_input_len"
    needs = (
        PrefixIndicesGeneration.needs[:2]
        + (("Req.set_extend_input_len", lambda m: hasattr(m.Req, "set_extend_input_len")),)
    )

    def allocated_len(self, req):
        return req.kv_allocated_len

    def set_extend(self, req, end):
        # PrefillAdder sets both; cache_unfinished_req keys the tree on get_fill_ids(), [:fill_len].
        req.set_extend_input_len(end - len(req.prefix_indices))
        req.fill_len = end

    def extend_len(self, req):
        return req.extend_input_len

    def after_extend(self, req, seq_len):
        super().after_extend(req, seq_len)
        req.kv_allocated_len = seq_len

    def after_decode(self, req):
        super().after_decode(req)
        req.kv_allocated_len += 1


class KvRecordGeneration(Generation):
    """Request state lives under ``req.kv``; the scheduler locks with
    ``lock()`` into ``req.lock``, publishes with ``checkpoint_kv_cache`` and
    releases with ``release_kv_cache(checkpoint=...)`` (0.5.22 on)."""

    name = "kv_record"
    needs = (
        ("mem_cache/common.py checkpoint_kv_cache", lambda m: hasattr(m.common, "checkpoint_kv_cache")),
        ("release_kv_cache(checkpoint=...)", lambda m: "checkpoint" in _params(m.common.release_kv_cache)),
        ("BasePrefixCache.lock", lambda m: hasattr(m.BasePrefixCache, "lock")),
    )

    def row(self, req):
        return req.kv.req_pool_idx

    def protected_len(self, req):
        return req.kv.cache_protected_len

    def allocated_len(self, req):
        return req.kv.kv_allocated_len

    def committed_len(self, req):
        return req.kv.kv_committed_len

    def prefix_len(self, req):
        return req.prefix_len

    def locked_node(self, req):
        lock = getattr(req, "lock", None)
        return lock.node if lock is not None else None

    def lock(self, req, cache):
        req.lock = cache.lock(req.last_node)

    def unlock(self, req, cache):
        cache.unlock(req.lock)
        req.lock = None

    def set_extend(self, req, end):
        req.extend_end = end

    def extend_len(self, req):
        return req.extend_len

    def after_extend(self, req, seq_len):
        req.is_retracted = False

    def cache_unfinished(self, req, cache):
        self.m.common.checkpoint_kv_cache(req, cache)

    chunking = None

    def next_chunk(self, req):
        req.init_next_round_input()

    def stash_chunk(self, req, cache):
        # A parked chunk (extend_end == prefix_len) computed nothing: nothing to stash.
        if req.extend_end > req.prefix_len:
            self.m.common.checkpoint_kv_cache(req, cache)

    def release(self, req, cache, *, insert):
        self.m.common.release_kv_cache(req, cache, checkpoint=insert)


# What every generation's harness calls on a Req, besides its own needs (0.5.12
# met the 0.5.13 generation's and had none of this: a false alarm).
REQ_NEEDS = (("Req.update_finish_state", lambda m: hasattr(m.Req, "update_finish_state")),)

# Tried in order: the first whose every need a release meets is its generation.
GENERATIONS: tuple[type[Generation], ...] = (
    KvRecordGeneration, PrefixIndicesKvGeneration, PrefixIndicesGeneration, ExtendInputLenGeneration,
)


def generation_of(m) -> Generation:
    """The generation whose every need the release meets; ``TargetError``
    naming what each lacks when none does."""
    if lacks := [what for what, probe in REQ_NEEDS if not probe(m)]:
        raise TargetError(f"sglang {m.version}: its Req predates the API --caller drives (it lacks {', '.join(lacks)})")
    why = []
    for gen in GENERATIONS:
        lacks = gen.missing(m)
        if not lacks:
            return gen(m)
        why.append(f"{gen.name} lacks {', '.join(lacks)}")
    raise TargetError(f"sglang {m.version}: no caller adapter fits this release ({'; '.join(why)})")


# --------------------------------------------------------------------------- #
# Readers: what a cache and an allocator hold, as plain lists.


def tree_sizes(cache) -> tuple[int, int]:
    """``(evictable, protected)`` tokens of the tree's full KV: the cache's
    ``evictable_size()`` / ``protected_size()``, or ``full_evictable_size()``
    / ``full_protected_size()`` where those raise ``NotImplementedError``
    (``SWARadixCache`` keeps two of each)."""
    try:
        return int(cache.evictable_size()), int(cache.protected_size())
    except NotImplementedError:
        return int(cache.full_evictable_size()), int(cache.full_protected_size())


def tree_slots(cache) -> list[int]:
    """Every slot the tree's nodes hold (``all_values_flatten()``); an empty
    tree may raise there (``torch.cat`` of nothing), which reads as empty."""
    try:
        return ids(cache.all_values_flatten())
    except (ValueError, RuntimeError):
        if sum(tree_sizes(cache)) == 0:
            return []
        raise


def _root(cache):
    # A Rust tree core raises NotImplementedError for root_node, not AttributeError.
    try:
        return cache.root_node
    except (AttributeError, NotImplementedError):
        return None


def path_reader(cache) -> str | None:
    """How ``path_slots`` reads this cache's paths: ``path_device_indices``
    (0.5.22 on), ``tree_core`` (a unified tree before), ``nodes`` (a node
    tree with ``parent`` and ``value``), or None when it can read none."""
    own = getattr(type(cache), "path_device_indices", None)
    base = next((getattr(k, "path_device_indices", None) for k in type(cache).__mro__ if k.__name__ == "BasePrefixCache"), None)
    if own is not None and own is not base:
        return "path_device_indices"
    core = getattr(cache, "tree_core", None)
    if core is not None and hasattr(core, "collect_full_device_indices") and hasattr(cache, "root_node_handle"):
        return "tree_core"
    root = _root(cache)
    if root is not None and hasattr(root, "children") and hasattr(root, "value"):
        return "nodes"
    return None


def path_slots(cache, how: str, node) -> list[int]:
    """The slots on the tree path from the root to ``node``."""
    if how == "path_device_indices":
        return ids(cache.path_device_indices(node))
    if how == "tree_core":
        return ids(cache.tree_core.collect_full_device_indices(node, cache.root_node_handle()))
    root, parts = cache.root_node, []
    while node is not None and node is not root:
        parts.append(ids(node.value))
        node = node.parent
    return [s for part in reversed(parts) for s in part]


def open_group_pages(allocator, page_size: int) -> list[int]:
    """The pages an open free group holds now: its queued tensors
    (``free_group``), read as they are at this moment (a queued view shows
    what its row holds now), and the paged queues of page representatives
    (``free_page_reps_group``, slots) or page ids (``free_page_ids_group``)."""
    out: list[int] = []
    for t in getattr(allocator, "free_group", None) or []:
        out += [s // page_size for s in ids(t)]
    for t in getattr(allocator, "free_page_reps_group", None) or []:
        out += [s // page_size for s in ids(t)]
    for t in getattr(allocator, "free_page_ids_group", None) or []:
        out += ids(t)
    return out


__all__ = [
    "GENERATIONS",
    "ExtendInputLenGeneration",
    "Generation",
    "KvRecordGeneration",
    "PrefixIndicesGeneration",
    "PrefixIndicesKvGeneration",
    "generation_of",
    "ids",
    "open_group_pages",
    "path_reader",
    "path_slots",
    "tree_sizes",
    "tree_slots",
]

