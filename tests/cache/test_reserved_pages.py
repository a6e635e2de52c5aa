"""Reserved L1 pages (``cache.full.pages.reserve``): out of circulation until given back.

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
        (page,) = cache.full.pages.reserve(1) or []
        assert cache.full.pages.reserved == [page] and cache.full.pages.usable == 3
        check_integrity(cache)  # the reserved page counts as held, not leaked
        assert cache_stats(cache).device_request_tokens == 2
        for tokens in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]):  # fills, then evicts
            req = serve(cache, tokens)
            assert req is not None and page not in req.pages
            check_integrity(cache)
        taken = cache.full.pages.alloc(3)  # everything else, by eviction
        assert taken is not None and page not in taken
        assert cache.full.pages.alloc(1) is None
        cache.full.pages.free(taken)
        cache.reset()
        assert cache.full.pages.device_pool.allocator.is_used(page)
        check_integrity(cache)
        with pytest.raises(ValueError, match="is not reserved"):
            cache.full.pages.unreserve([page, page])
        cache.full.pages.unreserve([page])
        assert cache.full.pages.reserved == [] and cache.full.pages.usable == 4
        assert not cache.full.pages.device_pool.allocator.is_used(page)
        check_integrity(cache)
