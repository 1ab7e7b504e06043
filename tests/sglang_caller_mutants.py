"""Cache subclasses with a known caller bug, for ``--caller MODULE:ATTR``.

Importable only with an sglang of the checkpoint generation (0.5.22 on) on
``sys.path``: ``kv-lockstep fuzz --caller tests.sglang_caller_mutants:FreesOnePast``.
"""

from sglang.srt.mem_cache.radix_cache import RadixCache


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
