"""Path-wise pins: ``lock_ref`` keeps a prefix in L1, ``host_ref`` keeps it in L2.

A pin on a node pins every ancestor too, so a node's count is at least the sum of its
children's, and a split can copy the count to the new head. Mixed into
:class:`~hicache.tree.radix.HiRadixTree`; pure Python.
"""

from __future__ import annotations

from collections.abc import Callable

from hicache.tree.components import Tier
from hicache.tree.node import TreeNode


class PathPins:
    """Pin and unpin a node and its ancestors (needs the tree's protected-page counter).

    ``lock_ref`` / ``host_ref`` are the full component's pins; each pin also pins every
    extra component's hit span at the node (``_pin_extras``), so an extra value a pinned
    hit needs is never evicted on its own."""

    _protected_pages: int
    _pin_extras: Callable[[TreeNode, Tier, int], None]
    """Pin (``delta`` +1) or unpin (-1) every extra component's span (from the tree)."""

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors in L1 (they are not evicted while pinned)."""
        self._pin_extras(node, Tier.DEVICE, 1)
        while node.parent is not None:
            if node.lock_ref == 0 and node.device is not None:
                self._protected_pages += len(node.device)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one :meth:`inc_lock_ref` on ``node``. Raises before changing anything if a
        count on the path would go negative."""
        self._check_path_ref(node, "lock_ref")
        self._pin_extras(node, Tier.DEVICE, -1)
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.device is not None:
                self._protected_pages -= len(node.device)
            assert node.parent is not None
            node = node.parent

    def inc_host_ref(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors in L2."""
        self._pin_extras(node, Tier.HOST, 1)
        while node.parent is not None:
            node.host_ref += 1
            assert node.parent is not None
            node = node.parent

    def dec_host_ref(self, node: TreeNode) -> None:
        """Undo one :meth:`inc_host_ref`; raises before changing anything on underflow."""
        self._check_path_ref(node, "host_ref")
        self._pin_extras(node, Tier.HOST, -1)
        while node.parent is not None:
            node.host_ref -= 1
            assert node.parent is not None
            node = node.parent

    def _check_path_ref(self, node: TreeNode, attr: str) -> None:
        n = node
        while n.parent is not None:
            if getattr(n, attr) <= 0:
                raise RuntimeError(f"{attr} underflow at {n!r} (unpinning a node not pinned)")
            assert n.parent is not None
            n = n.parent
