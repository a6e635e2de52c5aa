"""The tree's invariant checker, kept apart from the hot paths in :mod:`radix`.

It takes the tree's parts (its roots, page size, components and incremental counters), not
the tree, so it does not import :mod:`radix` and :mod:`radix` imports it without a cycle.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from hicache.tokens import TOKEN_BYTES
from hicache.tree.components import TreeComponent
from hicache.tree.node import TreeNode
from hicache.tree.results import TreeStats


def _descendants(roots: Sequence[TreeNode]) -> Iterator[TreeNode]:
    stack = [c for r in roots for c in r.children.values()]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def check_tree(
    shared_root: TreeNode,
    tenant_roots: Mapping[str, TreeNode],
    page_size: int,
    components: Sequence[TreeComponent],
    counted: TreeStats,
) -> TreeStats:
    """Check every invariant of :mod:`hicache.tree.radix`; raise AssertionError on the first
    violation, naming the node. ``counted`` are the tree's incremental counters; they must
    equal the stats recomputed from scratch, which are returned.

    Besides the per-node invariants: the shared root has tenant ``""``; each tenant root is
    registered under its own tenant and has at least one child (empty ones are pruned).
    ``components`` check their own values on every node (:meth:`TreeComponent.check`).
    """
    pb = page_size * TOKEN_BYTES
    roots = [shared_root, *tenant_roots.values()]
    for root in roots:
        assert root.parent is None and not root.device and not root.host, "root corrupted"
    assert shared_root.tenant == "", f"the shared root has tenant {shared_root.tenant!r}"
    for tenant, root in tenant_roots.items():
        assert tenant and root.tenant == tenant, f"tenant {tenant!r} maps to {root.tenant!r}"
        assert root.children, f"tenant {tenant!r} has an empty root (not pruned)"
    device_seen: set[int] = set()
    host_seen: set[int] = set()
    nodes = device = host = protected = 0
    for node in _descendants(roots):
        nodes += 1
        parent = node.parent
        assert parent is not None, f"{node!r} has no parent"
        n_pages = len(node.key) // pb
        assert n_pages > 0 and len(node.key) % pb == 0, f"{node!r}: key is not whole pages"
        assert parent.children.get(node.key[:pb]) is node, f"{node!r} not under its first page"
        assert node.tenant == parent.tenant, f"{node!r} is in another tenant's subtree"
        assert node.device is not None or node.host is not None, f"{node!r} is in no tier"
        if node.device is not None:
            assert len(node.device) == n_pages, f"{node!r}: {len(node.device)} device pages"
            assert parent.device is not None, f"{node!r} in L1 under a parent that is not"
            dup = device_seen.intersection(node.device)
            assert not dup and len(set(node.device)) == n_pages, f"L1 pages {dup} owned twice"
            device_seen.update(node.device)
            device += n_pages
            if node.lock_ref > 0:
                protected += n_pages
        if node.host is not None:
            assert len(node.host) == n_pages, f"{node!r}: {len(node.host)} host pages"
            assert parent.host is not None, f"{node!r} in L2 under a parent that is not"
            dup = host_seen.intersection(node.host)
            assert not dup and len(set(node.host)) == n_pages, f"L2 pages {dup} owned twice"
            host_seen.update(node.host)
            host += n_pages
        assert node.lock_ref >= 0 and node.host_ref >= 0, f"{node!r}: negative pin"
        kids = node.children.values()
        assert node.lock_ref >= sum(c.lock_ref for c in kids), f"{node!r}: lock_ref below children"
        assert node.host_ref >= sum(c.host_ref for c in kids), f"{node!r}: host_ref below children"
        for comp in components:
            comp.check(node, n_pages)
        if node.extra:
            known = {c.name for c in components}
            assert known.issuperset(node.extra), f"{node!r}: values of unknown components"
    recomputed = TreeStats(
        nodes=nodes, device_pages=device, host_pages=host, protected_device_pages=protected
    )
    assert recomputed == counted, f"counters {counted} != recomputed {recomputed}"
    return recomputed
