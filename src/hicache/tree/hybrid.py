"""Per-component operations of the tree: assign, plan hits/backups/loads, evict on budget.

Mixed into :class:`~hicache.tree.radix.HiRadixTree`. Every method works the same way for
every extra component (sliding window, Mamba state, ...) through the
:class:`~hicache.tree.components.TreeComponent` contract; the full component's values
change through the tree's own node methods (``assign_device``, ``evict_device``, ...),
which keep the page counters. Pure Python, like the rest of the tree.

What the owner does with these (the cache facade), per extra component ``c``:

* after an L1 hit is admitted: pin (the tree's ``inc_lock_ref`` pins ``c``'s hit span);
  :meth:`ComponentOps.hit_ids` gives the L1 ids the model reads;
* load back of a hit at ``b`` (after the full pages are assigned):
  :meth:`component_load_nodes` lists the nodes whose ``c`` value must be copied L2 -> L1;
  allocate, copy, :meth:`assign_component` on L1;
* backup of a path ending at ``b`` (after the full host pages are assigned):
  :meth:`component_backup_nodes` lists what to copy L1 -> L2; allocate, copy, assign;
* ``c``'s pool is short: walk :meth:`component_eviction_order` and
  :meth:`evict_component` until enough ids are free; the node (and its full KV) stays.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Mapping, Sequence

from hicache.tree.components import ComponentValues, Granularity, Tier, TreeComponent
from hicache.tree.node import PageIds, TreeNode, as_page_ids, page_ids
from hicache.tree.results import ComponentStats

__all__ = ["ComponentOps"]


class ComponentOps:
    """Component-generic tree operations (needs ``_extra``, ``_split``, path walks)."""

    _extra: tuple[TreeComponent, ...]
    _page_bytes: int
    _tick: int
    page_size: int

    def iter_nodes(self) -> Iterator[TreeNode]:
        raise NotImplementedError

    def _split(self, child: TreeNode, at_page: int) -> TreeNode:
        raise NotImplementedError

    def num_pages(self, node: TreeNode) -> int:
        return len(node.key) // self._page_bytes

    path_tail: Callable[[TreeNode, int], list[TreeNode]]

    # ------------------------------------------------------------------ basics

    @property
    def extra_components(self) -> tuple[TreeComponent, ...]:
        """The extra components (full attention is always there and not listed)."""
        return self._extra

    def component(self, name: str) -> TreeComponent:
        """The extra component called ``name`` (KeyError naming the known ones)."""
        for c in self._extra:
            if c.name == name:
                return c
        raise KeyError(f"no component {name!r}; this tree has {[c.name for c in self._extra]}")

    def depth_pages(self, node: TreeNode) -> int:
        """Pages from the root to the end of ``node`` (0 for a root)."""
        pages = 0
        while node.parent is not None:
            pages += self.num_pages(node)
            node = node.parent
        return pages

    def ensure_boundary(self, node: TreeNode, pages_back: int) -> None:
        """Split the path so that a node boundary lies ``pages_back`` pages above the end
        of ``node`` (nothing to do on a boundary, at or beyond the root)."""
        left = pages_back
        while left > 0 and node.parent is not None:
            n = self.num_pages(node)
            if n > left:
                self._split(node, n - left)
                return
            left -= n
            node = node.parent

    def _node_at(self, last: TreeNode, pages_back: int) -> TreeNode:
        """The node ending ``pages_back`` pages above the end of ``last`` (splits)."""
        self.ensure_boundary(last, pages_back)
        node = last
        while pages_back > 0:
            pages_back -= self.num_pages(node)
            assert node.parent is not None and pages_back >= 0
            node = node.parent
        return node

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
        want = c.ids_for(self.num_pages(node))
        if len(ids) != want:
            raise ValueError(f"{node!r} needs {want} {name} ids, got {len(ids)}")
        c.set(node, tier, as_page_ids(ids)[:])

    def _check_values(self, values: Mapping[str, ComponentValues], n_pages: int) -> None:
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

    def _insert_components(
        self, last: TreeNode, n_pages: int, values: Mapping[str, ComponentValues]
    ) -> dict[str, PageIds]:
        """Place insert-time L1 ids on the path to ``last`` (which ends at ``n_pages``);
        spans were checked by :meth:`_check_values`."""
        dups: dict[str, PageIds] = {}
        for name, vals in values.items():
            c = self.component(name)
            out = page_ids()
            for span in vals.spans:
                s, e, ids = span.start_page, span.end_page, as_page_ids(span.ids)
                end_node = self._node_at(last, n_pages - e)
                if c.granularity is Granularity.BOUNDARY:
                    nodes, chunks = [end_node], [ids[:]]
                else:
                    self.ensure_boundary(end_node, e - s)
                    nodes = self.path_tail(end_node, e - s)
                    chunks, at = [], 0
                    for n in nodes:
                        k = self.num_pages(n)
                        chunks.append(ids[at : at + k])
                        at += k
                for n, chunk in zip(nodes, chunks, strict=True):
                    have = c.get(n, Tier.DEVICE)
                    c.data_for(n).last_access = self._tick  # the inserter's hit needs it
                    if have is None:
                        c.set(n, Tier.DEVICE, chunk)
                    elif have != chunk:
                        out.extend(p for p, q in zip(chunk, have, strict=True) if p != q)
            if out:
                dups[name] = out
        return dups

    # ------------------------------------------------------------------ hits

    def hit_nodes(self, name: str, node: TreeNode) -> list[TreeNode]:
        """The nodes whose ``name`` values a hit ending at ``node`` needs, top-down (may
        split once so the span starts on a boundary)."""
        return self.component(name).hit_nodes(self, node)

    def hit_ids(self, name: str, node: TreeNode, tier: Tier = Tier.DEVICE) -> PageIds:
        """The ``tier`` ids of what a hit at ``node`` needs, in token order (SWA: the
        window's pages, ending at ``node``'s end; Mamba: the one slot). Raises
        LookupError if a needed value is not in that tier."""
        c = self.component(name)
        out = page_ids()
        for n in c.hit_nodes(self, node):
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
            for n in c.hit_nodes(self, node)
            if c.get(n, Tier.DEVICE) is None and c.get(n, Tier.HOST) is not None
        ]

    def component_backup_nodes(self, name: str, node: TreeNode) -> list[TreeNode]:
        """Nodes whose ``name`` value to copy L1 -> L2 so a hit at ``node`` works from L2:
        the hit's nodes that have the value in L1, not in L2, and full KV in L2 (so assign
        the full host pages first). No more: values above the hit span stay L1-only."""
        c = self.component(name)
        return [
            n
            for n in c.hit_nodes(self, node)
            if n.host is not None
            and c.get(n, Tier.DEVICE) is not None
            and c.get(n, Tier.HOST) is None
        ]

    # ------------------------------------------------------------------ eviction

    def component_eviction_order(self, name: str, tier: Tier) -> Iterator[TreeNode]:
        """Nodes whose ``name`` value in ``tier`` may be evicted on its own (unpinned),
        least recently needed first, lazily; re-checked when popped. Evicting one leaves
        the node and its full KV (a tombstone in that tier)."""
        c = self.component(name)
        tier = Tier(tier)
        heap = [(c.eviction_key(n), n) for n in self.iter_nodes() if c.evictable(n, tier)]
        heapq.heapify(heap)
        while heap:
            _, node = heapq.heappop(heap)
            if c.evictable(node, tier):
                yield node

    def evict_component(self, name: str, node: TreeNode, tier: Tier) -> PageIds:
        """Drop ``node``'s ``name`` value in ``tier``; return its ids for the owner to free."""
        c = self.component(name)
        tier = Tier(tier)
        if not c.evictable(node, tier):
            raise RuntimeError(f"{node!r}: its {name} {tier.value} value is absent or pinned")
        return c.take(node, tier)

    def _cascade(self, node: TreeNode, tier: Tier) -> dict[str, PageIds]:
        """Drop every extra value of ``node`` in ``tier`` (its full KV leaves that tier)."""
        out: dict[str, PageIds] = {}
        for c in self._extra:
            if c.get(node, tier) is not None:
                out[c.name] = c.take(node, tier)
        return out

    def _extra_values(self, node: TreeNode, tier: Tier) -> list[str]:
        return [c.name for c in self._extra if c.get(node, tier) is not None]

    # ------------------------------------------------------------------ inspection

    def component_ids(self, name: str, tier: Tier) -> list[int]:
        """Every ``tier`` id of ``name`` the tree owns (for allocator ownership checks)."""
        c = self.component(name)
        out: list[int] = []
        for n in self.iter_nodes():
            ids = c.get(n, Tier(tier))
            if ids is not None:
                out.extend(ids)
        return out

    def component_stats(self, name: str) -> ComponentStats:
        c = self.component(name)
        dev = host = prot = tomb = 0
        for n in self.iter_nodes():
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

    def _pin_extras(self, node: TreeNode, tier: Tier, delta: int) -> None:
        for c in self._extra:
            c.pin(self, node, tier, delta)

    def _check_extras(self, components: Sequence[TreeComponent]) -> None:
        """Per extra component and tier: every id owned by one node only."""
        for c in components:
            for tier in Tier:
                seen: set[int] = set()
                for n in self.iter_nodes():
                    ids = c.get(n, tier)
                    if ids is None:
                        continue
                    dup = seen.intersection(ids)
                    assert not dup and len(set(ids)) == len(ids), (
                        f"{c.name} {tier.value} ids {dup or list(ids)} owned twice"
                    )
                    seen.update(ids)
