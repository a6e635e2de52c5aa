"""The full KV's pages and tiers as tools, tests and reports see them (``cache.full.pages``).

:class:`FullPages` holds the tree, the L1 half (:class:`~hicache.cache.device_tier.DeviceTier`)
and the L2 half (:class:`~hicache.cache.host_tier.HostTier`; without the hierarchical cache,
:class:`~hicache.cache.no_host_tier.NoHostTier`), and offers the page-level API over them:
``match_prefix`` (copies nothing), ``insert`` (caller-owned L1 pages to the tree, backed up
by policy), ``alloc`` / ``free`` (caller-owned L1 pages), ``reserve`` / ``unreserve`` (out
of circulation), ``evict_device`` / ``evict_host``, the pools, and the L1 pages held
outside the tree. The request verbs of :class:`~hicache.cache.full_kv.FullKVStore` run on
it. Every L1 page is free, the tree's, a caller's, reserved, or quarantined by the L2 half
(:mod:`hicache.cache.device_tier`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from hicache.cache.components.stores import ComponentStores
from hicache.cache.device_tier import DeviceTier
from hicache.cache.host_tier import HostTier
from hicache.cache.no_host_tier import NoHostTier
from hicache.cache.request import CacheRequest
from hicache.cache.sync import CacheSync
from hicache.config import CacheConfig
from hicache.controller.policy import WriteRule
from hicache.memory import DevicePool, HostPool, check_pool_sizes
from hicache.metrics import CacheCounters
from hicache.spec import KVSpec
from hicache.tree import HiRadixTree, InsertResult, MatchResult, TreeNode
from hicache.tree.components import ComponentValues, Tier
from hicache.tree.node import PageIds, TokenIds

__all__ = ["FullPages"]


class FullPages:
    """The full KV's tree, tiers and pools of one cache, page by page (see the module
    docstring).

    ``sync``: the cache's owner of asynchronous results (the L2 half reports to it);
    ``stores``: the component stores, peers (they take back ids the tree releases and
    back up what a hit needs when the full KV reaches L2).
    """

    def __init__(
        self,
        *,
        tree: HiRadixTree,
        config: CacheConfig,
        spec: KVSpec,
        device: torch.device,
        rule: WriteRule,
        counters: CacheCounters,
        sync: CacheSync,
        stores: ComponentStores,
        layer_hook: Callable[[int, int], None] | None = None,
    ) -> None:
        check_pool_sizes(config, spec, device)  # both pools fit, before either exists
        pool = DevicePool(spec, config.device_pages, config.page_size, device)
        self.tree = tree
        self.counters = counters
        """The cache's counters (every tier and store counts here)."""
        self._rule = rule
        self._stores = stores
        self.host: HostTier | NoHostTier = NoHostTier()
        """The L2 half: a :class:`HostTier` with the hierarchical cache, else none."""
        if config.enable_hierarchical_cache:
            self.host = HostTier(
                tree=tree,
                device_pool=pool,
                config=config,
                spec=spec,
                device=device,
                sync=sync,
                stores=stores,
                counters=counters,
                layer_hook=layer_hook,
            )
        self.device = DeviceTier(
            tree=tree, pool=pool, rule=rule, counters=counters, host=self.host, stores=stores
        )
        """The L1 half: its pool, allocation with eviction, reserved pages."""

    # ------------------------------------------------------------------ pools

    @property
    def device_pool(self) -> DevicePool:
        """The L1 pool."""
        return self.device.pool

    @property
    def host_pool(self) -> HostPool | None:
        """The L2 pool, with the hierarchical cache."""
        return self.host.pool

    @property
    def usable(self) -> int:
        """Pages of the L1 pool less the reserved ones (the most one request can hold)."""
        return self.device.pages

    # ------------------------------------------------------------------ tree

    def match_prefix(self, tokens: TokenIds, tenant: str = "") -> MatchResult:
        """The cached prefix of ``tokens`` in L1 and L2 (whole pages); copies nothing and
        applies nothing (the tree as of the cache's last sync). Waits for no load: L1
        pages a load in flight maps may still be arriving (:meth:`HostTier.loads_on`
        names those loads), and those of a load that failed since leave the tree at the
        next sync."""
        return self.tree.match_prefix(tokens, tenant)

    def insert(
        self,
        tokens: TokenIds,
        device_pages: Sequence[int] | PageIds,
        *,
        priority: int = 0,
        tenant: str = "",
        back_up: bool = True,
        components: dict[str, ComponentValues] | None = None,
    ) -> InsertResult:
        """Hand the L1 pages of ``tokens`` (whole pages) to the tree; back up by policy
        (unless ``back_up`` is False). Pages the tree already holds under other ids are
        freed here (the component stores free their duplicates). The caller keeps
        ownership of pages beyond the whole pages of ``tokens``."""
        result = self.tree.insert(
            tokens, device_pages, priority=priority, tenant=tenant, components=components or None
        )
        if result.duplicate_pages:
            self.device.free(result.duplicate_pages)
        self._stores.free(Tier.DEVICE, result.component_duplicates)
        if back_up:
            self.back_up(result.last_node)
        return result

    def back_up(self, node: TreeNode) -> None:
        """Back up the path to ``node`` to L2 as the write policy says (no wait)."""
        if self._rule.backup_min_hits is not None:
            self.host.back_up(node, self._rule.backup_min_hits, wait=False)

    # ------------------------------------------------------------------ L1 pages

    def alloc(self, num_pages: int) -> PageIds | None:
        """``num_pages`` free L1 pages, evicting unpinned cached pages if needed (waiting
        for backups, never for loads: :meth:`DeviceTier.alloc`); None when even eviction
        cannot make room. The caller owns the pages until it inserts or frees them."""
        return self.device.alloc(num_pages)

    def free(self, pages: Iterable[int]) -> None:
        """Return caller-owned L1 pages (never pages the tree holds)."""
        self.device.free(pages)

    def reserve(self, num_pages: int) -> PageIds | None:
        """Take ``num_pages`` L1 pages out of circulation for the caller's own writes (the
        scratch page that padding rows of a CUDA-graph decode batch write their K/V to)
        until :meth:`unreserve`; None when even eviction cannot free that many. No request
        and no tree node is ever given a reserved page: the allocator counts it used, a
        reset leaves it, the integrity check and the stats count it held, and
        :attr:`usable` no longer counts it."""
        return self.device.reserve(num_pages)

    def unreserve(self, pages: Iterable[int]) -> None:
        """Give reserved pages back. ValueError for a page not reserved (nothing freed)."""
        self.device.unreserve(pages)

    @property
    def reserved(self) -> list[int]:
        """The L1 pages :meth:`reserve` took out of circulation."""
        return self.device.reserved

    def request_pages(self, requests: Iterable[CacheRequest]) -> list[int]:
        """L1 pages ``requests`` own (not the tree's)."""
        return [p for r in requests for p in r.full.pages[r.full.prefix_pages :]]

    def held_device_pages(self, requests: Iterable[CacheRequest]) -> list[int]:
        """L1 pages held outside the tree: the ``requests``' own, the reserved ones, and
        a failed load's pages copies in flight may still use."""
        quarantined = self.host.quarantined_device_pages()
        return [*self.request_pages(requests), *self.device.reserved, *quarantined]

    # ------------------------------------------------------------------ eviction

    def evict_device(self, num_pages: int) -> int:
        """Free at least ``num_pages`` L1 pages if possible; returns pages freed.
        Backed-up leaves are demoted to L2-only; the others are dropped, except under
        ``write_back``, which backs them up first."""
        return self.device.evict(num_pages)

    def evict_host(self, num_pages: int) -> int:
        """Free at least ``num_pages`` L2 pages if possible; returns pages freed."""
        return self.host.evict(num_pages)
