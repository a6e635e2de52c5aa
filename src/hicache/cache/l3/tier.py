"""An L3 tier as the slot holds it: :class:`L3Tier` while a backend is attached,
:class:`Detached` while none is.

An attached tier is its :class:`~hicache.controller.storage_controller.StorageController`
(the threads over the backend), this rank's keys (:class:`~hicache.cache.l3.keys.TierKeys`)
and its two parties of the cache's sync: the prefetches and the writes. A detached tier
answers the same calls the cache makes with nothing to do: no prefetch, ready at once,
nothing taken, nothing written, nothing held.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from hicache.cache.components.records import ComponentRecords
from hicache.cache.host_tier import HostTier
from hicache.cache.l3.keys import TierKeys
from hicache.cache.l3.prefetch import Prefetch
from hicache.cache.l3.prefetches import Prefetches
from hicache.cache.l3.writes import Writes
from hicache.cache.sync import CacheSync
from hicache.config import PrefetchConfig
from hicache.controller.storage_controller import StorageController
from hicache.keys import Namespace
from hicache.metrics import CacheCounters
from hicache.tree import HiRadixTree, TreeNode
from hicache.tree.node import PageIds, TokenIds

__all__ = ["DETACHED", "Detached", "L3Tier", "NoPrefetches", "NoWrites"]

log = logging.getLogger("hicache.cache")


class L3Tier:
    """An attached L3 tier of one cache (its parties join ``sync`` when the slot attaches
    it)."""

    def __init__(
        self,
        *,
        controller: StorageController,
        namespace: Namespace,
        prefetch: PrefetchConfig,
        tree: HiRadixTree,
        host: HostTier,
        counters: CacheCounters,
        sync: CacheSync,
        components: Sequence[ComponentRecords] = (),
    ) -> None:
        codecs = {c.name: c for c in components}
        self.controller = controller
        self.keys = TierKeys(
            storage=controller.storage,
            namespace=namespace,
            ranks=sync.ranks,
            page_size=host.page_size,
            components=tuple(codecs.values()),
        )
        self.prefetches = Prefetches(
            controller=controller,
            keys=self.keys,
            prefetch=prefetch,
            tree=tree,
            host=host,
            counters=counters,
            sync=sync,
            codecs=codecs,
        )
        self.writes = Writes(
            controller=controller,
            keys=self.keys,
            tree=tree,
            counters=counters,
            sync=sync,
            components=tuple(codecs.values()),
            mark=host.write_back_mark,
            announces=prefetch.announce_writes,
        )
        self._sync = sync

    @property
    def busy(self) -> bool:
        """Writes in flight, or quarantined pages a late read may still fill."""
        return len(self.writes) > 0 or self.prefetches.quarantined > 0

    def flush(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``, agreed: every rank gives up together) until every
        write has landed and every quarantine is lifted; False on timeout."""
        if not self._sync.wait_until(lambda: not self.busy, timeout_s):
            log.warning(
                "L3 flush timed out on some rank: %d writes pending, %d reads quarantined",
                len(self.writes),
                self.prefetches.quarantined,
            )
        return not self.busy

    def give_up(self) -> tuple[PageIds, dict[str, PageIds]]:
        """Give up every prefetch and write still open (after the controller closed):
        unpin what they pinned. Returns the L2 pages and, per component, the L2 ids that
        must stay quarantined until the backend's late writes settle."""
        held = self.prefetches.give_up()
        self.writes.give_up()
        return held


class NoPrefetches:
    """The prefetches of a detached tier: none."""

    def start(
        self, tokens: TokenIds, tenant: str, *, any_hit: bool = False, optional: bool = False
    ) -> Prefetch | None:
        return None

    def ready(self, p: Prefetch) -> bool:
        return True

    def take(self, p: Prefetch) -> int:
        return 0

    def quarantined_host_pages(self) -> list[int]:
        return []

    def quarantined_component_ids(self, name: str) -> list[int]:
        return []


class NoWrites:
    """The writes of a detached tier: none."""

    def announce(self, last: TreeNode) -> int:
        """Nothing is written, so nothing is announced: 0."""
        return 0

    def write_components(self, nodes: list[TreeNode]) -> None:
        """Nothing is written."""

    def write_path(self, node: TreeNode) -> bool:
        """Nothing can be written: False."""
        return False


class Detached:
    """No backend attached: every call the cache makes of a tier does nothing."""

    prefetches = NoPrefetches()
    writes = NoWrites()

    def flush(self, timeout_s: float) -> bool:
        return True


DETACHED = Detached()
"""The one detached tier (it holds nothing)."""
