"""HiCache: the one facade a scheduler talks to.

It owns the tree, the device (L1) and host (L2) pools and the controller, and keeps them in
step. All methods run on the owner's thread; worker threads only copy bytes and post
completions, which :meth:`HiCache.poll` applies.

Request life cycle, as an engine drives it::

    m = cache.match_prefix(tokens)        # tree walk only, no copy
    lb = cache.load_back(m)               # L2 -> L1, layer by layer
    cache.count_request(len(tokens), m, lb)
    cache.lock(lb.last_node)              # keep the prefix in L1 while the request runs
    pages = cache.alloc_device(n)         # pages for the new tokens (evicts under pressure)
    ... forward: layer i reads lb.device_pages after lb.progress.wait(i) ...
    cache.insert(tokens, lb.device_pages + pages)   # write policy may back up to L2
    cache.unlock(lb.last_node)
    cache.poll()                          # apply finished copies (also done by the calls above)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from hicache.cache_completions import PendingBackup, PendingLoad, apply_completion, back_up
from hicache.cache_inspect import cache_stats, check_cache_integrity
from hicache.cache_storage import L3Tier
from hicache.config import CacheConfig, KVSpec, PrefetchConfig
from hicache.controller import CacheController, write_rule
from hicache.controller.storage_controller import StorageController
from hicache.keys import Namespace
from hicache.lifecycle import Lifecycle
from hicache.memory import DevicePool, HostPool, PageAllocator
from hicache.metrics import CacheCounters, CacheStats
from hicache.transfer import Completion, LayerProgress
from hicache.tree import HiRadixTree, InsertResult, MatchResult, TreeNode
from hicache.tree.node import PageIds, TokenIds, page_ids


@dataclass(frozen=True, slots=True)
class LoadBackResult:
    """The L1 view of a matched prefix after :meth:`HiCache.load_back`.

    ``device_pages`` cover the whole usable prefix (``device_tokens`` tokens): the part that
    was already in L1 followed by ``loaded_tokens`` tokens being copied from L2. Read layer
    ``i`` of them only after ``progress.wait(i)``. ``last_node`` is the deepest node of the
    prefix: lock it for the request's lifetime.
    """

    device_pages: PageIds
    device_tokens: int
    loaded_tokens: int
    last_node: TreeNode
    progress: LayerProgress


class HiCache(Lifecycle):
    """Hierarchical KV cache over an L1 device pool and an L2 host pool.

    With ``config.enable_hierarchical_cache`` false there is no host pool: the tree is a
    plain radix cache over L1 and eviction drops nodes.
    """

    def __init__(
        self,
        config: CacheConfig,
        spec: KVSpec,
        device: torch.device | str = "cpu",
        *,
        layer_hook: Callable[[int, int], None] | None = None,
    ) -> None:
        self.config = config
        self.spec = spec
        self.device = torch.device(device)
        self.page_size = config.page_size
        self.device_pool = DevicePool(spec, config.device_pages, config.page_size, self.device)
        self.host_pool: HostPool | None = None
        self.controller: CacheController | None = None
        if config.enable_hierarchical_cache:
            self.host_pool = HostPool.for_config(spec, config, self.device)
            self.controller = CacheController(
                self.device_pool, self.host_pool, config.io_backend, layer_hook=layer_hook
            )
        self.tree = HiRadixTree(config.page_size, config.eviction_policy)
        self.rule = write_rule(config)
        self.counters = CacheCounters()
        self.l3: L3Tier | None = None
        self._backups: dict[int, PendingBackup] = {}
        self._loads: dict[int, PendingLoad] = {}
        self._started = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> HiCache:
        if self.controller is not None and not self._started:
            self.controller.start()
        self._started = True
        return self

    def close(self) -> None:
        """Finish in-flight copies, apply them, stop the workers. Idempotent."""
        if self.controller is not None and self._started:
            self.flush()
            self.detach_storage()
            self.controller.close()
        self._started = False

    # ------------------------------------------------------------------ L3

    def attach_storage(
        self, controller: StorageController, namespace: Namespace, prefetch: PrefetchConfig
    ) -> None:
        """Add the L3 tier (starts its threads). Needs the L2 tier; one L3 at a time."""
        if self.host_pool is None:
            raise ValueError("an L3 storage backend needs the hierarchical cache (L2) enabled")
        if self.l3 is not None:
            raise RuntimeError("a storage backend is attached already; detach it first")
        controller.start()
        self.l3 = L3Tier(self, controller, namespace, prefetch)

    def detach_storage(self) -> None:
        """Finish pending L3 writes, stop the L3 threads and close the backend."""
        if self.l3 is None:
            return
        self.l3.flush()
        self.l3.controller.close()
        self.l3 = None

    @property
    def hierarchical(self) -> bool:
        return self.host_pool is not None

    # ------------------------------------------------------------------ prefix reuse

    def match_prefix(self, tokens: TokenIds, tenant: str = "") -> MatchResult:
        """The cached prefix of ``tokens`` in L1 and L2 (whole pages); copies nothing.

        Waits first for loads still in flight, so every returned L1 page holds its data.
        """
        if self._loads:
            self._wait_all()
        return self.tree.match_prefix(tokens, tenant)

    def load_back(self, match: MatchResult) -> LoadBackResult:
        """Start copying the host-only part of ``match`` into L1, layer by layer.

        All-or-nothing per chain: when the host-only part is shorter than
        ``load_back_threshold`` tokens, or L1 cannot make room for it, nothing is loaded and
        the result covers the L1 part only. Hits are counted by :meth:`count_request`.
        """
        self.poll()
        nodes = self.tree.host_only_path(match.last_host_node)
        host_tokens = sum(self.tree.num_tokens(n) for n in nodes)
        no_load = LoadBackResult(
            device_pages=match.device_pages,
            device_tokens=match.device_tokens,
            loaded_tokens=0,
            last_node=match.last_device_node,
            progress=LayerProgress.completed(self.spec.num_layers),
        )
        if not nodes or self.controller is None:
            return no_load
        if host_tokens < self.config.load_back_threshold:
            self.counters.load_skipped_tokens_total += host_tokens
            return no_load
        host_pages = page_ids()
        for n in nodes:
            assert n.host is not None
            host_pages += n.host
        last = match.last_host_node
        # Pin the host copies and the L1 prefix while making room in L1.
        self.tree.inc_host_ref(last)
        self.tree.inc_lock_ref(match.last_device_node)
        try:
            device_pages = self.alloc_device(len(host_pages))
        finally:
            self.tree.dec_lock_ref(match.last_device_node)
        if device_pages is None:
            self.tree.dec_host_ref(last)
            self.counters.load_skipped_tokens_total += host_tokens
            return no_load
        offset = 0
        for n in nodes:
            k = self.tree.num_pages(n)
            self.tree.assign_device(n, device_pages[offset : offset + k])
            offset += k
        self.tree.inc_lock_ref(last)  # until the copy completes
        op_id, progress = self.controller.load(host_pages, device_pages)
        self._loads[op_id] = PendingLoad(last, host_tokens)
        return LoadBackResult(
            device_pages=match.device_pages + device_pages,
            device_tokens=match.device_tokens + host_tokens,
            loaded_tokens=host_tokens,
            last_node=last,
            progress=progress,
        )

    def count_request(
        self, query_tokens: int, match: MatchResult, lb: LoadBackResult, storage_tokens: int = 0
    ) -> None:
        """Count one admitted request: its prompt length and the tokens each tier served.

        ``storage_tokens`` were prefetched from L3 into L2 just before ``lb``; those that
        ``lb`` loaded count as L3 hits, the rest of ``lb``'s load as L2 hits.
        """
        storage = min(storage_tokens, lb.loaded_tokens)
        c = self.counters
        c.prefix_queries_total += 1
        c.query_tokens_total += query_tokens
        c.device_hit_tokens_total += match.device_tokens
        c.host_hit_tokens_total += lb.loaded_tokens - storage
        c.storage_hit_tokens_total += storage

    def insert(
        self,
        tokens: TokenIds,
        device_pages: Sequence[int] | PageIds,
        *,
        priority: int = 0,
        tenant: str = "",
    ) -> InsertResult:
        """Hand the L1 pages of ``tokens`` (whole pages) to the tree; back up by policy.

        Pages the tree already holds under other ids are freed here. The caller keeps
        ownership of pages beyond the whole pages of ``tokens``. Spans of a
        ``tenant`` (a request's cache salt) match only that tenant's requests and are never
        written to L3.
        """
        self.poll()
        result = self.tree.insert(tokens, device_pages, priority=priority, tenant=tenant)
        if result.duplicate_pages:
            self.device_pool.allocator.free(result.duplicate_pages)
        if self.controller is not None and self.rule.backup_min_hits is not None:
            back_up(self, result.last_node, self.rule.backup_min_hits, wait=False)
        return result

    def lock(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors in L1."""
        self.tree.inc_lock_ref(node)

    def unlock(self, node: TreeNode) -> None:
        self.tree.dec_lock_ref(node)

    # ------------------------------------------------------------------ L1 pages

    def alloc_device(self, num_pages: int) -> PageIds | None:
        """``num_pages`` free L1 pages, evicting unpinned cached pages if needed; None when
        even eviction cannot make room. The caller owns the pages until it inserts or frees
        them."""
        # nodes being backed up stay pinned in L1 until their copy lands
        return self._alloc(
            self.device_pool.allocator, self.evict_device, bool(self._backups), num_pages
        )

    def free_device(self, pages: Iterable[int]) -> None:
        """Return caller-owned L1 pages (never pages the tree holds)."""
        self.device_pool.allocator.free(pages)

    def evict_device(self, num_pages: int) -> int:
        """Free at least ``num_pages`` L1 pages if possible; returns pages freed.

        Backed-up leaves are demoted to L2-only; the others are dropped, except under
        ``write_back``, which backs them up first.
        """
        freed = 0
        for node in self.tree.device_eviction_order():
            if freed >= num_pages:
                break
            if node.host is None and self.rule.backup_on_evict and self.controller is not None:
                back_up(self, node, 0, wait=True)
                if node.lock_ref > 0:  # still copying (timeout): try the next one
                    continue
            demoted = node.host is not None
            pages = self.tree.evict_device(node)
            self.device_pool.allocator.free(pages)
            freed += len(pages)
            tokens = len(pages) * self.page_size
            if demoted:
                self.counters.device_demoted_tokens_total += tokens
            else:
                self.counters.device_evicted_tokens_total += tokens
        return freed

    # ------------------------------------------------------------------ L2 pages

    def alloc_host(self, num_pages: int) -> PageIds | None:
        """``num_pages`` free L2 pages, evicting unpinned L2-only leaves if needed."""
        assert self.host_pool is not None
        # host copies being loaded stay pinned in L2 until the load lands
        return self._alloc(self.host_pool.allocator, self.evict_host, bool(self._loads), num_pages)

    def _alloc(
        self, alloc: PageAllocator, evict: Callable[[int], int], in_flight: bool, num: int
    ) -> PageIds | None:
        """Allocate ``num`` pages, evicting first; if copies in flight pin what could go,
        wait for them and evict again."""
        if alloc.free_pages < num:
            evict(num - alloc.free_pages)
        if alloc.free_pages < num and in_flight:
            self._wait_all()
            evict(num - alloc.free_pages)
        pages = alloc.alloc(num)
        return None if pages is None else page_ids(pages)

    def evict_host(self, num_pages: int) -> int:
        """Free at least ``num_pages`` L2 pages if possible; returns pages freed.

        Unpinned L2-only leaves go first (in policy order); then, if that is not enough,
        the L2 copies of unpinned spans that are still in L1 (no data is lost that way).
        """
        if self.host_pool is None:
            return 0
        freed = 0
        for order, take in (
            (self.tree.host_eviction_order, self.tree.evict_host),
            (self.tree.host_copy_eviction_order, self.tree.drop_host),
        ):
            for node in order():
                if freed >= num_pages:
                    return freed
                pages = take(node)
                self.host_pool.allocator.free(pages)
                freed += len(pages)
                self.counters.host_evicted_tokens_total += len(pages) * self.page_size
        return freed

    # ------------------------------------------------------------------ completions

    def poll(self) -> int:
        """Apply finished copies (unpin their nodes); returns how many were applied."""
        if self.controller is None:
            return 0
        done = self.controller.poll()
        for c in done:
            self._apply(c)
        if self.l3 is not None:
            self.l3.poll()
        return len(done)

    def _wait_all(self) -> None:
        assert self.controller is not None
        for c in self.controller.wait():
            self._apply(c)
        if self.l3 is not None:
            self.l3.poll()

    def _apply(self, c: Completion) -> None:
        apply_completion(self, c)

    def flush(self) -> None:
        """Wait for every in-flight copy (L1<->L2, then L2->L3) and apply it."""
        if self.controller is not None and self._started:
            self._wait_all()
            if self.l3 is not None:
                self.l3.flush()

    # ------------------------------------------------------------------ whole cache

    def reset(self) -> None:
        """Empty L1 and L2 (``/flush_cache``). Refuses while any node is pinned."""
        self.flush()
        if any(n.lock_ref > 0 or n.host_ref > 0 for n in self.tree.iter_nodes()):
            raise RuntimeError("cannot reset the cache while requests hold prefixes")
        self.device_pool.allocator.free(self.tree.device_page_ids())
        if self.host_pool is not None:
            self.host_pool.allocator.free(self.tree.host_page_ids())
        self.tree.reset()

    def stats(self) -> CacheStats:
        """Occupancy per tier (tokens) and every counter, as one snapshot."""
        return cache_stats(self)

    def check_integrity(self, request_pages: Iterable[int] = ()) -> None:
        """Check tree and allocators agree: every used L1 page is owned by the tree or
        listed in ``request_pages`` (pages callers hold), exactly once; every used L2
        page is owned by the tree. Raises AssertionError."""
        check_cache_integrity(self, request_pages)
