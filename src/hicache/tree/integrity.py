"""The tree's invariant checker, kept apart from the hot paths.

It reads the node store (roots, page size, components and incremental counters), so it
imports neither :mod:`~hicache.tree.radix` nor any of the tree's other parts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from hicache.tree.components import Tier, TreeComponent
from hicache.tree.node import PageIds, TreeNode
from hicache.tree.results import TreeStats
from hicache.tree.store import NodeStore


def check_tree(store: NodeStore) -> TreeStats:
    """Check every invariant of :mod:`hicache.tree.radix`; raise AssertionError on the first
    violation, naming the node. The store's incremental counters must equal the stats
    recomputed from scratch, which are returned.

    Besides the per-node invariants: the shared root has tenant ``""``; each tenant root is
    registered under its own tenant and has at least one child (empty ones are pruned).
    Every component checks its own values on every node (:meth:`TreeComponent.check`),
    and each extra component's ids in a tier are owned by one node only.
    """
    _check_roots(store.root, store.tenant_roots)
    tally = _Tally()
    known = {c.name for c in store.components}
    for node in store.iter_nodes():
        n_pages = _check_shape(node, store.page_bytes)
        tally.add(node, n_pages)
        _check_pins(node)
        for comp in store.components:
            comp.check(node, n_pages)
        assert not node.extra or known.issuperset(node.extra), (
            f"{node!r}: values of unknown components"
        )
    recomputed = tally.stats()
    counted = store.stats()
    assert recomputed == counted, f"counters {counted} != recomputed {recomputed}"
    extras = [c for c in store.components if not c.base]
    _check_component_ids(store.iter_nodes, extras)
    return recomputed


def _check_roots(shared_root: TreeNode, tenant_roots: Mapping[str, TreeNode]) -> None:
    for root in (shared_root, *tenant_roots.values()):
        assert root.parent is None and not root.device and not root.host, "root corrupted"
    assert shared_root.tenant == "", f"the shared root has tenant {shared_root.tenant!r}"
    for tenant, root in tenant_roots.items():
        assert tenant and root.tenant == tenant, f"tenant {tenant!r} maps to {root.tenant!r}"
        assert root.children, f"tenant {tenant!r} has an empty root (not pruned)"


def _check_shape(node: TreeNode, page_bytes: int) -> int:
    """Check where ``node`` sits and that it is held; return its pages."""
    parent = node.parent
    assert parent is not None, f"{node!r} has no parent"
    n_pages = len(node.key) // page_bytes
    assert n_pages > 0 and len(node.key) % page_bytes == 0, f"{node!r}: key is not whole pages"
    assert parent.children.get(node.key[:page_bytes]) is node, f"{node!r} not under its first page"
    assert node.tenant == parent.tenant, f"{node!r} is in another tenant's subtree"
    assert node.device is not None or node.host is not None, f"{node!r} is in no tier"
    return n_pages


def _check_pins(node: TreeNode) -> None:
    assert node.lock_ref >= 0 and node.host_ref >= 0, f"{node!r}: negative pin"
    kids = node.children.values()
    assert node.lock_ref >= sum(c.lock_ref for c in kids), f"{node!r}: lock_ref below children"
    assert node.host_ref >= sum(c.host_ref for c in kids), f"{node!r}: host_ref below children"


class _Tally:
    """Nodes and full-KV pages recounted from scratch; each page id owned once per tier,
    each node's pages held contiguously (a tier only under a parent in that tier)."""

    def __init__(self) -> None:
        self.nodes = self.device = self.host = self.protected = 0
        self._device_seen: set[int] = set()
        self._host_seen: set[int] = set()

    def add(self, node: TreeNode, n_pages: int) -> None:
        parent = node.parent
        assert parent is not None
        self.nodes += 1
        if node.device is not None:
            assert parent.device is not None, f"{node!r} in L1 under a parent that is not"
            _own(self._device_seen, node.device, n_pages, f"{node!r}: L1")
            self.device += n_pages
            if node.lock_ref > 0:
                self.protected += n_pages
        if node.host is not None:
            assert parent.host is not None, f"{node!r} in L2 under a parent that is not"
            _own(self._host_seen, node.host, n_pages, f"{node!r}: L2")
            self.host += n_pages

    def stats(self) -> TreeStats:
        return TreeStats(
            nodes=self.nodes,
            device_pages=self.device,
            host_pages=self.host,
            protected_device_pages=self.protected,
        )


def _own(seen: set[int], pages: PageIds, n_pages: int, what: str) -> None:
    """Record ``pages`` (``n_pages`` of them, each once) as owned; none owned before."""
    assert len(pages) == n_pages, f"{what} has {len(pages)} pages"
    dup = seen.intersection(pages)
    assert not dup and len(set(pages)) == n_pages, f"{what} pages {dup} owned twice"
    seen.update(pages)


def _check_component_ids(
    nodes: Callable[[], Iterable[TreeNode]], components: Sequence[TreeComponent]
) -> None:
    """Per extra component and tier: every id owned by one node only."""
    for c in components:
        for tier in Tier:
            seen: set[int] = set()
            for n in nodes():
                ids = c.get(n, tier)
                if ids is None:
                    continue
                dup = seen.intersection(ids)
                assert not dup and len(set(ids)) == len(ids), (
                    f"{c.name} {tier.value} ids {dup or list(ids)} owned twice"
                )
                seen.update(ids)
