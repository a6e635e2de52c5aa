"""The DSA indexer's keys (DeepSeek-V3.2): pages that share the full KV's page ids.

A sparse-attention layer attends to the top-k of every cached token's indexer scores, so a
prefix is usable only with the indexer keys of *every* one of its tokens: hit policy
ALL_PAGES. A node's indexer value in a tier is the *same* page ids as its full KV's
(``node.device`` in the indexer's L1 pool, ``node.host`` in L2): it only says the keys are
there, present or absent (the full KV may reach a tier without its keys, say an L3 read
whose indexer records were missing), never other ids (:meth:`IndexerKeys.check`). Match: a
node may end a match only if every node from the root down holds its keys (in some tier;
in L1 for an L1 hit). Pins, eviction and access order are the full KV's: the keys live
and die with their node's full KV (the tree's cascade), so no pins or eviction of its own.
"""

from __future__ import annotations

from typing import ClassVar

from hicache.tree.components.base import (
    Granularity,
    MatchValidator,
    PathAccess,
    Tier,
    TreeComponent,
)
from hicache.tree.node import TreeNode

__all__ = ["IndexerKeys"]


class IndexerKeys(TreeComponent):
    """Indexer key pages on the full KV's page ids (``Granularity.PAGE``, ALL_PAGES)."""

    name: ClassVar[str] = "indexer"
    granularity: ClassVar[Granularity] = Granularity.PAGE

    def validator(self, *, device_only: bool) -> MatchValidator:
        whole = True  # every node walked so far holds its keys

        def valid(node: TreeNode) -> bool:
            nonlocal whole
            whole = whole and self.present(node, device_only=device_only)
            return whole

        return valid

    def hit_span(self, depth_pages: int, page_size: int) -> int:
        """Every page of the path: a sparse layer may select any earlier token."""
        return depth_pages

    def touch(self, tree: PathAccess, node: TreeNode, tick: int) -> None:
        """No-op: the keys have no eviction order of their own."""

    def pin(self, tree: PathAccess, node: TreeNode, tier: Tier, delta: int) -> None:
        """No-op: the full KV's path-wise pins (``lock_ref`` / ``host_ref``) hold the keys,
        which never leave a tier while their node's full KV is there."""

    def pinned(self, node: TreeNode, tier: Tier) -> bool:
        return (node.lock_ref if tier is Tier.DEVICE else node.host_ref) > 0

    def evictable(self, node: TreeNode, tier: Tier) -> bool:
        """Always False: the keys leave a tier with their node's full KV only."""
        return False

    def check(self, node: TreeNode, num_pages: int) -> None:
        """The base checks, and: a value is the full KV's ids in that tier."""
        super().check(node, num_pages)
        for tier, full in ((Tier.DEVICE, node.device), (Tier.HOST, node.host)):
            ids = self.get(node, tier)
            assert ids is None or ids == full, (
                f"indexer {tier.value} ids of {node!r} are {list(ids)}, the full KV's"
                f" {None if full is None else list(full)}"
            )
