"""The L3 tier: prefetch L3 -> L2 for waiting requests, write L2 -> L3 behind backups.

Owned by :class:`hicache.cache.HiCache` and run on its thread; the L3 threads only post
records (:class:`L3Lookup`, :class:`L3Read`, :class:`L3Write`), applied here. The flow:

* :meth:`StorageTier.start`: when a request arrives, the prefetch thread looks up the L3
  keys of the prompt beyond the local match; a hit of at least ``prefetch_threshold``
  tokens gets L2 pages and is read, chunk by chunk, while the request waits in the queue;
* :meth:`StorageTier.ready`: the prefetch policy says whether the request may be admitted
  now (``best_effort``: always; ``wait_complete``: once the read is over, capped by
  ``prefetch_timeout_max``; ``timeout``: once over, or ``min(prefetch_timeout_max,
  base + per_ki_token * tokens / 1024)`` seconds after arrival, the lookup included);
* :meth:`StorageTier.take`: at admission, the pages that arrived join the tree as an
  L2-only leaf, which the ordinary load back then brings to L1. Pages the thread may
  still write (the read is not over, or a backend call overran its deadline) are
  quarantined until the op's final record, then freed;
* :meth:`StorageTier.on_host_backup`: every span that reaches L2 is written to L3 (a
  tenant's spans under the namespace salted with its ``cache_salt``; for MLA models,
  whose ranks all hold the same bytes under one namespace, only rank 0 writes).

Models with recurrent layers (a :class:`~hicache.cache.component_records.SnapshotRecords`
codec): the L2 snapshots of a span written to L3 are written too, as ``"mamba"`` records
(their nodes stay pinned in L2 until the write's record arrives, so no slot is reused
while the backend reads it). A prefetch looks up the snapshot records within the full-KV
run found and reads only up to the deepest boundary whose snapshot every rank has (the
*usable* hit, all that a match could use): its pages and that snapshot, into an L2 slot
the inserted span's last node adopts. No snapshot, no read: pages past the last snapshot
could never end a match. The storage hit counted is that usable length.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from hicache.cache.component_records import RecordWrite, SnapshotRecords, agree_boundary
from hicache.cache.host_tier import HostTier
from hicache.cache.prefetch import Prefetch
from hicache.config import PrefetchConfig, PrefetchPolicy
from hicache.controller import L3Lookup, L3Read, L3Write
from hicache.controller.storage_controller import StorageController
from hicache.keys import FULL_COMPONENT, Namespace, PageKey, page_keys
from hicache.metrics import CacheCounters
from hicache.tree import HiRadixTree, MatchResult, TreeNode
from hicache.tree.node import PageIds, page_ids

log = logging.getLogger("hicache.cache")

MAX_TENANT_NAMESPACES = 1024
"""Salted namespaces kept ready (least recently used beyond this are rebuilt on demand)."""


class StorageTier:
    """L3 prefetch and backup bookkeeping for one cache."""

    def __init__(
        self,
        *,
        controller: StorageController,
        namespace: Namespace,
        prefetch: PrefetchConfig,
        tree: HiRadixTree,
        host: HostTier,
        counters: CacheCounters,
        op_ids: itertools.count[int],
        drain: Callable[[], object],
        snapshots: SnapshotRecords | None = None,
    ) -> None:
        self.controller = controller
        self.namespace = namespace
        self.prefetch = prefetch
        self.tree = tree
        self.host = host
        self.counters = counters
        self.page_size = host.page_size
        self._op_ids = op_ids
        self._drain = drain
        self._prefetches: dict[int, Prefetch] = {}
        self._quarantine: dict[int, PageIds] = {}
        self._quarantine_slots: dict[int, int] = {}
        self._writes: dict[int, tuple[TreeNode, int]] = {}
        self._state_writes: dict[int, list[RecordWrite]] = {}
        self._tenants: OrderedDict[tuple[str, str], Namespace] = OrderedDict()
        self.snapshots = snapshots
        if snapshots is not None:
            controller.storage.allow_component(snapshots.name)

    def owns(self, op_id: int) -> bool:
        return (
            op_id in self._prefetches
            or op_id in self._writes
            or op_id in self._state_writes
            or op_id in self._quarantine
        )

    def keys(self, key: bytes, tenant: str = "", component: str = FULL_COMPONENT) -> list[PageKey]:
        """L3 keys of the whole pages of the encoded tokens ``key``, under ``tenant``'s
        namespace (the shared one salted with the tenant's ``cache_salt``) for
        ``component``'s records (``"mamba"``: the snapshot after each page)."""
        if not tenant and component == self.namespace.component:
            ns = self.namespace
        else:
            found = self._tenants.get((tenant, component))
            if found is None:
                found = self.namespace.with_salt(tenant).with_component(component)
                if tenant:
                    self.controller.storage.allow_tenant(tenant)
                self._tenants[(tenant, component)] = found
                if len(self._tenants) > MAX_TENANT_NAMESPACES:
                    self._tenants.popitem(last=False)
            else:
                self._tenants.move_to_end((tenant, component))
            ns = found
        return page_keys(ns, key, self.page_size)

    # ------------------------------------------------------------------ prefetch

    def start(self, key: bytes, match: MatchResult, tenant: str) -> Prefetch | None:
        """Start looking up the L3 pages that follow ``match`` (a match of ``key``); None
        when nothing can be fetched (no uncached whole page, or the match ends on a span
        that is not in L2, under which fetched pages cannot hang)."""
        attach = match.last_host_node
        if attach.host is None:
            return None
        start = match.matched_tokens // self.page_size
        rest = self.keys(key, tenant)[start:]
        if not rest:
            return None
        self.tree.inc_host_ref(attach)  # the L2 span fetched pages will hang under
        op_id = next(self._op_ids)
        now = time.monotonic()
        deadline = now + self.prefetch.timeout_s(len(rest) * self.page_size)
        p = Prefetch(op_id, key, rest, start, attach, tenant, now, deadline)
        if self.snapshots is not None:
            p.component_keys = self.keys(key, tenant, self.snapshots.name)[start:]
        self._prefetches[op_id] = p
        self.controller.lookup(op_id, rest, p.component_keys)
        return p

    def ready(self, p: Prefetch) -> bool:
        """Whether the policy lets the request be admitted now."""
        if p.finished:
            return True
        policy = self.prefetch.policy
        if policy is PrefetchPolicy.BEST_EFFORT:
            return True
        now = time.monotonic()
        if policy is PrefetchPolicy.WAIT_COMPLETE:
            return now >= p.started + self.prefetch.prefetch_timeout_max
        return now >= p.deadline

    def take(self, p: Prefetch) -> int:
        """End ``p`` for its request: hang what arrived into the tree (as L2-only pages)
        and unpin. Returns the tokens added. Idempotent."""
        if p.taken:
            return 0
        p.taken = True
        self.tree.dec_host_ref(p.attach)
        if p.host_pages is None:
            if p.finished:  # else the lookup still runs: dropped when its record arrives
                self._prefetches.pop(p.op_id, None)
            return 0
        self.controller.cancel(p.op_id)
        done = self.controller.ranks.min(p.done_pages)
        slot = p.state_slot
        if slot is not None and done < len(p.host_pages):
            done = 0  # the snapshot ends the usable hit: no use for pages short of it
        added = 0
        ps = self.page_size
        if done:
            key = p.key[: (p.start_page + done) * ps * 4]
            result = self.tree.insert_host(key, p.host_pages[:done], p.start_page, p.tenant)
            if len(result.duplicate_pages):
                self.host.allocator.free(result.duplicate_pages)
            added = (done - len(result.duplicate_pages)) * ps
            sn = self.snapshots
            if (
                slot is not None
                and sn is not None
                and sn.adopt(result.last_node, p.start_page + done, slot)
            ):
                slot = None
        self.counters.prefetch_tokens_total += done * ps
        rest = p.host_pages[done:]
        self._prefetches.pop(p.op_id, None)
        if not p.read_final:  # the thread may still write them: keep them until it ends
            self._quarantine[p.op_id] = rest
            if slot is not None:
                self._quarantine_slots[p.op_id] = slot
        else:
            if len(rest):
                self.host.allocator.free(rest)
            self._free_slot(slot)
        return added

    def _free_slot(self, slot: int | None) -> None:
        if slot is not None and self.snapshots is not None:
            self.snapshots.free(slot)

    def _on_lookup(self, r: L3Lookup) -> None:
        p = self._prefetches.get(r.op_id)
        if p is None:
            return
        ranks = self.controller.ranks
        hit = ranks.min(r.hit_pages)
        if self.snapshots is not None:  # the usable hit ends at a snapshot on every rank
            hit = agree_boundary(ranks.min, r.boundaries, hit)
        if p.taken:
            self._prefetches.pop(r.op_id)
            return
        host_pages = None
        if hit and hit * self.page_size >= self.prefetch.prefetch_threshold:
            host_pages = self.host.alloc(hit)
        state: tuple[PageKey, int] | None = None
        if host_pages is not None and self.snapshots is not None:
            slot = self.snapshots.alloc()
            if slot is None:  # no L2 slot for the snapshot: the pages are no use
                self.host.allocator.free(host_pages)
                host_pages = None
            else:
                p.state_slot = slot
                state = (p.component_keys[hit - 1], slot)
        if host_pages is None:
            p.finished = True
            return
        p.host_pages = host_pages
        p.deadline = p.started + self.prefetch.timeout_s(hit * self.page_size)
        self.controller.read(p.op_id, p.keys[:hit], host_pages, state)

    def _on_read(self, r: L3Read) -> None:
        if r.op_id in self._quarantine:
            if r.final:
                pages = self._quarantine.pop(r.op_id)
                self.controller.forget(r.op_id)
                if len(pages):
                    self.host.allocator.free(pages)
                self._free_slot(self._quarantine_slots.pop(r.op_id, None))
            return
        p = self._prefetches.get(r.op_id)
        if p is None:
            return
        p.done_pages = max(p.done_pages, r.done_pages)
        if r.final:
            p.finished = p.read_final = True
            self.controller.forget(r.op_id)

    # ------------------------------------------------------------------ backup

    def on_host_backup(self, nodes: list[TreeNode]) -> None:
        """Write a run of spans that just landed in L2 (top-down, one path) to L3."""
        last = nodes[-1]
        if self.namespace.tp_rank is None and self.controller.ranks.rank != 0:
            return  # MLA: every rank holds the same latent KV; rank 0 alone writes it
        n = sum(self.tree.num_pages(x) for x in nodes)
        keys = self.keys(self.tree.path_key(last), last.tenant)[-n:]
        host = PageIds("q")
        for x in nodes:
            assert x.host is not None
            host += x.host
        self.tree.inc_host_ref(last)  # the L2 source stays until written
        op_id = next(self._op_ids)
        self._writes[op_id] = (last, n)
        self.controller.write(op_id, keys, host)
        self.write_states(nodes)

    def write_states(self, nodes: list[TreeNode]) -> None:
        """Write the L2 snapshots ``nodes`` (one path, top-down, in L2) hold to L3, each
        under the ``"mamba"`` key of its depth; each node stays pinned in L2 (with its
        snapshot slot) until the write's record arrives."""
        if self.snapshots is None or not nodes:
            return
        if self.namespace.tp_rank is None and self.controller.ranks.rank != 0:
            return
        todo = self.snapshots.writes(nodes)
        if not todo:
            return
        last = nodes[-1]
        keys = self.keys(self.tree.path_key(last), last.tenant, self.snapshots.name)
        for w in todo:
            self.tree.inc_host_ref(w.node)  # its L2 slot stays until written
        op_id = next(self._op_ids)
        self._state_writes[op_id] = todo
        self.controller.write_states(
            op_id, [keys[w.depth_pages - 1] for w in todo], page_ids([w.slot for w in todo])
        )

    def _on_write(self, r: L3Write) -> None:
        states = self._state_writes.pop(r.op_id, None)
        if states is not None:
            for w in states:
                self.tree.dec_host_ref(w.node)
            self.counters.l3_backup_snapshots_total += r.written
            self.counters.l3_backup_snapshots_failed_total += r.failed
            return
        item = self._writes.pop(r.op_id, None)
        if item is None:
            return
        node, _ = item
        self.tree.dec_host_ref(node)
        ps = self.page_size
        self.counters.l3_backup_tokens_total += r.written * ps
        self.counters.l3_backup_present_tokens_total += r.present * ps
        self.counters.l3_backup_failed_tokens_total += r.failed * ps

    # ------------------------------------------------------------------ records

    def apply(self, r: L3Lookup | L3Read | L3Write) -> None:
        if isinstance(r, L3Lookup):
            self._on_lookup(r)
        elif isinstance(r, L3Read):
            self._on_read(r)
        else:
            self._on_write(r)

    def held_host_pages(self) -> list[int]:
        """L2 pages held by L3 ops, not by the tree: reads not taken yet, quarantines."""
        held = [p for q in self._quarantine.values() for p in q]
        for p in self._prefetches.values():
            if p.host_pages is not None:
                held += p.host_pages
        return held

    def held_state_slots(self) -> list[int]:
        """L2 snapshot slots held by L3 reads, not by the tree (as :meth:`held_host_pages`)."""
        held = list(self._quarantine_slots.values())
        held += [p.state_slot for p in self._prefetches.values() if p.state_slot is not None]
        return held

    @property
    def busy(self) -> bool:
        """Writes in flight, or quarantined pages a late read may still fill."""
        return bool(self._writes or self._state_writes or self._quarantine)

    def flush(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until every write has landed and every quarantine
        is lifted; False on timeout."""
        end = time.monotonic() + timeout_s
        while self.busy and time.monotonic() < end:
            self._drain()
            if self.busy:
                time.sleep(0.001)
        if self.busy:
            log.warning(
                "L3 flush timed out: %d writes pending, %d reads quarantined",
                len(self._writes),
                len(self._quarantine),
            )
        return not self.busy

    def detach(self) -> tuple[PageIds, PageIds]:
        """Give up every prefetch and write still open (after the controller closed):
        unpin what they pinned. Returns the L2 pages and L2 snapshot slots that must stay
        quarantined until the backend's late writes settle (the caller frees them then)."""
        for p in list(self._prefetches.values()):
            if not p.taken:
                p.taken = True
                self.tree.dec_host_ref(p.attach)
            if p.host_pages is not None:
                self._quarantine[p.op_id] = p.host_pages
            if p.state_slot is not None:
                self._quarantine_slots[p.op_id] = p.state_slot
        self._prefetches.clear()
        for node, _ in self._writes.values():
            self.tree.dec_host_ref(node)  # a late put reads stale bytes: its checksum fails
        self._writes.clear()
        for writes in self._state_writes.values():
            for w in writes:
                self.tree.dec_host_ref(w.node)
        self._state_writes.clear()
        held = PageIds("q")
        for pages in self._quarantine.values():
            held += pages
        self._quarantine.clear()
        slots = page_ids(list(self._quarantine_slots.values()))
        self._quarantine_slots.clear()
        return held, slots
