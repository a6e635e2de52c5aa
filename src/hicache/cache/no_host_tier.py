"""The L2 tier of a cache without one (``enable_hierarchical_cache`` false).

:class:`NoHostTier` answers the :class:`~hicache.cache.host_tier.HostTier` calls the full
KV makes (:class:`~hicache.cache.full_pages.FullPages`, the L1 tier, the request verbs)
with what a cache without L2 does: it has no pool and adds no tier, backs nothing up (L1
eviction drops nodes), loads nothing back (a hit is what L1 holds), evicts nothing, and
never has a copy in flight. Holds no state.
"""

from __future__ import annotations

from collections.abc import Callable

from hicache.cache.host_tier import LoadBack
from hicache.cache.request import CacheRequest
from hicache.transfer import LayerProgress
from hicache.tree import MatchResult, TreeNode
from hicache.tree.components import Tier
from hicache.tree.node import PageIds

__all__ = ["NoHostTier"]


class NoHostTier:
    """No L2: every call of the host tier's, doing the no-L2 thing."""

    tiers: tuple[Tier, ...] = ()
    """The tiers it adds below L1: none."""
    pool: None = None
    """No L2 pool."""
    num_pages: int = 0
    """L2 pages in all: none."""

    def start(self) -> None:
        """No copy worker to start."""

    def close(self) -> None:
        """No copy worker to stop."""

    @property
    def backing_up(self) -> bool:
        """No L2: no copy to it."""
        return False

    def wait_idle(self) -> None:
        """No copy is ever in flight."""

    def wait_backups(self) -> bool:
        """No backup to wait for: False (eviction cannot free more by waiting)."""
        return False

    def loads_on(self, node: TreeNode) -> tuple[LayerProgress, ...]:
        """No load is ever in flight over any path."""
        return ()

    def back_up(self, node: TreeNode, min_hits: int, *, wait: bool) -> None:
        """Nowhere to back up to: the path stays L1-only (evicting it drops it)."""

    def load_back(
        self,
        match: MatchResult,
        req: CacheRequest | None,
        load: bool,
        alloc: Callable[[int], PageIds | None],
    ) -> LoadBack:
        """The hit is ``match``'s L1 part; nothing is loaded."""
        return LoadBack(match.last_device_node, match.device_pages, 0, ())

    def landed_end(self, node: TreeNode | None) -> TreeNode | None:
        """No L2 copy anywhere: None."""
        return None

    def serve_yields(self, yields: Callable[[int], int] | None) -> None:
        """No L2 eviction to yield to."""

    def evict(self, num_pages: int) -> int:
        """No L2 page to free: 0."""
        return 0

    def quarantined_device_pages(self) -> list[int]:
        """No failed load: no L1 page held back."""
        return []

    def reset(self) -> None:
        """No L2 page to free."""
