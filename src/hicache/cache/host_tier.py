"""L1 -> L2 backups issued, and finished L1<->L2 copies applied, on the owner's thread.

:func:`back_up` issues a backup; the cache records what each op id stands for
(:class:`PendingBackup`, :class:`PendingLoad`); when the controller reports the op done,
:func:`apply_completion` unpins its nodes, counts it, and passes a landed backup on to L3. A failed backup drops the L2 copies it was to
fill; a failed load cannot be repaired in place and raises.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hicache.transfer import Completion
from hicache.tree import TreeNode
from hicache.tree.node import page_ids

if TYPE_CHECKING:
    from hicache.cache import HiCache

log = logging.getLogger("hicache.cache")


@dataclass(slots=True)
class PendingBackup:
    """A run of spans being copied L1 -> L2: the last ``pages`` pages of the path to
    ``last``. Nodes of the run may split while it is in flight; the run stays the same."""

    last: TreeNode
    pages: int


@dataclass(slots=True)
class PendingLoad:
    """A chain being copied L2 -> L1, pinned in both tiers through ``node``."""

    node: TreeNode
    tokens: int


def apply_completion(cache: HiCache, c: Completion) -> None:
    """Apply one finished copy on the owner's thread: unpin, count, hand on to L3."""
    if c.op_id in cache._backups:
        b = cache._backups.pop(c.op_id)
        cache.tree.dec_lock_ref(b.last)
        nodes = cache.tree.path_tail(b.last, b.pages)
        if c.ok:
            cache.counters.backup_ops_total += 1
            cache.counters.backup_tokens_total += b.pages * cache.page_size
            cache.counters.backup_bytes_total += c.nbytes
            if cache.l3 is not None:
                cache.l3.on_host_backup(nodes)
        else:
            log.error("backup op %d failed: %s; dropping its L2 copies", c.op_id, c.error)
            cache.counters.backup_failures_total += 1
            _invalidate_host(cache, nodes[0])
    elif c.op_id in cache._loads:
        ld = cache._loads.pop(c.op_id)
        cache.tree.dec_lock_ref(ld.node)
        cache.tree.dec_host_ref(ld.node)
        if c.ok:
            cache.counters.load_ops_total += 1
            cache.counters.load_tokens_total += ld.tokens
            cache.counters.load_bytes_total += c.nbytes
        else:
            # Not recoverable in place: the L1 pages hold garbage. Fail loudly.
            cache.counters.load_failures_total += 1
            raise RuntimeError(f"load back op {c.op_id} failed: {c.error}")
    else:  # pragma: no cover - defensive
        log.warning("completion for unknown op %d ignored", c.op_id)


def _invalidate_host(cache: HiCache, top: TreeNode) -> None:
    """Drop the L2 copies of ``top``'s subtree (after a failed backup), bottom-up."""
    assert cache.host_pool is not None
    order: list[TreeNode] = []
    stack = [top]
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(c for c in n.children.values() if c.host is not None)
    for n in reversed(order):
        if n.host is None:
            continue
        if n.device is not None:
            pages = cache.tree.drop_host(n)
        elif n.host_ref == 0 and n.lock_ref == 0 and not n.children:
            pages = cache.tree.evict_host(n)
        else:
            log.error("cannot drop pinned L2 copy of %r", n)
            continue
        cache.host_pool.allocator.free(pages)


def back_up(cache: HiCache, node: TreeNode, min_hits: int, *, wait: bool) -> None:
    """Back up the not-yet-backed-up run of the path to ``node`` (top-down): pin its L1
    source, give it L2 pages, issue one copy; with ``wait``, apply it before returning."""
    assert cache.controller is not None
    nodes = cache.tree.nodes_to_back_up(node, min_hits=min_hits)
    if not nodes:
        return
    last = nodes[-1]
    cache.tree.inc_lock_ref(last)  # the L1 source must stay while it is copied
    try:
        num = sum(cache.tree.num_pages(n) for n in nodes)
        host_pages = cache.alloc_host(num)
    finally:
        cache.tree.dec_lock_ref(last)
    if host_pages is None:
        return  # L2 full of pinned data: the nodes stay L1-only
    device_pages = page_ids()
    offset = 0
    for n in nodes:
        k = cache.tree.num_pages(n)
        cache.tree.assign_host(n, host_pages[offset : offset + k])
        assert n.device is not None
        device_pages += n.device
        offset += k
    cache.tree.inc_lock_ref(last)
    op_id = cache.controller.backup(device_pages, host_pages)
    cache._backups[op_id] = PendingBackup(last, num)
    if wait:
        cache._wait_all()
