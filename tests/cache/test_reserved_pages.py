"""Reserved L1 pages (``HiCache.reserve_device_pages``): out of circulation until given back.

The decode CUDA graphs write their padding rows' K/V into such a page, so no request and
no tree node may ever be handed one, whatever eviction, reset or admission does.
"""

from __future__ import annotations

import pytest

from hicache.cache import HiCache
from hicache.config import CacheConfig, KVSpec
from tests.helpers.kvdata import serve

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")


def test_a_reserved_page_is_never_handed_out_and_survives_reset() -> None:
    with HiCache(CacheConfig(page_size=2, device_tokens=8), SPEC).start() as cache:
        (page,) = cache.reserve_device_pages(1) or []
        assert cache.reserved_device_pages == [page] and cache.device_pages == 3
        cache.check_integrity()  # the reserved page counts as held, not leaked
        assert cache.stats().device_request_tokens == 2
        for tokens in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]):  # fills, then evicts
            req = serve(cache, tokens)
            assert req is not None and page not in req.pages
            cache.check_integrity()
        taken = cache.alloc_device(3)  # everything else, by eviction
        assert taken is not None and page not in taken
        assert cache.alloc_device(1) is None
        cache.free_device(taken)
        cache.reset()
        assert cache.device_pool.allocator.is_used(page)
        cache.check_integrity()
        with pytest.raises(ValueError, match="is not reserved"):
            cache.unreserve_device_pages([page, page])
        cache.unreserve_device_pages([page])
        assert cache.reserved_device_pages == [] and cache.device_pages == 4
        assert not cache.device_pool.allocator.is_used(page)
        cache.check_integrity()
