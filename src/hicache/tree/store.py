"""The nodes of one radix tree: roots per tenant, node ids, the logical clock, page counters.

:class:`NodeStore` is the structure the tree's parts work on (:mod:`~hicache.tree.paths`,
:mod:`~hicache.tree.match`, :mod:`~hicache.tree.insert`, :mod:`~hicache.tree.pins`,
:mod:`~hicache.tree.eviction`, :mod:`~hicache.tree.extras`): each is handed the store and
changes nodes through it. The store creates, links, splits and unlinks nodes, gives a node
its full-KV pages in a tier and takes them back, and keeps the counters of
:class:`~hicache.tree.results.TreeStats` in step with each of those changes (the one
counter it does not keep, ``protected_pages``, changes with the pins:
:class:`~hicache.tree.pins.Pins`). Pure Python: no torch, no threads, no IO.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from hicache.tokens import TOKEN_BYTES, TokenIds, encode_tokens
from hicache.tree.components import TreeComponent
from hicache.tree.node import PageIds, TreeNode, page_ids
from hicache.tree.residency import ResidencyObserver
from hicache.tree.results import TreeStats

__all__ = ["NodeStore"]


class NodeStore:
    """Every node of one tree and the counters over them.

    Attributes:
        page_size: tokens per page; every non-root node spans whole pages.
        page_bytes: bytes of one page of an encoded key (``page_size * TOKEN_BYTES``).
        components: every component, the full one first; a split moves each one's values.
        root: the shared root (tenant ``""``); never dropped.
        tenant_roots: each tenant's root by tenant, in order of first use. A tenant root
            lives only while it has children (see :meth:`drop_if_empty_root`).
        tick: the logical clock, advanced once per match or insert (by its walk,
            :meth:`Matcher.descend <hicache.tree.match.Matcher.descend>`); nodes record
            it as ``created`` / ``last_access``.
        device_pages: L1 pages over every node (``len(node.device)`` summed).
        host_pages: L2 pages over every node.
        protected_pages: L1 pages of nodes with ``lock_ref > 0`` (kept by the pins and by
            :meth:`assign_device` / :meth:`take_device`).
        num_nodes: non-root nodes.
        observer: told of each change of a node's residency (L1 or L2), or ``None``
            (the default: KV events off, the hooks cost one test each).
    """

    def __init__(self, page_size: int, components: Sequence[TreeComponent]) -> None:
        self.page_size = page_size
        self.page_bytes = page_size * TOKEN_BYTES
        self.components = tuple(components)
        self.observer: ResidencyObserver | None = None
        self.reset()

    def reset(self) -> None:
        """Drop every node and zero the counters (the owner frees the pages)."""
        if self.observer is not None:
            self.observer.cleared()
        self._next_id = 0
        self.tick = 0
        self.root = self._new_root("")
        self.tenant_roots: dict[str, TreeNode] = {}
        self.device_pages = 0
        self.host_pages = 0
        self.protected_pages = 0
        self.num_nodes = 0

    # ------------------------------------------------------------------ geometry

    def page_key(self, tokens: TokenIds) -> bytes:
        """``tokens`` encoded, cut to whole pages (a partial last page is dropped)."""
        key = encode_tokens(tokens)
        return key[: len(key) - len(key) % self.page_bytes]

    def num_pages(self, node: TreeNode) -> int:
        """Pages of ``node``'s span (0 for a root)."""
        return len(node.key) // self.page_bytes

    # ------------------------------------------------------------------ roots

    def root_of(self, tenant: str) -> TreeNode:
        """The root of ``tenant``'s subtree, created on first use (``""``: the shared one).

        Raises TypeError for a ``tenant`` that is not a ``str``."""
        if not isinstance(tenant, str):
            raise TypeError(f"tenant={tenant!r} is invalid; must be a str (a cache salt)")
        if not tenant:
            return self.root
        root = self.tenant_roots.get(tenant)
        if root is None:
            root = self.tenant_roots[tenant] = self._new_root(tenant)
        return root

    @property
    def roots(self) -> list[TreeNode]:
        """The shared root, then each tenant's."""
        return [self.root, *self.tenant_roots.values()]

    def drop_if_empty_root(self, node: TreeNode) -> None:
        """Forget ``node`` if it is a tenant root with no children (a match or an insert
        that stored nothing, or the eviction of its last child, leaves one)."""
        tenant = node.tenant
        if node.parent is None and not node.children and self.tenant_roots.get(tenant) is node:
            del self.tenant_roots[tenant]

    # ------------------------------------------------------------------ structure

    def add_leaf(
        self,
        parent: TreeNode,
        key: bytes,
        *,
        device: PageIds | None = None,
        host: PageIds | None = None,
        priority: int = 0,
    ) -> TreeNode:
        """Link a new leaf spanning ``key`` (whole pages, starting no child of ``parent``)
        under ``parent``, holding ``device`` / ``host`` pages (one per page, not aliased
        by the caller); counts its node and pages."""
        node = TreeNode(
            self._next_id, key, parent, device=device, host=host, tick=self.tick, priority=priority
        )
        self._next_id += 1
        node.tenant = parent.tenant
        parent.children[key[: self.page_bytes]] = node
        self.num_nodes += 1
        if device is not None:
            self.device_pages += len(device)
        if host is not None:
            self.host_pages += len(host)
        if self.observer is not None and (device is not None or host is not None):
            self.observer.resident(node)
        return node

    def split(self, child: TreeNode, at_page: int) -> TreeNode:
        """Split ``child`` after ``at_page`` pages (``0 < at_page < pages``); return the new
        head, ``child``'s new parent. The head copies the pins, the statistics, the
        tenant and the L3 mark; every component moves its values (:meth:`TreeComponent.split`)."""
        parent = child.parent
        n = self.num_pages(child)
        assert parent is not None and 0 < at_page < n
        cut = at_page * self.page_bytes
        head = self._new_node(child.key[:cut], parent, priority=child.priority)
        for comp in self.components:
            comp.split(head, child, at_page, n)
        head.lock_ref = child.lock_ref
        head.host_ref = child.host_ref
        head.hit_count = child.hit_count
        head.last_access = child.last_access
        head.created = child.created
        head.tenant = child.tenant
        head.stored = child.stored
        child.key = child.key[cut:]
        child.parent = head
        head.children[child.key[: self.page_bytes]] = child
        parent.children[head.key[: self.page_bytes]] = head
        self.num_nodes += 1
        if self.observer is not None:
            self.observer.split(head, child, at_page)
        return head

    def remove_leaf(self, node: TreeNode) -> None:
        """Unlink a leaf that holds no pages any more; drops its tenant root if emptied."""
        parent = node.parent
        assert parent is not None and not node.children
        assert node.device is None and node.host is None
        del parent.children[node.key[: self.page_bytes]]
        node.parent = None
        self.num_nodes -= 1
        self.drop_if_empty_root(parent)

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node but the roots, parents before children."""
        stack = [c for r in self.roots for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ------------------------------------------------------------------ full-KV tiers

    def assign_device(self, node: TreeNode, pages: PageIds) -> None:
        """Give an L1-evicted node its L1 pages (after a load back or a recompute)."""
        if node.device is not None:
            raise RuntimeError(f"{node!r} already has device pages")
        if node.parent is None or node.parent.device is None:
            raise RuntimeError(f"{node!r}: parent not in L1; load back top-down (contiguity)")
        if len(pages) != self.num_pages(node):
            raise ValueError(f"{node!r} needs {self.num_pages(node)} pages, got {len(pages)}")
        node.device = pages
        self.device_pages += len(pages)
        if node.lock_ref > 0:
            self.protected_pages += len(pages)
        if self.observer is not None and node.host is None:
            self.observer.resident(node)

    def assign_host(self, node: TreeNode, pages: PageIds) -> None:
        """Give a node its L2 pages (a backup was issued for it)."""
        if node.host is not None:
            raise RuntimeError(f"{node!r} already has host pages")
        if node.parent is None or node.parent.host is None:
            raise RuntimeError(f"{node!r}: parent not in L2; back up top-down (contiguity)")
        if len(pages) != self.num_pages(node):
            raise ValueError(f"{node!r} needs {self.num_pages(node)} pages, got {len(pages)}")
        node.host = pages
        self.host_pages += len(pages)
        if self.observer is not None and node.device is None:
            self.observer.resident(node)

    def take_device(self, node: TreeNode) -> PageIds:
        """Remove and return ``node``'s L1 pages (it must have some); no other checks."""
        pages = node.device
        assert pages is not None
        node.device = None
        self.device_pages -= len(pages)
        if node.lock_ref > 0:
            self.protected_pages -= len(pages)
        if self.observer is not None and node.host is None:
            self.observer.left(node)
        return pages

    def take_host(self, node: TreeNode) -> PageIds:
        """Remove and return ``node``'s L2 pages (it must have some); no other checks."""
        pages = node.host
        assert pages is not None
        node.host = None
        self.host_pages -= len(pages)
        if self.observer is not None and node.device is None:
            self.observer.left(node)
        return pages

    def stats(self) -> TreeStats:
        """The counters, as kept incrementally."""
        return TreeStats(
            nodes=self.num_nodes,
            device_pages=self.device_pages,
            host_pages=self.host_pages,
            protected_device_pages=self.protected_pages,
        )

    # ------------------------------------------------------------------ internals

    def _new_node(
        self,
        key: bytes,
        parent: TreeNode | None,
        *,
        device: PageIds | None = None,
        host: PageIds | None = None,
        priority: int = 0,
    ) -> TreeNode:
        node = TreeNode(
            self._next_id, key, parent, device=device, host=host, tick=self.tick, priority=priority
        )
        self._next_id += 1
        return node

    def _new_root(self, tenant: str) -> TreeNode:
        root = self._new_node(b"", None, device=page_ids(), host=page_ids())
        root.tenant = tenant
        return root
