"""Full-attention KV: the base component, one L1/L2 page id per page of every node.

Its values are the node's fast-path fields ``node.device`` / ``node.host``; its pins are
the node's path-wise ``lock_ref`` / ``host_ref``; its eviction is the node lifecycle
(:meth:`~hicache.tree.radix.HiRadixTree.evict_node_device`, ``evict_node_host``,
``drop_node_host``), which the tree runs because the tree keeps the page counters. A hit
needs every page of the path, so any node in the tree is a valid boundary in some tier,
and a node whose full KV is in L1 is one for an L1 hit.
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
from hicache.tree.node import PageIds, TreeNode

__all__ = ["FullComponent"]


class FullComponent(TreeComponent):
    """Full-attention KV pages (``node.device`` / ``node.host``)."""

    name: ClassVar[str] = "full"
    granularity: ClassVar[Granularity] = Granularity.PAGE
    base: ClassVar[bool] = True

    def get(self, node: TreeNode, tier: Tier) -> PageIds | None:
        return node.device if tier is Tier.DEVICE else node.host

    def set(self, node: TreeNode, tier: Tier, ids: PageIds | None) -> None:
        raise NotImplementedError(
            "full KV changes through the tree (assign_device/assign_host/evict_*), which "
            "keeps the page counters"
        )

    def validator(self, *, device_only: bool) -> MatchValidator:
        if device_only:
            return lambda node: node.device is not None
        return lambda node: node.device is not None or node.host is not None

    def hit_span(self, depth_pages: int, page_size: int) -> int:
        return depth_pages

    def touch(self, tree: PathAccess, node: TreeNode, tick: int) -> None:
        """No-op: the walk itself sets ``node.last_access`` on every node it passes."""

    def split(self, head: TreeNode, child: TreeNode, at_page: int, num_pages: int) -> None:
        if child.device is not None:
            head.device, child.device = child.device[:at_page], child.device[at_page:]
        if child.host is not None:
            head.host, child.host = child.host[:at_page], child.host[at_page:]

    def pin(self, tree: PathAccess, node: TreeNode, tier: Tier, delta: int) -> None:
        """No-op: ``lock_ref`` / ``host_ref`` (kept by the tree) are this component's pins."""

    def pinned(self, node: TreeNode, tier: Tier) -> bool:
        return (node.lock_ref if tier is Tier.DEVICE else node.host_ref) > 0

    def evictable(self, node: TreeNode, tier: Tier) -> bool:
        """Always False here: the tree's node eviction evicts full KV (leaves only)."""
        return False

    def take(self, node: TreeNode, tier: Tier) -> PageIds:
        raise NotImplementedError("full KV is evicted by the tree's evict_device/evict_host")

    def check(self, node: TreeNode, num_pages: int) -> None:
        for tier, ids in ((Tier.DEVICE, node.device), (Tier.HOST, node.host)):
            if ids is not None and len(ids) != num_pages:
                raise AssertionError(
                    f"full {tier.value} value of {node!r} has {len(ids)} pages, span has"
                    f" {num_pages}"
                )
