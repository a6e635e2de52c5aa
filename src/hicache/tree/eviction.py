"""Node eviction: which leaf goes first under each policy, and taking a node's pages back.

A policy maps a node to a sort key; the smallest key is evicted first. Ties break on the
node id (older node first), so eviction order is deterministic. Evicting a node's full KV
from a tier drops every extra component's value in that tier with it (the cascade: a
component value needs the full KV in its tier). Pure Python.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from hicache.config import EvictionPolicy
from hicache.tree.components import Tier, TreeComponent
from hicache.tree.node import PageIds, TreeNode
from hicache.tree.results import NodeEviction
from hicache.tree.store import NodeStore

__all__ = ["Eviction", "EvictionKey", "eviction_key", "eviction_order"]

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


class Eviction:
    """Eviction of ``store``'s leaves in the order of ``key``; ``extras`` (the extra
    components) cascade."""

    def __init__(self, store: NodeStore, extras: Sequence[TreeComponent], key: EvictionKey) -> None:
        self._store = store
        self._extras = tuple(extras)
        self._key = key

    # ------------------------------------------------------------------ orders

    def device_eviction_order(self) -> Iterator[TreeNode]:
        """Unpinned L1 leaves (no child in L1) in policy order, lazily.

        The consumer evicts each yielded node with :meth:`evict_device` (or skips it)
        before asking for the next; a parent that becomes a leaf joins the order.
        """
        return eviction_order(
            self._store.iter_nodes(), self._key, _device_evictable, lambda n: n.device is None
        )

    def host_eviction_order(self) -> Iterator[TreeNode]:
        """Unpinned L2-only leaves in policy order, lazily (see :meth:`device_eviction_order`)."""
        return eviction_order(
            self._store.iter_nodes(), self._key, _host_evictable, lambda n: n.host is None
        )

    def stored_host_eviction_order(self) -> Iterator[TreeNode]:
        """Unpinned L2-only leaves whose pages are in L3 (``stored``) in policy order,
        lazily: evicting them loses nothing L3 does not hold (the ``watermark`` policy
        takes them first)."""
        return eviction_order(
            self._store.iter_nodes(),
            self._key,
            lambda n: n.stored and _host_evictable(n),
            lambda n: n.host is None,
        )

    def host_eviction_forecast(self, released: Mapping[int, int]) -> Iterator[TreeNode]:
        """The L2-only nodes in the order :meth:`host_eviction_order` would yield them
        were each evicted as it comes, lazily; evicts nothing. ``released``: host pins by
        node id (``id(node)``) to disregard, those that end by themselves (L3 writes in
        flight): a node whose other pins hold it stays out, and so do its ancestors."""
        taken: set[int] = set()

        def evictable(n: TreeNode) -> bool:
            return (
                n.parent is not None
                and n.device is None
                and n.host is not None
                and n.lock_ref == 0
                and n.host_ref == released.get(id(n), 0)
                and all(id(c) in taken for c in n.children.values())
            )

        def evicted(n: TreeNode) -> bool:
            taken.add(id(n))
            return True

        return eviction_order(self._store.iter_nodes(), self._key, evictable, evicted)

    def host_copy_eviction_order(self) -> Iterator[TreeNode]:
        """Unpinned spans in L1 *and* L2 whose children have no L2 copy, in policy order,
        lazily: their L2 copy can go (:meth:`drop_node_host`) without losing any data."""
        return eviction_order(
            self._store.iter_nodes(), self._key, _host_copy_droppable, lambda n: n.host is None
        )

    # ------------------------------------------------------------------ evictions

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
        if not _device_evictable(node):
            raise RuntimeError(f"{node!r} is not an unpinned L1 leaf")
        extra = self._cascade(node, Tier.DEVICE)
        pages = self._store.take_device(node)
        if node.host is None:
            self._store.remove_leaf(node)
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
        extra = self._cascade(node, Tier.DEVICE)
        return NodeEviction(self._store.take_device(node), extra)

    def evict_host(self, node: TreeNode) -> PageIds:
        """Remove an unpinned L2-only leaf and return its L2 page ids for the owner to free.

        Raises RuntimeError if an extra component has an L2 value on the node: use
        :meth:`evict_node_host`."""
        self._no_extra_values(node, Tier.HOST, "evict_node_host")
        return self.evict_node_host(node).full

    def evict_node_host(self, node: TreeNode) -> NodeEviction:
        """:meth:`evict_host` for every component (the extras' L2 values cascade)."""
        if not _host_evictable(node):
            raise RuntimeError(f"{node!r} is not an unpinned L2-only leaf")
        extra = self._cascade(node, Tier.HOST)
        pages = self._store.take_host(node)
        self._store.remove_leaf(node)
        return NodeEviction(pages, extra)

    def drop_node_host(self, node: TreeNode) -> NodeEviction:
        """Forget ``node``'s L2 copy while it stays in L1 (a failed backup, or room for new
        backups): its full L2 pages and every extra component's L2 value, for the owner
        to free."""
        if node.host is None or node.device is None:
            raise RuntimeError(f"{node!r} must be in L1 and L2 to drop its L2 copy")
        if any(c.host is not None for c in node.children.values()):
            raise RuntimeError(f"{node!r} has backed-up children (contiguity)")
        extra = self._cascade(node, Tier.HOST)
        return NodeEviction(self._store.take_host(node), extra)

    def _cascade(self, node: TreeNode, tier: Tier) -> dict[str, PageIds]:
        """Drop every extra value of ``node`` in ``tier`` (its full KV leaves that tier)."""
        out: dict[str, PageIds] = {}
        for c in self._extras:
            if c.get(node, tier) is not None:
                out[c.name] = c.take(node, tier)
        return out

    def _no_extra_values(self, node: TreeNode, tier: Tier, use: str) -> None:
        names = [c.name for c in self._extras if c.get(node, tier) is not None]
        if names:
            raise RuntimeError(
                f"{node!r} has {', '.join(names)} values in {tier.value}; use {use}"
                " to get their ids too"
            )


def _device_evictable(node: TreeNode) -> bool:
    """An unpinned node in L1 with no child in L1 (an L1 leaf)."""
    return (
        node.parent is not None
        and node.device is not None
        and node.lock_ref == 0
        and all(c.device is None for c in node.children.values())
    )


def _host_evictable(node: TreeNode) -> bool:
    """An unpinned childless node in L2 only."""
    return (
        node.parent is not None
        and node.device is None
        and node.host is not None
        and node.host_ref == 0
        and node.lock_ref == 0
        and not node.children
    )


def _host_copy_droppable(node: TreeNode) -> bool:
    """An unpinned node in L1 and L2 with no child in L2."""
    return (
        node.parent is not None
        and node.device is not None
        and node.host is not None
        and node.host_ref == 0
        and node.lock_ref == 0
        and all(c.host is None for c in node.children.values())
    )
