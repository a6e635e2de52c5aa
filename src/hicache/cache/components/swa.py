"""Sliding-window KV as a component store: its own L1/L2 pools, windows and L3 records.

The sliding layers' K/V live in their own pools (an L1 :class:`~hicache.memory.DevicePool`
of ``SlidingWindowSpec.device_pages(config)`` pages and, hierarchical, an L2
:class:`~hicache.memory.HostPool` of ``SlidingWindowSpec.host_pages(config, full)``), one
SWA page per sequence page, under the tree's
:class:`~hicache.tree.components.SlidingWindow` component (``"swa"``); the full pool holds
the global layers only. A query at position ``p`` reads keys ``p - window < q <= p``; with
``c`` positions computed a request keeps positions ``>= c - window`` and the
``ceil(window / page_size)`` pages before the last page boundary ``<= c``
(:meth:`SwaStore.keep_from`), so it holds at most :func:`request_pages` SWA pages. A
match may end only where the window before the boundary is in some tier
(:meth:`SwaStore.hit_needs` says which nodes' values a hit needs, and where). L3: one
``"swa"`` record per page (:class:`SwaRecords`). Commit, eviction and copies:
docs/architecture.md, "Hybrid models".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hicache.cache.components.base import (
    HeldPages,
    NominalSize,
    ServingLimits,
    StoreAdmission,
    StoreContext,
)
from hicache.cache.components.paged import PagedStore, ids_tensor
from hicache.cache.components.records import ComponentRecords, RecordWrites
from hicache.cache.request import CacheRequest, SlotTable, page_slots
from hicache.config import CacheConfig
from hicache.memory import DevicePool, HostPool
from hicache.memory.allocator import PageAllocator
from hicache.metrics import CacheCounters, ComponentUsage
from hicache.spec import ComponentSpec, KVSpec, SlidingWindowSpec
from hicache.tree import TreeNode
from hicache.tree.components import ComponentValues, SlidingWindow, Tier, TreeComponent
from hicache.tree.node import PageIds, page_ids

__all__ = [
    "SWA",
    "HitNeed",
    "SlidingTable",
    "SwaRecords",
    "SwaStore",
    "check_swa_pool",
    "request_pages",
]

SWA = SlidingWindowSpec.name
"""The tree component name of sliding-window KV (``"swa"``)."""


class SlidingTable(SlotTable):
    """One request's sliding-window page table (its part of the SWA store).

    ``pages[i]`` is the SWA pool page of sequence page ``first + i``; sequence pages before
    ``first`` have fallen out of the window (their SWA KV is not held: "none"), pages from
    ``end`` on are not allocated yet. Of the held pages, those below the request's
    ``prefix_pages`` belong to the tree (pinned through the request's node; never freed
    by the request), the others to the request. Changed only by :class:`SwaStore`.
    """

    __slots__ = ("first", "pages")

    def __init__(self, first: int = 0, pages: PageIds | None = None) -> None:
        self.first = first
        self.pages: PageIds = page_ids() if pages is None else pages

    @property
    def end(self) -> int:
        """One past the last sequence page held."""
        return self.first + len(self.pages)

    def slots(self, page_size: int, upto: int) -> torch.Tensor:
        """SWA pool slots of positions ``[first * page_size, upto)`` (the held tail of the
        first ``upto`` positions), ``(upto - first * page_size,)`` int64 on the CPU."""
        lo = self.first * page_size
        if not lo <= upto <= self.end * page_size:
            raise ValueError(
                f"SWA slots up to {upto}: the table holds positions [{lo}, {self.end * page_size})"
            )
        return page_slots(self.pages, page_size, upto - lo)

    def __repr__(self) -> str:
        return f"SlidingTable(first={self.first}, pages={list(self.pages)})"


def request_pages(window: int, chunk: int, page_size: int) -> int:
    """Most SWA pages one request holds at once when a forward adds at most ``chunk``
    positions: the window's pages before the page boundary at or below ``c`` (the
    forward's start), then pages up to ``c + chunk`` (one more where they straddle)."""
    return math.ceil(window / page_size) + math.ceil(chunk / page_size) + 1


def check_swa_pool(config: CacheConfig, window: int, chunk: int) -> None:
    """Refuse (ValueError naming ``swa_full_tokens_ratio`` and the numbers) an L1 SWA pool
    that cannot hold one request's window and one chunk (:func:`request_pages`)."""
    need = request_pages(window, chunk, config.page_size)
    have = SlidingWindowSpec.device_pages(config)
    if have < need:
        raise ValueError(
            f"swa_full_tokens_ratio={config.swa_full_tokens_ratio} gives the sliding-window"
            f" layers' L1 pool {have} pages of {config.page_size} tokens"
            f" ({config.device_pages} device pages x the ratio), but one request needs"
            f" {need}: its window of {window} tokens and a chunk of {chunk}; raise"
            " swa_full_tokens_ratio or device_tokens"
        )


@dataclass(frozen=True, slots=True)
class HitNeed:
    """One node whose SWA value a hit needs, and the ids it has per tier (None: absent)."""

    node: TreeNode
    device: PageIds | None
    host: PageIds | None


class SwaStore(PagedStore):
    """L1 (and optional L2) pages of the sliding-window layers for one cache."""

    spec_type = SlidingWindowSpec
    label = "SWA"

    def __init__(self, spec: ComponentSpec, ctx: StoreContext) -> None:
        super().__init__(spec, ctx)
        assert isinstance(spec, SlidingWindowSpec)
        config = ctx.config
        self.spec = spec
        self.window = spec.window
        self._build_pools(spec.kv, ctx, spec.device_pages(config), spec.host_pages(config, ctx.kv))

    @classmethod
    def tree_component(cls, spec: ComponentSpec) -> TreeComponent:
        assert isinstance(spec, SlidingWindowSpec)
        return SlidingWindow(spec.window)

    @classmethod
    def check_limits(
        cls, config: CacheConfig, kv: KVSpec, spec: ComponentSpec, limits: ServingLimits
    ) -> None:
        assert isinstance(spec, SlidingWindowSpec)
        check_swa_pool(config, spec.window, max(limits.chunk_tokens, config.page_size))

    @property
    def runner_pool(self) -> DevicePool:
        """The sliding layers read and write their K/V here."""
        return self._device_pool

    def allocator(self, tier: Tier) -> PageAllocator:
        return self.pool(tier).allocator

    def usage(self, cached_tokens: int) -> ComponentUsage:
        return self._usage(self.spec.kv.token_bytes * self.page_size, cached_tokens)

    def records(self) -> SwaRecords:
        return SwaRecords(self)

    def nominal(self) -> NominalSize:
        """The sliding layers' K/V of one token (what keeping every token would cost)."""
        kv = self.spec.kv
        return NominalSize(
            kv.num_layers, float(kv.token_bytes), "pages", f"window {self.window} tokens"
        )

    # ------------------------------------------------------------------ pages

    def alloc(self, tier: Tier, n: int) -> PageIds | None:
        """``n`` free pages of ``tier``, evicting unpinned tree-owned SWA values first
        (least recently needed by a hit first; nodes and their full KV stay); None if even
        that cannot make room.

        Only then does it wait, and only for the backups in flight: a backup pins the
        window at its run's end in L1 (and so in L2) until it is applied. Never for loads
        (another request's layer-wise load may last as long as its forward): a load pins
        the window at its chain's end for its request, which pins that same window
        itself once admitted, so its landing frees nothing (an admission that failed
        after issuing its load leaves the window free once the load lands, for a later
        allocation); and the SWA values a hit needs are copied here, synchronously, not
        by the load."""
        alloc = self.pool(tier).allocator
        self._evict(tier, n)
        if alloc.free_pages < n and self.sync.wait_backups():
            self._evict(tier, n)  # backups that landed unpinned their windows
        got = alloc.alloc(n)
        return None if got is None else page_ids(got)

    def _evict(self, tier: Tier, n: int) -> None:
        """Evict unpinned tree-owned values of ``tier`` until ``n`` pages are free."""
        alloc = self.pool(tier).allocator
        if alloc.free_pages >= n:
            return
        for node in self.tree.component_eviction_order(SWA, tier):
            alloc.free(self.tree.evict_component(SWA, node, tier))
            if alloc.free_pages >= n:
                return

    # ------------------------------------------------------------------ tiers

    def hit_needs(self, node: TreeNode) -> list[HitNeed]:
        """The nodes whose SWA values a hit ending at ``node`` needs (top-down), with the
        ids each has in L1 and L2: what an L3 record of this component would store for a
        boundary at ``node``, and what a load must bring. May split a node."""
        c = self.tree.component(SWA)
        return [
            HitNeed(n, c.get(n, Tier.DEVICE), c.get(n, Tier.HOST))
            for n in self.tree.hit_nodes(SWA, node)
        ]

    def back_up(self, last: TreeNode) -> list[TreeNode]:
        """Copy to L2 the SWA pages of the path ending at ``last`` that have their full KV
        in L2: first the window a hit at ``last`` needs, then (room permitting) every other
        L1-only SWA value on the path, so boundaries inside the span (where later requests
        may diverge, such as the end of a shared system prompt) stay valid from L2. A full
        L2 SWA pool leaves the rest L1-only (such a boundary then is no L2 boundary).
        Returns the nodes that got L2 pages, top-down."""
        if self._host_pool is None:
            return []
        window = self.tree.component_backup_nodes(SWA, last)
        if not self._copy_to_host(last, window):
            return []
        # the window's nodes end the path and now have L2 values: the rest lie above them
        rest = self.l1_only_on_path(last)
        return rest + window if self._copy_to_host(last, rest) else window

    def _copy_to_host(self, last: TreeNode, nodes: list[TreeNode]) -> bool:
        """Copy the L1 SWA values of ``nodes`` to fresh L2 pages, with ``last`` pinned (the
        L1 values must stay while L2 makes room); False when L2 has no room."""
        return self._copy(nodes, Tier.HOST, last)

    def _copy(self, nodes: list[TreeNode], to: Tier, pin: TreeNode | None) -> bool:
        """Copy the SWA values of ``nodes`` from the other tier into fresh pages of ``to``
        and assign them there (``pin`` locked while ``to`` makes room); False when ``to``
        has no room (nothing copied)."""
        if not nodes:
            return True
        assert self._host_pool is not None
        c = self.tree.component(SWA)
        frm = Tier.HOST if to is Tier.DEVICE else Tier.DEVICE
        values = [c.get(n, frm) for n in nodes]
        src = page_ids()
        for v in values:
            assert v is not None
            src += v
        if pin is not None:
            self.tree.inc_lock_ref(pin)
        try:
            got = self.alloc(to, len(src))
        finally:
            if pin is not None:
                self.tree.dec_lock_ref(pin)
        if got is None:
            return False
        if to is Tier.DEVICE:
            self.copier.load(self._device_pool, self._host_pool, ids_tensor(src), ids_tensor(got))
        else:
            self.copier.backup(self._device_pool, self._host_pool, ids_tensor(src), ids_tensor(got))
        at = 0
        for n, v in zip(nodes, values, strict=True):
            assert v is not None
            self.tree.assign_component(SWA, n, to, got[at : at + len(v)])
            at += len(v)
        return True

    # ------------------------------------------------------------------ requests

    def keep_from(self, computed: int) -> int:
        """First sequence page a request keeps when ``computed`` positions are done (its
        next forward starts there): the page of position ``computed - window``, or the
        first of the window pages before page boundary ``computed // page_size`` if
        lower (see the module doc)."""
        ps = self.page_size
        boundary_window = computed // ps - math.ceil(self.window / ps)
        return max(0, min((computed - self.window) // ps, boundary_window))

    def table(self, req: CacheRequest) -> SlidingTable | None:
        """``req``'s sliding-window page table while admitted (None otherwise)."""
        part = req.part(self.name)
        assert part is None or isinstance(part, SlidingTable)
        return part

    def _table(self, req: CacheRequest) -> SlidingTable:
        table = self.table(req)
        assert table is not None, "the request holds no SWA table"
        return table

    def admit(self, req: CacheRequest, node: TreeNode, prefix_pages: int) -> StoreAdmission:
        """Give ``req`` its table for a hit of ``prefix_pages`` pages ending at ``node``
        (pinned by the caller): the hit's window, loaded back to L1 if it is in L2 only.
        Not ok (``req`` unchanged) when the L1 SWA pool has no room for that load."""
        loaded = False
        if node.parent is not None:
            nodes = self.tree.component_load_nodes(SWA, node)
            if not self._copy(nodes, Tier.DEVICE, None):
                return StoreAdmission(ok=False, loaded=bool(nodes))
            loaded = bool(nodes)
        ids = self.tree.hit_ids(SWA, node) if node.parent is not None else page_ids()
        req.set_part(self.name, SlidingTable(prefix_pages - len(ids), ids))
        return StoreAdmission(ok=True, loaded=loaded)

    def trim(self, req: CacheRequest, computed: int) -> None:
        """Drop the table's pages before :meth:`keep_from` ``computed``; free the
        request's own (pages the tree owns are only dropped)."""
        table = self._table(req)
        keep = self.keep_from(computed)
        if keep <= table.first:
            return
        cut = min(keep, table.end) - table.first  # pages dropped
        own_from = max(0, req.prefix_pages - table.first)  # index of the first own page
        if cut > own_from:
            self.free(Tier.DEVICE, table.pages[own_from:cut])
        table.pages = table.pages[cut:]
        table.first = keep  # > end only for an empty table: nothing below keep is read

    def grow(self, req: CacheRequest, tokens: int, computed: int | None) -> bool:
        """Make the table cover positions up to ``tokens`` (trimmed to ``computed`` first,
        when given); False when the L1 SWA pool cannot make room (trimmed, nothing added)."""
        table = self._table(req)
        if computed is not None:
            self.trim(req, computed)
        need = math.ceil(tokens / self.page_size) - table.end
        if need <= 0:
            return True
        got = self.alloc(Tier.DEVICE, need)  # the tree pages it reads are pinned via req.node
        if got is None:
            return False
        table.pages = table.pages + got
        return True

    def values(self, req: CacheRequest, full: int, final: bool) -> ComponentValues | None:
        """The SWA values a commit of ``full`` pages hands the tree: every page still held
        below ``full``, before trimming (the tree keeps them until its SWA LRU needs room;
        None when none is held)."""
        table = self._table(req)
        n = min(full, table.end) - table.first
        return ComponentValues.pages(table.first, table.pages[:n]) if n > 0 else None

    def adopt(self, req: CacheRequest, last: TreeNode, full: int) -> None:
        """After a commit of ``full`` pages ending at ``last``: the table's pages below
        ``full`` become the tree's ids (the tree may already have held other ids for some;
        the caller freed the request's duplicates)."""
        table = self._table(req)
        n = min(full, table.end) - table.first
        if n <= 0:
            return
        c = self.tree.component(SWA)
        tree_ids = page_ids()
        for node in self.tree.path_tail(last, n):  # insert split at table.first
            ids = c.get(node, Tier.DEVICE)
            if ids is None:  # pragma: no cover - insert placed a value on each node
                raise RuntimeError(f"committed window of {node!r} is not in L1")
            tree_ids += ids
        table.pages = tree_ids + table.pages[n:]

    def committed(self, req: CacheRequest, last: TreeNode, full: int, computed: int) -> None:
        """The table's committed pages become the tree's; then the tree's pages before the
        next forward's window are dropped from it (none freed: the next forward starts at
        ``computed`` or later)."""
        self.adopt(req, last, full)
        self.trim(req, computed)

    def release(self, req: CacheRequest) -> None:
        """Free the request's own pages (the tree's stay); the request has no table."""
        table = self.table(req)
        if table is None:
            return
        own_from = max(0, req.prefix_pages - table.first)
        self.free(Tier.DEVICE, table.pages[own_from:])
        req.set_part(self.name, None)

    def held(self, req: CacheRequest) -> HeldPages | None:
        """The window's pages: sequence pages from the table's ``first`` on."""
        table = self.table(req)
        if table is None:
            return None
        return HeldPages(self.name, self.device_pool, table.first, table.pages[:], stable=False)

    def request_ids(self, requests: Sequence[CacheRequest]) -> list[int]:
        """SWA L1 pages ``requests`` own (not the tree's)."""
        out: list[int] = []
        for r in requests:
            table = self.table(r)
            if table is not None:
                out += table.pages[max(0, r.prefix_pages - table.first) :]
        return out


class SwaRecords(ComponentRecords):
    """The ``"swa"`` component's L3 codec over one cache's sliding-window store: one
    record per SWA page; a read fetches the window a boundary needs and no more."""

    name = SWA

    def __init__(self, swa: SwaStore) -> None:
        if swa.host_pool is None:
            raise ValueError("L3 sliding-window records need the L2 SWA pool")
        self.window_pages = -(-swa.window // swa.page_size)
        super().__init__(swa.tree, reach=self.window_pages - 1)
        self.swa = swa

    @property
    def pool(self) -> HostPool:
        assert self.swa.host_pool is not None
        return self.swa.host_pool

    def needed(self, depth_pages: int) -> range:
        return range(max(1, depth_pages - self.window_pages + 1), depth_pages + 1)

    def writes(self, nodes: Sequence[TreeNode]) -> RecordWrites | None:
        """Every L2 SWA page the run holds (tombstones are absent), and those of the window
        a hit at its last node needs above it: a boundary inside the run (where later
        requests diverge, as at a shared system prompt's end) is then an L3 boundary too,
        like an L2 one (:meth:`SwaStore.back_up`). Each node with pages written stays pinned
        (an SWA value is evicted per node, so a node's own pin covers all its pages)."""
        comp = self.tree.component(SWA)
        chosen = {id(n) for n in nodes} | {id(n) for n in self.tree.hit_nodes(SWA, nodes[-1])}
        path: list[TreeNode] = []
        node: TreeNode | None = nodes[-1]
        while node is not None and node.parent is not None:
            path.append(node)
            node = node.parent
        pins: list[TreeNode] = []
        pages: list[int] = []
        ids = page_ids()
        for n in reversed(path):
            host = comp.get(n, Tier.HOST)
            if id(n) not in chosen or host is None:
                continue
            first = self.tree.depth_pages(n) - self.tree.num_pages(n) + 1
            pins.append(n)
            pages.extend(range(first, first + len(host)))
            ids += host
        return RecordWrites(tuple(pins), tuple(pages), ids) if pages else None

    def host_ready(self) -> None:
        self.swa.host_ready()

    def alloc(self, n: int) -> PageIds | None:
        return self.swa.alloc(Tier.HOST, n)

    def free(self, ids: PageIds) -> None:
        self.swa.free(Tier.HOST, ids)

    def adopt(
        self, last: TreeNode, depth_pages: int, pages: Sequence[int], ids: PageIds
    ) -> PageIds:
        """Each window node whose pages were all read and that has L2 full KV and no L2
        SWA value takes its pages' ids."""
        if last.parent is None or self.tree.depth_pages(last) != depth_pages:
            return ids
        comp = self.tree.component(SWA)
        where = {p: i for i, p in enumerate(pages)}
        window = self.tree.hit_nodes(SWA, last)
        at = depth_pages - sum(self.tree.num_pages(n) for n in window) + 1
        used: set[int] = set()
        for n in window:
            k = self.tree.num_pages(n)
            idx = [where.get(p) for p in range(at, at + k)]
            at += k
            if any(i is None for i in idx) or n.host is None:
                continue
            if comp.get(n, Tier.HOST) is not None:
                continue
            got = page_ids([int(ids[i]) for i in idx if i is not None])
            self.tree.assign_component(SWA, n, Tier.HOST, got)
            used.update(i for i in idx if i is not None)
        return page_ids([int(x) for i, x in enumerate(ids) if i not in used])

    def count_written(self, counters: CacheCounters, written: int, failed: int) -> None:
        counters.l3_backup_swa_pages_total += written
        counters.l3_backup_swa_pages_failed_total += failed
