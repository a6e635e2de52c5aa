"""The L1 tier: the device pool of the full KV, allocation with eviction, reserved pages.

The L1 half of the full KV's :class:`~hicache.cache.full_pages.FullPages`, run on the cache's thread. Every L1 page of the full
KV is, at any time, exactly one of: free; the tree's (a node's ``device`` pages); a
caller's (pages :meth:`DeviceTier.alloc` gave it, until it inserts or frees them: an
admitted request's own pages); reserved (:meth:`DeviceTier.reserve`, out of circulation
until :meth:`DeviceTier.unreserve`); or quarantined by the host tier (a failed load's
pages a copy in flight may still use).

Eviction (:meth:`DeviceTier.evict`) walks the tree's L1 eviction order (unpinned leaves,
by policy): a node backed up in L2 is demoted to L2-only, the others are dropped, except
under ``write_back``, which backs a node up through the host tier just before evicting it.
The component values the tree releases with a node go back to their stores (the
component stores' list, a peer).
"""

from __future__ import annotations

from collections.abc import Iterable

from hicache.cache.components.stores import ComponentStores
from hicache.cache.host_tier import HostTier
from hicache.cache.no_host_tier import NoHostTier
from hicache.controller.policy import WriteRule
from hicache.memory import DevicePool, PageAllocator
from hicache.metrics import CacheCounters
from hicache.tree import HiRadixTree
from hicache.tree.components import Tier
from hicache.tree.node import PageIds, page_ids
from hicache.tree.results import NodeEviction

__all__ = ["DeviceTier"]


class DeviceTier:
    """L1 pages of the full KV for one cache.

    ``pool``: the L1 pool (the host tier copies to and from it too). ``host``: the L2 tier
    (:class:`NoHostTier` without the hierarchical cache); allocation waits for its backups
    (they pin their L1 sources) and ``write_back`` backs nodes up through it on eviction.
    ``stores``: the component stores, which take back the component ids the tree
    releases.
    """

    def __init__(
        self,
        *,
        tree: HiRadixTree,
        pool: DevicePool,
        rule: WriteRule,
        counters: CacheCounters,
        host: HostTier | NoHostTier,
        stores: ComponentStores,
    ) -> None:
        self.tree = tree
        self.pool = pool
        self.page_size = pool.page_size
        self.counters = counters
        self._host = host
        self._backup_on_evict = rule.backup_on_evict
        self._stores = stores
        self._reserved: list[int] = []
        """L1 pages taken out of circulation (:meth:`reserve`)."""

    @property
    def allocator(self) -> PageAllocator:
        return self.pool.allocator

    @property
    def pages(self) -> int:
        """Pages of the L1 pool less the reserved ones (the most one request can hold)."""
        return self.pool.num_pages - len(self._reserved)

    # ------------------------------------------------------------------ pages

    def alloc(self, num_pages: int) -> PageIds | None:
        """``num_pages`` free L1 pages, evicting unpinned cached pages if needed; None when
        even eviction cannot make room. The caller owns the pages until it inserts or
        frees them.

        Only when eviction cannot make room does it wait, and then only for the backups
        in flight (they pin their L1 sources until they land), never for loads: a load's
        chain stays pinned by its request when it lands, so waiting for it frees nothing,
        and a load may take as long as its forward. Records posted meanwhile are applied,
        failed loads excepted (the caller may be pinning their chain: the sync's
        re-entrancy rule applies them at its next sync)."""
        alloc = self.pool.allocator
        if alloc.free_pages < num_pages:
            self.evict(num_pages - alloc.free_pages)
        if alloc.free_pages < num_pages and self._host.wait_backups():
            self.evict(num_pages - alloc.free_pages)
        pages = alloc.alloc(num_pages)
        return None if pages is None else page_ids(pages)

    def free(self, pages: Iterable[int]) -> None:
        """Return caller-owned L1 pages (never pages the tree holds)."""
        self.pool.allocator.free(pages)

    # ------------------------------------------------------------------ reserved pages

    def reserve(self, num_pages: int) -> PageIds | None:
        """Take ``num_pages`` L1 pages out of circulation (allocated with eviction, like
        :meth:`alloc`) until :meth:`unreserve`; None when even eviction cannot free that
        many. No request and no tree node is ever given a reserved page."""
        pages = self.alloc(num_pages)
        if pages is not None:
            self._reserved.extend(pages)
        return pages

    def unreserve(self, pages: Iterable[int]) -> None:
        """Give reserved pages back to the allocator. ValueError for a page not reserved
        (nothing freed then)."""
        wanted = list(pages)
        left = list(self._reserved)
        for p in wanted:
            if p not in left:
                raise ValueError(f"L1 page {p} is not reserved (reserved: {self._reserved})")
            left.remove(p)
        self.pool.allocator.free(wanted)
        self._reserved = left

    @property
    def reserved(self) -> list[int]:
        """The L1 pages :meth:`reserve` took out of circulation."""
        return list(self._reserved)

    # ------------------------------------------------------------------ eviction

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` L1 pages if possible; returns pages freed.

        Backed-up leaves are demoted to L2-only; the others are dropped, except under
        ``write_back``, which backs them up first (and skips a node whose backup is still
        copying or failed: it stays pinned).
        """
        freed = 0
        for node in self.tree.device_eviction_order():
            if freed >= num_pages:
                break
            if node.host is None and self._backup_on_evict:
                self._host.back_up(node, 0, wait=True)
                if node.lock_ref > 0:  # still copying, or its backup failed: next one
                    continue
            demoted = node.host is not None
            pages = self._free_eviction(self.tree.evict_node_device(node))
            freed += len(pages)
            tokens = len(pages) * self.page_size
            if demoted:
                self.counters.device_demoted_tokens_total += tokens
            else:
                self.counters.device_evicted_tokens_total += tokens
        return freed

    def _free_eviction(self, ev: NodeEviction) -> PageIds:
        """Free what evicting one node from L1 released; returns its full pages."""
        self.pool.allocator.free(ev.full)
        self._stores.free(Tier.DEVICE, ev.components)
        return ev.full
