"""Restores: a prefix brought from L3 into L2 ahead of the request that will use it, then
held there.

:meth:`Restores.start` opens a :class:`Restore` over the whole pages of ``tokens``: its L3
prefetch runs like a request's (looked up and read as every rank agrees; any hit is read,
whatever ``prefetch_threshold``: it runs ahead of its request). Once its read is
final (agreed state: the same step on every rank) :meth:`Restores.advance` hangs what
arrived into the tree and pins the deepest node of the prefix that is in L2
(``inc_host_ref``): the *hold*. :meth:`Restores.release` ends it in any stage (a prefetch
still running is taken as a request's would be: what arrived stays cached, unpinned).
Stages: ``LOADING -> HELD | FAILED``, then ``ENDED``; a failed restore holds nothing and
says why (``error``: no L3 attached, or the backend's reason for its lookup's failure).
A held prefix may be copied on into L1 (:meth:`Restores.load_to_l1`) when the caller says
how many free L1 pages nothing else needs: no page is evicted for it.
Runs on the cache owner's thread; :meth:`Restores.resident` only reads.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hicache.cache.components.stores import ComponentStores
from hicache.cache.full_pages import FullPages
from hicache.cache.host_tier import HostTier
from hicache.cache.l3.prefetch import Prefetch
from hicache.cache.l3.slot import L3Slot
from hicache.cache.request import CachedTokens
from hicache.metrics import CacheCounters
from hicache.tree import HiRadixTree, TreeNode
from hicache.tree.node import TokenIds

__all__ = ["NO_L3", "Restore", "RestoreStage", "Restores"]

NO_L3 = "no L3 storage backend is attached"
"""Why a restore started while no L3 tier is attached fails."""


class RestoreStage(str, enum.Enum):
    """Where a :class:`Restore` is."""

    LOADING = "loading"
    """Its L3 prefetch runs (lookup, then read into L2)."""
    HELD = "held"
    """What arrived hangs in the tree; the prefix in L2 is pinned there."""
    FAILED = "failed"
    """It ended without a hold (``error`` says why)."""
    ENDED = "ended"
    """Released (its hold, if any, is given back)."""


@dataclass(eq=False)
class Restore:
    """One restore, owner-side: ``tokens`` (whole pages) of ``tenant``'s. ``prefetch``:
    its L3 prefetch while it runs (None: nothing to fetch, or taken). ``node``: the node
    pinned in L2 while held (None: nothing of the prefix is in L2). ``storage_tokens``:
    tokens its read brought from L3 into the tree."""

    tokens: TokenIds
    tenant: str
    stage: RestoreStage = RestoreStage.LOADING
    prefetch: Prefetch | None = None
    node: TreeNode | None = None
    storage_tokens: int = 0
    error: str | None = None


class Restores:
    """The restores of one cache: their verbs over its tree and L3 slot."""

    def __init__(
        self,
        *,
        tree: HiRadixTree,
        l3: L3Slot,
        pages: FullPages,
        stores: ComponentStores,
        counters: CacheCounters,
    ) -> None:
        self._counters = counters
        self._tree = tree
        self._l3 = l3
        self._pages = pages
        self._stores = stores
        self._page_size = pages.device_pool.page_size

    def start(self, tokens: TokenIds, tenant: str = "") -> Restore:
        """A restore of the whole pages of ``tokens``, its prefetch started (FAILED at
        once, holding nothing, when no L3 tier is attached)."""
        whole = tokens[: len(tokens) // self._page_size * self._page_size]
        r = Restore(tokens=whole, tenant=tenant)
        self._counters.restores_total += 1
        if self._l3.attached is None:
            r.stage, r.error = RestoreStage.FAILED, NO_L3
            self._counters.restore_failures_total += 1
            return r
        r.prefetch = self._l3.tier.prefetches.start(whole, tenant, any_hit=True)
        return r

    def advance(self, r: Restore) -> bool:
        """Move a loading ``r`` on once its prefetch is over, as every rank agreed at the
        last sync: its pages hang in the tree and its prefix in L2 is held (HELD), or,
        when its lookup failed or its tier was detached meanwhile, it holds nothing
        (FAILED). Returns whether ``r`` changed stage."""
        if r.stage is not RestoreStage.LOADING:
            return False
        p = r.prefetch
        if p is not None and not p.taken and not p.finished:
            return False
        if p is not None and p.taken:  # its tier was detached under it: given up
            r.prefetch = None
            r.stage, r.error = RestoreStage.FAILED, f"the L3 tier was detached; {NO_L3}"
            self._counters.restore_failures_total += 1
            return True
        if p is not None and p.lookup_failed:
            self._take(r)
            r.stage = RestoreStage.FAILED
            r.error = f"the L3 lookup failed: {p.lookup_error or 'on another rank'}"
            self._counters.restore_failures_total += 1
            return True
        self._take(r)
        end = self._tree.match_full(r.tokens, r.tenant).last_host_node
        node = self._pages.host.landed_end(end)
        if node is not None:
            self._tree.inc_host_ref(node)
            r.node = node
        r.stage = RestoreStage.HELD
        return True

    def release(self, r: Restore) -> None:
        """End ``r``: give its hold back, or take its prefetch still running (what arrived
        stays cached, unpinned). Idempotent."""
        if r.stage is RestoreStage.ENDED:
            return
        self._take(r)
        if r.node is not None:
            self._tree.dec_host_ref(r.node)
            r.node = None
        if r.stage is not RestoreStage.FAILED:
            r.stage = RestoreStage.ENDED

    def load_to_l1(self, r: Restore, spare_pages: int) -> int:
        """Start copying the part of held ``r``'s prefix that is in L2 alone into L1,
        layer by layer, when it fits in ``spare_pages`` (free L1 pages nothing else needs;
        no page is evicted); the copy pins its chain until it lands, then the pages stay
        cached in L1 like any. Returns the tokens whose copy started (0: none; always 0
        for a model with extra component stores, whose values a hit in L1 needs too)."""
        host = self._pages.host
        if r.stage is not RestoreStage.HELD or r.node is None or self._stores.needed_on_hit:
            return 0
        if not isinstance(host, HostTier):  # pragma: no cover - a hold needs L2
            return 0
        tree = self._tree
        nodes = tree.host_only_path(r.node)
        need = sum(tree.num_pages(n) for n in nodes)
        free = self._pages.device.allocator.free_pages
        if not need or need > min(spare_pages, free):
            return 0
        device_pages = self._pages.alloc(need)  # free pages enough: nothing is evicted
        if device_pages is None:  # pragma: no cover - checked above
            return 0
        host.load(nodes, device_pages, None)
        self._counters.restore_l1_tokens_total += need * self._page_size
        return need * self._page_size

    def _take(self, r: Restore) -> None:
        if r.prefetch is not None:
            if self._l3.attached is not None:
                got = self._l3.tier.prefetches.take(r.prefetch)
                r.storage_tokens += got
                self._counters.restore_tokens_total += got
            r.prefetch = None

    def resident(self, r: Restore) -> CachedTokens:
        """Tokens of ``r``'s prefix now in L1 (``device``) and in L2 (``host``) on its held
        path, and those its read brought from L3 (``storage``). Reads only."""
        device = host = 0
        node = r.node
        while node is not None and node.parent is not None:
            n = self._tree.num_tokens(node)
            device += n if node.device is not None else 0
            host += n if node.host is not None else 0
            node = node.parent
        return CachedTokens(device=device, host=host, storage=r.storage_tokens)
