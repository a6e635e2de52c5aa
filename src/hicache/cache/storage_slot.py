"""Where a cache's L3 tier attaches: one :class:`StorageTier` at a time, and the
quarantine of backends detached while they may still write.

Owned by :class:`hicache.cache.HiCache` (only with its L2 tier: L3 reads and writes go
through L2) and run on its thread. :meth:`StorageSlot.attach` starts a
:class:`~hicache.controller.storage_controller.StorageController` over a backend and
builds the tier over it; :meth:`StorageSlot.detach` finishes the tier's writes (bounded),
stops its threads and gives up its open ops. The L2 pages and component ids a detached
backend may still fill (a read whose call overran its deadline) stay out of use, held by
a :class:`Retired` entry, until that backend says its host writes have settled
(:meth:`StorageSlot.settle`, at every poll of the owner).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hicache.cache.components.records import ComponentRecords
from hicache.cache.host_tier import HostTier
from hicache.cache.storage_tier import StorageTier
from hicache.config import PrefetchConfig
from hicache.controller import CompletionQueue
from hicache.controller.rank_group import RankGroup
from hicache.controller.storage_controller import StorageController
from hicache.keys import Namespace
from hicache.metrics import CacheCounters
from hicache.storage.base import HiCacheStorage
from hicache.tree import HiRadixTree
from hicache.tree.components import Tier
from hicache.tree.node import PageIds

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
    """The L3 attachment of one cache (over its L2 tier ``host``).

    ``records``: builds the component stores' L3 codecs for a tier being attached.
    ``drain``: the owner's poll (a tier waiting for its writes applies records with it).
    ``free_components``: returns L2 component ids to their stores once a retired backend
    settled. ``ranks``: the cache's tensor-parallel ranks, ``wait_until``: its agreed wait
    (both handed to every tier attached).
    """

    def __init__(
        self,
        *,
        tree: HiRadixTree,
        host: HostTier,
        completions: CompletionQueue,
        counters: CacheCounters,
        op_ids: itertools.count[int],
        drain: Callable[[], object],
        records: Callable[[], Sequence[ComponentRecords]],
        free_components: Callable[[Tier, Mapping[str, PageIds]], None],
        ranks: RankGroup | None = None,
        wait_until: Callable[[Callable[[], bool], float], bool] | None = None,
    ) -> None:
        self._tree = tree
        self._host = host
        self._completions = completions
        self._counters = counters
        self._op_ids = op_ids
        self._drain = drain
        self._records = records
        self._free_components = free_components
        self._ranks = ranks or RankGroup.single()
        self._wait_until = wait_until
        self.tier: StorageTier | None = None
        """The attached L3 tier (None: none attached)."""
        self._retired: list[Retired] = []

    def attach(
        self,
        storage: HiCacheStorage,
        namespace: Namespace,
        prefetch: PrefetchConfig,
    ) -> StorageTier:
        """Start an L3 tier over ``storage`` (and its threads), agreeing over the cache's
        ranks. One at a time (RuntimeError); on failure nothing is attached and
        ``storage`` is closed."""
        if self.tier is not None:
            raise RuntimeError("a storage backend is attached already; detach it first")
        codecs = list(self._records())
        controller = StorageController(
            storage,
            self._host.pool,
            self._completions,
            self._ranks,
            component_pools={c.name: c.pool for c in codecs},
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
            op_ids=self._op_ids,
            drain=self._drain,
            components=codecs,
            wait_until=self._wait_until,
        )
        return self.tier

    def detach(self, timeout_s: float) -> bool:
        """Finish pending L3 writes (at most ``timeout_s``), stop the L3 threads, give up
        the tier's open ops and close the backend; what it may still write stays
        quarantined (:class:`Retired`). False when none was attached."""
        tier = self.tier
        if tier is None:
            return False
        tier.flush(timeout_s)
        tier.controller.close()
        self.tier = None
        held, ids = tier.detach()
        if len(held) or any(len(v) for v in ids.values()):
            log.warning(
                "%d L2 pages and %s L2 component ids stay quarantined until the old backend"
                " settles",
                len(held),
                {k: len(v) for k, v in ids.items()},
            )
            self._retired.append(Retired(tier.controller.storage, held, ids))
        return True

    def settle(self) -> None:
        """Free what each retired backend whose host writes have settled held (with
        several ranks: settled on every rank, so every rank's pools keep the same free
        pages; one all-reduce per retired backend, the same list on every rank)."""
        if not self._retired:
            return
        keep: list[Retired] = []
        for r in self._retired:
            if self._ranks.min(int(r.storage.host_writes_settled(0.0))):
                self._host.allocator.free(r.pages)
                self._free_components(Tier.HOST, r.ids)
            else:
                keep.append(r)
        self._retired = keep

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
