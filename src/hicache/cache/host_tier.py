"""The L2 tier: the host pool, L1 <-> L2 copies in flight, a hit's load back, L2 eviction.

The L2 half of the full KV's :class:`~hicache.cache.full_pages.FullPages` (without L2:
:mod:`~hicache.cache.no_host_tier`), on the cache's thread. It issues backups and loads
through the :class:`CacheController`, records what each op id stands for
(:class:`PendingBackup`, :class:`PendingLoad`) and applies the worker's completions when
:class:`~hicache.cache.sync.CacheSync` hands them over, agreed (the sync's transfer party;
it reports to the sync and the component stores, never up into the facade). Invariants:
pages another op pins are never freed under it; contiguity (a dropped L2 or L1 copy drops
the copies below it); a failure is applied at the next ``apply_deferred``, never inside a wait; a
load that failed after its last layer keeps its mapping. Loads run concurrently; a request
over pages a load in flight maps depends on it (``loads_on``). Under tensor parallelism
completions apply once every rank has them (:meth:`votes`, :meth:`apply_agreed`) and an
L2 allocation evicts and allocates alike on every rank. Failures step by step:
docs/architecture.md, "Failures".
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hicache.cache.components.stores import ComponentStores
from hicache.cache.quarantine import Quarantine
from hicache.cache.request import CacheRequest
from hicache.cache.sync import CacheSync
from hicache.config import CacheConfig
from hicache.controller import CacheController, Record
from hicache.controller.agreement import LocalRecords, Verdict, Vote
from hicache.memory import DevicePool, HostPool, PageAllocator
from hicache.metrics import CacheCounters
from hicache.spec import KVSpec
from hicache.transfer import Completion, LayerProgress
from hicache.tree import HiRadixTree, MatchResult, TreeNode
from hicache.tree.components import Tier
from hicache.tree.node import PageIds, page_ids
from hicache.tree.results import NodeEviction

log = logging.getLogger("hicache.cache")

COPY_OK = 2
"""A copy's vote value (:meth:`HostTier.votes`): it succeeded on this rank."""
COPY_FAILED_LANDED = 1
"""A copy's vote value: a load that failed after every layer had landed (its pages stay)."""


@dataclass(frozen=True, slots=True)
class PendingBackup:
    """A run of spans being copied L1 -> L2: the last ``pages`` pages of the path to
    ``last``. Nodes of the run may split while it is in flight; the run stays the same."""

    last: TreeNode
    pages: int


@dataclass(frozen=True, slots=True)
class PendingLoad:
    """A chain being copied L2 -> L1: the last ``pages`` pages of the path to ``last``,
    pinned in both tiers, mapped to ``device_pages`` (in path order); ``request`` is the
    handle that asked for it, ``progress`` the layers that have arrived."""

    last: TreeNode
    pages: int
    tokens: int
    request: CacheRequest | None
    progress: LayerProgress
    device_pages: PageIds


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


class HostTier:
    """L2 pages and the copies between L1 and L2 for one cache.

    ``sync``: the cache's owner of asynchronous results (the tier registers with it, posts
    its worker's records to its queue, waits through it, and reports landed backups and
    failed loads to it). ``stores``: the component stores, peers: each run whose full KV
    got L2 pages is handed to them (they back up what a hit there needs), and the
    component ids the tree releases go back to them.
    """

    def __init__(
        self,
        *,
        tree: HiRadixTree,
        device_pool: DevicePool,
        config: CacheConfig,
        spec: KVSpec,
        device: torch.device,
        sync: CacheSync,
        stores: ComponentStores,
        counters: CacheCounters,
        layer_hook: Callable[[int, int], None] | None = None,
    ) -> None:
        self.tree = tree
        self.device_allocator = device_pool.allocator
        self.pool = HostPool.for_config(spec, config, device)
        self.controller = CacheController(
            device_pool, self.pool, config.io_backend, sync.completions, layer_hook=layer_hook
        )
        self.counters = counters
        self.page_size = config.page_size
        self._load_back_threshold = config.load_back_threshold
        self.write_back_mark = config.write_back_mark(spec)
        """``watermark``: the L2 pages the tree may hold before L2 is written to L3 ahead of
        eviction (:mod:`hicache.cache.l3.ahead`), and eviction takes L2-only spans L3
        holds first; None under the other policies."""
        self.l3_attached = False
        """Whether an L3 tier is attached (the L3 slot sets it): an L2-only span evicted
        while not in L3 (``stored``) is then lost to every tier, and counted."""
        self._sync = sync
        self._stores = stores
        self._wait_timeout_s = sync.wait_timeout_s
        self.backups: dict[int, PendingBackup] = {}
        self._yields: Callable[[int], int] | None = None
        self.loads: dict[int, PendingLoad] = {}
        self._bad: list[PendingBackup] = []
        self._got = LocalRecords()
        """Completions received and not applied yet (:meth:`apply_agreed` pops them)."""
        self._failed: list[tuple[PendingLoad, str, bool]] = []
        """Failed loads not applied yet (still pinned): applied by :meth:`apply_deferred`; with
        whether every layer had landed (on every rank) all the same."""
        self._quarantine: Quarantine[frozenset[int], PageIds] = Quarantine()
        """L1 pages taken out of the tree (a failed load's chain) that copies in flight may
        still use, each until none of its ops is in flight any more."""
        self._num_layers = spec.num_layers
        self.ranks = sync.ranks
        """The tensor-parallel ranks (one: every agreement is this rank's own vote)."""
        sync.serve_transfers(self)

    tiers: tuple[Tier, ...] = (Tier.HOST,)
    """The tiers it adds below L1."""

    @property
    def allocator(self) -> PageAllocator:
        return self.pool.allocator

    @property
    def num_pages(self) -> int:
        """L2 pages in all."""
        return self.allocator.num_pages

    def reset(self) -> None:
        """Free every L2 page the tree holds (the tree is reset next)."""
        self.allocator.free(self.tree.host_page_ids())

    def start(self) -> None:
        self.controller.start()

    def close(self) -> None:
        self.controller.close()

    @property
    def busy(self) -> bool:
        """Copies in flight, or failed backups whose L2 copies are still to be dropped."""
        return bool(self.backups or self.loads or self._bad)

    @property
    def backing_up(self) -> bool:
        """L1 -> L2 copies in flight (the sync that applies them issues their L3 writes)."""
        return bool(self.backups)

    def wait_idle(self) -> None:
        """Wait (bounded, agreed: :meth:`CacheSync.wait_until`) until every copy in flight
        is applied (failed loads wait for :meth:`apply_deferred`). TimeoutError when some rank
        gave up; inside (the sync's rule) it only checks."""
        if self._sync.inside:
            return
        if not self._sync.wait_until(lambda: not self.backups and not self.loads):
            raise TimeoutError(
                f"copies still in flight on some rank after {self._wait_timeout_s} s"
            )

    def wait_backups(self) -> bool:
        """Wait (bounded, agreed) until the backups in flight are applied, not loads (they
        share no page with backups, so the engine never holds a backup behind a load);
        failed loads wait for :meth:`apply_deferred`. False when none was in flight or the cache
        is inside (the sync's rule: no wait there); TimeoutError when some rank gave up.

        A backup pins what it copies (and the component values a hit at its run's end
        needs) until it is applied, so waiting for it may free values to evict; a load
        pins its chain for its request, which keeps the chain pinned when the load lands,
        so waiting for a load frees nothing and may take as long as that request's
        forward."""
        if not self.backups or self._sync.inside:
            return False
        if not self._sync.wait_until(lambda: not self.backups):
            raise TimeoutError(
                f"backups still in flight on some rank after {self._wait_timeout_s} s"
            )
        return True

    def loads_on(self, node: TreeNode) -> tuple[LayerProgress, ...]:
        """The progress of every load not yet applied (in flight, or failed and not yet
        applied) whose pages the path to ``node`` runs through: a request whose prefix
        ends at ``node`` reads them, so it must wait for their layers."""
        if not self.loads and not self._failed:
            return ()
        on_path: set[int] = set()
        n = node
        while n.parent is not None:
            on_path.add(id(n))
            n = n.parent
        out: list[LayerProgress] = []
        for ld in [*self.loads.values(), *(f for f, _, _ in self._failed)]:
            chain = self.tree.path_tail(ld.last, ld.pages)
            if id(chain[0]) in on_path and _maps(chain, ld.device_pages):
                out.append(ld.progress)
        return tuple(out)

    # ------------------------------------------------------------------ L2 pages

    def alloc(self, num_pages: int) -> PageIds | None:
        """``num_pages`` free L2 pages, evicting unpinned L2 copies if needed; None when
        even that cannot make room. Loads in flight pin their sources: waits for them.

        Every decision is agreed (see the module docstring; one rank agrees with itself,
        no collective): the ranks agree on the largest shortfall of free pages, evict that
        many (the same nodes on every rank: their trees are the same), agree again, and
        allocate only when no rank falls short, so every rank gets its pages or none
        does. The collectives made depend on agreed values only."""
        alloc, ranks = self.allocator, self.ranks
        short = ranks.max(num_pages - alloc.free_pages)
        if short > 0:
            self.evict(short)
            short = ranks.max(num_pages - alloc.free_pages)
        if short > 0 and self.loads:
            self._sync.wait_until(lambda: not self.loads)  # inside: only checks
            self.evict(ranks.max(num_pages - alloc.free_pages))
            short = ranks.max(num_pages - alloc.free_pages)
        if short > 0:
            return None  # some rank cannot make room: none allocates
        pages = alloc.alloc(num_pages)
        assert pages is not None  # every rank has num_pages free
        return page_ids(pages)

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` L2 pages if possible; returns pages freed.

        Unpinned L2-only leaves go first (in policy order); then, if that is not enough,
        the L2 copies of unpinned spans that are still in L1 (no data is lost that way);
        then idle sessions yield their pins (:meth:`serve_yields`) and both go again.
        Under ``watermark`` the L2-only leaves L3 holds (``stored``) go before the others;
        never does eviction wait for a write (a span being written is pinned: skipped).
        """
        freed = self._evict_unpinned(num_pages)
        while freed < num_pages and self._yields is not None and self._yields(num_pages - freed):
            freed += self._evict_unpinned(num_pages - freed)
        return freed

    def _evict_unpinned(self, num_pages: int) -> int:
        """:meth:`evict` of what no pin holds."""
        freed = 0
        tree = self.tree
        phases = [
            (tree.host_eviction_order, tree.evict_node_host),
            (tree.host_copy_eviction_order, tree.drop_node_host),
        ]
        if self.write_back_mark is not None:  # watermark: what L3 holds goes first
            phases.insert(0, (tree.stored_host_eviction_order, tree.evict_node_host))
        for order, take in phases:
            for node in order():
                if freed >= num_pages:
                    return freed
                lost = self.l3_attached and node.device is None and not node.stored
                pages = len(self._free_host(take(node)))
                freed += pages
                tokens = pages * self.page_size
                self.counters.host_evicted_tokens_total += tokens
                if lost:  # in no tier any more (written ahead too late, or never)
                    self.counters.l3_unstored_evicted_tokens_total += tokens
        return freed

    def serve_yields(self, yields: Callable[[int], int] | None) -> None:
        """Who unpins L2 pages when eviction finds nothing else: ``yields(pages)`` frees at
        least ``pages`` pinned pages of their pins if it can, returning how many (0: none;
        the idle sessions' retention, :class:`~hicache.cache.sessions.Sessions`)."""
        self._yields = yields

    def landed_end(self, node: TreeNode | None) -> TreeNode | None:
        """The deepest node at or above ``node`` whose L2 copy has landed: one a pin may
        hold (a copy still in flight may fail and drop its pages, which a pin would hold
        up); None when none has."""
        copying = self._backing_up()
        while node is not None and node.parent is not None:
            if node.host is not None and id(node) not in copying:
                return node
            node = node.parent
        return None

    def _backing_up(self) -> set[int]:
        """Ids of the nodes an L1 -> L2 copy writes: in flight, or failed and waiting for
        its L2 copies to be dropped."""
        return {
            id(n)
            for b in [*self.backups.values(), *self._bad]
            for n in self.tree.path_tail(b.last, b.pages)
        }

    # ------------------------------------------------------------------ copies

    def back_up(self, node: TreeNode, min_hits: int, *, wait: bool) -> None:
        """Back up the not-yet-backed-up run of the path to ``node`` (top-down): pin its
        L1 source, give it L2 pages, issue one copy; with ``wait``, apply it first."""
        tree = self.tree
        nodes = tree.nodes_to_back_up(node, min_hits=min_hits)
        if not nodes:
            return
        last = nodes[-1]
        num = sum(tree.num_pages(n) for n in nodes)
        tree.inc_lock_ref(last)  # the L1 source must stay while L2 makes room
        try:
            host_pages = self.alloc(num)
        finally:
            tree.dec_lock_ref(last)
        if host_pages is None:
            return  # L2 full of pinned data: the nodes stay L1-only
        device_pages = page_ids()
        offset = 0
        for n in nodes:
            k = tree.num_pages(n)
            tree.assign_host(n, host_pages[offset : offset + k])
            assert n.device is not None
            device_pages += n.device
            offset += k
        tree.inc_lock_ref(last)  # until the copy lands
        op_id = self.controller.backup(device_pages, host_pages)
        self.backups[op_id] = PendingBackup(last, num)
        self._stores.back_up(last)  # what a hit at ``last`` needs of each component
        if wait:
            self.wait_backups()

    def load(
        self,
        nodes: list[TreeNode],
        device_pages: PageIds,
        request: CacheRequest | None,
    ) -> LayerProgress:
        """Map the host-only chain ``nodes`` (top-down) to ``device_pages`` and start
        copying it layer by layer; both tiers stay pinned until the copy lands."""
        tree = self.tree
        host_pages = page_ids()
        offset = 0
        for n in nodes:
            assert n.host is not None
            host_pages += n.host
            k = tree.num_pages(n)
            tree.assign_device(n, device_pages[offset : offset + k])
            offset += k
        last = nodes[-1]
        tree.inc_lock_ref(last)
        tree.inc_host_ref(last)
        op_id, progress = self.controller.load(host_pages, device_pages)
        tokens = len(device_pages) * self.page_size
        self.loads[op_id] = PendingLoad(
            last, len(device_pages), tokens, request, progress, device_pages[:]
        )
        return progress

    # ------------------------------------------------------------------ load back

    def load_back(
        self,
        match: MatchResult,
        req: CacheRequest | None,
        load: bool,
        alloc: Callable[[int], PageIds | None],
    ) -> LoadBack:
        """Start copying the host-only part of ``match`` into L1 pages from ``alloc`` (L1
        allocation with eviction), layer by layer (see :class:`LoadBack`).

        With extra components the L1 part of a match may end above an L1-resident span
        (say, a node whose snapshot is only in L2): the prefix then runs in L1 down to the
        first host-only node (or to ``last_host_node`` when none is), and only the
        host-only nodes are copied.

        All-or-nothing per chain: when the host-only part is shorter than
        ``load_back_threshold`` tokens, or L1 cannot make room for it, nothing is loaded;
        nor when ``load`` is False (the fallback of a failed load: it is recomputed)."""
        tree = self.tree
        no_load = LoadBack(
            match.last_device_node,
            match.device_pages,
            0,
            self.loads_on(match.last_device_node),
        )
        if not load:
            return no_load
        last = match.last_host_node
        # Pin the host copies first: pinning a hit's component span may split a node (so
        # the span starts on a boundary), which would change the chain computed before.
        tree.inc_host_ref(last)
        try:
            nodes = tree.host_only_path(last)
            base = nodes[0].parent if nodes else last  # the deepest L1 node the load continues
            assert base is not None
            if base is match.last_device_node:
                base_pages = match.device_pages
            else:  # L1-resident below the L1-valid boundary: its other components come later
                base_pages = path_device_pages(base)
            if not nodes:
                if base is match.last_device_node:
                    return no_load
                return LoadBack(base, base_pages, 0, self.loads_on(base))
            host_tokens = sum(tree.num_tokens(n) for n in nodes)
            if host_tokens < self._load_back_threshold:
                self.counters.load_skipped_tokens_total += host_tokens
                return no_load
            tree.inc_lock_ref(base)  # and the L1 prefix, while making room in L1
            try:
                device_pages = alloc(sum(tree.num_pages(n) for n in nodes))
            finally:
                tree.dec_lock_ref(base)
        finally:
            tree.dec_host_ref(last)
        if device_pages is None:
            self.counters.load_skipped_tokens_total += host_tokens
            return no_load
        self.load(nodes, device_pages, req)
        return LoadBack(last, base_pages + device_pages, host_tokens, self.loads_on(last))

    # ------------------------------------------------------------------ completions

    def claim(self, record: Record) -> bool:
        """Keep ``record`` when it is the completion of a copy in flight here."""
        mine = isinstance(record, Completion) and (
            record.op_id in self.backups or record.op_id in self.loads
        )
        if mine:
            self._got.put(record)
        return mine

    def apply(self, c: Completion, *, landed: bool | None = None) -> None:
        """Apply one finished copy (agreed: :meth:`apply_agreed`): unpin, count, hand on
        to L3. ``landed``: for a failed load, whether every layer had landed anyway
        (None: as its progress says; :meth:`apply_agreed` passes what the ranks agreed)."""
        if c.op_id in self.backups:
            b = self.backups.pop(c.op_id)
            if c.ok:
                self.tree.dec_lock_ref(b.last)
                self.counters.backup_ops_total += 1
                self.counters.backup_tokens_total += b.pages * self.page_size
                self.counters.backup_bytes_total += c.nbytes
                self._sync.backup_landed(self.tree.path_tail(b.last, b.pages))
            else:
                log.error("backup op %d failed: %s; dropping its L2 copies", c.op_id, c.error)
                self.counters.backup_failures_total += 1
                self._bad.append(b)  # stays pinned in L1 until its L2 copies are gone
                self.retry_invalidations()
        elif c.op_id in self.loads:
            ld = self.loads.pop(c.op_id)
            if c.ok:
                self.tree.dec_lock_ref(ld.last)
                self.tree.dec_host_ref(ld.last)
                self.counters.load_ops_total += 1
                self.counters.load_tokens_total += ld.tokens
                self.counters.load_bytes_total += c.nbytes
            else:
                log.error("load back op %d failed: %s", c.op_id, c.error)
                self.counters.load_failures_total += 1
                if landed is None:
                    landed = ld.progress.layers_done == self._num_layers
                self._failed.append(
                    (ld, c.error or "unknown error", landed)
                )  # pinned until apply_deferred
        else:  # pragma: no cover - defensive
            log.warning("completion for unknown op %d ignored", c.op_id)

    def votes(self) -> list[Vote]:
        """This rank's vote on every copy in flight, in op-id order: whether its
        completion is here and how it went (:data:`COPY_OK`, else
        :data:`COPY_FAILED_LANDED` for a failed load whose every layer landed anyway, else
        0), so the minimum over ranks says how it went everywhere."""
        out: list[Vote] = []
        for op_id in sorted(self.backups.keys() | self.loads.keys()):
            c = self._got.completions.get(op_id)
            value = 0
            if c is not None and c.ok:
                value = COPY_OK
            elif c is not None and op_id in self.loads:
                done = self.loads[op_id].progress.layers_done == self._num_layers
                value = COPY_FAILED_LANDED if done else 0
            out.append(Vote(op_id, arrived=c is not None, value=value))
        return out

    def apply_agreed(self, v: Verdict) -> bool:
        """Apply copy ``v.op_id``'s completion once every rank has it, ok only when ok on
        every rank (a copy failed on another rank fails here too); False: not yet."""
        got = self._got.completions
        if not v.arrived or v.op_id not in got:
            return False
        c = got.pop(v.op_id)
        if c.ok and v.value != COPY_OK:
            c = dataclasses.replace(c, ok=False, error="the copy failed on another rank")
        self.apply(c, landed=v.value == COPY_FAILED_LANDED)
        return True

    def apply_deferred(self) -> None:
        """Apply the failed loads agreed so far, retry the L2 invalidations that waited,
        and free quarantined L1 pages no copy in flight uses any more. Called by the sync
        at the end of a sync made outside (its re-entrancy rule), never inside a wait
        (whose caller may hold a pin for a moment)."""
        self.retry_invalidations()
        while self._failed:
            ld, error, landed = self._failed.pop(0)
            self.tree.dec_lock_ref(ld.last)
            self.tree.dec_host_ref(ld.last)
            self._drop_failed_load(ld, error, landed)
        in_flight = self.loads.keys() | self.backups.keys()
        for pages in self._quarantine.lift(lambda ops: not ops & in_flight):
            self.device_allocator.free(pages)

    def quarantined_device_pages(self) -> list[int]:
        """L1 pages a failed load mapped that copies in flight may still use (owned by the
        tier until :meth:`apply_deferred` frees them)."""
        return [p for pages in self._quarantine for p in pages]

    def _drop_failed_load(self, ld: PendingLoad, error: str, landed: bool) -> None:
        """Take what a failed load mapped (and every L1 copy below it) out of L1, unless
        every layer had ``landed``."""
        chain = self.tree.path_tail(ld.last, ld.pages)
        if not _maps(chain, ld.device_pages):
            return  # unmapped already: a load above it failed first
        if landed:
            log.error("load back failed after its last layer arrived: its L1 pages stay")
            return  # every layer landed: the pages hold the span's KV
        top = chain[0]
        reason = f"loading the cached prefix failed: {error}"
        self._sync.fail_holders(top, reason)
        in_flight = frozenset(self.loads) | frozenset(self.backups)
        backing_up = self._backing_up()
        for n in _post_order(top):
            if n.device is None:
                continue
            if any(ch.device is not None for ch in n.children.values()):
                log.error("cannot drop the L1 copy of %r: a child stays in L1", n)
                continue
            if n.lock_ref == 0:
                ev = self.tree.evict_node_device(n)
                self._free_device(ev.full, ev.components)
            elif n.host is not None and id(n) not in backing_up:
                # pinned by a copy in flight (a load of a chain below): out of the tree
                # now, its pages free once the copies in flight are done
                ev = self.tree.unmap_device(n)
                self._free_device(page_ids(), ev.components)  # no copy writes those
                self._quarantine.hold(in_flight, ev.full)
            else:  # pragma: no cover - pinned by a backup of it or by a caller outside
                # the cache: nothing is computed on a chain whose layers did not arrive
                log.error("cannot drop the L1 copy of pinned %r after a failed load", n)

    def _free_device(self, full: PageIds, components: dict[str, PageIds]) -> None:
        self.device_allocator.free(full)
        self._stores.free(Tier.DEVICE, components)

    def retry_invalidations(self) -> None:
        """Drop the L2 copies of failed backups whose subtrees no op pins any more."""
        keep: list[PendingBackup] = []
        for b in self._bad:
            top = self.tree.path_tail(b.last, b.pages)[0]
            if self._drop_host_subtree(top):
                self.tree.dec_lock_ref(b.last)
            else:
                keep.append(b)
        self._bad = keep

    def _drop_host_subtree(self, top: TreeNode) -> bool:
        """Forget every L2 copy in ``top``'s subtree, bottom-up; False (nothing changed)
        while any of them is pinned in L2 or is the target of a copy in flight."""
        nodes = [n for n in _post_order(top) if n.host is not None]
        if any(n.host_ref > 0 for n in nodes):
            return False
        busy = {id(n) for b in self.backups.values() for n in self.tree.path_tail(b.last, b.pages)}
        if any(id(n) in busy for n in nodes):
            return False
        for n in nodes:
            drop = self.tree.drop_node_host if n.device is not None else self.tree.evict_node_host
            self._free_host(drop(n))
        return True

    def _free_host(self, ev: NodeEviction) -> PageIds:
        """Free what dropping one node's L2 copy released; returns its full pages."""
        self.allocator.free(ev.full)
        self._stores.free(Tier.HOST, ev.components)
        return ev.full


def _maps(chain: list[TreeNode], device_pages: PageIds) -> bool:
    """Whether ``chain`` (top-down) is in L1 on exactly ``device_pages``."""
    got = page_ids()
    for n in chain:
        if n.device is None:
            return False
        got += n.device
    return got == device_pages


def _post_order(top: TreeNode) -> list[TreeNode]:
    """``top`` and its descendants, children before parents."""
    order: list[TreeNode] = []
    stack = [top]
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(n.children.values())
    order.reverse()
    return order


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
