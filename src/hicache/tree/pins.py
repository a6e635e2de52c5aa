"""Path-wise pins: ``lock_ref`` keeps a prefix in L1, ``host_ref`` keeps it in L2.

A pin on a node pins every ancestor too, so a node's count is at least the sum of its
children's, and a split can copy the count to the new head. ``lock_ref`` / ``host_ref``
are the full component's pins; each pin also pins every extra component's hit span at
the node (:meth:`TreeComponent.pin`), so an extra value a pinned hit needs is never
evicted on its own. Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.tree.components import Tier, TreeComponent
from hicache.tree.node import TreeNode
from hicache.tree.paths import Paths
from hicache.tree.store import NodeStore

__all__ = ["Pins"]


class Pins:
    """Pin and unpin paths of ``store``'s nodes, and the ``extras``' hit spans with them
    (``paths`` serves the extras' rules). Keeps ``store.protected_pages``."""

    def __init__(self, store: NodeStore, paths: Paths, extras: Sequence[TreeComponent]) -> None:
        self._store = store
        self._paths = paths
        self._extras = tuple(extras)

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors in L1 (they are not evicted while pinned)."""
        self._pin_extras(node, Tier.DEVICE, 1)
        store = self._store
        while node.parent is not None:
            if node.lock_ref == 0 and node.device is not None:
                store.protected_pages += len(node.device)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one :meth:`inc_lock_ref` on ``node``. Raises before changing anything if a
        count on the path would go negative."""
        _check_path_ref(node, "lock_ref")
        self._pin_extras(node, Tier.DEVICE, -1)
        store = self._store
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.device is not None:
                store.protected_pages -= len(node.device)
            node = node.parent

    def inc_host_ref(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors in L2."""
        self._pin_extras(node, Tier.HOST, 1)
        while node.parent is not None:
            node.host_ref += 1
            node = node.parent

    def dec_host_ref(self, node: TreeNode) -> None:
        """Undo one :meth:`inc_host_ref`; raises before changing anything on underflow."""
        _check_path_ref(node, "host_ref")
        self._pin_extras(node, Tier.HOST, -1)
        while node.parent is not None:
            node.host_ref -= 1
            node = node.parent

    def _pin_extras(self, node: TreeNode, tier: Tier, delta: int) -> None:
        """Add ``delta`` to every extra component's ``tier`` pins of a hit at ``node``."""
        for c in self._extras:
            c.pin(self._paths, node, tier, delta)


def _check_path_ref(node: TreeNode, attr: str) -> None:
    """Raise RuntimeError if ``attr`` is not positive on every node of the path to ``node``."""
    n = node
    while n.parent is not None:
        if getattr(n, attr) <= 0:
            raise RuntimeError(f"{attr} underflow at {n!r} (unpinning a node not pinned)")
        n = n.parent
