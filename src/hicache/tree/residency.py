"""The one hook through which the tree reports where its full-KV pages live.

A node is *resident* while it holds its full-KV pages in L1 or L2 (``device`` or ``host``
not ``None``). :class:`~hicache.tree.store.NodeStore`, the only code that gives a node
pages or takes them back, calls a :class:`ResidencyObserver` at each change of that
state, in the owner's thread; with no observer set the hook is one ``is None`` test.
By contiguity a node becomes resident only after its parent and stops being resident
only before it. Pure Python: no torch, no threads, no IO.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from hicache.tree.node import TreeNode

__all__ = ["ResidencyObserver"]


class ResidencyObserver(Protocol):
    """Told of every change of a node's residency on this instance (L1 or L2)."""

    def resident(self, node: TreeNode) -> None:
        """``node`` got its first tier (it holds ``device`` or ``host`` pages now)."""

    def left(self, node: TreeNode) -> None:
        """``node`` lost its last tier (neither ``device`` nor ``host`` any more)."""

    def split(self, head: TreeNode, child: TreeNode, at_page: int) -> None:
        """``child`` was split: ``head`` (new, ``child``'s parent now) took its first
        ``at_page`` pages with the same tiers."""

    def cleared(self) -> None:
        """Every node was dropped at once (the tree was reset)."""
