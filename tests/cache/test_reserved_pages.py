"""Reserved L1 pages (``cache.full.reserve``): out of circulation until given back.

The decode CUDA graphs write their padding rows' K/V into such a page, so no request and
no tree node may ever be handed one, whatever eviction, reset or admission does.
"""

from __future__ import annotations

import pytest

from hicache.cache import HiCache
from hicache.cache.report import cache_stats, check_integrity
from hicache.config import CacheConfig
from hicache.spec import KVSpec
from tests.helpers.kvdata import serve

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")


def test_a_reserved_page_is_never_handed_out_and_survives_reset() -> None:
    with HiCache(CacheConfig(page_size=2, device_tokens=8), SPEC).start() as cache:
        (page,) = cache.full.reserve(1) or []
        assert cache.full.reserved == [page] and cache.full.pages == 3
        check_integrity(cache)  # the reserved page counts as held, not leaked
        assert cache_stats(cache).device_request_tokens == 2
        for tokens in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]):  # fills, then evicts
            req = serve(cache, tokens)
            assert req is not None and page not in req.pages
            check_integrity(cache)
        taken = cache.full.alloc(3)  # everything else, by eviction
        assert taken is not None and page not in taken
        assert cache.full.alloc(1) is None
        cache.full.free(taken)
        cache.reset()
        assert cache.full.device_pool.allocator.is_used(page)
        check_integrity(cache)
        with pytest.raises(ValueError, match="is not reserved"):
            cache.full.unreserve([page, page])
        cache.full.unreserve([page])
        assert cache.full.reserved == [] and cache.full.pages == 4
        assert not cache.full.device_pool.allocator.is_used(page)
        check_integrity(cache)
