"""CPU stand-ins for a paged allocator's device-kernel paths.

Releases up to 0.5.20 run ``PagedTokenToKVPoolAllocator.alloc_extend`` and
(to 0.5.21) ``alloc_decode`` only as Triton kernels.  ``cpu_kernels`` gives
one allocator instance stand-ins with the same contract, built from the
release's own ``alloc_extend_naive`` and ``get_num_new_pages``, and says
what it replaced and why.  The real caller (``state_machines/callers``) and
``sglang:swa`` above page size 1 (whose two pools are paged allocators)
use them.
"""

from __future__ import annotations

import copy
import sys
import types

import torch

from state_machines.targets.base import TargetError, one_line, quiet


def _probe_extend(allocator, page_size: int) -> None:
    i64 = dict(dtype=torch.int64)
    allocator.alloc_extend(
        torch.tensor([0], **i64), torch.tensor([0], **i64), torch.tensor([page_size], **i64),
        torch.tensor([page_size], **i64), torch.tensor([-1], **i64), page_size,
    )


def _probe_decode(allocator, page_size: int) -> None:
    i64 = dict(dtype=torch.int64)
    allocator.alloc_decode(torch.tensor([page_size + 1], **i64), torch.tensor([page_size + 1], **i64),
                           torch.tensor([page_size - 1], **i64))


def _alloc_extend_on_cpu(naive, new_pages):
    """``alloc_extend`` with the contract of the release's own: the release's
    ``alloc_extend_naive`` fills the slots, ``get_num_new_pages`` counts."""

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens,
                     num_new_pages=None, **_):
        if num_new_pages is None:
            num_new_pages = new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu)
        if self.need_sort and num_new_pages > len(self.free_pages):
            self.merge_and_sort_free()
        if num_new_pages > len(self.free_pages):
            return None
        out = torch.empty((extend_num_tokens,), dtype=torch.int64, device=self.device)
        naive(prefix_lens, seq_lens, last_loc, self.free_pages, out, self.page_size, self.device)
        self.free_pages = self.free_pages[num_new_pages:]
        return out

    return alloc_extend


def _alloc_decode_on_cpu(new_pages):
    """``alloc_decode`` with the contract of the release's Triton kernel: a
    request whose new length is ``k * page_size + 1`` takes the next free
    page, any other gets the slot after ``last_loc``."""

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc, **_):
        if self.need_sort and len(seq_lens) > len(self.free_pages):
            self.merge_and_sort_free()
        num_new_pages = new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True)
        if num_new_pages > len(self.free_pages):
            return None
        out, taken = [], 0
        for n, last in zip(seq_lens_cpu.tolist(), last_loc.tolist()):
            if n % self.page_size == 1:
                out.append(int(self.free_pages[taken]) * self.page_size)
                taken += 1
            else:
                out.append(last + 1)
        self.free_pages = self.free_pages[num_new_pages:]
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    return alloc_decode


def _owner(obj, name: str) -> type:
    """The class in ``obj``'s MRO whose own body defines ``name`` (else
    ``obj``'s class): for a user's subclass that keeps the release's method,
    the release's class, whose module has the release's helpers."""
    return next((cls for cls in type(obj).__mro__ if name in vars(cls)), type(obj))


def cpu_kernels(allocator, page_size: int, *, at_page_size_one: bool = False) -> list[str]:
    """Give a paged allocator whose ``alloc_extend`` / ``alloc_decode`` cannot
    run here (Triton, no CPU path) a CPU stand-in with the same contract, on
    this instance only; returns what it replaced, with why.  At page size 1
    only with ``at_page_size_one`` (a pool whose caller extends it there).
    The stand-in is built from the helpers of the module whose class defines
    the method: a method a user's subclass writes itself is refused, not
    replaced by the release's logic (which would leave it untested)."""
    if (page_size == 1 and not at_page_size_one) or not callable(getattr(allocator, "alloc_extend", None)):
        return []
    replaced = []
    for name, probe in (("alloc_extend", _probe_extend), ("alloc_decode", _probe_decode)):
        try:
            with quiet():
                probe(copy.deepcopy(allocator), page_size)
            continue
        except Exception as exc:  # noqa: BLE001 - whatever stops it here needs the stand-in
            why = one_line(exc)
        owner = _owner(allocator, name)
        module = sys.modules.get(owner.__module__)
        naive, new_pages = getattr(module, "alloc_extend_naive", None), getattr(module, "get_num_new_pages", None)
        if new_pages is None or (name == "alloc_extend" and naive is None):
            if not owner.__module__.startswith("sglang."):
                raise TargetError(f"{owner.__name__}.{name} ({owner.__module__}) cannot run on CPU ({why}); it is not the"
                                  " release's, so no stand-in is built from the release's (it would leave yours untested)")
            raise TargetError(f"{type(allocator).__name__}.{name} cannot run on CPU ({why}) and the release has no"
                              " alloc_extend_naive / get_num_new_pages to build a stand-in from")
        stand_in = _alloc_extend_on_cpu(naive, new_pages) if name == "alloc_extend" else _alloc_decode_on_cpu(new_pages)
        setattr(allocator, name, types.MethodType(stand_in, allocator))
        source = "the release's alloc_extend_naive" if name == "alloc_extend" else "kv-lockstep's loop over the kernel's contract"
        replaced.append(f"{type(allocator).__name__}.{name}: a CPU stand-in ({source}); the release's fails here: {why}")
    return replaced


class _CpuLaunch:
    """A Triton kernel's launch shape, ``kernel[grid](*args)``, over a CPU
    function of the same arguments."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn


def _extend_kernel_on_cpu(naive):
    """``alloc_extend_kernel``'s contract through the release's own
    ``alloc_extend_naive``: per request, the rest of its last page after
    ``last_loc``, then whole pages of ``free_page_ptr`` in order, the last
    perhaps partly used."""

    def launch(prefix_lens, seq_lens, last_loc, free_page_ptr, out_indices, bs_upper, page_size):
        naive(prefix_lens, seq_lens, last_loc, free_page_ptr, out_indices, page_size, out_indices.device)

    return _CpuLaunch(launch)


def _decode_kernel_on_cpu(seq_lens, last_loc, free_page_ptr, out_indices, bs_upper, page_size):
    """``alloc_decode_kernel``'s contract: a request whose new length starts a
    page takes the next page of ``free_page_ptr`` (its first token), any other
    the token after ``last_loc``."""
    taken = 0
    for i, (n, last) in enumerate(zip(seq_lens.tolist(), last_loc.tolist())):
        if (n - 1) % page_size == 0:
            out_indices[i] = int(free_page_ptr[taken]) * page_size
            taken += 1
        else:
            out_indices[i] = last + 1


def unified_cpu_kernels(sub_pool, page_size: int) -> list[str]:
    """Let a unified sub-pool's own ``alloc_extend`` / ``alloc_decode`` run on
    CPU: each call, on this instance only, finds CPU stand-ins under the two
    Triton kernel names its module launches (``alloc_extend_kernel``,
    ``alloc_decode_kernel``); everything else (the virtual ids it takes, the
    physical pages it binds, its shortfall ladder) is the release's.  Returns
    what it replaced, with why; nothing at page size 1 (the caller sends
    decode and extend to ``alloc()`` there)."""
    if page_size == 1 or not callable(getattr(sub_pool, "alloc_extend", None)):
        return []
    module = sys.modules[_owner(sub_pool, "alloc_extend").__module__]
    paged = sys.modules.get(module.__name__.rsplit(".", 1)[0] + ".paged")
    naive = getattr(paged, "alloc_extend_naive", None)
    if naive is None or not all(hasattr(module, k) for k in ("alloc_extend_kernel", "alloc_decode_kernel")):
        return []
    kernels = {"alloc_extend_kernel": _extend_kernel_on_cpu(naive), "alloc_decode_kernel": _CpuLaunch(_decode_kernel_on_cpu)}

    def swapped(name):
        def call(self, *args, **kwargs):
            saved = {k: getattr(module, k) for k in kernels}
            for k, v in kernels.items():
                setattr(module, k, v)
            try:
                return getattr(type(self), name)(self, *args, **kwargs)
            finally:
                for k, v in saved.items():
                    setattr(module, k, v)

        return call

    # Bound methods, so a deep copy (the capability probe's) calls its own copy.
    for name in ("alloc_extend", "alloc_decode"):
        setattr(sub_pool, name, types.MethodType(swapped(name), sub_pool))
    return [f"{type(sub_pool).__name__}({sub_pool.sub_pool_name!r}).alloc_extend / alloc_decode: their Triton kernels"
            " (no CPU path) replaced, during the call only, by CPU stand-ins (the release's alloc_extend_naive;"
            " kv-lockstep's loop over alloc_decode_kernel's contract)"]
