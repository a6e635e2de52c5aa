"""Full KV as the first store of a cache: the tree's spine and the only store with
layer-wise copies, behind the same request verbs as the component stores.

:class:`FullKVStore` holds the L1 half (:class:`~hicache.cache.device_tier.DeviceTier`:
device pool, allocation with eviction, reserved pages), with the hierarchical cache the L2
half (:class:`~hicache.cache.host_tier.HostTier`: host pool, L1<->L2 copies, L2 eviction)
and the layer-wise load back of an L2 hit (:class:`LoadBack`). Its per-request data is the
handle's :class:`~hicache.cache.request.FullPart` (the page table), changed here only.
Request verbs, in order: :meth:`~FullKVStore.admit` (match, load back, pin, allocate: a
:class:`FullAdmission`, not ok when L1 has no room), :meth:`~FullKVStore.refuse` (another
store refused), :meth:`~FullKVStore.grow`, :meth:`~FullKVStore.commit` (whole pages),
:meth:`~FullKVStore.release`. The page-level API, for tests and tools only:
:meth:`~FullKVStore.match_prefix`, ``insert``, ``alloc``, ``free``, ``reserve``,
``evict_device``, ``evict_host``, the pools.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from hicache.cache.components.base import HeldPages, StoreAdmission
from hicache.cache.components.stores import ComponentStores
from hicache.cache.device_tier import DeviceTier
from hicache.cache.host_tier import HostTier
from hicache.cache.request import CachedTokens, CacheRequest
from hicache.cache.sync import CacheSync
from hicache.config import CacheConfig
from hicache.controller.policy import WriteRule
from hicache.memory import DevicePool, HostPool, check_pool_sizes
from hicache.metrics import CacheCounters
from hicache.spec import KVSpec
from hicache.transfer import LayerProgress
from hicache.tree import HiRadixTree, InsertResult, MatchResult, TreeNode
from hicache.tree.components import ComponentValues, Tier
from hicache.tree.node import PageIds, TokenIds, page_ids

__all__ = ["FULL", "FullAdmission", "FullKVStore", "LoadBack"]

FULL = "full"
"""The full KV's name in reports (``ComponentUsage.name``)."""


@dataclass(frozen=True, slots=True)
class LoadBack:
    """What a hit's load back gives: the deepest usable ``node``, the prefix's L1
    ``pages`` (in token order), the ``loaded_tokens`` being copied from L2, and the
    ``progress`` of every load the prefix depends on (its own, if any, and those other
    requests started for L1 pages of the prefix, still in flight)."""

    node: TreeNode
    pages: PageIds
    loaded_tokens: int
    progress: tuple[LayerProgress, ...]


@dataclass(frozen=True, slots=True)
class FullAdmission(StoreAdmission):
    """The full store's answer to an admission, as every store's (:class:`StoreAdmission`:
    ``ok`` False when L1 has no room now, holding nothing; ``loaded`` when part of the hit
    is copied from L2), with the hit: it ends at ``node`` (pinned), its first
    ``prefix_pages`` pages are the tree's, ``loaded_tokens`` of them come from L2 layer by
    layer, and ``progress`` is every load the prefix depends on (the request's own and
    those of other requests over pages it shares)."""

    node: TreeNode | None = None
    prefix_pages: int = 0
    loaded_tokens: int = 0
    progress: tuple[LayerProgress, ...] = ()


class FullKVStore:
    """The full KV of one cache (see the module docstring).

    ``sync``: the cache's owner of asynchronous results (the L2 half reports to it);
    ``stores``: the component stores, peers (they take back ids the tree releases and
    back up what a hit needs when the full KV reaches L2).
    """

    name = FULL

    def __init__(
        self,
        *,
        tree: HiRadixTree,
        config: CacheConfig,
        spec: KVSpec,
        device: torch.device,
        rule: WriteRule,
        counters: CacheCounters,
        sync: CacheSync,
        stores: ComponentStores,
        layer_hook: Callable[[int, int], None] | None = None,
    ) -> None:
        check_pool_sizes(config, spec, device)  # both pools fit, before either exists
        pool = DevicePool(spec, config.device_pages, config.page_size, device)
        self.tree = tree
        self.config = config
        self.page_size = config.page_size
        self.rule = rule
        self.counters = counters
        self._stores = stores
        self.host: HostTier | None = None
        """The L2 half, with the hierarchical cache."""
        if config.enable_hierarchical_cache:
            self.host = HostTier(
                tree=tree,
                device_pool=pool,
                config=config,
                spec=spec,
                device=device,
                sync=sync,
                stores=stores,
                counters=counters,
                layer_hook=layer_hook,
            )
        self.device = DeviceTier(
            tree=tree, pool=pool, rule=rule, counters=counters, host=self.host, stores=stores
        )
        """The L1 half: its pool, allocation with eviction, reserved pages."""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the L2 half's copy worker."""
        if self.host is not None:
            self.host.start()

    def close(self) -> None:
        """Stop the L2 half's copy worker."""
        if self.host is not None:
            self.host.close()

    def wait_idle(self) -> None:
        """Wait (bounded, agreed) until every L1<->L2 copy in flight is applied."""
        if self.host is not None:
            self.host.wait_idle()

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers the cache has below L3: L1, and L2 with the hierarchical cache."""
        return (Tier.DEVICE,) if self.host is None else (Tier.DEVICE, Tier.HOST)

    # ------------------------------------------------------------------ pools

    @property
    def device_pool(self) -> DevicePool:
        """The L1 pool."""
        return self.device.pool

    @property
    def host_pool(self) -> HostPool | None:
        """The L2 pool, with the hierarchical cache."""
        return None if self.host is None else self.host.pool

    @property
    def pages(self) -> int:
        """Pages of the L1 pool less the reserved ones (the most one request can hold)."""
        return self.device.pages

    # ------------------------------------------------------------------ page level

    def match_prefix(self, tokens: TokenIds, tenant: str = "") -> MatchResult:
        """The cached prefix of ``tokens`` in L1 and L2 (whole pages); copies nothing and
        applies nothing (the tree as of the cache's last sync). Waits for no load: L1
        pages a load in flight maps may still be arriving (:meth:`HostTier.loads_on`
        names those loads), and those of a load that failed since leave the tree at the
        next sync."""
        return self.tree.match_prefix(tokens, tenant)

    def insert(
        self,
        tokens: TokenIds,
        device_pages: Sequence[int] | PageIds,
        *,
        priority: int = 0,
        tenant: str = "",
        back_up: bool = True,
        components: dict[str, ComponentValues] | None = None,
    ) -> InsertResult:
        """Hand the L1 pages of ``tokens`` (whole pages) to the tree; back up by policy
        (unless ``back_up`` is False). Pages the tree already holds under other ids are
        freed here (the component stores free their duplicates). The caller keeps
        ownership of pages beyond the whole pages of ``tokens``."""
        result = self.tree.insert(
            tokens, device_pages, priority=priority, tenant=tenant, components=components or None
        )
        if result.duplicate_pages:
            self.device.free(result.duplicate_pages)
        self._stores.free(Tier.DEVICE, result.component_duplicates)
        if back_up:
            self.back_up(result.last_node)
        return result

    def back_up(self, node: TreeNode) -> None:
        """Back up the path to ``node`` to L2 as the write policy says (no wait)."""
        if self.host is not None and self.rule.backup_min_hits is not None:
            self.host.back_up(node, self.rule.backup_min_hits, wait=False)

    def alloc(self, num_pages: int) -> PageIds | None:
        """``num_pages`` free L1 pages, evicting unpinned cached pages if needed (waiting
        for backups, never for loads: :meth:`DeviceTier.alloc`); None when even eviction
        cannot make room. The caller owns the pages until it inserts or frees them."""
        return self.device.alloc(num_pages)

    def free(self, pages: Iterable[int]) -> None:
        """Return caller-owned L1 pages (never pages the tree holds)."""
        self.device.free(pages)

    def reserve(self, num_pages: int) -> PageIds | None:
        """Take ``num_pages`` L1 pages out of circulation for the caller's own writes (the
        scratch page that padding rows of a CUDA-graph decode batch write their K/V to)
        until :meth:`unreserve`; None when even eviction cannot free that many. No request
        and no tree node is ever given a reserved page: the allocator counts it used, a
        reset leaves it, the integrity check and the stats count it held, and
        :attr:`pages` no longer counts it."""
        return self.device.reserve(num_pages)

    def unreserve(self, pages: Iterable[int]) -> None:
        """Give reserved pages back. ValueError for a page not reserved (nothing freed)."""
        self.device.unreserve(pages)

    @property
    def reserved(self) -> list[int]:
        """The L1 pages :meth:`reserve` took out of circulation."""
        return self.device.reserved

    def evict_device(self, num_pages: int) -> int:
        """Free at least ``num_pages`` L1 pages if possible; returns pages freed.
        Backed-up leaves are demoted to L2-only; the others are dropped, except under
        ``write_back``, which backs them up first."""
        return self.device.evict(num_pages)

    def evict_host(self, num_pages: int) -> int:
        """Free at least ``num_pages`` L2 pages if possible; returns pages freed."""
        return 0 if self.host is None else self.host.evict(num_pages)

    # ------------------------------------------------------------------ requests

    def admit(self, req: CacheRequest, wanted: TokenIds, tokens: int) -> FullAdmission:
        """Give ``req`` L1 pages for positions ``[0, tokens)``: the longest cached prefix
        of ``wanted`` from L1, or loaded back from L2 layer by layer (nothing from L2
        after a failed load), pinned; fresh pages for the rest. Not ok, holding nothing,
        when L1 cannot make room now."""
        part = req.full
        hit = self.load_back(self.tree.match_prefix(wanted, req.tenant), req, not part.no_load)
        self.tree.inc_lock_ref(hit.node)
        new = self.alloc(math.ceil(tokens / self.page_size) - len(hit.pages))
        if new is None:
            self.tree.dec_lock_ref(hit.node)
            return FullAdmission(ok=False)
        part.node = hit.node
        part.pages = hit.pages + new
        part.prefix_pages = len(hit.pages)
        part.progress = hit.progress
        return FullAdmission(
            ok=True,
            loaded=hit.loaded_tokens > 0,
            node=hit.node,
            prefix_pages=len(hit.pages),
            loaded_tokens=hit.loaded_tokens,
            progress=hit.progress,
        )

    def admitted(self, req: CacheRequest, got: FullAdmission, query: int) -> None:
        """Every store took ``req`` (admitted with ``got`` for ``query`` tokens): end its
        fallback after a failed load, if it was one (it serves what L1 holds); at its
        first admission count its hit per tier (``req.cached``, the counters), count the
        hit on the node and back the path up by policy."""
        prefix = got.prefix_pages * self.page_size
        if req.full.no_load:
            req.full.no_load = False
            req.cached = CachedTokens(device=min(req.cached.device, prefix))
        if not req.count_once():
            return
        loaded = got.loaded_tokens
        storage = min(req.storage_tokens, loaded)
        req.cached = CachedTokens(device=prefix - loaded, host=loaded - storage, storage=storage)
        c = self.counters
        c.prefix_queries_total += 1
        c.query_tokens_total += query
        c.device_hit_tokens_total += prefix - loaded
        c.host_hit_tokens_total += loaded - storage
        c.storage_hit_tokens_total += storage
        if got.node is not None and got.node.parent is not None:
            self.tree.count_hit(got.node)
            self.back_up(got.node)

    def fail_over(self, req: CacheRequest) -> None:
        """``req`` is requeued after a failed load: its next admission loads nothing from
        L2 (the prefill recomputes what the load could not bring; counted in
        ``load_fallbacks_total``)."""
        req.full.no_load = True
        self.counters.load_fallbacks_total += 1

    def grow(self, req: CacheRequest, tokens: int) -> bool:
        """Make ``req``'s pages cover positions ``[0, tokens)``; False when L1 cannot make
        room."""
        part = req.full
        need = math.ceil(tokens / self.page_size) - len(part.pages)
        if need <= 0:
            return True
        new = self.alloc(need)
        if new is None:
            return False
        part.pages += new
        return True

    def commit(
        self,
        req: CacheRequest,
        prefix: TokenIds,
        components: dict[str, ComponentValues],
    ) -> TreeNode:
        """Hand ``req``'s first ``len(prefix) // page_size`` pages (computed: their KV is
        ``prefix``'s) to the tree with the stores' ``components``; ``req`` keeps using the
        tree's copy, pinned at the returned node (the committed path's last). The write
        policy backs the path up."""
        part = req.full
        full = len(prefix) // self.page_size
        if full > len(part.pages):
            raise ValueError(f"commit of {full} pages; the request holds {len(part.pages)}")
        result = self.insert(
            prefix,
            part.pages[:full],
            priority=req.priority,
            tenant=req.tenant,
            back_up=False,
            components=components,
        )
        last = result.last_node
        tree_pages = path_device_pages(last)  # not a match: a boundary need not be valid
        if len(tree_pages) != full:  # pragma: no cover - a tree invariant
            raise RuntimeError("committed prefix is not resident in L1")
        self.tree.inc_lock_ref(last)
        if part.node is not None:
            self.tree.dec_lock_ref(part.node)
        part.node = last
        part.pages = tree_pages + part.pages[full:]
        part.prefix_pages = full
        if self.host is not None:  # the tree's pages may be another request's load in flight
            part.progress = _union(part.progress, self.host.loads_on(last))
        self.back_up(last)
        return last

    def release(self, req: CacheRequest) -> None:
        """Free ``req``'s own pages and unpin its prefix; it holds nothing then."""
        part = req.full
        if len(part.pages) > part.prefix_pages:
            self.device.free(part.pages[part.prefix_pages :])
        if part.node is not None:
            self.tree.dec_lock_ref(part.node)
        part.clear()

    def held(self, req: CacheRequest) -> HeldPages | None:
        """Every page of ``req``'s page table (the tree's prefix, then its own), or None
        when it holds none (not admitted)."""
        pages = req.full.pages
        if not len(pages):
            return None
        return HeldPages("full", self.device_pool, 0, pages[:])

    def request_pages(self, requests: Iterable[CacheRequest]) -> list[int]:
        """L1 pages ``requests`` own (not the tree's)."""
        return [p for r in requests for p in r.full.pages[r.full.prefix_pages :]]

    def held_device_pages(self, requests: Iterable[CacheRequest]) -> list[int]:
        """L1 pages held outside the tree: the ``requests``' own, the reserved ones, and
        a failed load's pages copies in flight may still use."""
        quarantined = [] if self.host is None else self.host.quarantined_device_pages()
        return [*self.request_pages(requests), *self.device.reserved, *quarantined]

    def reset(self) -> None:
        """Free every page the tree holds in L1 and L2 (the tree is reset next)."""
        self.device.free(self.tree.device_page_ids())
        if self.host is not None:
            self.host.allocator.free(self.tree.host_page_ids())

    # ------------------------------------------------------------------ load back

    def load_back(self, match: MatchResult, req: CacheRequest | None, load: bool) -> LoadBack:
        """Start copying the host-only part of ``match`` into L1, layer by layer (see
        :class:`LoadBack`).

        With extra components the L1 part of a match may end above an L1-resident span
        (say, a node whose snapshot is only in L2): the prefix then runs in L1 down to the
        first host-only node (or to ``last_host_node`` when none is), and only the
        host-only nodes are copied.

        All-or-nothing per chain: when the host-only part is shorter than
        ``load_back_threshold`` tokens, or L1 cannot make room for it, nothing is loaded;
        nor when ``load`` is False (the fallback of a failed load: it is recomputed)."""
        host = self.host
        if host is None:
            return LoadBack(match.last_device_node, match.device_pages, 0, ())
        no_load = LoadBack(
            match.last_device_node,
            match.device_pages,
            0,
            host.loads_on(match.last_device_node),
        )
        if not load:
            return no_load
        last = match.last_host_node
        # Pin the host copies first: pinning a hit's component span may split a node (so
        # the span starts on a boundary), which would change the chain computed before.
        self.tree.inc_host_ref(last)
        try:
            nodes = self.tree.host_only_path(last)
            base = nodes[0].parent if nodes else last  # the deepest L1 node the load continues
            assert base is not None
            if base is match.last_device_node:
                base_pages = match.device_pages
            else:  # L1-resident below the L1-valid boundary: its other components come later
                base_pages = path_device_pages(base)
            if not nodes:
                if base is match.last_device_node:
                    return no_load
                return LoadBack(base, base_pages, 0, host.loads_on(base))
            host_tokens = sum(self.tree.num_tokens(n) for n in nodes)
            if host_tokens < self.config.load_back_threshold:
                self.counters.load_skipped_tokens_total += host_tokens
                return no_load
            self.tree.inc_lock_ref(base)  # and the L1 prefix, while making room in L1
            try:
                device_pages = self.alloc(sum(self.tree.num_pages(n) for n in nodes))
            finally:
                self.tree.dec_lock_ref(base)
        finally:
            self.tree.dec_host_ref(last)
        if device_pages is None:
            self.counters.load_skipped_tokens_total += host_tokens
            return no_load
        host.load(nodes, device_pages, req)
        return LoadBack(last, base_pages + device_pages, host_tokens, host.loads_on(last))


def _union(a: tuple[LayerProgress, ...], b: tuple[LayerProgress, ...]) -> tuple[LayerProgress, ...]:
    """``a`` and the progresses of ``b`` not in it, in order."""
    return a + tuple(p for p in b if all(p is not q for q in a))


def path_device_pages(node: TreeNode) -> PageIds:
    """The L1 pages of the path from the root to ``node``, in token order (all in L1)."""
    parts: list[PageIds] = []
    while node.parent is not None:
        if node.device is None:  # pragma: no cover - contiguity
            raise RuntimeError(f"{node!r} on a committed path is not in L1")
        parts.append(node.device)
        node = node.parent
    out = page_ids()
    for p in reversed(parts):
        out += p
    return out
