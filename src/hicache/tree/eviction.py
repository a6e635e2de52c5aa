"""Eviction order: which evictable leaf goes first under each policy.

A policy maps a node to a sort key; the smallest key is evicted first. Ties break on the
node id (older node first), so eviction order is deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator

from hicache.config import EvictionPolicy
from hicache.tree.node import TreeNode

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
