"""The DSA indexer's keys (DeepSeek-V3.2): pages that share the full KV's page ids.

A sparse-attention layer scores every cached token with a small indexer and attends to
the top-k of them, so a prefix is usable only with the indexer keys of *every* one of its
tokens: the hit policy ALL_PAGES. A node's indexer value in a tier is one id per page
like the full KV's, and it is the *same* ids: where a node's full KV lies at L1 pages
``node.device`` its indexer keys lie at those pages of the indexer's L1 pool (likewise in
L2 with ``node.host``). The value only says that the keys are there: it is present or
absent (a node whose full KV reached a tier without its keys, say an L3 read of the KV
whose indexer records were missing), and never differs from the full KV's ids
(:meth:`IndexerKeys.check`).

Match: a node may end a match only if every node from the root down to it holds its
keys (in some tier; in L1 for an L1 hit). Pins, eviction and the access order are the
full KV's: the keys live and die with the full KV of their node (the tree's cascade drops
them with it), so this component has no pin counts and no eviction of its own.
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
