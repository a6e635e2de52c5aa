"""What the cache's tiers (L2, L3) and component stores tell their owner, given at
construction.

:class:`HostTier` (L1 <-> L2 copies) and the component stores run on the owner's thread
and call back into it for a few things only: apply the records the workers posted (when
they must wait for copies in flight), hand a run whose backup landed on to L3, fail the requests over a load that failed, let the
component stores back up what a hit there needs, return ids the tree released to their
stores' pools, and wait for backups in flight before evicting. :class:`TierEvents` is that
contract; :class:`hicache.cache.HiCache` gives one object implementing it to each tier and
store it builds, so nothing is patched in afterwards.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from hicache.tree import TreeNode
from hicache.tree.components import Tier
from hicache.tree.node import PageIds

__all__ = ["TierEvents"]


class TierEvents(Protocol):
    """The owner's side of the cache's tiers and stores (all called on its thread)."""

    def drain(self) -> object:
        """Apply every record the workers posted so far."""

    def backed_up(self, nodes: list[TreeNode]) -> None:
        """The L1 -> L2 copy of ``nodes`` (one path, top-down) landed: hand them to L3."""

    def backup_issued(self, last: TreeNode) -> None:
        """The full KV of the run ending at ``last`` got its L2 pages: the component stores
        back up what a hit there needs."""

    def free_components(self, tier: Tier, ids: Mapping[str, PageIds]) -> None:
        """Return ids the tree released, per component, to their stores' ``tier`` pools."""

    def fail_holders(self, top: TreeNode, reason: str) -> None:
        """A load into the chain under ``top`` failed (``reason``): mark failed and unpin
        every admitted request whose prefix runs through ``top`` (its pages were never
        written; the request's caller requeues it to recompute them)."""

    def wait_backups(self) -> bool:
        """Wait for the L1 -> L2 backups in flight, then apply every record posted (failed
        loads excepted: the owner's poll applies those); False when none was in flight.

        Not for loads: a backup pins what it copies (and the component values a hit at
        its run's end needs) until it is applied, so waiting for it may free values to
        evict; a load pins its chain for its request, which keeps the chain pinned when
        the load lands, so waiting for a load frees nothing and may take as long as that
        request's forward."""
