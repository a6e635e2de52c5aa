"""The extra components' values in the tree: assign, place at insert, plan hits, evict.

:class:`ExtraComponents` works the same way for every extra component through the
:class:`~hicache.tree.components.TreeComponent` contract; the full component's values
change through the node store (which keeps the page counters). Pure Python. What the owner
(the cache facade) does with it, per extra component ``c``: after an L1 hit, pin it and read
:meth:`~ExtraComponents.hit_ids`; on a load back, copy the nodes of
:meth:`~ExtraComponents.component_load_nodes` L2 -> L1 and
:meth:`~ExtraComponents.assign_component`; on a backup, the same with
:meth:`~ExtraComponents.component_backup_nodes` L1 -> L2; when ``c``'s pool is short, walk
:meth:`~ExtraComponents.component_eviction_order` and
:meth:`~ExtraComponents.evict_component` (the node and its full KV stay). Invariant: load
back and backup run after the full pages are assigned.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from hicache.tree.components import ComponentValues, Granularity, Span, Tier, TreeComponent
from hicache.tree.eviction import eviction_order
from hicache.tree.node import PageIds, TreeNode, as_page_ids, page_ids
from hicache.tree.paths import Paths
from hicache.tree.results import ComponentStats
from hicache.tree.store import NodeStore

__all__ = ["ExtraComponents"]


class ExtraComponents:
    """The ``extras`` of one tree (full attention is not one of them) over the nodes of
    ``store``; ``paths`` is what their rules may ask of the tree."""

    def __init__(self, store: NodeStore, paths: Paths, extras: Sequence[TreeComponent]) -> None:
        self._store = store
        self._paths = paths
        self._extras = tuple(extras)

    def component(self, name: str) -> TreeComponent:
        """The extra component called ``name`` (KeyError naming the known ones)."""
        for c in self._extras:
            if c.name == name:
                return c
        raise KeyError(f"no component {name!r}; this tree has {[c.name for c in self._extras]}")

    # ------------------------------------------------------------------ values

    def assign_component(self, name: str, node: TreeNode, tier: Tier, ids: PageIds) -> None:
        """Give ``node`` its ``name`` value in ``tier`` (a load back, a backup, a copy).

        The node must hold its full KV in that tier and no ``name`` value there yet;
        ``ids`` must have :meth:`TreeComponent.ids_for` entries."""
        c = self.component(name)
        tier = Tier(tier)
        full = node.device if tier is Tier.DEVICE else node.host
        if node.parent is None or full is None:
            raise RuntimeError(f"{node!r}: no full KV in {tier.value}; assign that first")
        if c.get(node, tier) is not None:
            raise RuntimeError(f"{node!r} already has a {name} value in {tier.value}")
        want = c.ids_for(self._paths.num_pages(node))
        if len(ids) != want:
            raise ValueError(f"{node!r} needs {want} {name} ids, got {len(ids)}")
        c.set(node, tier, as_page_ids(ids)[:])

    def check_values(self, values: Mapping[str, ComponentValues], n_pages: int) -> None:
        """Raise (before the tree changes) unless every span fits an insert of ``n_pages``."""
        for name, vals in values.items():
            c = self.component(name)
            for span in vals.spans:
                s, e, n = span.start_page, span.end_page, len(span.ids)
                if c.granularity is Granularity.BOUNDARY:
                    ok = 1 <= e <= n_pages and s == e and n == 1
                else:
                    ok = 0 <= s < e <= n_pages and n == e - s
                if not ok:
                    raise ValueError(
                        f"{name} span [{s}, {e}) with {n} ids does not fit an insert of"
                        f" {n_pages} pages ({c.granularity.value} granularity)"
                    )

    def place(
        self, last: TreeNode, n_pages: int, values: Mapping[str, ComponentValues], tick: int
    ) -> dict[str, PageIds]:
        """Place an insert's L1 ids on the path to ``last`` (which ends at page
        ``n_pages``; spans were checked by :meth:`check_values`), splitting so each span
        starts and ends on a node boundary. A node that has a value keeps it; return, per
        component, the caller's ids that differ from the kept ones (the caller frees them).
        Every node given or keeping a value is marked needed at ``tick``."""
        dups: dict[str, PageIds] = {}
        for name, vals in values.items():
            c = self.component(name)
            out = page_ids()
            for span in vals.spans:
                for node, chunk in self._span_nodes(c, last, n_pages, span):
                    have = c.get(node, Tier.DEVICE)
                    c.data_for(node).last_access = tick  # the inserter's hit needs it
                    if have is None:
                        c.set(node, Tier.DEVICE, chunk)
                    elif have != chunk:
                        out.extend(p for p, q in zip(chunk, have, strict=True) if p != q)
            if out:
                dups[name] = out
        return dups

    def _span_nodes(
        self, c: TreeComponent, last: TreeNode, n_pages: int, span: Span
    ) -> list[tuple[TreeNode, PageIds]]:
        """The nodes ``span`` of ``c`` covers on the path to ``last``, each with its ids
        (splits so the span's ends are node boundaries)."""
        ids = as_page_ids(span.ids)
        end_node = self._paths.node_at(last, n_pages - span.end_page)
        if c.granularity is Granularity.BOUNDARY:
            return [(end_node, ids[:])]
        pages = span.end_page - span.start_page
        self._paths.ensure_boundary(end_node, pages)
        out: list[tuple[TreeNode, PageIds]] = []
        at = 0
        for node in self._paths.path_tail(end_node, pages):
            k = self._paths.num_pages(node)
            out.append((node, ids[at : at + k]))
            at += k
        return out

    # ------------------------------------------------------------------ hits

    def hit_nodes(self, name: str, node: TreeNode) -> list[TreeNode]:
        """The nodes whose ``name`` values a hit ending at ``node`` needs, top-down (may
        split once so the span starts on a boundary)."""
        return self.component(name).hit_nodes(self._paths, node)

    def hit_ids(self, name: str, node: TreeNode, tier: Tier = Tier.DEVICE) -> PageIds:
        """The ``tier`` ids of what a hit at ``node`` needs, in token order (SWA: the
        window's pages, ending at ``node``'s end; Mamba: the one slot). Raises
        LookupError if a needed value is not in that tier."""
        c = self.component(name)
        out = page_ids()
        for n in c.hit_nodes(self._paths, node):
            ids = c.get(n, Tier(tier))
            if ids is None:
                raise LookupError(f"{name} value of {n!r} is not in {Tier(tier).value}")
            out.extend(ids)
        return out

    def component_load_nodes(self, name: str, node: TreeNode) -> list[TreeNode]:
        """Nodes whose ``name`` value a hit at ``node`` needs from L2: in L2, not in L1.

        Call after the path's full pages are in L1 (values need their full KV in a tier).
        """
        c = self.component(name)
        return [
            n
            for n in c.hit_nodes(self._paths, node)
            if c.get(n, Tier.DEVICE) is None and c.get(n, Tier.HOST) is not None
        ]

    def component_backup_nodes(self, name: str, node: TreeNode) -> list[TreeNode]:
        """Nodes whose ``name`` value to copy L1 -> L2 so a hit at ``node`` works from L2:
        the hit's nodes that have the value in L1, not in L2, and full KV in L2 (so assign
        the full host pages first). No more: values above the hit span stay L1-only."""
        c = self.component(name)
        return [
            n
            for n in c.hit_nodes(self._paths, node)
            if n.host is not None
            and c.get(n, Tier.DEVICE) is not None
            and c.get(n, Tier.HOST) is None
        ]

    # ------------------------------------------------------------------ own eviction

    def component_eviction_order(self, name: str, tier: Tier) -> Iterator[TreeNode]:
        """Nodes whose ``name`` value in ``tier`` may be evicted on its own (unpinned),
        least recently needed first, lazily; re-checked when popped. Evicting one leaves
        the node and its full KV (a tombstone in that tier)."""
        c = self.component(name)
        tier = Tier(tier)
        return eviction_order(
            self._store.iter_nodes(),
            c.eviction_key,
            lambda n: c.evictable(n, tier),
            lambda n: False,  # the node stays: its parent gains nothing to evict
        )

    def evict_component(self, name: str, node: TreeNode, tier: Tier) -> PageIds:
        """Drop ``node``'s ``name`` value in ``tier``; return its ids for the owner to free."""
        c = self.component(name)
        tier = Tier(tier)
        if not c.evictable(node, tier):
            raise RuntimeError(f"{node!r}: its {name} {tier.value} value is absent or pinned")
        return c.take(node, tier)

    # ------------------------------------------------------------------ inspection

    def component_ids(self, name: str, tier: Tier) -> list[int]:
        """Every ``tier`` id of ``name`` the tree owns (for allocator ownership checks)."""
        c = self.component(name)
        out: list[int] = []
        for n in self._store.iter_nodes():
            ids = c.get(n, Tier(tier))
            if ids is not None:
                out.extend(ids)
        return out

    def component_stats(self, name: str) -> ComponentStats:
        """``name``'s ids per tier over the tree, its pinned L1 ids and its L1 tombstones."""
        c = self.component(name)
        dev = host = prot = tomb = 0
        for n in self._store.iter_nodes():
            d = c.get(n, Tier.DEVICE)
            h = c.get(n, Tier.HOST)
            if d is not None:
                dev += len(d)
                if c.pinned(n, Tier.DEVICE):
                    prot += len(d)
            elif n.device is not None:
                tomb += 1
            if h is not None:
                host += len(h)
        return ComponentStats(name, dev, host, prot, tomb)
