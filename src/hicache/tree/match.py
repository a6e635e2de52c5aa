"""Prefix matching: the one walk down a key, and where a match may end on it.

:meth:`Matcher.descend` is the only walk from a root along a query's pages: it follows
children by their first page, splits the node in which the query diverges (so the walk
ends on a node boundary) and marks every node it passes as accessed. A match
(:meth:`Matcher.match`) runs it, then picks the deepest node every component accepts;
an insert (:mod:`~hicache.tree.insert`) runs it, then stores what follows. Pure Python.

Where a match may end: the full component accepts any node (every node is held by some
tier) and, for an L1 hit, a node whose full KV is in L1; each extra component's validator
(:meth:`TreeComponent.validator`) must accept it too. Validators are stateful over one
walk: each one sees every node walked, top-down. With no extra component to ask (a
full-KV tree, or :meth:`~hicache.tree.radix.HiRadixTree.match_full`) the ends follow
from the walk alone: its last node, and its last node in L1 (contiguity makes the L1
nodes a prefix of the walk).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hicache.tokens import TOKEN_BYTES, TokenIds
from hicache.tree.components import TreeComponent
from hicache.tree.node import TreeNode, common_prefix_bytes, page_ids
from hicache.tree.paths import Paths
from hicache.tree.results import MatchResult, MatchStop
from hicache.tree.store import NodeStore

__all__ = ["Descent", "Matcher"]


@dataclass(slots=True)
class Descent:
    """What one walk down a key found (read once by the walk's caller; not frozen, as it
    is made on every match and insert).

    ``nodes`` are the nodes passed, top-down; the last one ends exactly where the cached
    prefix of the key does. ``last`` is that node, or the root when none was passed.
    ``end`` is the bytes of the key they cover (whole pages). ``stop`` says why the walk
    ended there.
    """

    nodes: list[TreeNode]
    last: TreeNode
    end: int
    stop: MatchStop


class Matcher:
    """Matches keys against the nodes of ``store``; ``paths`` serves the components."""

    def __init__(self, store: NodeStore, paths: Paths) -> None:
        self._store = store
        self._paths = paths
        self._page_bytes = store.page_bytes

    def descend(self, root: TreeNode, key: bytes) -> Descent:
        """Walk from ``root`` along ``key`` (whole pages) as far as it is cached.

        One access: advances the store's clock and sets every passed node's
        ``last_access`` to it. Splits the node in which ``key`` diverges or ends, so the
        walk ends on a node boundary."""
        pb = self._page_bytes
        store = self._store
        store.tick += 1
        tick = store.tick
        nodes: list[TreeNode] = []
        node = root
        pos = 0
        end = len(key)
        stop = MatchStop.END_OF_KEY
        while pos < end:
            child = node.children.get(key[pos : pos + pb])
            if child is None:
                stop = MatchStop.NO_CHILD
                break
            klen = len(child.key)
            diverged = False
            if key[pos : pos + klen] != child.key:
                klen = common_prefix_bytes(key[pos:], child.key, pb)
                child = store.split(child, klen // pb)
                diverged = pos + klen < end
            child.last_access = tick
            nodes.append(child)
            pos += klen
            node = child
            if diverged:
                stop = MatchStop.DIVERGED
                break
        return Descent(nodes, node, pos, stop)

    def within(self, key: bytes, tenant: str) -> TreeNode | None:
        """The deepest node whose path is a prefix of ``key`` (whole pages): the end of
        the spans a cached sequence still has, found without a split, a clock tick or a
        new tenant root (a look, not an access). None when nothing of it is cached."""
        store = self._store
        node = store.root if not tenant else store.tenant_roots.get(tenant)
        if node is None:
            return None
        pos, pb = 0, self._page_bytes
        while pos < len(key):
            child = node.children.get(key[pos : pos + pb])
            if child is None or key[pos : pos + len(child.key)] != child.key:
                break
            pos += len(child.key)
            node = child
        return node if node.parent is not None else None

    def match(self, tokens: TokenIds, tenant: str, extras: Sequence[TreeComponent]) -> MatchResult:
        """The longest prefix of ``tokens`` that may end a match under the full component
        and every one of ``extras`` (none: full KV alone), in any tier and in L1 only.

        Splits and marks like :meth:`descend`; refreshes each extra component's own LRU on
        what a hit at either end needs (:meth:`TreeComponent.touch`). A tenant root that
        the walk created for nothing is dropped again."""
        store = self._store
        root = store.root_of(tenant)
        walk = self.descend(root, store.page_key(tokens))
        if walk.last.parent is None:
            store.drop_if_empty_root(walk.last)  # a miss must not keep a tenant root alive
        if extras:
            return self._validated(root, walk, extras)
        # full KV alone: the walk's last node, and its last in L1 (the L1 nodes lead)
        device_pages = page_ids()
        last_device = root
        for node in walk.nodes:
            if node.device is None:
                break
            device_pages += node.device
            last_device = node
        device_tokens = len(device_pages) * store.page_size
        return MatchResult(
            device_pages=device_pages,
            last_device_node=last_device,
            last_host_node=walk.last,
            device_tokens=device_tokens,
            host_tokens=walk.end // TOKEN_BYTES - device_tokens,
            stop=walk.stop,
        )

    def _validated(
        self, root: TreeNode, walk: Descent, extras: Sequence[TreeComponent]
    ) -> MatchResult:
        """:meth:`match` on ``walk`` from ``root`` with the ``extras``' validators: the
        deepest node they all accept (in any tier; in L1 only for the L1 part)."""
        any_ok = [c.validator(device_only=False) for c in extras]
        dev_ok = [c.validator(device_only=True) for c in extras]
        best_any = best_dev = root
        device_pages = page_ids()
        n_dev = 0  # device pages up to best_dev
        pos = pos_any = 0  # bytes of the key up to the node / up to best_any
        limited_by: str | None = None  # the first extra rejecting the node
        for node in walk.nodes:
            pos += len(node.key)
            oks = [v(node) for v in any_ok]  # every validator sees every node
            devs = [v(node) for v in dev_ok]
            if node.device is not None:
                device_pages += node.device
                if all(devs):
                    best_dev, n_dev = node, len(device_pages)
            limited_by = None if all(oks) else extras[oks.index(False)].name
            if limited_by is None:
                best_any, pos_any = node, pos
        tick = self._store.tick  # the walk's
        for c in extras:
            c.touch(self._paths, best_any, tick)
            if best_dev is not best_any:
                c.touch(self._paths, best_dev, tick)
        device_tokens = n_dev * self._store.page_size
        return MatchResult(
            device_pages=device_pages[:n_dev],
            last_device_node=best_dev,
            last_host_node=best_any,
            device_tokens=device_tokens,
            host_tokens=pos_any // TOKEN_BYTES - device_tokens,
            stop=walk.stop,
            limited_by=limited_by,
        )
