"""Walks along root-to-node paths: what to back up, what to load back, a run's nodes.

Mixed into :class:`~hicache.tree.radix.HiRadixTree`; read-only, pure Python.
"""

from __future__ import annotations

from hicache.tree.node import TreeNode


class PathQueries:
    """Path walks of the tree (needs ``_page_bytes`` from the tree)."""

    _page_bytes: int

    def nodes_to_back_up(self, node: TreeNode, *, min_hits: int = 0) -> list[TreeNode]:
        """Nodes on the path to ``node`` without an L2 copy, top-down, that may be backed up
        now: the run just below the backed-up prefix whose hit counts reach ``min_hits``."""
        path: list[TreeNode] = []
        while node.parent is not None and node.host is None:
            path.append(node)
            assert node.parent is not None
            node = node.parent
        path.reverse()
        run: list[TreeNode] = []
        for n in path:
            if n.hit_count < min_hits:
                break
            run.append(n)
        return run

    def host_only_path(self, node: TreeNode) -> list[TreeNode]:
        """The L1-evicted nodes on the path to ``node``, top-down (what a load back copies)."""
        path: list[TreeNode] = []
        while node.parent is not None and node.device is None:
            path.append(node)
            assert node.parent is not None
            node = node.parent
        path.reverse()
        return path

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
            left -= self._pages_of(node)
            node = node.parent
        if left < 0:
            raise ValueError(f"{num_pages} pages do not end on a node boundary")
        out.reverse()
        return out

    def path_key(self, node: TreeNode) -> bytes:
        """The encoded tokens from the root to the end of ``node``."""
        parts: list[bytes] = []
        while node.parent is not None:
            parts.append(node.key)
            assert node.parent is not None
            node = node.parent
        return b"".join(reversed(parts))

    def _pages_of(self, node: TreeNode) -> int:
        return len(node.key) // self._page_bytes
