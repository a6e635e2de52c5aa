"""The L3 side of the facade: prefetch L3 -> L2 for a request, back up L2 -> L3.

Owned by :class:`hicache.cache.HiCache` (``cache.l3``) and run on its thread. The flow:

* :meth:`L3Tier.start_prefetch`: after the local match, the prefetch thread looks up the
  L3 keys of the rest of the prompt; when at least ``prefetch_threshold`` tokens hit, L2
  pages are allocated (on the owner's thread) and the thread reads into them;
* :meth:`L3Tier.ready` / :meth:`L3Tier.finish`: the policy (best_effort, wait_complete,
  timeout) says when to stop; the pages that arrived by then join the tree as an L2-only
  leaf, which the ordinary load back then brings to L1;
* :meth:`L3Tier.on_host_backup`: every span that reaches L2 is written to L3 (a tenant's
  spans under the namespace salted with its ``cache_salt``, so no other tenant can read
  them; for MLA models, whose ranks all hold the same bytes under one namespace, only
  rank 0 writes).

Pages of a stopped prefetch that may still be written by the thread are freed only once
the thread reports it is done with them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hicache.config import PrefetchConfig, PrefetchPolicy
from hicache.controller.storage_controller import PrefetchOp, StorageController
from hicache.keys import Namespace, PageKey, page_keys
from hicache.memory import PageAllocator
from hicache.tree import MatchResult, TreeNode
from hicache.tree.node import PageIds

if TYPE_CHECKING:
    from hicache.cache import HiCache

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PrefetchHandle:
    """One request's prefetch: pages ``start_page ..`` of ``key`` (encoded tokens).

    ``reading`` turns True once the lookup found a hit worth reading and L2 pages were
    allocated for it; ``deadline`` (monotonic seconds) is the ``timeout`` policy's: the
    base timeout while looking up, then the full formula from the start of the read.
    """

    op: PrefetchOp
    key: bytes
    start_page: int
    attach: TreeNode
    deadline: float
    tenant: str = ""
    reading: bool = False
    dropped: bool = False


class L3Tier:
    """L3 prefetch and backup bookkeeping for one :class:`HiCache`."""

    def __init__(
        self,
        cache: HiCache,
        controller: StorageController,
        namespace: Namespace,
        prefetch: PrefetchConfig,
    ) -> None:
        self.cache = cache
        self.controller = controller
        self.namespace = namespace
        self.prefetch = prefetch
        self._ops = 0
        self._backups: dict[int, tuple[TreeNode, int]] = {}
        self._draining: list[tuple[PrefetchOp, PageIds]] = []
        self._tenants: dict[str, Namespace] = {"": namespace}

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    def keys(self, key: bytes, tenant: str = "") -> list[PageKey]:
        """L3 keys of the whole pages of the encoded tokens ``key``, under ``tenant``'s
        namespace (the shared one salted with the tenant's ``cache_salt``)."""
        ns = self._tenants.get(tenant)
        if ns is None:
            ns = self._tenants[tenant] = self.namespace.with_salt(tenant)
            self.controller.storage.allow_tenant(tenant)
        return page_keys(ns, np.frombuffer(key, dtype="<u4"), self.page_size)

    # ------------------------------------------------------------------ prefetch

    def start_prefetch(
        self, key: bytes, match: MatchResult, tenant: str = ""
    ) -> PrefetchHandle | None:
        """Start looking up the L3 pages that follow ``match`` (a match of ``key``) on the
        prefetch thread; None when nothing can be fetched (no uncached whole page, or the
        match ends on a span that is not in L2, under which L2 pages cannot hang)."""
        attach = match.last_host_node
        if attach.host is None:
            return None
        start = match.matched_tokens // self.page_size
        rest = self.keys(key, tenant)[start:]
        if not rest:
            return None
        self.cache.tree.inc_host_ref(attach)  # the L2 span we hang fetched pages under
        self._ops += 1
        op = PrefetchOp(self._ops, rest)
        self.controller.prefetch(op)
        deadline = time.monotonic() + self.prefetch.timeout_s(0)
        return PrefetchHandle(op, key, start, attach, deadline, tenant)

    def _advance(self, handle: PrefetchHandle) -> None:
        """Once the lookup is back: read the hit if it is worth it, else drop the op."""
        op = handle.op
        if handle.reading or handle.dropped or not op.looked_up.is_set():
            return
        hit = self.controller.agreed_hit(op)
        host_pages = None
        if hit and hit * self.page_size >= self.prefetch.prefetch_threshold:
            host_pages = self.cache.alloc_host(hit)
        if host_pages is None:
            handle.dropped = True
            return
        op.keys = op.keys[:hit]
        op.host_pages = host_pages
        handle.reading = True
        handle.deadline = time.monotonic() + self.prefetch.timeout_s(hit * self.page_size)
        self.controller.prefetch(op)

    def ready(self, handle: PrefetchHandle) -> bool:
        """Whether the policy says to stop waiting now (starts the read when it can)."""
        self._advance(handle)
        if handle.dropped or handle.op.finished.is_set():
            return True
        policy = self.prefetch.policy
        if policy is PrefetchPolicy.BEST_EFFORT:
            return True
        return policy is PrefetchPolicy.TIMEOUT and time.monotonic() >= handle.deadline

    def finish(self, handle: PrefetchHandle) -> int:
        """Stop the prefetch; hang what arrived into the tree. Returns the tokens added."""
        op = handle.op
        op.stop.set()
        tree = self.cache.tree
        tree.dec_host_ref(handle.attach)
        if not handle.reading:
            return 0
        assert op.host_pages is not None
        done = self.controller.agreed_done(op)
        added = 0
        if done:
            ps = self.page_size
            key = handle.key[: (handle.start_page + done) * ps * 4]
            result = tree.insert_host(key, op.host_pages[:done], handle.start_page, handle.tenant)
            if len(result.duplicate_pages):
                self._host_allocator().free(result.duplicate_pages)
            added = (done - len(result.duplicate_pages)) * ps
        self._draining.append((op, op.host_pages[done:]))
        self._free_drained()
        self.cache.counters.prefetch_tokens_total += done * self.page_size
        return added

    def _host_allocator(self) -> PageAllocator:
        assert self.cache.host_pool is not None
        return self.cache.host_pool.allocator

    def _free_drained(self) -> None:
        keep = []
        for op, pages in self._draining:
            if op.finished.is_set():
                if len(pages):
                    self._host_allocator().free(pages)
            else:
                keep.append((op, pages))
        self._draining = keep

    # ------------------------------------------------------------------ backup

    def on_host_backup(self, nodes: list[TreeNode]) -> None:
        """Write a run of spans that just landed in L2 (top-down, one path) to L3."""
        last = nodes[-1]
        if self.namespace.tp_rank is None and self.controller.ranks.rank != 0:
            return  # MLA: every rank holds the same latent KV; rank 0 alone writes it
        n = sum(self.cache.tree.num_pages(x) for x in nodes)
        keys = self.keys(self.cache.tree.path_key(last), last.tenant)[-n:]
        host = PageIds("q")
        for x in nodes:
            assert x.host is not None
            host += x.host
        self.cache.tree.inc_host_ref(last)  # L2 source stays until written
        self._ops += 1
        self._backups[self._ops] = (last, n)
        self.controller.backup(self._ops, keys, host)

    # ------------------------------------------------------------------ completions

    def poll(self) -> None:
        for done in self.controller.drain_backups():
            node, n = self._backups.pop(done.op_id)
            self.cache.tree.dec_host_ref(node)
            self.cache.counters.l3_backup_tokens_total += done.written * self.page_size
            if done.written < n:
                self.cache.counters.l3_backup_failed_tokens_total += (
                    n - done.written
                ) * self.page_size
        self._free_drained()

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every L3 backup has landed and every stopped prefetch has drained."""
        end = time.monotonic() + timeout
        while (self._backups or self._draining) and time.monotonic() < end:
            self.poll()
            if self._backups or self._draining:
                time.sleep(0.001)
        if self._backups or self._draining:
            log.warning("L3 flush timed out with %d backups pending", len(self._backups))

    @property
    def busy(self) -> bool:
        return bool(self._backups or self._draining)
