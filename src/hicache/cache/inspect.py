"""Read-only views of the cache's parts: the stats snapshot, the integrity check and the
tree digest that tensor-parallel ranks compare."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from hicache.memory import DevicePool, HostPool, PageAllocator
from hicache.metrics import CacheCounters, CacheStats, ComponentUsage
from hicache.storage.base import HiCacheStorage
from hicache.tree import HiRadixTree


def cache_stats(
    tree: HiRadixTree,
    device_pool: DevicePool,
    host_pool: HostPool | None,
    counters: CacheCounters,
    storage: HiCacheStorage | None,
    *,
    held_device_pages: int,
) -> CacheStats:
    """Occupancy per tier in tokens; ``held_device_pages`` are L1 pages requests own or
    the cache reserved."""
    s = tree.stats()
    ps = tree.page_size
    host_only = sum(tree.num_pages(n) for n in tree.iter_nodes() if n.device is None)
    return CacheStats(
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
        counters=counters.snapshot(),
        storage=None if storage is None else storage.stats(),
    )


def component_usage(
    name: str,
    device: PageAllocator,
    host: PageAllocator | None,
    unit_bytes: int,
    cached_tokens: int,
) -> ComponentUsage:
    """:class:`ComponentUsage` of one component's pools; ``cached_tokens``: tokens whose
    full KV is in L1."""
    used = device.used_pages
    return ComponentUsage(
        name=name,
        device_used=used,
        device_total=device.num_pages,
        host_used=0 if host is None else host.used_pages,
        host_total=0 if host is None else host.num_pages,
        unit_bytes=unit_bytes,
        bytes_per_cached_token=used * unit_bytes / cached_tokens if cached_tokens else 0.0,
    )


def full_usage(device_pool: DevicePool, host_pool: HostPool | None) -> ComponentUsage:
    """Pool use and L1 bytes per cached token of the full KV (``"full"``); the component
    stores report their own (``ComponentStore.usage``) over the same cached tokens
    (:func:`cached_tokens`)."""
    host = None if host_pool is None else host_pool.allocator
    page_bytes = device_pool.spec.token_bytes * device_pool.page_size
    return component_usage(
        "full", device_pool.allocator, host, page_bytes, cached_tokens(device_pool)
    )


def cached_tokens(device_pool: DevicePool) -> int:
    """Tokens whose full KV is in L1 (the tree's and the requests'): the denominator of
    every component's bytes per cached token."""
    return device_pool.allocator.used_pages * device_pool.page_size


def check_cache_integrity(
    tree: HiRadixTree,
    device_pool: DevicePool,
    host_pool: HostPool | None,
    request_pages: Sequence[int],
    host_held: Sequence[int],
) -> None:
    """Check tree and allocators agree: every used L1 page is owned by the tree or listed
    in ``request_pages``, exactly once; every used L2 page is owned by the tree or listed
    in ``host_held`` (L3 ops), exactly once. Raises AssertionError."""
    tree.check_integrity()
    check_owned("L1", device_pool.allocator, tree.device_page_ids() + list(request_pages))
    if host_pool is not None:
        check_owned("L2", host_pool.allocator, tree.host_page_ids() + list(host_held))


def check_owned(tier: str, alloc: PageAllocator, owned: list[int]) -> None:
    """Every used page of ``alloc`` is in ``owned`` exactly once, and nothing more."""
    alloc.check_integrity()
    assert len(set(owned)) == len(owned), f"an {tier} page is owned twice"
    assert all(alloc.is_used(p) for p in owned), f"a free {tier} page is owned"
    assert len(owned) == alloc.used_pages, (
        f"{alloc.used_pages} {tier} pages used, {len(owned)} owned: leak"
    )


def tree_digest(tree: HiRadixTree, *, exact: bool = False) -> str:
    """SHA-256 (hex) of the tree's structure, equal on ranks whose trees are the same.

    Covers every node (in a canonical order: tenant, then the path's tokens): its tenant,
    its path's tokens, which tiers hold its full KV (L1, L2), its pins (``lock_ref``,
    ``host_ref``), its ``hit_count`` and the names of the components with a value there.
    With ``exact``, also its L1 and L2 page ids, its logical access clock and its
    priority (what decides the ranks' next allocations and evictions, when no outside
    holder uses a pool: the engine's rank digest); without, a rank whose pool some outside
    holder uses (other ids for the same tree) still digests alike.
    """
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
