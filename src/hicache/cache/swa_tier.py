"""Sliding-window KV as a component of the one tree: its own L1/L2 pools and each
request's window.

A model with sliding-window layers (Gemma 3, GPT-OSS) needs, for those layers, only the
K/V of the last ``window`` tokens before each query. This tier keeps those layers' K/V in
their own pools (a :class:`~hicache.memory.DevicePool` L1 of
``config.swa_device_pages`` pages and, with the hierarchical cache, a
:class:`~hicache.memory.HostPool` L2 of ``config.swa_host_pages(full)`` pages), one SWA
page per sequence page, under the tree's :class:`~hicache.tree.components.SlidingWindow`
component (``"swa"``). The full pool then holds the global layers only.

The window rule, with positions. A query at position ``p`` attends to keys at
``p - window < q <= p``. A request whose next forward starts at position ``c`` (``c``
positions computed) keeps the SWA pages of positions ``>= c - window`` (one token more
than its queries read) and the ``ceil(window / page_size)`` pages before the last page
boundary ``b <= c`` (:meth:`SwaTier.keep_from`), so that a commit of its whole pages
hands the tree the window before ``b``, which is what a hit there needs
(:meth:`~hicache.tree.components.SlidingWindow.hit_span`). Its own pages wholly before
that are freed as it advances (on :meth:`grow`, which the scheduler calls before every
forward with ``c``, and on commit); pages the tree owns are just dropped from its table. So a request holds at most :func:`request_pages` SWA
pages however long it gets, while its full pages grow with it.

Commit hands the tree every SWA page the request still holds (``ComponentValues.pages``
from its first held page) before trimming its table; the scheduler commits every prefill
chunk, so a prompt's SWA pages are all cached, while positions passed between commits
(decode steps) are tombstones: their nodes keep full KV and no SWA value. A match may end
only where the window before the boundary is present in some tier (the component's
validator). Tree-owned SWA pages stay until the SWA pool runs short, then are evicted
under their own LRU (the node and its full KV stay): which boundary later requests will
diverge at (a shared system prompt's end) is unknown when a span is cached, so its window
is kept while there is room. Evicting a node's full KV drops its SWA values too (the tree
cascades; the facade frees them here).

Copies between the tiers (backup of a span's SWA pages, load back of a hit's host-only
window) are issued on the owner's thread through the cache's page copier, synchronously
on CPU and stream-ordered before the next forward on CUDA (the current stream). A load
moves at most ``ceil(window / page_size)`` pages, next to a full-KV load of the whole
prefix that the controller's worker overlaps with the forward; a backup moves a span's
SWA pages (as many as its full pages), off the forward's critical path.

L3 keeps them as records of the ``"swa"`` component, one per page
(:class:`~hicache.cache.component_records.SwaRecords`): a span written to L3 carries its
L2 SWA pages, and a prefetch reads the window its usable boundary needs into this tier's
L2 pool. :meth:`SwaTier.hit_needs` tells which nodes' SWA values a hit at a node needs,
and where each is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hicache.cache.request import CacheRequest, SlidingTable
from hicache.config import CacheConfig, KVSpec, SlidingWindowSpec
from hicache.memory import DevicePool, HostPool
from hicache.transfer import make_copier
from hicache.tree import HiRadixTree, TreeNode
from hicache.tree.components import ComponentValues, Tier
from hicache.tree.node import PageIds, page_ids

__all__ = ["SWA", "HitNeed", "SwaTier", "check_swa_pool", "request_pages"]

SWA = "swa"
"""The tree component name of sliding-window KV."""


def request_pages(window: int, chunk: int, page_size: int) -> int:
    """Most SWA pages one request holds at once when a forward adds at most ``chunk``
    positions: the window's pages before the page boundary at or below ``c`` (the
    forward's start), then pages up to ``c + chunk`` (one more where they straddle)."""
    return math.ceil(window / page_size) + math.ceil(chunk / page_size) + 1


def check_swa_pool(config: CacheConfig, window: int, chunk: int) -> None:
    """Refuse (ValueError naming ``swa_full_tokens_ratio`` and the numbers) an L1 SWA pool
    that cannot hold one request's window and one chunk (:func:`request_pages`)."""
    need = request_pages(window, chunk, config.page_size)
    have = config.swa_device_pages
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


def _ids_tensor(ids: PageIds) -> torch.Tensor:
    """Page ids as a 1-D int64 CPU tensor (the copiers' page lists)."""
    return torch.tensor(list(ids), dtype=torch.int64)


class SwaTier:
    """L1 (and optional L2) pages of the sliding-window layers for one cache."""

    def __init__(
        self,
        *,
        tree: HiRadixTree,
        config: CacheConfig,
        full: KVSpec,
        spec: SlidingWindowSpec,
        device: torch.device,
        hierarchical: bool,
    ) -> None:
        self.tree = tree
        self.spec = spec
        self.window = spec.window
        self.page_size = config.page_size
        self.device_pool = DevicePool(spec.kv, config.swa_device_pages, config.page_size, device)
        self.copier = make_copier(config.io_backend)
        self.wait_copies: Callable[[], bool] | None = None
        """Set by the owner: waits for L1<->L2 copies in flight (they pin the windows
        they copy) and applies them; True when it waited for any."""
        self.host_pool: HostPool | None = None
        if hierarchical:
            self.host_pool = HostPool.create(
                spec.kv,
                config.swa_host_pages(full),
                config.page_size,
                config.mem_layout,
                device,
            )

    def pool(self, tier: Tier) -> DevicePool | HostPool:
        if tier is Tier.DEVICE:
            return self.device_pool
        if self.host_pool is None:
            raise RuntimeError("no L2 SWA pool without the hierarchical cache")
        return self.host_pool

    # ------------------------------------------------------------------ pages

    def alloc(self, tier: Tier, n: int) -> PageIds | None:
        """``n`` free pages of ``tier``, evicting unpinned tree-owned SWA values first
        (least recently needed by a hit first; nodes and their full KV stay); None if even
        that cannot make room."""
        alloc = self.pool(tier).allocator
        self._evict(tier, n)
        if alloc.free_pages < n and self.wait_copies is not None and self.wait_copies():
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

    def free(self, tier: Tier, ids: PageIds) -> None:
        if len(ids):
            self.pool(tier).allocator.free(ids)

    def owned(self, tier: Tier) -> list[int]:
        """Every page of ``tier`` the tree owns (for the ownership check)."""
        return self.tree.component_ids(SWA, tier)

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

    def load(self, node: TreeNode) -> bool:
        """Bring the window a hit at ``node`` needs to L1 (copies of its L2 pages); False
        when the L1 SWA pool has no room (the caller must not use the hit). Call with the
        hit pinned and its full KV assigned in L1."""
        return self._copy(self.tree.component_load_nodes(SWA, node), Tier.DEVICE, None)

    def back_up(self, last: TreeNode) -> list[TreeNode]:
        """Copy to L2 the SWA pages of the path ending at ``last`` that have their full KV
        in L2: first the window a hit at ``last`` needs, then (room permitting) every other
        L1-only SWA value on the path, so boundaries inside the span (where later requests
        may diverge, such as the end of a shared system prompt) stay valid from L2. A full
        L2 SWA pool leaves the rest L1-only (such a boundary then is no L2 boundary).
        Returns the nodes that got L2 pages, top-down."""
        if self.host_pool is None:
            return []
        window = self.tree.component_backup_nodes(SWA, last)
        if not self._copy_to_host(last, window):
            return []
        # the window's nodes end the path and now have L2 values: the rest lie above them
        rest = self._path_backup_nodes(last)
        return rest + window if self._copy_to_host(last, rest) else window

    def _path_backup_nodes(self, last: TreeNode) -> list[TreeNode]:
        """Nodes from the root to ``last`` (top-down) with full KV in L2 and an SWA value in
        L1 only."""
        c = self.tree.component(SWA)
        out: list[TreeNode] = []
        node: TreeNode | None = last
        while node is not None and node.parent is not None and node.host is not None:
            if c.get(node, Tier.DEVICE) is not None and c.get(node, Tier.HOST) is None:
                out.append(node)
            node = node.parent
        out.reverse()
        return out

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
        assert self.host_pool is not None
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
            self.copier.load(self.device_pool, self.host_pool, _ids_tensor(src), _ids_tensor(got))
        else:
            self.copier.backup(self.device_pool, self.host_pool, _ids_tensor(src), _ids_tensor(got))
        at = 0
        for n, v in zip(nodes, values, strict=True):
            assert v is not None
            self.tree.assign_component(SWA, n, to, got[at : at + len(v)])
            at += len(v)
        return True

    def host_ready(self) -> None:
        """Wait until every L1 -> L2 page copy issued so far has landed (on CUDA they are
        ordered on the current stream; on CPU they are done already). Call before another
        thread reads L2 SWA pages (an L3 write)."""
        dev = self.device_pool.device
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()

    # ------------------------------------------------------------------ requests

    def keep_from(self, computed: int) -> int:
        """First sequence page a request keeps when ``computed`` positions are done (its
        next forward starts there): the page of position ``computed - window``, or the
        first of the window pages before page boundary ``computed // page_size`` if
        lower (see the module doc)."""
        ps = self.page_size
        boundary_window = computed // ps - math.ceil(self.window / ps)
        return max(0, min((computed - self.window) // ps, boundary_window))

    def admit(self, req: CacheRequest, node: TreeNode, prefix_pages: int) -> bool:
        """Give ``req`` its table for a hit of ``prefix_pages`` pages ending at ``node``
        (pinned by the caller): the hit's window, loaded back to L1 if it is in L2 only.
        False (``req`` unchanged) when the L1 SWA pool has no room for that load."""
        if node.parent is not None and not self.load(node):
            return False
        ids = self.tree.hit_ids(SWA, node) if node.parent is not None else page_ids()
        req.swa = SlidingTable(prefix_pages - len(ids), ids)
        return True

    def trim(self, req: CacheRequest, computed: int) -> None:
        """Drop the table's pages before :meth:`keep_from` ``computed``; free the
        request's own (pages the tree owns are only dropped)."""
        table = req.swa
        assert table is not None
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
        table = req.swa
        assert table is not None
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

    def values(self, req: CacheRequest, full: int) -> ComponentValues | None:
        """The SWA values a commit of ``full`` pages hands the tree: the held pages below
        ``full`` (None when none is held)."""
        table = req.swa
        assert table is not None
        n = min(full, table.end) - table.first
        return ComponentValues.pages(table.first, table.pages[:n]) if n > 0 else None

    def adopt(self, req: CacheRequest, last: TreeNode, full: int) -> None:
        """After a commit of ``full`` pages ending at ``last``: the table's pages below
        ``full`` become the tree's ids (the tree may already have held other ids for some;
        the caller freed the request's duplicates)."""
        table = req.swa
        assert table is not None
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

    def release(self, req: CacheRequest) -> None:
        """Free the request's own pages (the tree's stay); the request has no table."""
        table = req.swa
        if table is None:
            return
        own_from = max(0, req.prefix_pages - table.first)
        self.free(Tier.DEVICE, table.pages[own_from:])
        req.swa = None

    def request_pages(self, requests: list[CacheRequest]) -> list[int]:
        """SWA L1 pages ``requests`` own (not the tree's)."""
        out: list[int] = []
        for r in requests:
            if r.swa is not None:
                out += r.swa.pages[max(0, r.prefix_pages - r.swa.first) :]
        return out
