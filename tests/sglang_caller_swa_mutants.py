"""An ``SWARadixCache`` subclass with a known caller bug, for ``--caller MODULE:ATTR``.

Importable only with an sglang that has ``SWARadixCache`` and keeps request
state on the request (0.5.17, 0.5.18) on ``sys.path``:
``kv-lockstep fuzz --caller tests.sglang_caller_swa_mutants:FreesTheTreesWindow --target sglang:swa``.
"""

from sglang.srt.mem_cache.swa_radix_cache import SWARadixCache


class FreesTheTreesWindow(SWARadixCache):
    """When a prefill is published, it also frees the SWA peers of the
    request's first page, which the tree now holds and counts live (the class
    of sglang PR 38519: a caller frees SWA the cache still counts)."""

    def cache_unfinished_req(self, req, chunked=False):
        super().cache_unfinished_req(req, chunked=chunked)
        allocator, ps = self.token_to_kv_pool_allocator, self.page_size
        first = self.req_to_token_pool.req_to_token[req.req_pool_idx, :ps].long()
        if req.cache_protected_len >= ps and bool((allocator.full_to_swa_index_mapping[first] > 0).all()):
            allocator.free_swa(first.clone())
