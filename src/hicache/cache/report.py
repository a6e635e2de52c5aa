"""Reports on a whole cache, beside the facade: the stats snapshot, the integrity check
and the tree digest tensor-parallel ranks compare.

Each reads the cache's parts (the full KV's pages: its tree, pools and counters; the
component stores, the L3 slot, the admitted requests) through read-only properties and
changes nothing. One pool's use and ownership check are :mod:`hicache.cache.pool_audit`'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable

from hicache.cache.facade import HiCache
from hicache.cache.pool_audit import check_owned, component_usage
from hicache.memory import DevicePool, HostPool
from hicache.metrics import CacheStats, ComponentUsage

__all__ = ["cache_stats", "check_integrity", "tree_digest"]


def cache_stats(cache: HiCache) -> CacheStats:
    """Occupancy per tier (tokens: each tier's, the tree's distinct L1 + L2 tokens and
    those marked in L3) and every counter, as one snapshot, with each store's pool use
    (the full KV's first). L1 pages requests own or the cache reserved count as the
    requests' tokens."""
    full, requests = cache.full.pages, cache.admitted
    tier = cache.l3.attached
    backend = None if tier is None else tier.controller.storage
    tree, device_pool, host_pool = full.tree, full.device_pool, full.host_pool
    held_device_pages = len(full.request_pages(requests)) + len(full.reserved)
    s = tree.stats()
    ps = tree.page_size
    host_only = in_tree = stored = 0
    for n in tree.iter_nodes():
        k = tree.num_pages(n)
        in_tree += k
        host_only += k if n.device is None else 0
        stored += k if n.stored else 0
    stats = CacheStats(
        page_size=ps,
        device_total_tokens=device_pool.num_pages * ps,
        device_cached_tokens=s.device_pages * ps,
        device_free_tokens=device_pool.allocator.free_pages * ps,
        device_evictable_tokens=s.evictable_device_pages * ps,
        device_request_tokens=held_device_pages * ps,
        host_total_tokens=0 if host_pool is None else host_pool.num_pages * ps,
        host_cached_tokens=s.host_pages * ps,
        host_free_tokens=0 if host_pool is None else host_pool.allocator.free_pages * ps,
        host_only_tokens=host_only * ps,
        nodes=s.nodes,
        counters=full.counters.snapshot(),
        storage=None if backend is None else backend.stats(),
        tree_tokens=in_tree * ps,
        l3_stored_tokens=stored * ps,
        restores=cache.restore_rates,
    )
    cached = _cached_tokens(device_pool)
    ps = cache.context.page_size
    usage = dataclasses.replace(
        _full_usage(device_pool, host_pool),
        device_requests=stats.device_request_tokens // ps,
        device_cached=stats.device_cached_tokens // ps,
        host_cached=stats.host_cached_tokens // ps,
    )
    return dataclasses.replace(stats, components=(usage, *cache.stores.usages(cached, requests)))


def _full_usage(device_pool: DevicePool, host_pool: HostPool | None) -> ComponentUsage:
    """Pool use and L1 bytes per cached token of the full KV (``"full"``); the component
    stores report their own (``ComponentStore.usage``) over the same cached tokens
    (:func:`_cached_tokens`)."""
    host = None if host_pool is None else host_pool.allocator
    page_bytes = device_pool.spec.token_bytes * device_pool.page_size
    return component_usage(
        "full", device_pool.allocator, host, page_bytes, _cached_tokens(device_pool)
    )


def _cached_tokens(device_pool: DevicePool) -> int:
    """Tokens whose full KV is in L1 (the tree's and the requests'): the denominator of
    every component's bytes per cached token."""
    return device_pool.allocator.used_pages * device_pool.page_size


def check_integrity(cache: HiCache, request_pages: Iterable[int] = ()) -> None:
    """Check tree and allocators agree: every used L1 page is owned by the tree, an
    admitted request, the reserved pages, a failed load's quarantine or
    ``request_pages`` (pages other callers hold), exactly once; every used L2 page is
    owned by the tree or held by an L3 op (or by a detached backend that may still write
    it); every component store's ids likewise. Raises AssertionError."""
    full, l3, names = cache.full.pages, cache.l3, cache.stores.names
    requests = cache.admitted
    host_held = l3.quarantined_host_pages()
    ids_held = l3.quarantined_component_ids(names)
    tree, host_pool = full.tree, full.host_pool
    device_owned = [*full.held_device_pages(requests), *request_pages]
    tree.check_integrity()
    check_owned("L1", full.device_pool.allocator, tree.device_page_ids() + device_owned)
    if host_pool is not None:
        check_owned("L2", host_pool.allocator, tree.host_page_ids() + list(host_held))
    cache.stores.check(requests, ids_held)


def tree_digest(cache: HiCache, *, exact: bool = False) -> str:
    """SHA-256 (hex) of the cache's tree structure, equal on ranks whose trees are the
    same.

    Covers every node (in a canonical order: tenant, then the path's tokens): its tenant,
    its path's tokens, which tiers hold its full KV (L1, L2), its pins (``lock_ref``,
    ``host_ref``), its ``hit_count`` and the names of the components with a value there.
    With ``exact``, also its L1 and L2 page ids, its logical access clock and its
    priority (what decides the ranks' next allocations and evictions, when no outside
    holder uses a pool: the engine's rank digest); without, a rank whose pool some outside
    holder uses (other ids for the same tree) still digests alike.
    """
    tree = cache.full.pages.tree
    rows: list[tuple[str, bytes, str]] = []
    for n in tree.iter_nodes():
        tiers = ("D" if n.device is not None else "-") + ("H" if n.host is not None else "-")
        extra = ",".join(sorted(n.extra or ()))
        state = f"{tiers}|{n.lock_ref}|{n.host_ref}|{n.hit_count}|{extra}"
        if exact:
            state += f"|{_ids(n.device)}|{_ids(n.host)}|{n.last_access}|{n.priority}"
        rows.append((n.tenant, tree.path_key(n), state))
    h = hashlib.sha256()
    for tenant, key, state in sorted(rows):
        for part in (tenant.encode(), key, state.encode()):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()


def _ids(ids: Iterable[int] | None) -> str:
    return "-" if ids is None else ",".join(str(int(i)) for i in ids)
