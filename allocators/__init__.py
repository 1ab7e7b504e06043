"""KV-cache allocators under test. One file per strategy.

Each follows sglang's allocator contract, so the harness drives these and
sglang's own classes the same way:

- ``alloc(n)`` returns ``n`` slot indices, or ``None`` when the pool is short;
- ``free(index)`` and ``free_segment(index, start_pos=)`` give slots back;
- ``free_group_begin()`` / ``free_group_end()`` batch frees: while a group is
  open, frees are only queued, and the queue owns copies of what it queued;
- ``available_size()``, ``clear()``, and the census ``get_all_free_pages()``.

Mamba's state slots (``mamba.py``) keep sglang's ``MambaSlotAllocator``
contract instead: no free groups, frees at once, allocation groups
(``alloc_group_begin(n)`` / ``alloc_group_end()``), census ``free_slots``.

Each strategy also names its mutants: variants that re-create a known bug
class, for checking that the harness catches it.
"""

from allocators.base import Mutant, SlotAllocator
from allocators.dsv4_hisparse import DSV4_HISPARSE_MUTANTS, DSV4HiSparseAllocator
from allocators.hisparse import HISPARSE_MUTANTS, HiSparseAllocator
from allocators.mamba import MAMBA_MUTANTS, MambaSlotAllocator
from allocators.multi_ended import MULTI_ENDED_MUTANTS, MultiEndedAllocator
from allocators.npu import NPU_MUTANTS, NPUPagedAllocator
from allocators.page_interleave import PAGE_INTERLEAVE_MUTANTS, PageInterleaveAllocator
from allocators.paged import PAGED_MUTANTS, PagedAllocator
from allocators.swa import PURE_SWA_MUTANTS, SWA_MUTANTS, PureSWAAllocator, SWAAllocator
from allocators.token import TOKEN_MUTANTS, TokenAllocator
from allocators.unified_mamba import UNIFIED_MAMBA_MUTANTS, UnifiedMambaAllocator
from allocators.unified_swa import UNIFIED_SWA_MUTANTS, UnifiedSWAAllocator

__all__ = [
    "BUILTINS",
    "DSV4HiSparseAllocator",
    "HiSparseAllocator",
    "MambaSlotAllocator",
    "MultiEndedAllocator",
    "Mutant",
    "NPUPagedAllocator",
    "PageInterleaveAllocator",
    "PagedAllocator",
    "PureSWAAllocator",
    "SWAAllocator",
    "SlotAllocator",
    "TokenAllocator",
    "UnifiedMambaAllocator",
    "UnifiedSWAAllocator",
]

# name -> (allocator class, its mutants by name)
BUILTINS: dict[str, tuple[type, dict[str, Mutant]]] = {
    "token": (TokenAllocator, TOKEN_MUTANTS),
    "paged": (PagedAllocator, PAGED_MUTANTS),
    "swa": (SWAAllocator, SWA_MUTANTS),
    "pure-swa": (PureSWAAllocator, PURE_SWA_MUTANTS),
    "hisparse": (HiSparseAllocator, HISPARSE_MUTANTS),
    "dsv4-hisparse": (DSV4HiSparseAllocator, DSV4_HISPARSE_MUTANTS),
    "npu": (NPUPagedAllocator, NPU_MUTANTS),
    "mamba": (MambaSlotAllocator, MAMBA_MUTANTS),
    "page-interleave": (PageInterleaveAllocator, PAGE_INTERLEAVE_MUTANTS),
    "multi-ended": (MultiEndedAllocator, MULTI_ENDED_MUTANTS),
    "unified-swa": (UnifiedSWAAllocator, UNIFIED_SWA_MUTANTS),
    "unified-mamba": (UnifiedMambaAllocator, UNIFIED_MAMBA_MUTANTS),
}
