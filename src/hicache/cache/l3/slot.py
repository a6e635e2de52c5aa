"""Where a cache's L3 tier attaches: one tier at a time, and the quarantine of backends
detached while they may still write.

:class:`L3Slot` holds its tier as an object, attached (:class:`~hicache.cache.l3.tier.L3Tier`)
or not (:class:`~hicache.cache.l3.tier.Detached`), so the cache calls its tier alike in
both states. Attaching starts a controller over the backend and serves the tier's two
parties to the sync; detaching finishes the writes (bounded), stops the threads, takes
the parties out and gives up their open ops. What a detached backend may still fill
stays quarantined until it says its host writes settled, on every rank (the slot is a
party with no ops of its own: it lifts that quarantine when the sync applies what it deferred).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from hicache.cache.components.stores import ComponentStores
from hicache.cache.host_tier import HostTier
from hicache.cache.l3.tier import DETACHED, Detached, L3Tier
from hicache.cache.no_host_tier import NoHostTier
from hicache.cache.quarantine import Quarantine
from hicache.cache.sync import CacheSync
from hicache.config import PrefetchConfig
from hicache.controller import Record
from hicache.controller.agreement import Verdict, Vote
from hicache.controller.rank_group import RankGroup
from hicache.controller.storage_controller import StorageController
from hicache.keys import Namespace
from hicache.metrics import CacheCounters
from hicache.storage.base import HiCacheStorage
from hicache.storage.negative import NegativeCache
from hicache.tree import HiRadixTree, TreeNode
from hicache.tree.components import Tier
from hicache.tree.node import PageIds

__all__ = ["L3Slot", "Retired"]

log = logging.getLogger("hicache.cache")

Retired = tuple[PageIds, Mapping[str, PageIds]]
"""What a detached backend may still write: L2 pages of the full KV and L2 ids per
component, freed once it settles."""


class L3Slot:
    """The L3 attachment of one cache (over its L2 tier ``host``; a :class:`NoHostTier`
    without L2: then nothing attaches, and its tier stays detached).

    ``sync``: the cache's owner of asynchronous results (the slot joins it as a party;
    every tier attached posts to its queue, numbers its ops from it and waits through
    it). ``stores``: the component stores, peers (their L3 codecs for a tier being
    attached; the L2 component ids a retired backend held go back to them).
    """

    def __init__(
        self,
        *,
        tree: HiRadixTree,
        host: HostTier | NoHostTier,
        counters: CacheCounters,
        sync: CacheSync,
        stores: ComponentStores,
    ) -> None:
        self._tree = tree
        self._host = host
        self._counters = counters
        self._sync = sync
        self._stores = stores
        self._ranks = sync.ranks
        self.tier: L3Tier | Detached = DETACHED
        """The tier: attached, or :data:`~hicache.cache.l3.tier.DETACHED`."""
        self._retired: Quarantine[HiCacheStorage, Retired] = Quarantine()
        sync.serve(self)

    @property
    def attached(self) -> L3Tier | None:
        """The attached tier (None: none attached)."""
        return self.tier if isinstance(self.tier, L3Tier) else None

    def attach(
        self,
        storage: HiCacheStorage,
        namespace: Namespace,
        prefetch: PrefetchConfig,
        ranks: RankGroup | None = None,
    ) -> L3Tier:
        """Start an L3 tier over ``storage`` (and its threads), agreeing over the cache's
        ranks (``ranks``, when given, must be that group: ValueError). Needs L2
        (ValueError); one at a time (RuntimeError); on failure nothing is attached and
        ``storage`` is closed."""
        host = self._host
        if not isinstance(host, HostTier):  # L3 is written from and read into L2 pages
            raise ValueError("an L3 storage backend needs the hierarchical cache (L2) enabled")
        mine = self._ranks
        if ranks is not None and (ranks.size, ranks.rank) != (mine.size, mine.rank):
            storage.close()
            raise ValueError(
                f"attach with rank {ranks.rank} of {ranks.size}, but the cache is rank"
                f" {mine.rank} of {mine.size}: build it with HiCache(..., ranks=)"
            )
        if self.attached is not None:
            raise RuntimeError("a storage backend is attached already; detach it first")
        codecs = self._stores.records()
        controller = StorageController(
            storage,
            host.pool,
            self._sync.completions,
            self._ranks,
            component_pools={c.name: c.pool for c in codecs},
            negative=(
                NegativeCache(prefetch.negative_ttl_s, prefetch.negative_max_entries)
                if prefetch.negative_ttl_s > 0
                else None
            ),
            announced_wait_s=prefetch.announced_wait_s,
        )
        try:
            controller.start()
        except BaseException:
            controller.close()
            storage.close()
            raise
        self._sync.restore_meter.forget_storage()  # what it measured was another L3's
        tier = L3Tier(
            controller=controller,
            namespace=namespace,
            prefetch=prefetch,
            tree=self._tree,
            host=host,
            counters=self._counters,
            sync=self._sync,
            components=codecs,
        )
        self.tier = tier
        host.l3_attached = True
        self._sync.serve(tier.prefetches, tier.writes)
        self._sync.serve_backups(tier.writes)
        return tier

    def detach(self, timeout_s: float | None = None) -> bool:
        """Finish pending L3 writes (at most ``timeout_s``; None: the sync's wait bound),
        stop the L3 threads, give up the tier's open ops (prefetches dropped), forget the
        tree's L3 marks and close the backend; what it may still write stays quarantined. False when none was
        attached. Detached also when closing the backend raises (the error then comes
        out)."""
        tier = self.tier
        if not isinstance(tier, L3Tier):
            return False
        tier.flush(self._sync.wait_timeout_s if timeout_s is None else timeout_s)
        self.tier = DETACHED  # detached whatever closing raises (the ranks agree on that)
        self._tree.clear_stored()  # the marks speak of the backend going away
        if isinstance(self._host, HostTier):
            self._host.l3_attached = False
        self._sync.serve_backups(None)
        try:
            tier.controller.close()
        finally:
            self._sync.leave(tier.prefetches, tier.writes)  # their records are dropped
            held, ids = tier.give_up()
            self._retire(tier.controller.storage, held, ids)
        return True

    def _retire(self, storage: HiCacheStorage, held: PageIds, ids: dict[str, PageIds]) -> None:
        """Quarantine what the detached backend ``storage`` may still write."""
        if len(held) or any(len(v) for v in ids.values()):
            log.warning(
                "%d L2 pages and %s L2 component ids stay quarantined until the old backend"
                " settles",
                len(held),
                {k: len(v) for k, v in ids.items()},
            )
            self._retired.hold(storage, (held, ids))

    def write_path(self, node: TreeNode) -> bool:
        """Write what L2 holds of the path to ``node`` and L3 does not, now
        (:meth:`~hicache.cache.l3.writes.Writes.write_path`; nothing while detached)."""
        return self.tier.writes.write_path(node)

    def back_up_added(self, node: TreeNode) -> None:
        """Component values were added at ``node``, whose full KV was in L2 already (no
        backup was issued with them): the stores copy them to L2 now, and the tier writes
        those copies to L3."""
        backed = self._stores.back_up(node)
        if backed:
            chosen = {id(n) for n in backed} | {id(node)}  # nodes of one path, ``node`` last
            path = self._tree.path_tail(node, self._tree.depth_pages(node))
            self.tier.writes.write_components([n for n in path if id(n) in chosen])

    # ------------------------------------------------------------------ the sync's party

    def claim(self, record: Record) -> bool:
        """No op of its own: the tier's parties keep their records."""
        return False

    def votes(self) -> list[Vote]:
        return []

    def apply_agreed(self, verdict: Verdict) -> bool:  # pragma: no cover - it votes on none
        raise AssertionError("the slot has no op in flight")

    def apply_deferred(self) -> None:
        """Free what each retired backend whose host writes have settled held (with
        several ranks: settled on every rank, so every rank's pools keep the same free
        pages; one all-reduce per retired backend, the same list on every rank)."""
        ranks = self._ranks
        for pages, ids in self._retired.lift(
            lambda s: bool(ranks.min(int(s.host_writes_settled(0.0))))
        ):
            assert isinstance(self._host, HostTier)  # a backend attached: over L2
            self._host.allocator.free(pages)
            self._stores.free(Tier.HOST, ids)

    # ------------------------------------------------------------------ holdings

    def quarantined_host_pages(self) -> list[int]:
        """L2 pages held by L3 ops and retired backends, not by the tree."""
        held = self.tier.prefetches.quarantined_host_pages()
        for pages, _ in self._retired:
            held += pages
        return held

    def quarantined_component_ids(self, names: Sequence[str]) -> dict[str, list[int]]:
        """L2 ids per component (``names``, and any a retired backend holds) held by L3
        ops and retired backends, not by the tree."""
        held = {name: self.tier.prefetches.quarantined_component_ids(name) for name in names}
        for _, ids in self._retired:
            for name, got in ids.items():
                held.setdefault(name, []).extend(got)
        return held
