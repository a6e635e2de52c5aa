"""Reports on a whole cache, beside the facade: the stats snapshot, the integrity check
and the tree digest tensor-parallel ranks compare.

Each reads the cache's parts (the full KV store, the component stores, the L3 slot, the
admitted requests) through read-only properties and changes nothing; the per-part
pieces are in :mod:`hicache.cache.inspect`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from hicache.cache import inspect
from hicache.cache.facade import HiCache
from hicache.metrics import CacheStats

__all__ = ["cache_stats", "check_integrity", "tree_digest"]


def cache_stats(cache: HiCache) -> CacheStats:
    """Occupancy per tier (tokens) and every counter, as one snapshot, with each store's
    pool use (the full KV's first)."""
    full, requests = cache.full, cache.admitted
    storage = cache.storage
    stats = inspect.cache_stats(
        cache.full.tree,
        full.device_pool,
        full.host_pool,
        cache.full.counters,
        None if storage is None else storage.controller.storage,
        held_device_pages=len(full.request_pages(requests)) + len(full.reserved),
    )
    cached = inspect.cached_tokens(full.device_pool)
    ps = cache.page_size
    usage = dataclasses.replace(
        inspect.full_usage(full.device_pool, full.host_pool),
        device_requests=stats.device_request_tokens // ps,
        device_cached=stats.device_cached_tokens // ps,
        host_cached=stats.host_cached_tokens // ps,
    )
    return dataclasses.replace(stats, components=(usage, *cache.stores.usages(cached, requests)))


def check_integrity(cache: HiCache, request_pages: Iterable[int] = ()) -> None:
    """Check tree and allocators agree: every used L1 page is owned by the tree, an
    admitted request, the reserved pages, a failed load's quarantine or
    ``request_pages`` (pages other callers hold), exactly once; every used L2 page is
    owned by the tree or held by an L3 op (or by a detached backend that may still write
    it); every component store's ids likewise. Raises AssertionError."""
    full, l3, names = cache.full, cache.l3, cache.stores.names
    requests = cache.admitted
    host_held = l3.held_host_pages()
    ids_held = l3.held_component_ids(names)
    inspect.check_cache_integrity(
        cache.full.tree,
        full.device_pool,
        full.host_pool,
        [*full.held_device_pages(requests), *request_pages],
        host_held,
    )
    cache.stores.check(requests, ids_held)


def tree_digest(cache: HiCache, *, exact: bool = False) -> str:
    """SHA-256 (hex) of the cache's tree structure (:func:`hicache.cache.inspect.tree_digest`):
    tensor-parallel ranks whose trees stayed identical have equal digests."""
    return inspect.tree_digest(cache.full.tree, exact=exact)
