"""Read-only views of a :class:`~hicache.cache.HiCache`: stats and the integrity check."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from hicache.metrics import CacheStats

if TYPE_CHECKING:
    from hicache.cache import HiCache


def cache_stats(cache: HiCache) -> CacheStats:
    s = cache.tree.stats()
    ps = cache.page_size
    host_only = sum(cache.tree.num_pages(n) for n in cache.tree.iter_nodes() if n.device is None)
    host_total = cache.host_pool.num_pages if cache.host_pool is not None else 0
    host_free = cache.host_pool.allocator.free_pages if cache.host_pool is not None else 0
    return CacheStats(
        page_size=ps,
        device_total_tokens=cache.device_pool.num_pages * ps,
        device_cached_tokens=s.device_pages * ps,
        device_free_tokens=cache.device_pool.allocator.free_pages * ps,
        device_evictable_tokens=s.evictable_device_pages * ps,
        host_total_tokens=host_total * ps,
        host_cached_tokens=s.host_pages * ps,
        host_free_tokens=host_free * ps,
        host_only_tokens=host_only * ps,
        nodes=s.nodes,
        counters=cache.counters.snapshot(),
        storage=cache.l3.controller.storage.stats() if cache.l3 is not None else None,
    )


def check_cache_integrity(cache: HiCache, request_pages: Iterable[int] = ()) -> None:
    """Check tree and allocators agree: every used L1 page is owned by the tree or
    listed in ``request_pages`` (pages callers hold), exactly once; every used L2
    page is owned by the tree. Raises AssertionError."""
    cache.tree.check_integrity()
    alloc = cache.device_pool.allocator
    alloc.check_integrity()
    tree_dev = cache.tree.device_page_ids()
    req = list(request_pages)
    owned = tree_dev + req
    assert len(set(owned)) == len(owned), "an L1 page is owned twice (tree and a request)"
    assert all(alloc.is_used(p) for p in owned), "the tree or a request owns a free L1 page"
    assert len(owned) == alloc.used_pages, (
        f"{alloc.used_pages} L1 pages used, {len(owned)} owned: leak"
    )
    if cache.host_pool is not None:
        halloc = cache.host_pool.allocator
        halloc.check_integrity()
        tree_host = cache.tree.host_page_ids()
        assert all(halloc.is_used(p) for p in tree_host), "the tree owns a free L2 page"
        assert len(tree_host) == halloc.used_pages, (
            f"{halloc.used_pages} L2 pages used, {len(tree_host)} owned: leak"
        )
