"""Walks along root-to-node paths: depths, a path's last pages, what to back up or load back.

:class:`Paths` is what the components may ask of the tree
(:class:`~hicache.tree.components.PathAccess`); its one mutating walk,
:meth:`Paths.ensure_boundary`, only splits (every invariant holds across a split). Pure
Python.
"""

from __future__ import annotations

from collections.abc import Callable

from hicache.tree.node import TreeNode
from hicache.tree.store import NodeStore

__all__ = ["Paths"]


class Paths:
    """Path walks over the nodes of ``store`` (implements ``PathAccess``)."""

    def __init__(self, store: NodeStore) -> None:
        self._store = store
        self.page_size = store.page_size
        self._page_bytes = store.page_bytes

    def num_pages(self, node: TreeNode) -> int:
        """Pages of ``node``'s span (0 for a root)."""
        return len(node.key) // self._page_bytes

    def depth_pages(self, node: TreeNode) -> int:
        """Pages from the root to the end of ``node`` (0 for a root)."""
        pages = 0
        while node.parent is not None:
            pages += self.num_pages(node)
            node = node.parent
        return pages

    def path_tail(self, node: TreeNode, num_pages: int) -> list[TreeNode]:
        """The nodes holding the last ``num_pages`` pages of the path to ``node``, top-down.

        ``num_pages`` must end on a node boundary (true of any run recorded as nodes: splits
        only add boundaries)."""
        out: list[TreeNode] = []
        left = num_pages
        while left > 0:
            if node.parent is None:
                raise ValueError(f"the path has fewer than {num_pages} pages")
            out.append(node)
            left -= self.num_pages(node)
            node = node.parent
        if left < 0:
            raise ValueError(f"{num_pages} pages do not end on a node boundary")
        out.reverse()
        return out

    def mark_stored(self, node: TreeNode, num_pages: int) -> int:
        """Mark the nodes wholly inside the last ``num_pages`` pages of the path to ``node``
        as in L3 (``stored``); a node reaching above them stays as it is. Returns the
        pages marked."""
        marked = 0
        while node.parent is not None and marked + self.num_pages(node) <= num_pages:
            node.stored = True
            marked += self.num_pages(node)
            node = node.parent
        return marked

    def path_key(self, node: TreeNode) -> bytes:
        """The encoded tokens from the root to the end of ``node``."""
        parts: list[bytes] = []
        while node.parent is not None:
            parts.append(node.key)
            node = node.parent
        return b"".join(reversed(parts))

    def ensure_boundary(self, node: TreeNode, pages_back: int) -> None:
        """Split the path so that a node boundary lies ``pages_back`` pages above the end
        of ``node`` (nothing to do on a boundary, at or beyond the root)."""
        left = pages_back
        while left > 0 and node.parent is not None:
            n = self.num_pages(node)
            if n > left:
                self._store.split(node, n - left)
                return
            left -= n
            node = node.parent

    def node_at(self, last: TreeNode, pages_back: int) -> TreeNode:
        """The node ending ``pages_back`` pages above the end of ``last`` (splits so one
        does; the root when that is the path's start)."""
        self.ensure_boundary(last, pages_back)
        node = last
        while pages_back > 0:
            pages_back -= self.num_pages(node)
            assert node.parent is not None and pages_back >= 0
            node = node.parent
        return node

    def nodes_to_back_up(self, node: TreeNode, *, min_hits: int = 0) -> list[TreeNode]:
        """Nodes on the path to ``node`` without an L2 copy, top-down, that may be backed up
        now: the run just below the backed-up prefix whose hit counts reach ``min_hits``."""
        run: list[TreeNode] = []
        for n in self._below(node, lambda n: n.host is not None):
            if n.hit_count < min_hits:
                break
            run.append(n)
        return run

    def host_only_path(self, node: TreeNode) -> list[TreeNode]:
        """The L1-evicted nodes on the path to ``node``, top-down (what a load back copies)."""
        return self._below(node, lambda n: n.device is not None)

    def count_hit(self, node: TreeNode) -> None:
        """One more request reused the path to ``node``: add a hit to it and each
        ancestor (``write_through_selective`` and ``lfu`` read the counts)."""
        while node.parent is not None:
            node.hit_count += 1
            node = node.parent

    @staticmethod
    def _below(node: TreeNode, held: Callable[[TreeNode], bool]) -> list[TreeNode]:
        """The nodes on the path to ``node`` below its deepest ``held`` ancestor (or the
        root), top-down; empty when ``node`` itself is ``held``."""
        path: list[TreeNode] = []
        while node.parent is not None and not held(node):
            path.append(node)
            node = node.parent
        path.reverse()
        return path
