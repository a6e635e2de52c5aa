"""The L3 prefetches: lookup -> read -> take, and the prefetch policy; one party of the
cache's sync.

:class:`Prefetches` starts a request's lookup when it arrives (:meth:`Prefetches.start`),
applies the lookup with the hit every rank agreed on (the read it plans:
:class:`~hicache.cache.l3.reads.Reads`), follows the read's agreed progress, says whether
the policy lets the request in (:meth:`Prefetches.ready`, as agreed) and hangs what
arrived into the tree at admission (:meth:`Prefetches.take`). L2 pages and component ids
a read may still fill stay quarantined until its final record is agreed. Its votes and
verdicts cover its own ops only. The flow: ``docs/architecture.md`` (L3).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from hicache.cache.components.records import ComponentRecords
from hicache.cache.host_tier import HostTier
from hicache.cache.l3.keys import TierKeys
from hicache.cache.l3.prefetch import ComponentFetch, Prefetch
from hicache.cache.l3.reads import Reads
from hicache.cache.l3.worth import RestoreCosts
from hicache.cache.quarantine import Quarantine
from hicache.cache.sync import CacheSync
from hicache.config import PrefetchConfig, PrefetchPolicy
from hicache.controller import L3Lookup, L3Read, Record
from hicache.controller.agreement import LocalRecords, ReadProgress, Verdict, Vote
from hicache.controller.storage_controller import StorageController
from hicache.metrics import CacheCounters
from hicache.tokens import TOKEN_BYTES, encode_tokens
from hicache.tree import HiRadixTree, TreeNode
from hicache.tree.node import PageIds, TokenIds, page_ids

__all__ = ["HeldRead", "Prefetches"]

HeldRead = tuple[PageIds, list[ComponentFetch]]
"""What a read not final yet may still fill: L2 pages and component ids."""


class Prefetches:
    """The L3 prefetches of one attached tier (a party of ``sync``)."""

    def __init__(
        self,
        *,
        controller: StorageController,
        keys: TierKeys,
        prefetch: PrefetchConfig,
        tree: HiRadixTree,
        host: HostTier,
        counters: CacheCounters,
        sync: CacheSync,
        codecs: Mapping[str, ComponentRecords],
    ) -> None:
        self._controller = controller
        self._keys = keys
        self.prefetch = prefetch
        self._tree = tree
        self._host = host
        self._counters = counters
        self._op_ids = sync.op_ids
        self._codecs = codecs
        self._components = tuple(c for c in codecs.values() if not c.optional)
        """The components a hit needs (an optional one's records only ride along)."""
        self._page_size = host.page_size
        self._sync = sync
        self._reads = Reads(
            controller=controller,
            keys=keys,
            host=host,
            prefetch=prefetch,
            ranks=sync.ranks,
            codecs=codecs,
            costs=self._costs,
            counters=counters,
        )
        self._open: dict[int, Prefetch] = {}
        """Every prefetch in flight (a ``held`` one: taken, its read not final yet)."""
        self._held: Quarantine[int, HeldRead] = Quarantine()
        """What reads taken before their final record may still fill, until it is agreed."""
        self._got = LocalRecords()

    # ------------------------------------------------------------------ lookup

    def start(
        self, tokens: TokenIds, tenant: str, *, any_hit: bool = False, optional: bool = False
    ) -> Prefetch | None:
        """Start looking up the L3 pages of ``tokens`` past what the tree holds (``any_hit``:
        a restore's, read whatever ``prefetch_threshold``); None when nothing can be fetched (no uncached whole page; with extra components, also
        when the held prefix ends on a span that is not in L2 and no held boundary past
        the valid match is left to serve). ``docs/architecture.md`` (L3) says where the
        lookup starts and what it covers. ``optional``: also look up and read the records of
        optional components (a scoring request's entries) among the pages read."""
        if not tokens:
            return None
        key = encode_tokens(tokens)
        tree, ps = self._tree, self._page_size
        held = tree.match_full(key, tenant)
        attach = held.last_host_node
        start = held.matched_tokens // ps
        in_l2 = attach.parent is None or attach.host is not None
        cached_to = start
        if not in_l2 and not self._components:
            # the held prefix ends on a span in L1 alone (write_back): fetch from its
            # deepest ancestor in L2 on, so the span adopts its L3 copy and what L3 has
            # past it can hang there (useful only if L3 has pages past it: Reads.plan)
            while attach.parent is not None and attach.host is None:
                start -= tree.num_pages(attach)
                attach = attach.parent
            in_l2 = True
        rest = self._keys.of(key, tenant)[start:] if in_l2 else []
        valid = inner_to = 0
        pin = attach
        if self._components:
            valid = tree.match_prefix(key, tenant).matched_tokens // ps
            depth = start
            while pin.parent is not None and pin.host is None:  # L2 is a prefix of a path
                depth -= tree.num_pages(pin)
                pin = pin.parent
            inner_to = depth if depth > valid else 0
        if not rest and not inner_to:
            return None
        tree.inc_host_ref(pin)  # the L2 span fetched pages (or records) hang under
        now = time.monotonic()
        p = Prefetch(next(self._op_ids), key, rest, start, pin, tenant, now, now)
        p.valid_pages, p.inner_to, p.cached_to = valid, inner_to, cached_to
        p.any_hit = any_hit
        p.optional = optional
        p.deadline = self._reads.deadline(p, len(rest) * ps)
        if p.deadline == now:
            self._counters.l3_unwaited_prefetches_total += 1
        lookups = self._reads.lookups(p, attach, len(rest))
        self._open[p.op_id] = p
        previous = self._keys.previous_page(key, tenant, start + 1) if rest else None
        self._controller.lookup(p.op_id, rest, lookups, previous, self._reads.wait_gain(p))
        return p

    def _costs(self) -> RestoreCosts:
        """This rank's measured cost lines now (:mod:`hicache.cache.l3.worth`)."""
        sync = self._sync
        return RestoreCosts.measured(sync.restore_meter, sync.prefill_rate(), time.monotonic())

    def _on_lookup(self, r: L3Lookup, hit: int) -> None:
        """Apply lookup ``r`` with ``hit`` pages (agreed: the minimum over ranks)."""
        p = self._open.get(r.op_id)
        if r.skipped:  # this rank's negative cache answered part of the run (or all of it)
            self._counters.l3_negative_keys_skipped_total += r.skipped
            if p is not None and r.skipped == len(p.keys):
                self._counters.l3_negative_lookups_saved_total += 1
        if r.waited:
            self._counters.l3_announced_waits_total += 1
            self._counters.l3_announced_waits_expired_total += int(r.expired)
        self._counters.l3_announced_unwaited_total += int(r.unwaited)
        if p is None:
            return
        p.looking = False
        p.lookup_error = r.error
        if p.taken:  # agreed state: every rank drops it here, without a collective
            del self._open[r.op_id]
            return
        self._reads.plan(p, r, hit)

    # ------------------------------------------------------------------ policy

    def ready(self, p: Prefetch) -> bool:
        """Whether the policy lets the request be admitted now: as agreed at the last sync
        (the same answer on every rank; one rank agrees with its own clock). A prefetch
        taken or given up (its tier detached) waits for nothing."""
        if p.finished or p.taken or self.prefetch.policy is PrefetchPolicy.BEST_EFFORT:
            return True
        return p.agreed_ready

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

    # ------------------------------------------------------------------ take

    def take(self, p: Prefetch) -> int:
        """End ``p`` for its request: hang what arrived into the tree (as L2-only pages,
        with the component records read adopted) and unpin. Returns the tokens added.
        Idempotent."""
        if p.taken:
            return 0
        p.taken = True
        waited = not p.finished and self.prefetch.policy is not PrefetchPolicy.BEST_EFFORT
        waited = waited and p.deadline > p.started  # not one the rates said not to wait for
        if waited and self.ready(p):  # its deadline passed before L3 answered (as agreed)
            self._counters.prefetch_timeouts_total += 1
            if p.looking:  # the lookup outlasted the wait: it is at least that slow
                now = time.monotonic()
                self._sync.restore_meter.lookup.observe(1, now - p.started, now)
        p.agreed_ready = False
        self._tree.dec_host_ref(p.attach)
        if p.host_pages is None and not p.reads:
            if p.finished:  # else the lookup still runs: dropped when its record arrives
                self._open.pop(p.op_id, None)
            elif p.looking:  # a lookup still queued asks the store nothing now
                self._controller.cancel(p.op_id)
            return 0
        self._controller.cancel(p.op_id)
        if p.host_pages is None:
            return self._take_records(p)
        done = p.done_pages  # agreed already with several ranks: no collective here
        if p.reads and done < len(p.host_pages):
            done = 0  # the component records end the usable hit: no use for pages short of it
        added = 0
        ps = self._page_size
        left = list(p.reads)  # component ids not adopted: freed (or quarantined) below
        if done:
            key = p.key[: (p.start_page + done) * ps * TOKEN_BYTES]
            result = self._tree.insert_host(key, p.host_pages[:done], p.start_page, p.tenant)
            if len(result.duplicate_pages):
                self._host.allocator.free(result.duplicate_pages)
            added = (done - len(result.duplicate_pages)) * ps
            self._tree.mark_stored(result.last_node, done)  # read from L3: it is there
            left = self._adopt(p, result.last_node, p.start_page + done)
        self._counters.prefetch_tokens_total += done * ps
        self._end(p, p.host_pages[done:], left)
        return added

    def _take_records(self, p: Prefetch) -> int:
        """:meth:`take` of a read of component records alone (a held boundary): the node
        ending at ``p.boundary`` (split there if needed), still with its full KV in L2,
        and the window nodes above it adopt the records. Returns the tokens this made
        usable beyond the local valid match (0 when the read failed or was not over)."""
        left = list(p.reads)
        gained = 0
        if p.records_read:  # agreed already with several ranks: no collective here
            d, tree = p.boundary, self._tree
            held = tree.match_full(p.key[: d * self._page_size * TOKEN_BYTES], p.tenant)
            node = held.last_host_node
            whole = held.matched_tokens == d * self._page_size
            if whole and node.parent is not None and node.host is not None:
                before = tree.match_prefix(p.key, p.tenant).matched_tokens
                left = self._adopt(p, node, d)
                after = tree.match_prefix(p.key, p.tenant).matched_tokens
                gained = max(0, after - before)
        self._end(p, page_ids(), left)
        return gained

    def _adopt(self, p: Prefetch, node: TreeNode, depth: int) -> list[ComponentFetch]:
        """``node`` (ending at page ``depth``) and those above it adopt ``p``'s component
        records; returns the ids not adopted."""
        left: list[ComponentFetch] = []
        for r in p.reads:
            rest = self._codecs[r.name].adopt(node, depth, r.pages, r.ids)
            self._counters.prefetch_component_records_total += len(r.ids) - len(rest)
            left.append(ComponentFetch(r.name, r.pages, rest))
        return left

    def _end(self, p: Prefetch, pages: PageIds, left: list[ComponentFetch]) -> None:
        """Free taken ``p``'s L2 ``pages`` and component ids ``left`` not adopted, or
        quarantine them (``p`` held) while the thread may still write them."""
        if not p.read_final:  # the thread may still write them: keep them until it ends
            p.held = True
            self._held.hold(p.op_id, (pages, left))
        else:
            self._open.pop(p.op_id, None)
            self._free((pages, left))

    def _free(self, held: HeldRead) -> None:
        pages, fetches = held
        if len(pages):
            self._host.allocator.free(pages)
        self._reads.free(fetches)

    # ------------------------------------------------------------------ the sync's party

    def claim(self, record: Record) -> bool:
        op_id = record.op_id
        mine = isinstance(record, (L3Lookup, L3Read)) and op_id in self._open
        if mine:
            self._got.put(record)
        return mine

    def votes(self) -> list[Vote]:
        """A lookup's result, a read's progress, a quarantined read's end; a waiting
        prefetch adds its policy's verdict by this rank's clock. In op-id order: the open
        prefetches are kept in the order they were opened."""
        return [v for p in self._open.values() if (v := self._vote(p)) is not None]

    def _vote(self, p: Prefetch) -> Vote | None:
        if p.held:
            return Vote(p.op_id, True, final=self._got.reads.get(p.op_id, ReadProgress()).final)
        ready = not p.taken and self._policy_ready(p)
        if p.looking:
            r = self._got.lookups.get(p.op_id)
            hit = 0 if r is None else r.hit_pages
            ok = r is not None and not r.error  # agreed: it failed on no rank
            return Vote(p.op_id, arrived=r is not None, value=hit, flag=ok, ready=ready)
        if not p.read_final and (p.host_pages is not None or p.reads):
            g = self._got.reads.get(p.op_id, ReadProgress())
            return Vote(p.op_id, True, g.done, final=g.final, flag=g.records, ready=ready)
        if not p.finished and not p.taken:  # pragma: no cover - no such state
            return Vote(p.op_id, arrived=True, ready=ready)
        return None

    def apply_agreed(self, v: Verdict) -> bool:
        """Apply what every rank agreed on op ``v.op_id`` (see :meth:`votes`); returns
        whether a record was applied."""
        p = self._open[v.op_id]
        if p.held:  # lifted once final everywhere
            if not v.final:
                return False
            del self._open[v.op_id]
            self._got.reads.pop(v.op_id, None)
            self._controller.forget(v.op_id)
            for held in self._held.lift(lambda op: op == v.op_id):
                self._free(held)
            return True
        if v.ready and not p.taken:
            p.agreed_ready = True
        if p.looking:
            if not v.arrived:
                return False
            p.lookup_failed = not v.flag
            self._on_lookup(self._got.lookups.pop(v.op_id), v.value)
            return True
        if p.read_final:
            return False
        changed = v.value > p.done_pages or (v.flag and not p.records_read) or v.final
        p.done_pages = max(p.done_pages, v.value)
        p.records_read = p.records_read or v.flag
        if v.final:
            self._got.reads.pop(v.op_id, None)
            p.finished = p.read_final = True
            self._controller.forget(v.op_id)
        return changed

    def apply_deferred(self) -> None:
        """Nothing is deferred here (a read's quarantine ends with its verdict)."""

    # ------------------------------------------------------------------ holdings

    @property
    def quarantined(self) -> int:
        """Reads whose pages a late record may still fill (quarantined)."""
        return len(self._held)

    def quarantined_host_pages(self) -> list[int]:
        """L2 pages held by L3 ops, not by the tree: reads not taken yet, quarantines."""
        held = [p for pages, _ in self._held for p in pages]
        for p in self._open.values():
            if p.host_pages is not None and not p.held:
                held += p.host_pages
        return held

    def quarantined_component_ids(self, name: str) -> list[int]:
        """L2 ids of component ``name`` held by L3 reads, not by the tree (as
        :meth:`quarantined_host_pages`)."""
        fetches = [f for _, q in self._held for f in q]
        fetches += [f for p in self._open.values() if not p.held for f in p.reads]
        return [int(i) for f in fetches if f.name == name for i in f.ids]

    def give_up(self) -> tuple[PageIds, dict[str, PageIds]]:
        """Give up every prefetch still open (the controller closed): unpin what they
        pinned. Returns the L2 pages and, per component, the L2 ids that must stay
        quarantined until the backend's late writes settle."""
        for p in self._open.values():
            if p.held:
                continue  # in the quarantine already
            if not p.taken:
                p.taken = True
                self._tree.dec_host_ref(p.attach)
            self._held.hold(
                p.op_id, (page_ids() if p.host_pages is None else p.host_pages, p.reads)
            )
        self._open.clear()
        self._got.clear()
        pages = PageIds("q")
        ids: dict[str, PageIds] = {}
        for held, fetches in self._held.clear():
            pages += held
            for f in fetches:
                ids.setdefault(f.name, page_ids()).extend(f.ids)
        return pages, ids
