"""Where a cache's L3 tier attaches: one :class:`StorageTier` at a time, and the
quarantine of backends detached while they may still write.

Built with the cache's L2 tier (L3 reads and writes go through L2) and run on the
cache's thread. :meth:`StorageSlot.attach` starts a
:class:`~hicache.controller.storage_controller.StorageController` over a backend and
builds the tier over it; :meth:`StorageSlot.detach` finishes the tier's writes (bounded),
stops its threads and gives up its open ops. The L2 pages and component ids a detached
backend may still fill (a read whose call overran its deadline) stay out of use, held by
a :class:`Retired` entry, until that backend says its host writes have settled
(:meth:`StorageSlot.settle`, at every sync).

The slot is the L3 party of the cache's :class:`~hicache.cache.sync.CacheSync` (it
registers when built): it hands the attached tier's votes, agreed records and landed
backups on, and drops the records of a detached tier's ops.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hicache.cache.components.stores import ComponentStores
from hicache.cache.host_tier import HostTier
from hicache.cache.prefetch import Prefetch
from hicache.cache.storage_tier import StorageTier
from hicache.cache.sync import CacheSync
from hicache.config import PrefetchConfig
from hicache.controller import Record
from hicache.controller.agreement import LocalRecords, Verdict, Vote
from hicache.controller.rank_group import RankGroup
from hicache.controller.storage_controller import StorageController
from hicache.keys import Namespace
from hicache.metrics import CacheCounters
from hicache.storage.base import HiCacheStorage
from hicache.storage.negative import NegativeCache
from hicache.tokens import encode_tokens
from hicache.transfer import Completion
from hicache.tree import HiRadixTree, TreeNode
from hicache.tree.components import Tier
from hicache.tree.node import PageIds, TokenIds

__all__ = ["Retired", "StorageSlot"]

log = logging.getLogger("hicache.cache")


@dataclass(frozen=True, slots=True)
class Retired:
    """A detached backend that may still write ``pages`` (L2 pages of the full KV) and
    ``ids`` (L2 ids per component): they are freed once it settles."""

    storage: HiCacheStorage
    pages: PageIds
    ids: Mapping[str, PageIds]


class StorageSlot:
    """The L3 attachment of one cache (over its L2 tier ``host``; None without L2: then
    nothing attaches, and every request-level call below is a no-op).

    ``sync``: the cache's owner of asynchronous results (the slot registers as its L3
    party; every tier attached posts to its queue, numbers its ops from it and waits
    through it). ``stores``: the component stores, peers (their L3 codecs for a tier
    being attached; the L2 component ids a retired backend held go back to them).
    """

    def __init__(
        self,
        *,
        tree: HiRadixTree,
        host: HostTier | None,
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
        self.tier: StorageTier | None = None
        """The attached L3 tier (None: none attached)."""
        self._retired: list[Retired] = []
        sync.serve_l3(self)

    def attach(
        self,
        storage: HiCacheStorage,
        namespace: Namespace,
        prefetch: PrefetchConfig,
        ranks: RankGroup | None = None,
    ) -> StorageTier:
        """Start an L3 tier over ``storage`` (and its threads), agreeing over the cache's
        ranks (``ranks``, when given, must be that group: ValueError). Needs L2
        (ValueError); one at a time (RuntimeError); on failure nothing is attached and
        ``storage`` is closed."""
        if self._host is None:
            raise ValueError("an L3 storage backend needs the hierarchical cache (L2) enabled")
        mine = self._ranks
        if ranks is not None and (ranks.size, ranks.rank) != (mine.size, mine.rank):
            storage.close()
            raise ValueError(
                f"attach_storage with rank {ranks.rank} of {ranks.size}, but the cache is rank"
                f" {mine.rank} of {mine.size}: build it with HiCache(..., ranks=)"
            )
        if self.tier is not None:
            raise RuntimeError("a storage backend is attached already; detach it first")
        codecs = self._stores.records()
        controller = StorageController(
            storage,
            self._host.pool,
            self._sync.completions,
            self._ranks,
            component_pools={c.name: c.pool for c in codecs},
            negative=(
                NegativeCache(prefetch.negative_ttl_s, prefetch.negative_max_entries)
                if prefetch.negative_ttl_s > 0
                else None
            ),
        )
        try:
            controller.start()
        except BaseException:
            controller.close()
            storage.close()
            raise
        self.tier = StorageTier(
            controller=controller,
            namespace=namespace,
            prefetch=prefetch,
            tree=self._tree,
            host=self._host,
            counters=self._counters,
            sync=self._sync,
            components=codecs,
        )
        return self.tier

    def detach(self, timeout_s: float) -> bool:
        """Finish pending L3 writes (at most ``timeout_s``), stop the L3 threads, give up
        the tier's open ops and close the backend; what it may still write stays
        quarantined (:class:`Retired`). False when none was attached. Detached also when
        closing the backend raises (the error then comes out)."""
        tier = self.tier
        if tier is None:
            return False
        tier.flush(timeout_s)
        self.tier = None  # detached whatever closing raises (the ranks agree on that)
        try:
            tier.controller.close()
        finally:
            self._sync.drop_l3()  # records of the detached tier's ops are dropped
            held, ids = tier.detach()
            self._retire(tier, held, ids)
        return True

    def _retire(self, tier: StorageTier, held: PageIds, ids: dict[str, PageIds]) -> None:
        """Quarantine what the detached ``tier``'s backend may still write."""
        if len(held) or any(len(v) for v in ids.values()):
            log.warning(
                "%d L2 pages and %s L2 component ids stay quarantined until the old backend"
                " settles",
                len(held),
                {k: len(v) for k, v in ids.items()},
            )
            self._retired.append(Retired(tier.controller.storage, held, ids))

    def settle(self) -> None:
        """Free what each retired backend whose host writes have settled held (with
        several ranks: settled on every rank, so every rank's pools keep the same free
        pages; one all-reduce per retired backend, the same list on every rank)."""
        if not self._retired:
            return
        keep: list[Retired] = []
        for r in self._retired:
            if self._ranks.min(int(r.storage.host_writes_settled(0.0))):
                assert self._host is not None  # a backend attached: over L2
                self._host.allocator.free(r.pages)
                self._stores.free(Tier.HOST, r.ids)
            else:
                keep.append(r)
        self._retired = keep

    # ------------------------------------------------------------------ requests

    def prefetch(self, tokens: TokenIds, tenant: str, compute_last: bool) -> Prefetch | None:
        """Start the L3 prefetch of a request that just arrived with ``tokens`` (the last
        one excluded with ``compute_last``); None when no tier is attached or nothing
        can be fetched."""
        if self.tier is None or len(tokens) <= int(compute_last):
            return None
        key = encode_tokens(tokens[: len(tokens) - int(compute_last)])
        return self.tier.start(key, tenant)  # metadata only: no copy waited on

    def ready(self, p: Prefetch) -> bool:
        """Whether the prefetch policy lets ``p``'s request in (as agreed at the last
        sync); True once the tier is detached (its prefetch was dropped)."""
        return self.tier is None or self.tier.ready(p)

    def take(self, p: Prefetch) -> int:
        """End ``p`` for its request (:meth:`StorageTier.take`); the tokens it added to
        the tree (0 once the tier is detached)."""
        return 0 if self.tier is None else self.tier.take(p)

    def write_components(self, nodes: list[TreeNode]) -> None:
        """Write the component values of ``nodes`` (one path) that a hit needs to L3."""
        if self.tier is not None:
            self.tier.write_components(nodes)

    def back_up_added(self, node: TreeNode) -> None:
        """Component values were added at ``node``, whose full KV was in L2 already (no
        backup was issued with them): the stores copy them to L2 now, and the attached
        tier writes those copies to L3."""
        backed = self._stores.back_up(node)
        if backed:
            chosen = {id(n) for n in backed} | {id(node)}  # nodes of one path, ``node`` last
            path = self._tree.path_tail(node, self._tree.depth_pages(node))
            self.write_components([n for n in path if id(n) in chosen])

    def flush(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``, agreed) for the attached tier's writes."""
        if self.tier is not None:
            self.tier.flush(timeout_s)

    # ------------------------------------------------------------------ the sync's party

    def keeps(self, record: Record) -> bool:
        """Whether ``record`` is of an op of the attached tier (a detached one's are not)."""
        tier = self.tier
        return not isinstance(record, Completion) and tier is not None and tier.owns(record.op_id)

    def votes(self, got: LocalRecords) -> list[Vote]:
        return [] if self.tier is None else self.tier.votes(got)

    def apply_agreed(self, verdict: Verdict, got: LocalRecords) -> bool:
        assert self.tier is not None  # a vote of it was agreed in this round
        return self.tier.apply_agreed(verdict, got)

    def on_host_backup(self, nodes: list[TreeNode]) -> None:
        """A run landed in L2: the attached tier writes it to L3."""
        if self.tier is not None:
            self.tier.on_host_backup(nodes)

    def held_host_pages(self) -> list[int]:
        """L2 pages held by L3 ops and retired backends, not by the tree."""
        held = [] if self.tier is None else self.tier.held_host_pages()
        for r in self._retired:
            held += r.pages
        return held

    def held_component_ids(self, names: Sequence[str]) -> dict[str, list[int]]:
        """L2 ids per component (``names``, and any a retired backend holds) held by L3
        ops and retired backends, not by the tree."""
        held: dict[str, list[int]] = {name: [] for name in names}
        if self.tier is not None:
            for name, got in held.items():
                got += self.tier.held_component_ids(name)
        for r in self._retired:
            for name, ids in r.ids.items():
                held.setdefault(name, []).extend(ids)
        return held
