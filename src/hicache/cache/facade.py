"""HiCache: the one facade a scheduler talks to, in requests.

It holds the request verbs (``open``, ``ready``, ``admit``, ``plan_chunk``, ``grow``,
``commit``, ``release``, ``requeue``, ``reusable_prefix``), :meth:`HiCache.sync` and the
read-only :class:`CacheContext`, over the tree and the model's stores: first the full KV
(:attr:`HiCache.full`, a :class:`~hicache.cache.full_kv.FullKVStore`: its L1 and L2
halves and the page-level API behind its ``pages``), then one store per extra component of its
:class:`~hicache.spec.CacheSpec` (:mod:`hicache.cache.components`), and the optional L3
tier behind an :class:`~hicache.cache.l3.slot.L3Slot` (:attr:`HiCache.l3`). All methods run on the owner's
thread; worker records are applied by :class:`~hicache.cache.sync.CacheSync` at
:meth:`HiCache.sync` (once per step, whatever the rank count) and inside explicit waits;
no verb applies a record. Stats, the integrity check and the rank digest live beside it
(:mod:`hicache.cache.report`). A request's life cycle as an engine drives it:
docs/architecture.md, "Request flow".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hicache.cache.components import STORE_TYPES
from hicache.cache.components.base import (
    ChunkPlan,
    ComponentStore,
    ServingLimits,
    StoreContext,
)
from hicache.cache.components.stores import ComponentStores, store_type
from hicache.cache.full_kv import FullKVStore
from hicache.cache.full_pages import FullPages
from hicache.cache.l3.slot import L3Slot
from hicache.cache.request import CacheRequest, RequestState, ScoreAsk, ScoreLog
from hicache.cache.restores import Restores
from hicache.cache.sessions import Sessions
from hicache.cache.sync import DEFAULT_WAIT_TIMEOUT_S, CacheSync
from hicache.config import CacheConfig
from hicache.controller import write_rule
from hicache.controller.rank_group import RankGroup
from hicache.extras import SequenceExtras
from hicache.lifecycle import Lifecycle
from hicache.metrics import CacheCounters
from hicache.rates import RateFit, RestoreRates
from hicache.spec import CacheSpec, KVSpec
from hicache.tree import HiRadixTree
from hicache.tree.node import TokenIds
from hicache.tree.residency import ResidencyObserver
from hicache.validate import number_at_least

__all__ = ["DEFAULT_WAIT_TIMEOUT_S", "CacheContext", "HiCache"]


@dataclass(frozen=True, kw_only=True)
class CacheContext:
    """What a cache was built with, fixed for its life: its ``config``, the full KV's
    shape ``spec`` (the global layers only when sliding layers have their own store) and
    the tensor-parallel ``ranks`` it agrees with (one rank: its verdict is its vote)."""

    config: CacheConfig
    spec: KVSpec
    ranks: RankGroup

    @property
    def page_size(self) -> int:
        """Tokens per page (``config.page_size``)."""
        return self.config.page_size


class HiCache(Lifecycle):
    """Hierarchical KV cache over the model's stores (:attr:`full` first, then
    :attr:`stores`) and an optional L3 storage tier (attached at :attr:`l3`).

    With ``config.enable_hierarchical_cache`` false there is no L2: the tree is a plain
    radix cache over L1 and eviction drops nodes.

    ``spec``: what the model caches (:class:`~hicache.spec.CacheSpec`, the model side
    produces it), or a plain :class:`KVSpec` for a full-KV-only model. Each of its
    components gets a store (:mod:`hicache.cache.components`) of the type in
    ``store_types`` that takes its spec; :attr:`context` holds the full KV's shape.
    ``limits``: refuse (ValueError) stores too small to serve one request under them.

    ``ranks``: the tensor-parallel group this cache is one rank of (None: one rank);
    records are applied as every rank agreed (see :meth:`sync`), so every rank's tree
    stays the same.
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
        cache_spec = CacheSpec.of(spec)
        kv = cache_spec.kv
        number_at_least("wait_timeout_s", wait_timeout_s, 0.001, "of seconds")
        self._wait_timeout_s = wait_timeout_s
        if limits is not None:  # every store can serve one request
            for c in cache_spec.components:
                store_type(c, store_types).check_limits(config, kv, c, limits)
        tree = HiRadixTree(
            config.page_size,
            config.eviction_policy,
            ComponentStores.tree_components(cache_spec, store_types),
        )
        self._tree = tree
        counters = CacheCounters()
        self._sync = CacheSync(
            tree=tree, token_bytes=kv.token_bytes, ranks=ranks, wait_timeout_s=wait_timeout_s
        )
        self.context = CacheContext(config=config, spec=kv, ranks=self._sync.ranks)
        """What the cache was built with (config, full KV shape, page size, ranks)."""
        self._requests = self._sync.holders
        dev = torch.device(device)
        ctx = StoreContext(tree=tree, config=config, kv=kv, device=dev, sync=self._sync)
        self.stores = ComponentStores.build(cache_spec, ctx, store_types)
        """The model's component stores, in its spec's order (empty: full KV only)."""
        pages = FullPages(
            tree=tree,
            config=config,
            spec=kv,
            device=dev,
            rule=write_rule(config),
            counters=counters,
            sync=self._sync,
            stores=self.stores,
            layer_hook=layer_hook,
        )
        self.full = FullKVStore(pages)
        """The full KV: the first store, the tree's spine (its page-level API: ``full.pages``)."""
        self._l3 = L3Slot(
            tree=tree,
            host=pages.host,
            counters=counters,
            sync=self._sync,
            stores=self.stores,
        )
        self.sessions = Sessions(
            tree,
            host_pages=pages.host.num_pages,
            ratio=config.session_ratio,
            page_size=config.page_size,
            counters=counters,
            landed_end=pages.host.landed_end,
            write_path=self._l3.write_path,
        )
        """The idle agent sessions whose KV is kept in L2 (:mod:`hicache.cache.sessions`)."""
        pages.host.serve_yields(self.sessions.yield_pages)
        self.restores = Restores(
            tree=tree, l3=self._l3, pages=pages, stores=self.stores, counters=counters
        )
        """Prefixes brought from L3 into L2 ahead of their request, and held there."""
        self._started = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> HiCache:
        if not self._started:
            self.full.start()
        self._started = True
        return self

    def close(self) -> None:
        """Finish in-flight copies, apply them, detach L3, stop the workers. Idempotent."""
        if self._started:
            try:
                self.sync(wait=True)
            finally:
                self._l3.detach()
                self.full.close()
        self._started = False

    # ------------------------------------------------------------------ request verbs

    def open(
        self,
        tokens: TokenIds,
        *,
        tenant: str = "",
        priority: int = 0,
        cacheable: bool = True,
        compute_last: bool = True,
        max_prefix: int | None = None,
        max_load: int | None = None,
        scores: ScoreAsk | None = None,
    ) -> CacheRequest:
        """A handle for a request that just arrived with ``tokens``; starts its L3
        prefetch (lookup, then read into L2) so it runs while the request waits.

        ``tenant`` (a ``cache_salt``): the request matches and stores only its tenant's
        spans. ``priority``: higher stays longer under the ``priority`` eviction policy.
        ``cacheable`` False: no match, no prefetch, nothing kept (a disabled radix cache).
        ``compute_last`` (default): the last token is always computed, so the forward
        yields its logits; False lets every whole page of the sequence hit (a caller that
        only wants the KV, such as a warm-up or a test). ``max_prefix``: at most this
        many leading tokens may come from the cache (whole pages: the match floors to a
        page, and to a boundary every component store can resume from), the rest is
        computed whatever is cached; None: no limit. A request that needs the logits of
        early positions (prompt log probabilities) sets it; it still commits its pages for
        others like any request. ``max_load``: at most this many tokens of the prefix may
        be restored from L2 and L3 (whole pages; L1 hits do not count; the prefetch reads
        no further than what L1 holds now plus this); None: no limit. ``scores``: the
        request scores its prompt (positions ``scores.start`` on, ``scores.top``
        alternatives): when a store keeps scoring entries of that many alternatives, the
        handle gets a :class:`~hicache.cache.request.ScoreLog` and ``max_prefix`` is
        dropped (the entries cap the match instead, and the admission hands the cached
        positions' records back in it); else ``max_prefix`` stands.
        """
        if not isinstance(tenant, str):
            raise TypeError(f"tenant must be a str, got {type(tenant).__name__}")
        if max_prefix is not None and (
            isinstance(max_prefix, bool) or not isinstance(max_prefix, int) or max_prefix < 0
        ):
            raise ValueError(f"max_prefix={max_prefix!r} is invalid; must be None or an int >= 0")
        if max_load is not None and (
            isinstance(max_load, bool) or not isinstance(max_load, int) or max_load < 0
        ):
            raise ValueError(f"max_load={max_load!r} is invalid; must be None or an int >= 0")
        keep = self.stores.scoring_top() if scores is not None else None
        if keep is not None and scores is not None and scores.top > keep:
            keep = None  # asks more alternatives than are kept: it recomputes
        req = CacheRequest(
            tenant=tenant,
            priority=int(priority),
            cacheable=cacheable,
            compute_last=compute_last,
            max_prefix=max_prefix if keep is None else None,
            max_load=max_load,
            prompt_tokens=len(tokens),
            page_size=self.context.page_size,
        )
        if keep is not None and scores is not None:
            req.scores = ScoreLog(scores, keep, tokens)
        if cacheable:
            wanted = tokens[: req.reusable(len(tokens))]
            if max_load is not None:  # L3 pages past L1's prefix plus the cap are no use
                wanted = wanted[: self.full.device_prefix(wanted, tenant) + max_load]
            req.prefetch = self._l3.tier.prefetches.start(
                wanted, tenant, optional=req.scores is not None
            )
        return req

    def ready(self, req: CacheRequest) -> bool:
        """Whether ``req`` may be admitted now: its prefetch policy is satisfied, as agreed
        at the last :meth:`sync` (the same answer on every rank)."""
        return req.prefetch is None or self._l3.tier.prefetches.ready(req.prefetch)

    def admit(self, req: CacheRequest, tokens: TokenIds) -> bool:
        """Give ``req`` L1 pages for positions ``[0, len(tokens))``.

        The longest cached prefix of ``tokens[:-1]`` (so at least one token is left to
        compute; all of ``tokens`` when opened with ``compute_last=False``; at most
        ``max_prefix`` tokens when opened with one) comes from L1,
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
            req.storage_tokens += self._l3.tier.prefetches.take(req.prefetch)
            req.prefetch = None
        wanted = tokens[: req.reusable(len(tokens))] if req.cacheable else ()
        if wanted and req.scores is not None:  # as far as the scoring entries serve
            wanted = wanted[: self.stores.cap(req, wanted)]
        got = self.full.admit(req, wanted, len(tokens))
        if not got.ok:
            return False
        assert got.node is not None
        if not self.stores.admit(req, got.node, got.prefix_pages):  # no room for a hit's
            self.full.release(req)  # values now: later
            return False
        req.state = RequestState.ADMITTED
        req.failed = None
        self._requests.add(req)
        loaded = req.take_loaded()
        if got.prefix_pages > 0:
            self.stores.count_hit(loaded)
        self.full.admitted(req, got, len(tokens))  # hits counted at the first admission
        return True

    def grow(self, req: CacheRequest, tokens: int, *, computed: int | None = None) -> bool:
        """Make ``req``'s pages cover positions ``[0, tokens)``, evicting cached pages if
        needed; False when L1 cannot make room (what was added stays with ``req``).

        Component stores grow too: ``computed`` (the first position of the next forward)
        lets them drop what that forward no longer reads (a sliding window's pages before
        it, :mod:`hicache.cache.components.swa`). Call this before every forward with its
        end and start."""
        self._require_admitted(req)
        return self.stores.grow(req, tokens, computed) and self.full.grow(req, tokens)

    def plan_chunk(self, req: CacheRequest, start: int, tokens: int) -> ChunkPlan:
        """Where a forward of ``req`` over ``[start, start + tokens)`` must end (``tokens``
        or fewer) and after which of its new tokens the runner must keep the sequence's
        extras (what the component stores take at the next commit: recurrent state at a
        snapshot boundary). Pure: asking again gives the same plan."""
        self._require_admitted(req)
        if tokens < 1:
            raise ValueError(f"plan_chunk of {tokens} tokens; a forward runs at least 1")
        return self.stores.plan(req, start, tokens)

    def commit(
        self,
        req: CacheRequest,
        tokens: TokenIds = (),
        *,
        extras: SequenceExtras | None = None,
    ) -> None:
        """``tokens`` (a prefix of the request's sequence) now have their KV in ``req``'s
        pages: hand the whole pages to the tree so other requests share them (the write
        policy may back them up). ``req`` keeps using the tree's copy of them.

        ``extras``: the runner's extras of ``req``'s last forward, handed to the component
        stores; they give what these tokens cover to the tree with the pages (a state
        snapshot at a boundary, so later requests can resume there) and keep the rest for
        a later commit or the release. With no ``tokens`` only the extras are handed over
        (a forward whose pages are committed later, a decode step's)."""
        self._require_admitted(req)
        if extras is not None:
            self.stores.keep(req, extras)
        self._commit(req, tokens, final=False)

    def _commit(self, req: CacheRequest, tokens: TokenIds, *, final: bool) -> None:
        """:meth:`commit` without extras; ``final``: the request's last commit (at its
        release), where stores also hand over what they keep for its end."""
        self._require_admitted(req)
        ps = self.context.page_size
        full = len(tokens) // ps
        if not req.cacheable or req.failed is not None:
            return
        if full <= req.prefix_pages:
            if final and req.node is not None:  # values that came after their pages
                self.stores.late(req, req.node, req.prefix_pages)
                if self.stores.take_added():
                    self._l3.back_up_added(req.node)
            return
        components = self.stores.values(req, full, final)
        last = self.full.commit(req, tokens[: full * ps], components)
        self.stores.committed(req, last, full, len(tokens))
        added = self.stores.take_added()  # values placed on nodes in L2 already
        if (components or added) and last.host is not None:  # no backup was issued with them
            self._l3.back_up_added(last)

    def release(
        self, req: CacheRequest, tokens: TokenIds | None = None, *, commit: bool = True
    ) -> None:
        """End ``req``: with ``commit`` (and a sequence ``tokens`` whose KV is computed),
        commit its whole pages first and, when its L3 tier announces its writes
        (``announce_writes``), announce those on their way to L3 (waiting a few
        milliseconds at most until that is stored, so a next turn looked up anywhere finds
        them announced: docs/architecture.md, "The next turn finds the previous answer");
        then free its own pages and unpin its prefix. A waiting request gives up its
        prefetch. Idempotent."""
        if req.state is RequestState.RELEASED:
            return
        if req.prefetch is not None:
            self._l3.tier.prefetches.take(req.prefetch)
            req.prefetch = None
        if req.state is RequestState.ADMITTED:
            if commit and tokens is not None:
                self._commit(req, tokens, final=True)
                if req.node is not None and req.failed is None:  # its answer ends now: a
                    self._l3.tier.writes.announce(req.node)  # next turn may look it up
            self.stores.release(req)  # before the full part: they read its prefix
            self._requests.discard(req)
        self.full.release(req)
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
            self.full.fail_over(req)
        self.release(req, tokens, commit=req.failed is None)
        req.state = RequestState.WAITING

    def _require_admitted(self, req: CacheRequest) -> None:
        if req.state is not RequestState.ADMITTED:
            raise RuntimeError(f"the request is {req.state.value}, not admitted")

    def reusable_prefix(self, req: CacheRequest, tokens: TokenIds) -> int:
        """Tokens of ``tokens``' prefix the cache holds in L1 and L2 that ``req`` may reuse
        (whole pages of its tenant's; none when it is not cacheable; what its
        ``compute_last`` and ``max_prefix`` allow): what its admission could reuse as of
        the last :meth:`sync`. Copies and applies nothing: a scheduling policy's question
        (``lpm``)."""
        if not req.cacheable:
            return 0
        wanted = tokens[: req.reusable(len(tokens))]
        return self._tree.match_prefix(wanted, req.tenant).matched_tokens

    # ------------------------------------------------------------------ completions

    def sync(self, *, wait: bool = False) -> int:
        """Apply what the workers posted, agreed with the other ranks: every op in flight,
        in op order, with the agreed values (:meth:`CacheSync.sync`); returns how many
        records were applied. The one point per step where records are applied (besides
        the cache's waits), the same with one rank or many: every rank calls it at the
        same point of its step (the engine: once per step).

        ``wait``: first wait (bounded) for every copy in flight (L1<->L2, then L2->L3), so
        all of them are applied; a cache not started applies nothing then (returns 0)."""
        if wait:
            if not self._started:
                return 0
            self.full.wait_idle()
            self.sessions.refresh()  # what landed may demote sessions: their writes are
            self._l3.tier.flush(self._wait_timeout_s)  # waited for with the others
        applied = self._sync.sync()  # failed loads are applied here, outside the wait
        if applied:
            self.sessions.refresh()  # pin what landed in L2 for the sessions waiting on it
        return applied

    # ------------------------------------------------------------------ whole cache

    def reset(self) -> None:
        """Empty L1 and L2 (``/flush_cache``), ending every kept session. Refuses while
        any node is pinned otherwise."""
        self.sync(wait=True)
        self.sessions.clear()
        self._l3.tier.flush(self._wait_timeout_s)  # what that sync wrote ahead (watermark)
        tree = self._tree
        if self._requests or any(n.lock_ref > 0 or n.host_ref > 0 for n in tree.iter_nodes()):
            raise RuntimeError("cannot reset the cache while requests hold prefixes")
        self.full.reset()
        self.stores.reset(self.full.tiers)
        tree.reset()

    def observe_residency(self, observer: ResidencyObserver | None) -> None:
        """Report every change of where full-KV pages live on this instance (L1 or L2) to
        ``observer`` (KV events; ``None`` stops); it is called in the owner's thread."""
        self._tree.observe_residency(observer)

    @property
    def backing_up(self) -> bool:
        """L1 -> L2 copies in flight: the :meth:`sync` that applies them issues their L3
        writes, so a driver with nothing else to do syncs again soon (an answer's pages
        reach L3 the sooner for a next turn looked up elsewhere)."""
        return self.full.pages.host.backing_up

    @property
    def admitted(self) -> tuple[CacheRequest, ...]:
        """The admitted requests holding pages."""
        return tuple(self._requests)

    def measure_prefill(self, source: Callable[[], RateFit | None]) -> None:
        """Read this rank's prefill rate from ``source`` (the engine's prefill timer): what
        recomputing an L3 hit costs, against reading it (:mod:`hicache.cache.l3.worth`)."""
        self._sync.prefill_rate = source

    @property
    def restore_rates(self) -> RestoreRates:
        """What restoring costs on this rank, per tier, as measured from its loads and
        L3 reads so far (:mod:`hicache.rates`)."""
        return self._sync.restore_meter.rates()

    @property
    def l3(self) -> L3Slot:
        """Where the L3 tier attaches: ``l3.attach(storage, namespace, prefetch)``,
        ``l3.detach()``, the tier while attached (``l3.attached``), its quarantines."""
        return self._l3
