"""The steps that drive an allocator's scheduler-facing hooks.

sglang's scheduler asks its allocator questions that change no ownership
(``ask``: capacity, eviction shortfalls, PD preallocation, transfer ids),
retracts a request to CPU and back (``offload``: ``get_cpu_copy`` /
``load_cpu_copy``), and gives a finished request's row back in segments
(``finish_segments``: ``free_segments`` / ``free_full_segments``, as
``free_kv_row_segments`` in ``mem_cache/common.py`` does).  A harness models
these where its own class body names them in ``hook_steps`` (the core and
the SWA harness); elsewhere they are disabled, saying so.

Which hooks a target has is probed on a throwaway copy
(``disabled_hooks``): a hook it lacks, or one that raises there, is not
asked, and a step with nothing left to ask is disabled with the reason.
"""

from __future__ import annotations

import copy
import inspect

import torch

from state_machines.orphans import call_user_code
from state_machines.targets.base import one_line, quiet
from state_machines.targets.probe import OWN_PACKAGES, real_interrupt

HOOK_STEPS = ("ask", "offload", "finish_segments", "resize")

# What ``ask`` asks, where the allocator has it (sglang 0.5.19 on has some,
# 0.5.22 on most).  The SWA harness adds its own (swa.py).
CORE_HOOKS = (
    "check_decode_capacity",
    "max_new_tokens_for_memory",
    "prealloc_fits",
    "prealloc_fits_assumes_reclaim",
    "prealloc_ceiling_fits",
    "get_extend_allocation_demand",
    "request_slot_reserve",
    "verify_byte_accounting",
    "translate_kv_indices_for_transfer",
    "create_prefill_budget",
    "size_full",
    "mamba_full_cache_donor",
    "set_hicache_transfer_done_event",
)
SWA_HOOKS = (
    "swa_capacity_and_available",
    "reclaim_for_prealloc",
    "translate_swa_indices_for_transfer",
    "size_swa",
    "size",
    "debug_print",
)


class _Evicted:
    """What an eviction of nothing returns (sglang's ``EvictResult`` fields)."""

    num_tokens_evicted = 0
    swa_num_tokens_evicted = 0
    mamba_num_evicted = 0


class CacheStandIn:
    """A prefix cache with nothing it may evict (every entry of the harness's
    cache stays, as a locked one would): it records each eviction the
    allocator asks of it, as (full tokens, SWA tokens).  ``sharing=False``
    is a chunk cache (no prefix sharing), which no allocator may ask."""

    def __init__(self, allocator, sharing: bool = True):
        self.token_to_kv_pool_allocator = allocator
        self.asked: list[tuple[int, int]] = []
        self.sharing = sharing

    def is_chunk_cache(self) -> bool:
        return not self.sharing

    def supports_prefix_sharing(self) -> bool:
        return self.sharing

    def supports_mamba(self) -> bool:
        return False

    def evictable_size(self) -> int:
        return 0

    full_evictable_size = swa_evictable_size = evictable_size

    def evict_for_alloc(self, params, **kwargs) -> _Evicted:
        self.asked.append((int(getattr(params, "num_tokens", 0) or 0), int(getattr(params, "swa_num_tokens", 0) or 0)))
        return _Evicted()

    evict = evict_for_alloc

    def __repr__(self) -> str:
        return "<prefix cache stand-in, nothing evictable>"


def taking(fn, **kwargs) -> dict:
    """The keyword arguments among ``kwargs`` that ``fn`` takes (a release
    adds parameters: 0.5.19's ``get_cpu_copy`` has no ``req_pool_index``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def ask_call(allocator, hook: str, tokens: int, page_size: int, slots: torch.Tensor, cache: CacheStandIn,
             budgets: tuple[int, int | None] = (0, None)):
    """Ask ``hook`` as the scheduler asks it, about ``tokens`` tokens (and the
    live token ids ``slots``; ``budgets``: what the scheduler's policy leaves
    each side, full and SWA).  A property is read, not called."""
    fn = getattr(allocator, hook)
    if not callable(fn):
        return fn
    lens = torch.tensor([0], dtype=torch.int64), torch.tensor([tokens], dtype=torch.int64)
    calls = {
        "check_decode_capacity": lambda: fn(**taking(fn, num_tokens=tokens, tree_cache=cache)),
        "max_new_tokens_for_memory": lambda: fn(tokens, tokens, token_capacity=_capacity(allocator),
                                                sliding_window_size=None, chunk_size=None),
        "prealloc_fits": lambda: fn(None, tokens, tokens, full_budget_tokens=budgets[0], swa_budget_tokens=budgets[1]),
        "prealloc_fits_assumes_reclaim": fn,
        "prealloc_ceiling_fits": lambda: fn(tokens, tokens),
        "get_extend_allocation_demand": lambda: fn(*lens, conservative_num_tokens=tokens + page_size, shard_size=1),
        "request_slot_reserve": lambda: fn(has_req_pool_slot=True, prefill_tokens=tokens),
        "verify_byte_accounting": fn,
        "translate_kv_indices_for_transfer": lambda: fn(slots),
        "create_prefill_budget": lambda: fn(cache, num_mixed_decode_tokens=0),
        "mamba_full_cache_donor": fn,
        "set_hicache_transfer_done_event": lambda: fn(("kv-lockstep", tokens), None),
        "swa_capacity_and_available": lambda: fn(full_capacity=tokens, swa_capacity=tokens),
        "reclaim_for_prealloc": lambda: fn(cache, tokens, tokens),
        "translate_swa_indices_for_transfer": lambda: fn(slots),
        "debug_print": fn,
    }
    return calls[hook]()


def _capacity(allocator) -> int:
    size = getattr(allocator, "size_full", None)
    return int(size if size is not None else allocator.size)


_PROBED: dict[tuple, dict[str, str]] = {}


def disabled_hooks(allocator, hooks: tuple[str, ...], page_size: int) -> dict[str, str]:
    """The hooks of ``hooks`` that ``ask`` leaves out, each with the reason:
    the allocator has none, or it raises on a fresh throwaway copy (probed
    once per class and shape)."""
    key = (type(allocator), hooks, page_size, getattr(allocator, "need_sort", None))
    if key not in _PROBED:
        _PROBED[key] = _probe_hooks(allocator, hooks, page_size)
    return _PROBED[key]


def _probe_hooks(allocator, hooks: tuple[str, ...], page_size: int) -> dict[str, str]:
    out = {}
    for hook in hooks:
        if not hasattr(type(allocator), hook):
            out[hook] = f"{type(allocator).__name__} has no {hook}"
            continue
        probe = copy.deepcopy(allocator)
        try:
            with quiet():
                call_user_code(ask_call, probe, hook, page_size, page_size, torch.tensor([], dtype=torch.int64),
                               CacheStandIn(probe))
        except BaseException as exc:  # noqa: BLE001 - whatever stops it here leaves it out
            real_interrupt(exc)
            out[hook] = f"{hook}: {one_line(exc)}"
    return out


def disabled_steps(allocator, hooks: dict[str, str], asked: tuple[str, ...]) -> dict[str, str]:
    """The hook steps this allocator cannot run here, each with the reason
    (probed once per class and shape)."""
    key = ("steps", type(allocator), asked, getattr(allocator, "page_size", 1), getattr(allocator, "need_sort", None))
    if key not in _PROBED:
        _PROBED[key] = _probe_steps(allocator, hooks, asked)
    return _PROBED[key]


def _probe_steps(allocator, hooks: dict[str, str], asked: tuple[str, ...]) -> dict[str, str]:
    name = type(allocator).__name__
    out = {}
    if len(hooks) == len(asked):
        out["ask"] = f"{name} has none of the scheduler hooks ask asks (check_decode_capacity, ...)"
    if not callable(getattr(allocator, "free_segments", None)):
        out["finish_segments"] = f"{name} has no free_segments"
    # Segments not provided: finish_segments off; free_segment's step off,
    # its segments going back through free (``has_free_segment``).
    unprovided = frees_not_provided(allocator)
    out.update({step: unprovided[m] for step, m in (("free_segment", "free_segment"), ("finish_segments", "free_segments"))
                if m in unprovided})
    out.update(_offload_disabled(allocator))
    if not callable(getattr(allocator, "resize", None)):
        out["resize"] = f"{name} has no resize"
    else:
        page_size = getattr(allocator, "page_size", 1)
        resized = copy.deepcopy(allocator)
        # To 1 page, but to 2 on a pool of 1 page, where a resize to 1 would
        # leave num_pages as it was either way (the verdict is kept for
        # every size: built first on 1 page, 0.5.23's paged pool at page
        # size 1 kept resize on, and a resize to 5 on the default pool then
        # broke free_sets_agree).
        to = 2 if getattr(allocator, "num_pages", None) == 1 else 1
        try:
            with quiet():
                call_user_code(resized.resize, resize_config(to, page_size))
        except BaseException as exc:  # noqa: BLE001 - whatever stops it here disables the step
            real_interrupt(exc)
            out["resize"] = f"resize: {one_line(exc)}"
        else:
            pages = getattr(resized, "num_pages", None)
            if page_size == 1 and pages is not None and pages != to:
                # 0.5.23 base.py:261-265 updates num_pages only above page size 1;
                # at 1 sglang builds TokenToKVPoolAllocator (kv_cache_configurator.py).
                out["resize"] = (f"resize to {to} page{'s' if to > 1 else ''} leaves {name}.num_pages at {pages} at page size 1, where "
                                 "sglang builds the token allocator instead: no caller resizes this class here "
                                 "(a latent finding, README)")
    return out


class _ResizeConfig:
    """The sizes a post-capture resize reads (``KVCacheConfig``'s fields)."""

    def __init__(self, tokens: int):
        self.max_total_num_tokens = self.full_max_total_num_tokens = self.swa_max_total_num_tokens = tokens

    def __repr__(self) -> str:
        return f"<KV config: {self.max_total_num_tokens} tokens>"


def resize_config(pages: int, page_size: int) -> _ResizeConfig:
    """A config of ``pages`` pages for every pool."""
    return _ResizeConfig(pages * page_size)


def _offload_disabled(allocator) -> dict[str, str]:
    name = type(allocator).__name__
    for method in ("get_cpu_copy", "load_cpu_copy"):
        if not callable(getattr(allocator, method, None)):
            return {"offload": f"{name} has no {method}"}
    if getattr(allocator.get_kvcache() if callable(getattr(allocator, "get_kvcache", None)) else None,
               "kv_lockstep_copies", None) is None:
        return {"offload": f"{name}'s KV pool is not the harness's stand-in, so a copy cannot be judged"}
    probe = copy.deepcopy(allocator)
    one = torch.tensor([1], dtype=torch.int64)
    try:
        with quiet():
            cpu = call_user_code(probe.get_cpu_copy, one, **taking(probe.get_cpu_copy, mamba_indices=None, req_pool_index=0))
            call_user_code(probe.load_cpu_copy, cpu, one, **taking(probe.load_cpu_copy, mamba_indices=None, req_pool_index=0))
    except BaseException as exc:  # noqa: BLE001 - whatever stops it here disables the step
        real_interrupt(exc)
        return {"offload": f"get_cpu_copy / load_cpu_copy: {one_line(exc)}"}
    return {}


# The optional frees a harness falls back from (``free_segment`` to
# ``free``, ``free_full_segments`` to ``free_full_segment`` to ``free_full``
# to ``free``, ``free_swa_segment`` to ``free_swa``; ``free_segments`` has
# its own step), each with the empty call a caller makes (``free_empty_span``:
# an empty view, ``start_pos``; ``free_kv_row``: no segments).
OPTIONAL_FREES = {
    "free_segment": lambda f: f(torch.zeros(0, dtype=torch.int32), start_pos=0),
    "free_segments": lambda f: f([]),
    "free_full": lambda f: f(torch.zeros(0, dtype=torch.int32)),
    "free_full_segment": lambda f: f(torch.zeros(0, dtype=torch.int32), start_pos=0),
    "free_full_segments": lambda f: f([]),
    "free_swa_segment": lambda f: f(torch.zeros(0, dtype=torch.int32), start_pos=0),
}


def frees_not_provided(allocator) -> dict[str, str]:
    """The optional frees (``OPTIONAL_FREES``) of a custom target that raise
    ``NotImplementedError`` on an empty call, with the reason: the harness
    uses the method it falls back to, as for an allocator without one
    (``Lockstep.provides``).  Probed once per class and shape, on a
    throwaway copy: the README calls them optional, and a base class's
    ``NotImplementedError`` failed a correct allocator as
    ``allocator_raised``.  Any other raise is left to the run."""
    if type(allocator).__module__.partition(".")[0] in OWN_PACKAGES:
        return {}
    key = ("frees", type(allocator), getattr(allocator, "page_size", 1), getattr(allocator, "need_sort", None))
    if key not in _PROBED:
        _PROBED[key] = _probe_frees(allocator)
    return _PROBED[key]


def _probe_frees(allocator) -> dict[str, str]:
    name = type(allocator).__name__
    out = {}
    for method, call in OPTIONAL_FREES.items():
        if not callable(getattr(allocator, method, None)):
            continue
        try:
            throwaway = copy.deepcopy(allocator)
        except Exception:  # noqa: BLE001 - uncopied, the method stays on and the run judges it
            continue
        try:
            with quiet():
                call_user_code(call, getattr(throwaway, method))
        except NotImplementedError:
            out[method] = f"{name}.{method}: not provided (NotImplementedError)"
        except BaseException as exc:  # noqa: BLE001 - the run reports it
            real_interrupt(exc)
    return out
