"""The L3 tier: prefetch L3 -> L2 for waiting requests, write L2 -> L3 behind backups.

Attached through the cache's :class:`~hicache.cache.storage_slot.StorageSlot` and run on
the cache's thread; the L3 threads only post records (:class:`L3Lookup`, :class:`L3Read`,
:class:`L3Write`) to the queue of the cache's :class:`~hicache.cache.sync.CacheSync`,
which hands them here once agreed. The flow:

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

Hybrid models (one :class:`~hicache.cache.components.records.ComponentRecords` codec per
extra component: ``"mamba"`` snapshots, ``"swa"`` sliding-window pages): when a span is
written to L3, the component values a hit at its end needs and that are in L2 are written
too, as records of the component's namespace (their nodes stay pinned in L2 until the
write's record arrives, so no L2 id is reused while the backend reads it). A prefetch
starts from what the tree holds (the full-KV prefix in any tier, whatever the components'
validators say, so it never fetches pages the tree has), looks up the full-KV run beyond it
and each component's records within reach, and reads only up to the deepest boundary every
component can serve on every rank (its needs held by the tree or found in L3; the *usable*
hit, all that a match could use): the full pages up to it and the component records it
needs that the tree does not hold (a snapshot there; the SWA pages of its window), into L2
ids the inserted span and the nodes above it adopt. No usable boundary, no read: pages
past the last one could never end a match. The storage hit counted is that usable length.

A boundary inside the held prefix counts too (a snapshot, or a window page, evicted from
L1 and L2 while the node's full KV stayed): the lookup also covers the boundaries between
the local valid match and the held prefix's end whose nodes have their full KV in L2, and
when the deepest usable boundary every rank agrees on is one of them, only its component
records are read (no page), into L2 ids the held nodes adopt at admission (a held node
whose full KV is in L1 alone is skipped: an L2 component value needs L2 full KV under it).
The storage hit counted is then the tokens the records made usable beyond the local valid
match, as far as the request loads them from L2 (the facade counts a prefix already in L1
as a device hit).

Tensor-parallel ranks (one rank runs the same code, agreeing with itself): nothing here
applies a record on one rank alone. The sync collects this tier's votes (:meth:`StorageTier.votes`: for
every op in flight, whether its record is here and its value, and each waiting prefetch's
local policy verdict), agrees on them in one all-reduce, and hands back the verdicts
(:meth:`StorageTier.apply_agreed`): a lookup is applied with the minimum hit of every rank,
a read's progress is the minimum done pages, final only once final everywhere, a write is
applied once it landed everywhere, and a prefetch is ready once any rank's policy lets it
in (a rank whose deadline passed gives up for all). Applying an agreed lookup makes further
all-reduces whose count depends on agreed values alone: the component boundary
(:func:`agree_boundary`), then reserve -> all-reduce(min) -> commit or abort of the L2
pages and component ids. :meth:`StorageTier.take` makes no collective (what it uses is
agreed already), so no rank can skip one. For MLA only rank 0 writes, but every rank pins
and tracks each write alike (a write rank 0 alone tracked would unpin its L2 source on
rank 0 alone and change its eviction choices), and it is released once rank 0's write
landed.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

from hicache.cache.components.records import (
    ComponentRecords,
    RecordWrites,
    agree_boundary,
    usable_boundaries,
)
from hicache.cache.host_tier import HostTier
from hicache.cache.prefetch import ComponentFetch, Prefetch
from hicache.cache.sync import CacheSync
from hicache.config import PrefetchConfig, PrefetchPolicy
from hicache.controller import L3Lookup, L3Read, L3Write
from hicache.controller.agreement import LocalRecords, ReadProgress, Verdict, Vote
from hicache.controller.storage_controller import (
    ComponentLookup,
    ComponentRead,
    StorageController,
)
from hicache.keys import (
    FULL_COMPONENT,
    HEAD_RECORDS,
    Namespace,
    PageKey,
    PreviousPage,
    page_keys,
)
from hicache.memory.state_pool import StatePool
from hicache.metrics import CacheCounters
from hicache.tokens import TOKEN_BYTES
from hicache.tree import HiRadixTree, TreeNode
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
        sync: CacheSync,
        components: Sequence[ComponentRecords] = (),
    ) -> None:
        self.controller = controller
        self.namespace = namespace
        self.prefetch = prefetch
        self.tree = tree
        self.host = host
        self.counters = counters
        self.page_size = host.page_size
        self._op_ids = sync.op_ids
        self._sync = sync
        self._prefetches: dict[int, Prefetch] = {}
        self._quarantine: dict[int, PageIds] = {}
        self._quarantine_ids: dict[int, list[ComponentFetch]] = {}
        self._writes: dict[int, tuple[TreeNode, int]] = {}
        self._write_keys: dict[int, list[PageKey]] = {}
        """Keys of every write in flight, on every rank (sent here or not): the negative
        cache forgets them when the write is queued and again once it landed."""
        self._component_writes: dict[int, tuple[ComponentRecords, RecordWrites]] = {}
        self._tenants: OrderedDict[tuple[str, str], Namespace] = OrderedDict()
        self.ranks = controller.ranks
        self._looking: set[int] = set()
        """Prefetches whose lookup result is not applied yet."""
        self._agreed_ready: set[int] = set()
        """Prefetches some rank's policy let in, as agreed (:meth:`ready` says so)."""
        self._unsent: set[int] = set()
        """Writes tracked but not sent on this rank (MLA: only rank 0 writes)."""
        storage = controller.storage
        if namespace.records == HEAD_RECORDS:
            self.writer = storage.writes_pages
        else:
            self.writer = namespace.tp_rank is not None or self.ranks.rank == 0
        """Whether this rank writes L3 (head records: a rank holding K/V heads no lower rank
        holds, :meth:`~hicache.heads.HeadSplit.writes_any`; page records per rank: every
        rank its shard; MLA: rank 0 alone, whose writes every rank's lookups see: all ranks
        read one namespace)."""
        if namespace.records == HEAD_RECORDS:  # the previous spec: one record per rank
            self._previous_tp: tuple[int, int | None] = (self.ranks.size, self.ranks.rank)
        else:
            self._previous_tp = (namespace.tp_size, namespace.tp_rank)
        """The TP fields this rank's namespace had under the previous key spec."""
        self._previous_digests: dict[str, bytes] = {}
        """Each tenant's namespace digest under the previous key spec."""
        self.components = tuple(components)
        self._codecs = {c.name: c for c in self.components}
        self._slot_components = {c.name for c in self.components if isinstance(c.pool, StatePool)}
        """Components recorded a whole state slot per key: one rank's shard, per rank
        (:meth:`~hicache.keys.Namespace.for_slots`)."""
        for c in self.components:
            storage.allow_component(c.name, slots=c.name in self._slot_components)

    def owns(self, op_id: int) -> bool:
        return (
            op_id in self._prefetches
            or op_id in self._writes
            or op_id in self._component_writes
            or op_id in self._quarantine
        )

    def keys(self, key: bytes, tenant: str = "", component: str = FULL_COMPONENT) -> list[PageKey]:
        """L3 keys of the whole pages of the encoded tokens ``key``, under ``tenant``'s
        namespace (the shared one salted with the tenant's ``cache_salt``) for
        ``component``'s records (``"mamba"``: the snapshot after each page)."""
        return page_keys(self._namespace_of(tenant, component), key, self.page_size)

    def _previous_page(self, key: bytes, tenant: str, pages: int) -> PreviousPage:
        """The previous key spec's key of page ``pages`` of ``key`` under ``tenant``'s
        namespace as this rank had it, unhashed (probed, and hashed then, on a lookup that
        finds nothing)."""
        digest = self._previous_digests.get(tenant)
        if digest is None:
            digest = self._namespace_of(tenant).previous_digest(*self._previous_tp)
            if len(self._previous_digests) >= MAX_TENANT_NAMESPACES:
                self._previous_digests.clear()
            self._previous_digests[tenant] = digest
        return PreviousPage(digest, key[: pages * self.page_size * TOKEN_BYTES], self.page_size)

    def _namespace_of(self, tenant: str, component: str = FULL_COMPONENT) -> Namespace:
        if not tenant and component == self.namespace.component:
            ns = self.namespace
        else:
            found = self._tenants.get((tenant, component))
            if found is None:
                found = self.namespace.with_salt(tenant).with_component(component)
                if component in self._slot_components:
                    found = found.for_slots(self.ranks.size, self.ranks.rank)
                if tenant:
                    self.controller.storage.allow_tenant(tenant)
                self._tenants[(tenant, component)] = found
                if len(self._tenants) > MAX_TENANT_NAMESPACES:
                    self._tenants.popitem(last=False)
            else:
                self._tenants.move_to_end((tenant, component))
            ns = found
        return ns

    # ------------------------------------------------------------------ prefetch

    def start(self, key: bytes, tenant: str) -> Prefetch | None:
        """Start looking up the L3 pages of ``key`` (encoded tokens) past what the tree
        holds; None when nothing can be fetched (no uncached whole page; with extra
        components, also when the held prefix ends on a span that is not in L2, under
        which fetched pages cannot hang, and no held boundary past the valid match is
        left to serve). A full-KV-only cache whose held prefix ends on a span in L1 alone
        (``write_back``) looks up from that span's deepest ancestor in L2 instead: when
        L3 has pages past the span, they are read with the span's own, which the span's
        nodes adopt as their L2 copy (contiguity: an L2 copy hangs under an L2 copy), and
        the rest hangs past it; when it has none past it, nothing is read.

        The start is the full-KV prefix the tree holds in any tier, not the validated
        match: pages there are never fetched again. A component's values that pages past
        it need from before it (a sliding window reaching back) are taken from the tree
        when it holds them, else looked up and read from L3 with the rest.

        With extra components the lookup also covers the boundaries between the local
        valid match and the held prefix's end whose nodes have their full KV in L2 (a
        snapshot or window page evicted while the full KV stayed): when the deepest
        usable boundary is one of them, only its component records are read, and the
        held nodes adopt them (:meth:`take`). Held nodes whose full KV is in L1 alone are
        skipped, not backed up first: an L2 component value needs L2 full KV under it,
        and a speculative L1 -> L2 backup (L2 room, a copy) before L3 is known to hold the
        records would override the backup policy that chose not to copy them."""
        held = self.tree.match_held(key, tenant)
        attach = held.last_host_node
        start = held.matched_tokens // self.page_size
        in_l2 = attach.parent is None or attach.host is not None
        held_to = start
        if not in_l2 and not self.components:
            # the held prefix ends on a span in L1 alone (write_back): fetch from its
            # deepest ancestor in L2 on, so the span adopts its L3 copy and what L3 has
            # past it can hang there (useful only if L3 has pages past it: _on_lookup)
            while attach.parent is not None and attach.host is None:
                start -= self.tree.num_pages(attach)
                attach = attach.parent
            in_l2 = True
        rest = self.keys(key, tenant)[start:] if in_l2 else []
        valid = inner_to = 0
        pin = attach
        if self.components:
            valid = self.tree.match_prefix(key, tenant).matched_tokens // self.page_size
            depth = start
            while pin.parent is not None and pin.host is None:  # L2 is a prefix of a path
                depth -= self.tree.num_pages(pin)
                pin = pin.parent
            inner_to = depth if depth > valid else 0
        if not rest and not inner_to:
            return None
        self.tree.inc_host_ref(pin)  # the L2 span fetched pages (or records) hang under
        op_id = next(self._op_ids)
        now = time.monotonic()
        deadline = now + self.prefetch.timeout_s(len(rest) * self.page_size)
        p = Prefetch(op_id, key, rest, start, pin, tenant, now, deadline)
        p.valid_pages, p.inner_to, p.held_to = valid, inner_to, held_to
        lo = valid if inner_to else start  # boundaries considered: (lo, start + hit]
        lookups: list[ComponentLookup] = []
        for c in self.components:
            keys = self.keys(key, tenant, c.name)
            first = max(1, lo - c.reach + 1)  # records of pages first.. may be needed
            p.component_keys[c.name] = keys
            p.component_first[c.name] = first
            p.local[c.name] = c.local_pages(attach, start, first)
            lead = start - first + 1
            lookups.append(
                ComponentLookup(
                    c.name,
                    tuple(keys[first - 1 : start + len(rest)]),
                    lead,
                    held=max(0, inner_to - first + 1) if inner_to else 0,
                )
            )
        self._prefetches[op_id] = p
        self._looking.add(op_id)
        previous = self._previous_page(key, tenant, start + 1) if rest else None
        self.controller.lookup(op_id, rest, lookups, previous)
        return p

    def ready(self, p: Prefetch) -> bool:
        """Whether the policy lets the request be admitted now: as agreed at the last sync
        (the same answer on every rank; one rank agrees with its own clock)."""
        if p.finished or self.prefetch.policy is PrefetchPolicy.BEST_EFFORT:
            return True
        return p.op_id in self._agreed_ready

    def _policy_ready(self, p: Prefetch) -> bool:
        """This rank's verdict of the prefetch policy, by its clock."""
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
        """End ``p`` for its request: hang what arrived into the tree (as L2-only pages,
        with the component records read adopted) and unpin. Returns the tokens added.
        Idempotent."""
        if p.taken:
            return 0
        p.taken = True
        waited = not p.finished and self.prefetch.policy is not PrefetchPolicy.BEST_EFFORT
        if waited and self.ready(p):  # its deadline passed before L3 answered (as agreed)
            self.counters.prefetch_timeouts_total += 1
        self._agreed_ready.discard(p.op_id)
        self.tree.dec_host_ref(p.attach)
        if p.host_pages is None and not p.reads:
            if p.finished:  # else the lookup still runs: dropped when its record arrives
                self._prefetches.pop(p.op_id, None)
            return 0
        self.controller.cancel(p.op_id)
        if p.host_pages is None:
            return self._take_records(p)
        done = p.done_pages  # agreed already with several ranks: no collective here
        if p.reads and done < len(p.host_pages):
            done = 0  # the component records end the usable hit: no use for pages short of it
        added = 0
        ps = self.page_size
        left = list(p.reads)  # component ids not adopted: freed (or quarantined) below
        if done:
            key = p.key[: (p.start_page + done) * ps * TOKEN_BYTES]
            result = self.tree.insert_host(key, p.host_pages[:done], p.start_page, p.tenant)
            if len(result.duplicate_pages):
                self.host.allocator.free(result.duplicate_pages)
            added = (done - len(result.duplicate_pages)) * ps
            depth = p.start_page + done
            left = []
            for r in p.reads:
                rest = self._codecs[r.name].adopt(result.last_node, depth, r.pages, r.ids)
                self.counters.prefetch_component_records_total += len(r.ids) - len(rest)
                left.append(ComponentFetch(r.name, r.pages, rest))
        self.counters.prefetch_tokens_total += done * ps
        self._end(p, p.host_pages[done:], left)
        return added

    def _take_records(self, p: Prefetch) -> int:
        """:meth:`take` of a read of component records alone (a held boundary): the node
        ending at ``p.boundary`` (split there if needed), still with its full KV in L2,
        and the window nodes above it adopt the records. Returns the tokens this made
        usable beyond the local valid match (``match_prefix`` before and after the
        adoption; 0 when the read failed or was not over, or the match did not grow).
        The caller counts them as storage hits only as far as they are loaded from L2 (a
        held node whose full KV is in L1 too counts as a device hit)."""
        ok = p.records_read  # agreed already with several ranks: no collective here
        left = list(p.reads)
        gained = 0
        if ok:
            ps = self.page_size
            d = p.boundary
            held = self.tree.match_held(p.key[: d * ps * TOKEN_BYTES], p.tenant)
            node = held.last_host_node
            if held.matched_tokens == d * ps and node.parent is not None and node.host is not None:
                before = self.tree.match_prefix(p.key, p.tenant).matched_tokens
                left = []
                for r in p.reads:
                    rest = self._codecs[r.name].adopt(node, d, r.pages, r.ids)
                    self.counters.prefetch_component_records_total += len(r.ids) - len(rest)
                    left.append(ComponentFetch(r.name, r.pages, rest))
                after = self.tree.match_prefix(p.key, p.tenant).matched_tokens
                gained = max(0, after - before)
        self._end(p, page_ids(), left)
        return gained

    def _end(self, p: Prefetch, pages: PageIds, left: list[ComponentFetch]) -> None:
        """Drop taken ``p``: free its L2 ``pages`` and component ids ``left`` that were
        not adopted, or quarantine them while the thread may still write them."""
        self._prefetches.pop(p.op_id, None)
        if not p.read_final:  # the thread may still write them: keep them until it ends
            self._quarantine[p.op_id] = pages
            self._quarantine_ids[p.op_id] = left
        else:
            if len(pages):
                self.host.allocator.free(pages)
            self._free_fetches(left)

    def _on_lookup(self, r: L3Lookup, hit: int) -> None:
        """Apply lookup ``r`` with ``hit`` pages (agreed: the minimum over ranks)."""
        self._looking.discard(r.op_id)
        p = self._prefetches.get(r.op_id)
        if r.skipped:  # this rank's negative cache answered part of the run (or all of it)
            self.counters.l3_negative_keys_skipped_total += r.skipped
            if p is not None and r.skipped == len(p.keys):
                self.counters.l3_negative_lookups_saved_total += 1
        if p is None:
            return
        if p.taken:  # agreed state: every rank drops it here, without a collective
            self._prefetches.pop(r.op_id)
            return
        ranks = self.ranks
        start = p.start_page
        boundary = start + hit
        if self.components:  # the usable hit ends at a boundary every component serves
            found = {
                f.name: {p.component_first[f.name] + i for i in f.present} for f in r.components
            }
            lo = p.valid_pages if p.inner_to else start
            usable = [
                d
                for d in usable_boundaries(self.components, lo, start + hit, p.local, found)
                if d > start or d <= p.inner_to  # held pages: only those with L2 full KV
            ]
            # absolute depths (a page of the prompt), the same calls on every rank
            boundary = agree_boundary(ranks.min, usable, start + hit)
        if boundary <= start:
            self._read_records(p, boundary)
            return
        if boundary <= p.held_to:  # L3 has nothing past what L1 holds: no read
            p.finished = True
            return
        hit = boundary - start
        host_pages = None
        if hit and hit * self.page_size >= self.prefetch.prefetch_threshold:
            host_pages = self.host.alloc(hit)  # agreed by every rank (HostTier.alloc)
        reads: list[ComponentFetch] = []
        got_all = True
        for c in self.components if host_pages is not None else ():
            pages = c.reads(start + hit, p.local.get(c.name, ()))
            if not pages:
                continue
            assert host_pages is not None
            ids = c.alloc_read(pages, start, host_pages)
            if ids is None:  # no L2 room for the records a boundary needs: no use
                got_all = False
                break
            reads.append(ComponentFetch(c.name, tuple(pages), ids))
        if host_pages is not None and self.components and ranks.min(int(got_all)) == 0:
            self.host.allocator.free(host_pages)  # abort on every rank together
            host_pages = None
            self._free_fetches(reads)
            reads = []
        if host_pages is None:
            p.finished = True
            return
        p.host_pages = host_pages
        p.reads = reads
        p.boundary = boundary
        p.deadline = p.started + self.prefetch.timeout_s(hit * self.page_size)
        self._submit(p, hit, host_pages)

    def _read_records(self, p: Prefetch, boundary: int) -> None:
        """Read only the component records that make the held boundary ``boundary``
        (``valid_pages < boundary <= inner_to``; 0: none) usable, into L2 ids the held
        nodes adopt at :meth:`take`. Worth it when the tokens it makes usable beyond the
        local valid match reach ``prefetch_threshold``."""
        gain = boundary - p.valid_pages
        if (
            not p.valid_pages < boundary <= p.inner_to
            or gain * self.page_size < self.prefetch.prefetch_threshold
        ):
            p.finished = True
            return
        reads: list[ComponentFetch] = []
        got_all = True
        for c in self.components:
            pages = c.reads(boundary, p.local.get(c.name, ()))
            if not pages:
                continue
            ids = c.alloc_read(pages, p.start_page, page_ids())
            if ids is None:  # no L2 room for them: no use
                got_all = False
                break
            reads.append(ComponentFetch(c.name, tuple(pages), ids))
        if self.ranks.min(int(got_all)) == 0:  # reserve -> agree -> commit or abort
            self._free_fetches(reads)
            p.finished = True
            return
        if not reads:  # pragma: no cover - a boundary past the valid match needs a record
            p.finished = True
            return
        p.reads = reads
        p.boundary = boundary
        p.deadline = p.started + self.prefetch.timeout_s(0)
        self._submit(p, 0, page_ids())

    def _submit(self, p: Prefetch, hit: int, host_pages: PageIds) -> None:
        """Queue the read of ``p``'s first ``hit`` pages into ``host_pages`` after its
        component records ``p.reads``."""
        component_reads = [
            ComponentRead(f.name, tuple(p.component_keys[f.name][j - 1] for j in f.pages), f.ids)
            for f in p.reads
        ]
        self.controller.read(p.op_id, p.keys[:hit], host_pages, component_reads)

    def _free_fetches(self, fetches: list[ComponentFetch]) -> None:
        """Return the L2 ids of component reads to their pools."""
        for f in fetches:
            if len(f.ids):
                self._codecs[f.name].free(f.ids)

    def _on_read(self, r: L3Read) -> None:
        if r.op_id in self._quarantine:
            if r.final:
                pages = self._quarantine.pop(r.op_id)
                self.controller.forget(r.op_id)
                if len(pages):
                    self.host.allocator.free(pages)
                self._free_fetches(self._quarantine_ids.pop(r.op_id, []))
            return
        p = self._prefetches.get(r.op_id)
        if p is None:
            return
        p.done_pages = max(p.done_pages, r.done_pages)
        p.records_read = p.records_read or r.records
        if r.final:
            p.finished = p.read_final = True
            self.controller.forget(r.op_id)

    # ------------------------------------------------------------------ backup

    def on_host_backup(self, nodes: list[TreeNode]) -> None:
        """Write a run of spans that just landed in L2 (top-down, one path) to L3."""
        last = nodes[-1]
        n = sum(self.tree.num_pages(x) for x in nodes)
        keys = self.keys(self.tree.path_key(last), last.tenant)[-n:]
        host = PageIds("q")
        for x in nodes:
            assert x.host is not None
            host += x.host
        self.tree.inc_host_ref(last)  # the L2 source stays until written (on every rank)
        op_id = next(self._op_ids)
        self._writes[op_id] = (last, n)
        self._write_keys[op_id] = keys
        self.controller.forget_misses(keys)  # every rank: a lower one may write them
        if self.writer:
            self.controller.write(op_id, keys, host)
        else:  # MLA: rank 0 alone writes the latent KV every rank holds
            self._unsent.add(op_id)
        self.write_components(nodes)

    def write_components(self, nodes: list[TreeNode]) -> None:
        """Write, for each component, the L2 values a hit at the end of ``nodes`` (one
        path, top-down, in L2) needs (:meth:`ComponentRecords.writes`) to L3, each under
        its page's key in the component namespace; the codec's pins hold them in L2 until
        the write's record arrives."""
        if not self.components or not nodes:
            return
        last = nodes[-1]
        for c in self.components:
            todo = c.writes(nodes)
            if todo is None:
                continue
            c.host_ready()  # the L1 -> L2 copies have landed
            keys = self.keys(self.tree.path_key(last), last.tenant, c.name)
            for n in todo.pins:
                self.tree.inc_host_ref(n)  # its L2 ids stay until written
            op_id = next(self._op_ids)
            self._component_writes[op_id] = (c, todo)
            written = self._write_keys[op_id] = [keys[j - 1] for j in todo.pages]
            self.controller.forget_misses(written)
            if not self._sends(c.name):  # tracked and pinned alike on every rank
                self._unsent.add(op_id)
                continue
            self.controller.write_component(op_id, c.name, written, todo.ids)

    def _sends(self, component: str) -> bool:
        """Whether this rank sends ``component``'s writes: a writer always; under head
        records every rank its state-slot records too (each holds its own shard of the
        state, per rank, :meth:`~hicache.keys.Namespace.for_slots`, whether or not a lower
        rank holds its K/V heads)."""
        return self.writer or (
            component in self._slot_components and self.namespace.records == HEAD_RECORDS
        )

    def _on_write(self, r: L3Write) -> None:
        self._unsent.discard(r.op_id)
        # landed: a miss a lookup saw before it landed is forgotten (after that lookup)
        self.controller.forget_misses(self._write_keys.pop(r.op_id, []))
        comp = self._component_writes.pop(r.op_id, None)
        if comp is not None:
            codec, todo = comp
            for n in todo.pins:
                self.tree.dec_host_ref(n)
            codec.count_written(self.counters, r.written, r.failed)
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

    def votes(self, got: LocalRecords) -> list[Vote]:
        """This rank's vote on every L3 op in flight, in op-id order (the same ops on
        every rank): a lookup's result, a read's progress, a write's landing, a
        quarantined read's end; a waiting prefetch adds its policy's verdict by this
        rank's clock."""
        out: list[Vote] = []
        ops = sorted({*self._prefetches, *self._writes, *self._component_writes, *self._quarantine})
        for op_id in ops:
            p = self._prefetches.get(op_id)
            if p is not None:
                ready = not p.taken and self._policy_ready(p)
                if op_id in self._looking:
                    r = got.lookups.get(op_id)
                    hit = 0 if r is None else r.hit_pages
                    out.append(Vote(op_id, arrived=r is not None, value=hit, ready=ready))
                elif not p.read_final and (p.host_pages is not None or p.reads):
                    g = got.reads.get(op_id, ReadProgress())
                    out.append(
                        Vote(op_id, True, g.done, final=g.final, flag=g.records, ready=ready)
                    )
                elif not p.finished and not p.taken:  # pragma: no cover - no such state
                    out.append(Vote(op_id, arrived=True, ready=ready))
            elif op_id in self._quarantine:
                g = got.reads.get(op_id, ReadProgress())
                out.append(Vote(op_id, arrived=True, final=g.final))
            else:
                landed = op_id in got.writes or op_id in self._unsent
                out.append(Vote(op_id, arrived=landed))
        return out

    def apply_agreed(self, v: Verdict, got: LocalRecords) -> bool:
        """Apply what every rank agreed on op ``v.op_id`` (see :meth:`votes`); returns
        whether a record was applied."""
        op_id = v.op_id
        p = self._prefetches.get(op_id)
        if p is not None:
            if v.ready and not p.taken:
                self._agreed_ready.add(op_id)
            if op_id in self._looking:
                if not v.arrived:
                    return False
                self._on_lookup(got.lookups.pop(op_id), v.value)
                return True
            if p.read_final:
                return False
            changed = v.value > p.done_pages or (v.flag and not p.records_read) or v.final
            p.done_pages = max(p.done_pages, v.value)
            p.records_read = p.records_read or v.flag
            if v.final:
                got.reads.pop(op_id, None)
                p.finished = p.read_final = True
                self.controller.forget(op_id)
            return changed
        if op_id in self._quarantine:
            if not v.final:
                return False
            got.reads.pop(op_id, None)
            self._on_read(L3Read(op_id, 0, final=True))
            return True
        if not v.arrived or (op_id not in self._writes and op_id not in self._component_writes):
            return False
        self._on_write(got.writes.pop(op_id) if op_id in got.writes else L3Write(op_id, 0, 0, 0))
        return True

    def held_host_pages(self) -> list[int]:
        """L2 pages held by L3 ops, not by the tree: reads not taken yet, quarantines."""
        held = [p for q in self._quarantine.values() for p in q]
        for p in self._prefetches.values():
            if p.host_pages is not None:
                held += p.host_pages
        return held

    def held_component_ids(self, name: str) -> list[int]:
        """L2 ids of component ``name`` held by L3 reads, not by the tree (as
        :meth:`held_host_pages`)."""
        fetches = [f for q in self._quarantine_ids.values() for f in q]
        fetches += [f for p in self._prefetches.values() for f in p.reads]
        return [int(i) for f in fetches if f.name == name for i in f.ids]

    @property
    def busy(self) -> bool:
        """Writes in flight, or quarantined pages a late read may still fill."""
        return bool(self._writes or self._component_writes or self._quarantine)

    def flush(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``, agreed: every rank gives up together) until every
        write has landed and every quarantine is lifted; False on timeout."""
        if not self._sync.wait_until(lambda: not self.busy, timeout_s):
            log.warning(
                "L3 flush timed out on some rank: %d writes pending, %d reads quarantined",
                len(self._writes),
                len(self._quarantine),
            )
        return not self.busy

    def detach(self) -> tuple[PageIds, dict[str, PageIds]]:
        """Give up every prefetch and write still open (after the controller closed):
        unpin what they pinned. Returns the L2 pages and, per component, the L2 ids that
        must stay quarantined until the backend's late writes settle (the caller frees
        them then)."""
        for p in list(self._prefetches.values()):
            if not p.taken:
                p.taken = True
                self.tree.dec_host_ref(p.attach)
            if p.host_pages is not None:
                self._quarantine[p.op_id] = p.host_pages
            self._quarantine_ids.setdefault(p.op_id, []).extend(p.reads)
        self._prefetches.clear()
        self._looking.clear()
        self._agreed_ready.clear()
        self._unsent.clear()
        for node, _ in self._writes.values():
            self.tree.dec_host_ref(node)  # a late put reads stale bytes: its checksum fails
        self._writes.clear()
        for _, todo in self._component_writes.values():
            for n in todo.pins:
                self.tree.dec_host_ref(n)
        self._component_writes.clear()
        self._write_keys.clear()
        held = PageIds("q")
        for pages in self._quarantine.values():
            held += pages
        self._quarantine.clear()
        ids: dict[str, PageIds] = {}
        for fetches in self._quarantine_ids.values():
            for f in fetches:
                ids.setdefault(f.name, page_ids()).extend(f.ids)
        self._quarantine_ids.clear()
        return held, ids
