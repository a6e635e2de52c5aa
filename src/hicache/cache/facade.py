"""HiCache: the one facade a scheduler talks to, in requests.

It holds the request verbs below and :meth:`HiCache.sync`, over the tree and three tier
objects: the L1 :class:`~hicache.cache.device_tier.DeviceTier` (the device pool
of the full KV, allocation with eviction, reserved pages), the optional L2
:class:`~hicache.cache.host_tier.HostTier` (host pool, L1<->L2 copies, L2 eviction) and the
optional L3 :class:`~hicache.cache.storage_tier.StorageTier` (prefetch and writes,
attached and detached through a :class:`~hicache.cache.storage_slot.StorageSlot`); and the
model's component stores (one per extra component of its
:class:`~hicache.config.CacheSpec`: :mod:`hicache.cache.components`). All methods run on
the owner's thread; worker threads only move bytes and post records to one completion
queue, owned by the cache's :class:`~hicache.cache.sync.CacheSync`, which applies them at
:meth:`HiCache.sync` (the engine calls it once per step, whatever the rank count) and
inside explicit waits; no verb applies a record.

Request life cycle, as an engine drives it::

    cache.sync()                            # once per step: apply what the workers posted
    req = cache.open(prompt, tenant=salt)   # on arrival: the L3 prefetch starts now
    while not cache.ready(req): ...         # the policy, as agreed at the last sync
    if cache.admit(req, prompt):            # match, take the prefetch, load back, pin, pages
        resume = req.take_resume()          # what the runner resumes from (opaque)
        plan = cache.plan_chunk(req, start, n)  # where the forward ends, what it keeps
        cache.grow(req, start + plan.tokens, computed=start)
        # forward: positions [start, start + plan.tokens) into req.slots(...) and
        # req.pool_slots(...); before layer i reads the prefix: req.wait_layer(i, timeout)
        cache.commit(req, computed_tokens, extras=runner_extras)  # whole pages to the tree
        cache.keep(req, runner_extras)      # a forward that commits nothing (decode)
        cache.release(req, all_tokens)      # commit, free the rest, unpin

Page-level methods (``match_prefix``, ``insert``, ``alloc_device``, ``evict_*``, the
reserved pages) stay public for tests and tools, the L1 ones delegating to the L1 tier; a
scheduler needs none of them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from hicache.cache.components import STORE_TYPES
from hicache.cache.components.base import (
    ChunkPlan,
    ComponentStore,
    ServingLimits,
    StoreContext,
)
from hicache.cache.components.stores import ComponentStores, store_type
from hicache.cache.device_tier import DeviceTier
from hicache.cache.host_tier import HostTier
from hicache.cache.inspect import (
    cache_stats,
    cached_tokens,
    check_cache_integrity,
    full_usage,
    tree_digest,
)
from hicache.cache.request import CachedTokens, CacheRequest, RequestState
from hicache.cache.storage_slot import StorageSlot
from hicache.cache.storage_tier import StorageTier
from hicache.cache.sync import DEFAULT_WAIT_TIMEOUT_S, CacheSync
from hicache.config import CacheConfig, CacheSpec, KVSpec, PrefetchConfig
from hicache.controller import write_rule
from hicache.controller.rank_group import RankGroup
from hicache.extras import SequenceExtras
from hicache.keys import Namespace
from hicache.lifecycle import Lifecycle
from hicache.memory import DevicePool, HostPool, check_pool_sizes
from hicache.metrics import CacheCounters, CacheStats
from hicache.storage.base import HiCacheStorage
from hicache.tokens import encode_tokens
from hicache.transfer import LayerProgress
from hicache.tree import HiRadixTree, InsertResult, MatchResult, TreeNode
from hicache.tree.components import (
    ComponentValues,
    Tier,
)
from hicache.tree.node import PageIds, TokenIds, page_ids
from hicache.validate import number_at_least

log = logging.getLogger("hicache.cache")

__all__ = ["DEFAULT_WAIT_TIMEOUT_S", "ComponentHits", "HiCache"]

S = TypeVar("S", bound=ComponentStore)


@dataclass(frozen=True, slots=True)
class ComponentHits:
    """Admissions that reused a prefix, per component store: ``l1`` with the hit's values
    of the component in L1 already, ``l2`` with them copied from L2 (counted at the
    admission that succeeded, also when an earlier attempt did the copy)."""

    name: str
    l1: int
    l2: int


class HiCache(Lifecycle):
    """Hierarchical KV cache over an L1 device tier (:attr:`device_tier`), an optional L2
    host tier (:attr:`host`) and an optional L3 storage tier (:attr:`storage`).

    With ``config.enable_hierarchical_cache`` false there is no host tier: the tree is a
    plain radix cache over L1 and eviction drops nodes.

    ``spec``: what the model caches (:class:`~hicache.config.CacheSpec`, the model side
    produces it), or a plain :class:`KVSpec` for a full-KV-only model. Each of its
    components gets a store (:mod:`hicache.cache.components`) of the type in
    ``store_types`` that takes its spec; :attr:`spec` is the full KV's shape (the global
    layers only when sliding layers have their own store). ``limits``: refuse (ValueError)
    stores too small to serve one request under them.

    ``ranks``: the tensor-parallel group this cache is one rank of (None: one rank). No
    worker record is applied on one rank alone, nor anywhere but in :meth:`sync` (every
    rank calls it once per engine step) and inside the cache's waits: the cache's
    :class:`~hicache.cache.sync.CacheSync` agrees on every op in flight (one all-reduce;
    none with one rank, whose verdict is its vote) and applies what every rank has, with
    the agreed values, so every rank's tree stays the same.
    """

    def __init__(
        self,
        config: CacheConfig,
        spec: KVSpec | CacheSpec,
        device: torch.device | str = "cpu",
        *,
        layer_hook: Callable[[int, int], None] | None = None,
        wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S,
        limits: ServingLimits | None = None,
        store_types: Sequence[type[ComponentStore]] = STORE_TYPES,
        ranks: RankGroup | None = None,
    ) -> None:
        self.config = config
        self.cache_spec = CacheSpec.of(spec)
        self.spec: KVSpec = self.cache_spec.kv
        spec = self.spec
        self.device = torch.device(device)
        self.page_size = config.page_size
        number_at_least("wait_timeout_s", wait_timeout_s, 0.001, "of seconds")
        self.wait_timeout_s = wait_timeout_s
        if limits is not None:  # every store can serve one request
            for c in self.cache_spec.components:
                store_type(c, store_types).check_limits(config, spec, c, limits)
        check_pool_sizes(config, spec, self.device)  # both pools fit, before either exists
        device_pool = DevicePool(spec, config.device_pages, config.page_size, self.device)
        self.tree = HiRadixTree(
            config.page_size,
            config.eviction_policy,
            ComponentStores.tree_components(self.cache_spec, store_types),
        )
        self.rule = write_rule(config)
        self.counters = CacheCounters()
        self._sync = CacheSync(tree=self.tree, ranks=ranks, wait_timeout_s=wait_timeout_s)
        self.ranks = self._sync.ranks
        """The tensor-parallel ranks this cache agrees with (one: its verdict is its vote)."""
        self._requests = self._sync.holders
        self.host: HostTier | None = None
        ctx = StoreContext(
            tree=self.tree, config=config, kv=spec, device=self.device, sync=self._sync
        )
        self.stores = ComponentStores.build(self.cache_spec, ctx, store_types)
        """The model's component stores, in its spec's order (empty: full KV only)."""
        self._hits = {name: [0, 0] for name in self.stores.names}
        if config.enable_hierarchical_cache:
            self.host = HostTier(
                tree=self.tree,
                device_pool=device_pool,
                config=config,
                spec=spec,
                device=self.device,
                sync=self._sync,
                stores=self.stores,
                counters=self.counters,
                layer_hook=layer_hook,
            )
        self.device_tier = DeviceTier(
            tree=self.tree,
            pool=device_pool,
            rule=self.rule,
            counters=self.counters,
            host=self.host,
            stores=self.stores,
        )
        """The L1 tier: its pool, allocation with eviction, reserved pages."""
        self._l3: StorageSlot | None = None
        """Where the L3 tier attaches (only over the L2 tier)."""
        if self.host is not None:
            self._l3 = StorageSlot(
                tree=self.tree,
                host=self.host,
                counters=self.counters,
                sync=self._sync,
                stores=self.stores,
            )
        self._started = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> HiCache:
        if self.host is not None and not self._started:
            self.host.start()
        self._started = True
        return self

    def close(self) -> None:
        """Finish in-flight copies, apply them, detach L3, stop the workers. Idempotent."""
        if self.host is not None and self._started:
            try:
                self.flush()
            finally:
                self.detach_storage()
                self.host.close()
        self._started = False

    @property
    def hierarchical(self) -> bool:
        return self.host is not None

    @property
    def device_pool(self) -> DevicePool:
        """The L1 pool of the full KV (:attr:`device_tier`'s)."""
        return self.device_tier.pool

    @property
    def device_pages(self) -> int:
        """Pages of the L1 pool less the reserved ones (the most one request can hold)."""
        return self.device_tier.pages

    @property
    def host_pool(self) -> HostPool | None:
        """The L2 pool, when the hierarchical cache is on."""
        return None if self.host is None else self.host.pool

    # ------------------------------------------------------------------ L3

    def attach_storage(
        self,
        storage: HiCacheStorage,
        namespace: Namespace,
        prefetch: PrefetchConfig,
        ranks: RankGroup | None = None,
    ) -> None:
        """Add the L3 tier over ``storage`` (starts it and its threads). Needs the L2
        tier; one L3 at a time. On failure nothing is attached and ``storage`` is closed.

        The tier agrees over the cache's :attr:`ranks`; ``ranks``, when given, must be
        that group (a group of several ranks needs ``HiCache(..., ranks=...)``: the
        L1<->L2 completions must be agreed too)."""
        if self._l3 is None:
            raise ValueError("an L3 storage backend needs the hierarchical cache (L2) enabled")
        if ranks is not None and (ranks.size, ranks.rank) != (self.ranks.size, self.ranks.rank):
            storage.close()
            raise ValueError(
                f"attach_storage with rank {ranks.rank} of {ranks.size}, but the cache is rank"
                f" {self.ranks.rank} of {self.ranks.size}: build it with HiCache(..., ranks=)"
            )
        self._l3.attach(storage, namespace, prefetch)

    def detach_storage(self, timeout_s: float | None = None) -> bool:
        """Finish pending L3 writes (at most ``timeout_s``), stop the L3 threads and close
        the backend. Open prefetches are dropped; pages a late backend write may still
        fill stay out of use until it settles. False when none was attached."""
        if self._l3 is None or self._l3.tier is None:
            return False
        for req in self._requests:
            req.prefetch = None
        return self._l3.detach(self.wait_timeout_s if timeout_s is None else timeout_s)

    @property
    def storage(self) -> StorageTier | None:
        """The L3 tier, while a backend is attached."""
        return None if self._l3 is None else self._l3.tier

    @property
    def storage_attached(self) -> bool:
        return self.storage is not None

    # ------------------------------------------------------------------ request verbs

    def open(
        self,
        tokens: TokenIds,
        *,
        tenant: str = "",
        priority: int = 0,
        cacheable: bool = True,
        compute_last: bool = True,
    ) -> CacheRequest:
        """A handle for a request that just arrived with ``tokens``; starts its L3
        prefetch (lookup, then read into L2) so it runs while the request waits.

        ``tenant`` (a ``cache_salt``): the request matches and stores only its tenant's
        spans. ``priority``: higher stays longer under the ``priority`` eviction policy.
        ``cacheable`` False: no match, no prefetch, nothing kept (a disabled radix cache).
        ``compute_last`` (default): the last token is always computed, so the forward
        yields its logits; False lets every whole page of the sequence hit (a caller that
        only wants the KV, such as a warm-up or a test).
        """
        if not isinstance(tenant, str):
            raise TypeError(f"tenant must be a str, got {type(tenant).__name__}")
        req = CacheRequest(
            tenant=tenant,
            priority=int(priority),
            cacheable=cacheable,
            compute_last=compute_last,
            prompt_tokens=len(tokens),
        )
        if cacheable and self.storage is not None and len(tokens) > int(compute_last):
            key = encode_tokens(tokens[: len(tokens) - int(compute_last)])
            req.prefetch = self.storage.start(key, tenant)  # metadata only: no copy waited on
        return req

    def ready(self, req: CacheRequest) -> bool:
        """Whether ``req`` may be admitted now: its prefetch policy is satisfied, as agreed
        at the last :meth:`sync` (the same answer on every rank)."""
        if req.prefetch is None or self.storage is None:
            return True
        return self.storage.ready(req.prefetch)

    def admit(self, req: CacheRequest, tokens: TokenIds) -> bool:
        """Give ``req`` L1 pages for positions ``[0, len(tokens))``.

        The longest cached prefix of ``tokens[:-1]`` (so at least one token is left to
        compute; all of ``tokens`` when opened with ``compute_last=False``) comes from L1,
        or is loaded back from L2 (with what the prefetch brought from L3) layer by layer;
        fresh pages cover the rest. Hits are counted on the
        first admission only. Returns False, holding nothing, when L1 cannot make room
        now (``req`` stays waiting and may be admitted later).
        """
        if req.state is not RequestState.WAITING:
            raise RuntimeError(f"admit of a request that is {req.state.value}")
        if not tokens:
            raise ValueError("admit needs at least one token")
        if req.prefetch is not None:
            if self.storage is not None:
                req.storage_tokens += self.storage.take(req.prefetch)
            req.prefetch = None
        ps = self.page_size
        wanted = tokens[: len(tokens) - int(req.compute_last)] if req.cacheable else ()
        match = self.tree.match_prefix(wanted, req.tenant)
        node, pages, loaded, progress = self._load_back(match, req, load=not req._no_load)
        self.tree.inc_lock_ref(node)
        new = self.alloc_device(math.ceil(len(tokens) / ps) - len(pages))
        if new is None:
            self.tree.dec_lock_ref(node)
            return False
        req.prefix_pages = len(pages)  # the stores tell the tree's ids from the request's
        if not self.stores.admit(req, node, len(pages)):  # no room for a hit's values: later
            req.prefix_pages = 0
            self.device_tier.free(new)
            self.tree.dec_lock_ref(node)
            return False
        req.state = RequestState.ADMITTED
        req.node = node
        req.pages = pages + new
        req._prefix_tokens = len(pages) * ps
        req._progress = progress
        req.failed = None
        if req._no_load:  # the fallback of a failed load: it serves what L1 holds
            req._no_load = False
            req.cached = CachedTokens(device=min(req.cached.device, len(pages) * ps))
        self._requests.add(req)
        if req.prefix_pages > 0:
            for name, hits in self._hits.items():
                hits[1 if name in req._loaded else 0] += 1
        req._loaded.clear()
        if not req._counted:
            req._counted = True
            self._count(req, len(tokens), len(pages) * ps - loaded, loaded)
            if node.parent is not None:
                self.tree.count_hit(node)
                if self.host is not None and self.rule.backup_min_hits is not None:
                    self.host.back_up(node, self.rule.backup_min_hits, wait=False)
        return True

    def grow(self, req: CacheRequest, tokens: int, *, computed: int | None = None) -> bool:
        """Make ``req``'s pages cover positions ``[0, tokens)``, evicting cached pages if
        needed; False when L1 cannot make room (what was added stays with ``req``).

        Component stores grow too: ``computed`` (the first position of the next forward)
        lets them drop what that forward no longer reads (a sliding window's pages before
        it, :mod:`hicache.cache.components.swa`). Call this before every forward with its
        end and start."""
        self._require_admitted(req)
        if not self.stores.grow(req, tokens, computed):
            return False
        need = math.ceil(tokens / self.page_size) - len(req.pages)
        if need <= 0:
            return True
        new = self.alloc_device(need)
        if new is None:
            return False
        req.pages += new
        return True

    def plan_chunk(self, req: CacheRequest, start: int, tokens: int) -> ChunkPlan:
        """Where a forward of ``req`` over ``[start, start + tokens)`` must end (``tokens``
        or fewer) and after which of its new tokens the runner must keep the sequence's
        extras (what the component stores take at the next commit: recurrent state at a
        snapshot boundary). Pure: asking again gives the same plan."""
        self._require_admitted(req)
        if tokens < 1:
            raise ValueError(f"plan_chunk of {tokens} tokens; a forward runs at least 1")
        return self.stores.plan(req, start, tokens)

    def keep(self, req: CacheRequest, extras: SequenceExtras | None) -> None:
        """Hand the runner's ``extras`` of ``req``'s last forward to the component stores
        (used by the next commit that covers them; None: nothing kept)."""
        self._require_admitted(req)
        if extras is not None:
            self.stores.keep(req, extras)

    def commit(
        self, req: CacheRequest, tokens: TokenIds, *, extras: SequenceExtras | None = None
    ) -> None:
        """``tokens`` (a prefix of the request's sequence) now have their KV in ``req``'s
        pages: hand the whole pages to the tree so other requests share them (the write
        policy may back them up). ``req`` keeps using the tree's copy of them.

        ``extras``: the runner's extras of the forward that computed them (see
        :meth:`keep`); the stores hand what they cover to the tree with the pages (a state
        snapshot at a boundary, so later requests can resume there)."""
        self.keep(req, extras)
        self._commit(req, tokens, final=False)

    def _commit(self, req: CacheRequest, tokens: TokenIds, *, final: bool) -> None:
        """:meth:`commit` without extras; ``final``: the request's last commit (at its
        release), where stores also hand over what they keep for its end."""
        self._require_admitted(req)
        ps = self.page_size
        full = len(tokens) // ps
        if not req.cacheable or req.failed is not None or full <= req.prefix_pages:
            return
        if full > len(req.pages):
            raise ValueError(f"commit of {full} pages; the request holds {len(req.pages)}")
        prefix = tokens[: full * ps]
        components = self.stores.values(req, full, final)
        result = self.insert(
            prefix,
            req.pages[:full],
            priority=req.priority,
            tenant=req.tenant,
            back_up=False,
            components=components,
        )
        last = result.last_node
        tree_pages = _path_device_pages(last)  # not a match: a boundary need not be valid
        if len(tree_pages) != full:  # pragma: no cover - a tree invariant
            raise RuntimeError("committed prefix is not resident in L1")
        self.tree.inc_lock_ref(last)
        if req.node is not None:
            self.tree.dec_lock_ref(req.node)
        req.node = last
        req.pages = tree_pages + req.pages[full:]
        req.prefix_pages = full
        req._prefix_tokens = full * ps
        if self.host is not None:  # the tree's pages may be another request's load in flight
            req._progress = _union(req._progress, self.host.loads_on(last))
        self.stores.committed(req, last, full, len(tokens))
        if self.host is not None and self.rule.backup_min_hits is not None:
            self.host.back_up(result.last_node, self.rule.backup_min_hits, wait=False)
        if components and last.host is not None:
            self._back_up_added(last)

    def _back_up_added(self, node: TreeNode) -> None:
        """Component values were added at ``node``, whose KV was in L2 already (no backup
        was issued with them): copy them to L2 now, and write those copies to L3."""
        backed = self.stores.back_up(node)
        if backed and self.storage is not None:
            chosen = {id(n) for n in backed} | {id(node)}  # nodes of one path, ``node`` last
            path = self.tree.path_tail(node, self.tree.depth_pages(node))
            self.storage.write_components([n for n in path if id(n) in chosen])

    def release(
        self, req: CacheRequest, tokens: TokenIds | None = None, *, keep: bool = True
    ) -> None:
        """End ``req``: with ``keep`` (and a sequence ``tokens`` whose KV is computed),
        commit its whole pages first; then free its own pages and unpin its prefix. A
        waiting request gives up its prefetch. Idempotent."""
        if req.state is RequestState.RELEASED:
            return
        if req.prefetch is not None:
            if self.storage is not None:
                self.storage.take(req.prefetch)
            req.prefetch = None
        if req.state is RequestState.ADMITTED:
            if keep and tokens is not None:
                self._commit(req, tokens, final=True)
            if len(req.pages) > req.prefix_pages:
                self.device_tier.free(req.pages[req.prefix_pages :])
            self.stores.release(req)
            if req.node is not None:
                self.tree.dec_lock_ref(req.node)
            self._requests.discard(req)
        req.node = None
        req.pages = page_ids()
        req.prefix_pages = 0
        req._prefix_tokens = 0
        req._progress = ()
        req.state = RequestState.RELEASED

    def requeue(self, req: CacheRequest, tokens: TokenIds) -> None:
        """Preempt an admitted request: keep its computed KV (``tokens``) in the tree,
        give back its pages, and make it wait for a new :meth:`admit` (which finds its
        prefix cached and counts no hits again).

        A request whose load failed (``failed`` set) keeps nothing, and its next
        :meth:`admit` loads nothing from L2: its prefix is then what L1 holds (the failed
        chain is out of L1) and the prefill recomputes the rest, instead of the request
        failing (counted in ``load_fallbacks_total``)."""
        self._require_admitted(req)
        if req.failed is not None:
            req._no_load = True
            self.counters.load_fallbacks_total += 1
        self.release(req, tokens, keep=req.failed is None)
        req.state = RequestState.WAITING

    def _require_admitted(self, req: CacheRequest) -> None:
        if req.state is not RequestState.ADMITTED:
            raise RuntimeError(f"the request is {req.state.value}, not admitted")

    def _count(self, req: CacheRequest, query: int, device: int, loaded: int) -> None:
        storage = min(req.storage_tokens, loaded)
        req.cached = CachedTokens(device=device, host=loaded - storage, storage=storage)
        c = self.counters
        c.prefix_queries_total += 1
        c.query_tokens_total += query
        c.device_hit_tokens_total += device
        c.host_hit_tokens_total += loaded - storage
        c.storage_hit_tokens_total += storage

    # ------------------------------------------------------------------ prefix reuse

    def match_prefix(self, tokens: TokenIds, tenant: str = "") -> MatchResult:
        """The cached prefix of ``tokens`` in L1 and L2 (whole pages); copies nothing and
        applies nothing (the tree as of the last :meth:`sync`). Waits for no load: L1
        pages a load in flight maps may still be arriving (:meth:`HostTier.loads_on`
        names those loads; a request admitted over them waits for their layers in
        ``wait_layer``), and those of a load that failed since leave the tree at the next
        sync.
        """
        return self.tree.match_prefix(tokens, tenant)

    def _load_back(
        self, match: MatchResult, req: CacheRequest | None, *, load: bool = True
    ) -> tuple[TreeNode, PageIds, int, tuple[LayerProgress, ...]]:
        """Start copying the host-only part of ``match`` into L1, layer by layer; returns
        the deepest usable node, the prefix's L1 pages, the tokens being loaded and the
        progress of every load the prefix depends on: its own (if any), and those still
        in flight that other requests started for L1 pages of the prefix.

        With extra components the L1 part of a match may end above an L1-resident span
        (say, a node whose snapshot is only in L2): the prefix then runs in L1 down to the
        first host-only node (or to ``last_host_node`` when none is), and only the
        host-only nodes are copied.

        All-or-nothing per chain: when the host-only part is shorter than
        ``load_back_threshold`` tokens, or L1 cannot make room for it, nothing is loaded;
        nor when ``load`` is False (the fallback of a failed load: it is recomputed).
        """
        if self.host is None:
            return (match.last_device_node, match.device_pages, 0, ())
        no_load = (
            match.last_device_node,
            match.device_pages,
            0,
            self.host.loads_on(match.last_device_node),
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
                base_pages = _path_device_pages(base)
            if not nodes:
                if base is match.last_device_node:
                    return no_load
                return (base, base_pages, 0, self.host.loads_on(base))
            host_tokens = sum(self.tree.num_tokens(n) for n in nodes)
            if host_tokens < self.config.load_back_threshold:
                self.counters.load_skipped_tokens_total += host_tokens
                return no_load
            self.tree.inc_lock_ref(base)  # and the L1 prefix, while making room in L1
            try:
                device_pages = self.alloc_device(sum(self.tree.num_pages(n) for n in nodes))
            finally:
                self.tree.dec_lock_ref(base)
        finally:
            self.tree.dec_host_ref(last)
        if device_pages is None:
            self.counters.load_skipped_tokens_total += host_tokens
            return no_load
        self.host.load(nodes, device_pages, req)
        return last, base_pages + device_pages, host_tokens, self.host.loads_on(last)

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
        """Page level: hand the L1 pages of ``tokens`` (whole pages) to the tree; back
        up by policy (unless ``back_up`` is False).

        Pages the tree already holds under other ids are freed here. The caller keeps
        ownership of pages beyond the whole pages of ``tokens``.
        """
        result = self.tree.insert(
            tokens, device_pages, priority=priority, tenant=tenant, components=components or None
        )
        if result.duplicate_pages:
            self.device_tier.free(result.duplicate_pages)
        self.stores.free(Tier.DEVICE, result.component_duplicates)
        if back_up and self.host is not None and self.rule.backup_min_hits is not None:
            self.host.back_up(result.last_node, self.rule.backup_min_hits, wait=False)
        return result

    # ------------------------------------------------------------------ L1 pages

    def alloc_device(self, num_pages: int) -> PageIds | None:
        """Page level: ``num_pages`` free L1 pages, evicting unpinned cached pages if
        needed (waiting for backups, never for loads: :meth:`DeviceTier.alloc`); None when
        even eviction cannot make room. The caller owns the pages until it inserts or
        frees them."""
        return self.device_tier.alloc(num_pages)

    def free_device(self, pages: Iterable[int]) -> None:
        """Page level: return caller-owned L1 pages (never pages the tree holds)."""
        self.device_tier.free(pages)

    def reserve_device_pages(self, num_pages: int) -> PageIds | None:
        """Take ``num_pages`` L1 pages out of circulation for the caller's own writes (the
        scratch page that padding rows of a CUDA-graph decode batch write their K/V to,
        :mod:`hicache.runner.decode_graphs`) until :meth:`unreserve_device_pages`; None
        when even eviction cannot free that many. No request and no tree node is ever
        given a reserved page: the allocator counts it used, :meth:`reset` leaves it,
        :meth:`check_integrity` and :meth:`stats` count it held, and
        :attr:`device_pages` no longer counts it."""
        return self.device_tier.reserve(num_pages)

    def unreserve_device_pages(self, pages: Iterable[int]) -> None:
        """Give reserved pages back to the allocator. ValueError for a page not reserved
        (nothing freed then)."""
        self.device_tier.unreserve(pages)

    @property
    def reserved_device_pages(self) -> list[int]:
        """The L1 pages :meth:`reserve_device_pages` took out of circulation."""
        return self.device_tier.reserved

    def evict_device(self, num_pages: int) -> int:
        """Free at least ``num_pages`` L1 pages if possible; returns pages freed.

        Backed-up leaves are demoted to L2-only; the others are dropped, except under
        ``write_back``, which backs them up first.
        """
        return self.device_tier.evict(num_pages)

    def evict_host(self, num_pages: int) -> int:
        """Free at least ``num_pages`` L2 pages if possible; returns pages freed."""
        return 0 if self.host is None else self.host.evict(num_pages)

    # ------------------------------------------------------------------ component stores

    @property
    def resumable(self) -> bool:
        """Whether a model that carries state between forwards can resume cached prefixes
        here (a store hands admitted requests a state to resume from)."""
        return self.stores.resumes

    def store(self, kind: type[S]) -> S | None:
        """The component store of type ``kind``, or None when the model has none."""
        return self.stores.of_type(kind)

    def runner_pools(self) -> dict[str, DevicePool]:
        """The component stores' L1 pools the model reads and writes in a forward, by
        component name (the slots come from :meth:`CacheRequest.pool_slots`)."""
        return self.stores.runner_pools()

    def component_hits(self) -> tuple[ComponentHits, ...]:
        """Admissions that reused a prefix, per component store, since the cache was
        built (see :class:`ComponentHits`)."""
        return tuple(ComponentHits(n, h[0], h[1]) for n, h in self._hits.items())

    # ------------------------------------------------------------------ completions

    def sync(self) -> int:
        """Apply what the workers posted, agreed with the other ranks: every op in flight,
        in op order, with the agreed values (:meth:`CacheSync.sync`); returns how many
        records were applied. The one point per step where records are applied (besides
        the cache's waits), the same with one rank or many: every rank calls it at the
        same point of its step (the engine: once per step)."""
        return self._sync.sync()

    def flush(self) -> None:
        """Wait (bounded) for every in-flight copy (L1<->L2, then L2->L3) and apply it."""
        if self.host is not None and self._started:
            self.host.wait_idle()
            if self.storage is not None:
                self.storage.flush(self.wait_timeout_s)
            self.sync()  # failed loads are applied here, outside the wait

    # ------------------------------------------------------------------ whole cache

    def reset(self) -> None:
        """Empty L1 and L2 (``/flush_cache``). Refuses while any node is pinned."""
        self.flush()
        if self._requests or any(n.lock_ref > 0 or n.host_ref > 0 for n in self.tree.iter_nodes()):
            raise RuntimeError("cannot reset the cache while requests hold prefixes")
        self.device_tier.free(self.tree.device_page_ids())
        if self.host is not None:
            self.host.allocator.free(self.tree.host_page_ids())
        self.stores.reset((Tier.DEVICE, *((Tier.HOST,) if self.host is not None else ())))
        self.tree.reset()

    @property
    def requests(self) -> int:
        """Admitted requests holding pages."""
        return len(self._requests)

    def request_pages(self) -> list[int]:
        """L1 pages admitted requests own (not the tree's)."""
        return [p for r in self._requests for p in r.pages[r.prefix_pages :]]

    def stats(self) -> CacheStats:
        """Occupancy per tier (tokens) and every counter, as one snapshot."""
        stats = cache_stats(
            self.tree,
            self.device_pool,
            self.host_pool,
            self.counters,
            None if self.storage is None else self.storage.controller.storage,
            held_device_pages=len(self.request_pages()) + len(self.device_tier.reserved),
        )
        cached = cached_tokens(self.device_pool)
        ps = self.page_size
        full = dataclasses.replace(
            full_usage(self.device_pool, self.host_pool),
            device_requests=stats.device_request_tokens // ps,
            device_cached=stats.device_cached_tokens // ps,
            host_cached=stats.host_cached_tokens // ps,
        )
        usage = (full, *self.stores.usages(cached, list(self._requests)))
        return dataclasses.replace(stats, components=usage)

    def tree_digest(self) -> str:
        """SHA-256 (hex) of the tree's structure (:func:`~hicache.cache.inspect.tree_digest`):
        tensor-parallel ranks whose trees stayed identical have equal digests."""
        return tree_digest(self.tree)

    def check_integrity(self, request_pages: Iterable[int] = ()) -> None:
        """Check tree and allocators agree: every used L1 page is owned by the tree, an
        admitted request, the reserved pages or ``request_pages`` (pages other callers
        hold), exactly once;
        every used L2 page is owned by the tree or held by an L3 op (or by a detached
        backend that may still write it). Raises AssertionError."""
        l3 = self._l3
        host_held = [] if l3 is None else l3.held_host_pages()
        ids_held = (
            {n: [] for n in self.stores.names}
            if l3 is None
            else l3.held_component_ids(self.stores.names)
        )
        check_cache_integrity(
            self.tree,
            self.device_pool,
            self.host_pool,
            [
                *self.request_pages(),
                *self.device_tier.reserved,
                *request_pages,
                *(self.host.quarantined_device_pages() if self.host is not None else ()),
            ],
            host_held,
        )
        self.stores.check(list(self._requests), ids_held)


def _union(a: tuple[LayerProgress, ...], b: tuple[LayerProgress, ...]) -> tuple[LayerProgress, ...]:
    """``a`` and the progresses of ``b`` not in it, in order."""
    return a + tuple(p for p in b if all(p is not q for q in a))


def _path_device_pages(node: TreeNode) -> PageIds:
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
