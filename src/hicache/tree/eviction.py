"""Eviction: which evictable leaf goes first under each policy, and the tree's eviction ops.

A policy maps a node to a sort key; the smallest key is evicted first. Ties break on the
node id (older node first), so eviction order is deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator

from hicache.config import EvictionPolicy
from hicache.tree.components import Tier
from hicache.tree.node import PageIds, TreeNode
from hicache.tree.results import NodeEviction

EvictionKey = Callable[[TreeNode], tuple[int, ...]]
NodePredicate = Callable[[TreeNode], bool]


def _lru(node: TreeNode) -> tuple[int, ...]:
    return (node.last_access, node.id)


def _lfu(node: TreeNode) -> tuple[int, ...]:
    return (node.hit_count, node.last_access, node.id)


def _fifo(node: TreeNode) -> tuple[int, ...]:
    return (node.created, node.id)


def _priority(node: TreeNode) -> tuple[int, ...]:
    return (node.priority, node.last_access, node.id)


_KEYS: dict[EvictionPolicy, EvictionKey] = {
    EvictionPolicy.LRU: _lru,
    EvictionPolicy.LFU: _lfu,
    EvictionPolicy.FIFO: _fifo,
    EvictionPolicy.PRIORITY: _priority,
}


def eviction_key(policy: EvictionPolicy) -> EvictionKey:
    """The sort key of ``policy``: least recently used, least frequently used (then LRU),
    first created, or lowest priority (then LRU)."""
    return _KEYS[EvictionPolicy(policy)]


def eviction_order(
    nodes: Iterable[TreeNode],
    key: EvictionKey,
    evictable: NodePredicate,
    evicted: NodePredicate,
) -> Iterator[TreeNode]:
    """Yield the ``evictable`` nodes among ``nodes`` smallest ``key`` first, lazily.

    The consumer evicts (or skips) each yielded node before asking for the next. When the
    yielded node is ``evicted`` afterwards, its parent is considered again, so a parent that
    became a leaf joins the order. Nodes whose state changed since they were queued are
    re-checked with ``evictable`` when popped.
    """
    heap = [(key(n), n.id, n) for n in nodes if evictable(n)]
    heapq.heapify(heap)
    while heap:
        _, _, node = heapq.heappop(heap)
        if not evictable(node):
            continue
        parent = node.parent  # before the yield: removing the node unlinks it
        yield node
        if evicted(node) and parent is not None and evictable(parent):
            heapq.heappush(heap, (key(parent), parent.id, parent))


class EvictionOps:
    """Eviction of the tree's leaves (mixed into :class:`~hicache.tree.radix.HiRadixTree`).

    Needs from the tree: its counters, its policy key, ``_page_bytes`` and ``iter_nodes``.
    """

    _page_bytes: int
    _device_pages: int
    _host_pages: int
    _protected_pages: int
    _num_nodes: int
    _evict_key: EvictionKey
    _cascade: Callable[[TreeNode, Tier], dict[str, PageIds]]
    _extra_values: Callable[[TreeNode, Tier], list[str]]

    def iter_nodes(self) -> Iterator[TreeNode]:
        raise NotImplementedError

    def _after_remove(self, parent: TreeNode) -> None:
        """Called once ``parent`` has lost a child (the tree drops emptied tenant roots)."""

    def _device_evictable(self, node: TreeNode) -> bool:
        return (
            node.parent is not None
            and node.device is not None
            and node.lock_ref == 0
            and all(c.device is None for c in node.children.values())
        )

    def _host_evictable(self, node: TreeNode) -> bool:
        return (
            node.parent is not None
            and node.device is None
            and node.host is not None
            and node.host_ref == 0
            and node.lock_ref == 0
            and not node.children
        )

    def device_eviction_order(self) -> Iterator[TreeNode]:
        """Unpinned L1 leaves (no child in L1) in policy order, lazily.

        The consumer evicts each yielded node with :meth:`evict_device` (or skips it)
        before asking for the next; a parent that becomes a leaf joins the order.
        """
        return eviction_order(
            self.iter_nodes(), self._evict_key, self._device_evictable, lambda n: n.device is None
        )

    def host_eviction_order(self) -> Iterator[TreeNode]:
        """Unpinned L2-only leaves in policy order, lazily (see :meth:`device_eviction_order`)."""
        return eviction_order(
            self.iter_nodes(), self._evict_key, self._host_evictable, lambda n: n.host is None
        )

    def _host_copy_droppable(self, node: TreeNode) -> bool:
        return (
            node.parent is not None
            and node.device is not None
            and node.host is not None
            and node.host_ref == 0
            and node.lock_ref == 0
            and all(c.host is None for c in node.children.values())
        )

    def host_copy_eviction_order(self) -> Iterator[TreeNode]:
        """Unpinned spans in L1 *and* L2 whose children have no L2 copy, in policy order,
        lazily: their L2 copy can go (:meth:`drop_host`) without losing any data."""
        return eviction_order(
            self.iter_nodes(), self._evict_key, self._host_copy_droppable, lambda n: n.host is None
        )

    def evict_device(self, node: TreeNode) -> PageIds:
        """Drop ``node``'s L1 copy and return its L1 page ids for the owner to free.

        A node backed up in L2 stays (host-only); one that is not is removed. Raises
        RuntimeError if an extra component has an L1 value on the node (those ids would
        be lost): use :meth:`evict_node_device`.
        """
        self._no_extra_values(node, Tier.DEVICE, "evict_node_device")
        return self.evict_node_device(node).full

    def evict_node_device(self, node: TreeNode) -> NodeEviction:
        """:meth:`evict_device` for every component: the node's full L1 pages and each
        extra component's L1 value (cascade), all for the owner to free."""
        if not self._device_evictable(node):
            raise RuntimeError(f"{node!r} is not an unpinned L1 leaf")
        pages = node.device
        assert pages is not None
        extra = self._cascade(node, Tier.DEVICE)
        node.device = None
        self._device_pages -= len(pages)
        if node.host is None:
            self._remove(node)
        return NodeEviction(pages, extra)

    def unmap_device(self, node: TreeNode) -> NodeEviction:
        """Take ``node``'s L1 copy out of the tree even while it is pinned, because its
        pages do not hold the span's KV (a load into them failed). The node must be in
        L2 (it stays, L2-only; its pins count on as for any node) and its children out
        of L1 (unmap bottom-up: contiguity). Returns the L1 pages and the extras' L1
        values (cascade) for the owner to free once no copy in flight uses them."""
        if node.parent is None or node.device is None or node.host is None:
            raise RuntimeError(f"{node!r} must be in L1 and L2 to unmap its L1 copy")
        if any(c.device is not None for c in node.children.values()):
            raise RuntimeError(f"{node!r} has children in L1 (contiguity)")
        pages = node.device
        extra = self._cascade(node, Tier.DEVICE)
        node.device = None
        self._device_pages -= len(pages)
        if node.lock_ref > 0:
            self._protected_pages -= len(pages)
        return NodeEviction(pages, extra)

    def evict_host(self, node: TreeNode) -> PageIds:
        """Remove an unpinned L2-only leaf and return its L2 page ids for the owner to free.

        Raises RuntimeError if an extra component has an L2 value on the node: use
        :meth:`evict_node_host`."""
        self._no_extra_values(node, Tier.HOST, "evict_node_host")
        return self.evict_node_host(node).full

    def evict_node_host(self, node: TreeNode) -> NodeEviction:
        """:meth:`evict_host` for every component (the extras' L2 values cascade)."""
        if not self._host_evictable(node):
            raise RuntimeError(f"{node!r} is not an unpinned L2-only leaf")
        pages = node.host
        assert pages is not None
        extra = self._cascade(node, Tier.HOST)
        node.host = None
        self._host_pages -= len(pages)
        self._remove(node)
        return NodeEviction(pages, extra)

    def drop_host(self, node: TreeNode) -> PageIds:
        """Forget ``node``'s L2 copy while it stays in L1 (a failed backup, or room for new
        backups); return the pages. Raises RuntimeError if an extra component has an L2
        value on the node: use :meth:`drop_node_host`."""
        self._no_extra_values(node, Tier.HOST, "drop_node_host")
        return self.drop_node_host(node).full

    def drop_node_host(self, node: TreeNode) -> NodeEviction:
        """:meth:`drop_host` for every component (the extras' L2 values go too)."""
        if node.host is None or node.device is None:
            raise RuntimeError(f"{node!r} must be in L1 and L2 to drop its L2 copy")
        if any(c.host is not None for c in node.children.values()):
            raise RuntimeError(f"{node!r} has backed-up children (contiguity)")
        pages = node.host
        extra = self._cascade(node, Tier.HOST)
        node.host = None
        self._host_pages -= len(pages)
        return NodeEviction(pages, extra)

    def _no_extra_values(self, node: TreeNode, tier: Tier, use: str) -> None:
        names = self._extra_values(node, tier)
        if names:
            raise RuntimeError(
                f"{node!r} has {', '.join(names)} values in {tier.value}; use {use}"
                " to get their ids too"
            )

    def _remove(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[node.key[: self._page_bytes]]
        node.parent = None
        self._num_nodes -= 1
        self._after_remove(parent)
