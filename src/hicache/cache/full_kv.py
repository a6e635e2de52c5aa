"""Full KV as the first store of a cache: the tree's spine and the only store with
layer-wise copies, behind the same request verbs as the component stores.

:class:`FullKVStore` runs the request verbs over its :attr:`~FullKVStore.pages`
(:class:`~hicache.cache.full_pages.FullPages`: the tree, the L1 and L2 halves, the
page-level API tools and tests use; its L2 half starts the layer-wise load back of a
hit). Its per-request data is the handle's
:class:`~hicache.cache.request.FullPart` (the page table), changed here only. Request
verbs, in order: :meth:`~FullKVStore.admit` (match, load back, pin, allocate: a
:class:`FullAdmission`, not ok when L1 has no room), :meth:`~FullKVStore.admitted`
(every store took it: hits counted once), :meth:`~FullKVStore.grow`,
:meth:`~FullKVStore.commit` (whole pages), :meth:`~FullKVStore.release`,
:meth:`~FullKVStore.fail_over` (requeued after a failed load).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hicache.cache.components.base import HeldPages, StoreAdmission
from hicache.cache.full_pages import FullPages
from hicache.cache.host_tier import path_device_pages
from hicache.cache.request import CachedTokens, CacheRequest
from hicache.transfer import LayerProgress
from hicache.tree import TreeNode
from hicache.tree.components import ComponentValues, Tier
from hicache.tree.node import TokenIds

__all__ = ["FULL", "FullAdmission", "FullKVStore"]

FULL = "full"
"""The full KV's name in reports (``ComponentUsage.name``)."""


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
    """The full KV of one cache (see the module docstring): the request verbs over
    ``pages`` (its tree, tiers and pools, page by page)."""

    name = FULL

    def __init__(self, pages: FullPages) -> None:
        self._tree = pages.tree
        self._page_size = pages.tree.page_size
        self._counters = pages.counters
        self.pages = pages
        """The tree, tiers and pools of the full KV, page by page (tools, tests, reports)."""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the L2 half's copy worker."""
        self.pages.host.start()

    def close(self) -> None:
        """Stop the L2 half's copy worker."""
        self.pages.host.close()

    def wait_idle(self) -> None:
        """Wait (bounded, agreed) until every L1<->L2 copy in flight is applied."""
        self.pages.host.wait_idle()

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers the cache has below L3: L1, and L2 with the hierarchical cache."""
        return (Tier.DEVICE, *self.pages.host.tiers)

    # ------------------------------------------------------------------ requests

    def device_prefix(self, tokens: TokenIds, tenant: str) -> int:
        """Tokens of the longest prefix of ``tokens`` whose full KV L1 holds now (whole
        pages; the matched nodes are marked accessed)."""
        return self._tree.match_prefix(tokens, tenant).device_tokens

    def admit(self, req: CacheRequest, wanted: TokenIds, tokens: int) -> FullAdmission:
        """Give ``req`` L1 pages for positions ``[0, tokens)``: the longest cached prefix
        of ``wanted`` from L1, or loaded back from L2 layer by layer (nothing from L2
        after a failed load), pinned; fresh pages for the rest. Not ok, holding nothing,
        when L1 cannot make room now."""
        part = req.full
        match = self._tree.match_prefix(wanted, req.tenant)
        if req.max_load is not None and match.host_tokens > req.max_load:
            # restore at most max_load tokens: match no further (a whole page, and a
            # boundary every component accepts, at or below it)
            match = self._tree.match_prefix(
                wanted[: match.device_tokens + req.max_load], req.tenant
            )
        hit = self.pages.host.load_back(match, req, not part.no_load, self.pages.alloc)
        self._tree.inc_lock_ref(hit.node)
        new = self.pages.alloc(math.ceil(tokens / self._page_size) - len(hit.pages))
        if new is None:
            self._tree.dec_lock_ref(hit.node)
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
        prefix = got.prefix_pages * self._page_size
        if req.full.no_load:
            req.full.no_load = False
            req.cached = CachedTokens(device=min(req.cached.device, prefix))
        if not req.count_once():
            return
        loaded = got.loaded_tokens
        storage = min(req.storage_tokens, loaded)
        req.cached = CachedTokens(device=prefix - loaded, host=loaded - storage, storage=storage)
        c = self._counters
        c.prefix_queries_total += 1
        c.query_tokens_total += query
        c.device_hit_tokens_total += prefix - loaded
        c.host_hit_tokens_total += loaded - storage
        c.storage_hit_tokens_total += storage
        if got.node is not None and got.node.parent is not None:
            self._tree.count_hit(got.node)
            self.pages.back_up(got.node)

    def fail_over(self, req: CacheRequest) -> None:
        """``req`` is requeued after a failed load: its next admission loads nothing from
        L2 (the prefill recomputes what the load could not bring; counted in
        ``load_fallbacks_total``)."""
        req.full.no_load = True
        self._counters.load_fallbacks_total += 1

    def grow(self, req: CacheRequest, tokens: int) -> bool:
        """Make ``req``'s pages cover positions ``[0, tokens)``; False when L1 cannot make
        room."""
        part = req.full
        need = math.ceil(tokens / self._page_size) - len(part.pages)
        if need <= 0:
            return True
        new = self.pages.alloc(need)
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
        full = len(prefix) // self._page_size
        if full > len(part.pages):
            raise ValueError(f"commit of {full} pages; the request holds {len(part.pages)}")
        result = self.pages.insert(
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
        self._tree.inc_lock_ref(last)
        if part.node is not None:
            self._tree.dec_lock_ref(part.node)
        part.node = last
        part.pages = tree_pages + part.pages[full:]
        part.prefix_pages = full
        # the tree's pages may be another request's load in flight
        part.progress = _union(part.progress, self.pages.host.loads_on(last))
        self.pages.back_up(last)
        return last

    def release(self, req: CacheRequest) -> None:
        """Free ``req``'s own pages and unpin its prefix; it holds nothing then."""
        part = req.full
        if len(part.pages) > part.prefix_pages:
            self.pages.free(part.pages[part.prefix_pages :])
        if part.node is not None:
            self._tree.dec_lock_ref(part.node)
        part.clear()

    def held(self, req: CacheRequest) -> HeldPages | None:
        """Every page of ``req``'s page table (the tree's prefix, then its own), or None
        when it holds none (not admitted)."""
        pages = req.full.pages
        if not len(pages):
            return None
        return HeldPages("full", self.pages.device_pool, 0, pages[:])

    def reset(self) -> None:
        """Free every page the tree holds in L1 and L2 (the tree is reset next)."""
        self.pages.free(self._tree.device_page_ids())
        self.pages.host.reset()


def _union(a: tuple[LayerProgress, ...], b: tuple[LayerProgress, ...]) -> tuple[LayerProgress, ...]:
    """``a`` and the progresses of ``b`` not in it, in order."""
    return a + tuple(p for p in b if all(p is not q for q in a))
