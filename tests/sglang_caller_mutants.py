"""Cache subclasses with a known caller bug, for ``--caller MODULE:ATTR``.

Importable only with an sglang of the checkpoint generation (0.5.22 on) on
``sys.path``: ``kv-lockstep fuzz --caller tests.sglang_caller_mutants:FreesOnePast``.
"""

import torch
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache


class FreesOnePast(RadixCache):
    """When an insert drops a duplicate, it frees one slot past the
    duplicated span: the request's own next slot, which its row still holds."""

    def _insert_cache(self, req, token_ids, **kwargs):
        protected = req.kv.cache_protected_len
        key, kv_indices, matched = super()._insert_cache(req, token_ids, **kwargs)
        if protected < matched < req.kv.kv_allocated_len:
            row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
            self.token_to_kv_pool_allocator.free(row[matched : matched + 1].clone())
        return key, kv_indices, matched


class UnifiedFreesOnePast(UnifiedRadixCache):
    """0.5.23's default cache for a plain model, with the same bug: when an
    insert drops a duplicate (the tree already held ``[prev_prefix_len,
    prefix_len)``), it also frees the slot just past that span, which the
    insert has just put in the tree."""

    def insert(self, params):
        result = super().insert(params)
        value = params.value
        if value is not None and params.prev_prefix_len < result.prefix_len < len(value):
            self.token_to_kv_pool_allocator.free(value[result.prefix_len : result.prefix_len + 1].clone())
        return result


class SlidesIntoTheTree(UnifiedRadixCache):
    """Built with the SWA component: a window slide also frees the SWA peers
    of the request's first page, which the tree holds (the class of sglang PR
    38519: a caller frees SWA the cache still counts live)."""

    def evict_sliding_windows(self, req, pre_len, **kwargs):
        super().evict_sliding_windows(req, pre_len, **kwargs)
        allocator, ps = self.token_to_kv_pool_allocator, self.page_size
        first = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :ps].to(torch.int64)
        if req.kv.cache_protected_len >= ps and bool((allocator.full_to_swa_index_mapping[first] > 0).all()):
            allocator.free_swa_segment(first.clone(), start_pos=0)
