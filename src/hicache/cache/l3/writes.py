"""The L3 writes: L2 -> L3 behind backups or ahead of eviction, one party of the sync.

:class:`Writes` writes every run that lands in L2 (``on_host_backup``, from the sync; under
``watermark`` none: instead, at the end of each sync, the coldest L2 pages once L2 passes
its high mark, :mod:`hicache.cache.l3.ahead`), any path's unwritten L2 runs on demand
(``write_path``) and the component values a hit at a run's end needs
(``write_components``), each as one op of the sync's L3 op ids, pinning its L2 source
until the ranks agree it landed. At a request's end it announces (``announce_writes``)
the pages of its path that are on their way to L3 (``announce``,
:mod:`hicache.storage.announce`), so a next turn looked up elsewhere before they land
waits for them. Every rank tracks every write, sent or not (MLA: rank 0
alone sends). Its votes and agreed verdicts cover its own ops only. The flow:
``docs/architecture.md`` (L3).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hicache.cache.components.records import ComponentRecords, RecordWrites
from hicache.cache.l3.ahead import InFlight, ahead_runs, path_runs
from hicache.cache.l3.keys import TierKeys
from hicache.cache.sync import CacheSync
from hicache.controller import L3Write, Record
from hicache.controller.agreement import LocalRecords, Verdict, Vote
from hicache.controller.storage_controller import StorageController
from hicache.keys import PageKey
from hicache.metrics import CacheCounters
from hicache.tree import HiRadixTree, TreeNode
from hicache.tree.node import PageIds

__all__ = [
    "ANNOUNCE_TTL_S",
    "ANNOUNCE_WAIT_S",
    "MAX_FAILED_NODES",
    "MAX_PAUSE_SYNCS",
    "ComponentWrite",
    "PageWrite",
    "Writes",
]

MAX_PAUSE_SYNCS = 256
"""Longest pause of the writes ahead of eviction after failed writes, in syncs (steps)."""

ANNOUNCE_TTL_S = 2.0
"""How long an announcement promises its pages (seconds): a reader waits no longer for
them, however long its own bound (a write that failed is waited for this long at most)."""

MAX_FAILED_NODES = 4096
"""Nodes remembered as holding pages whose write failed (forgotten all at once beyond)."""

ANNOUNCE_WAIT_S = 0.005
"""Longest wait of a request's end for its announcement to be stored (seconds): the
answer's last token waits that long at most (a file or Redis store takes well under a
millisecond); past it the announcement lands a little later."""


@dataclass(frozen=True, slots=True)
class PageWrite:
    """A write of full-KV pages: ``node`` (pinned in L2 until it landed) ends the run;
    ``keys`` its pages' keys; ``sent``: from this rank (else tracked only)."""

    node: TreeNode
    keys: list[PageKey]
    sent: bool

    def unpin(self, tree: HiRadixTree) -> None:
        tree.dec_host_ref(self.node)

    def pinned(self) -> list[TreeNode]:
        """The nodes it pinned in L2 (each with its path)."""
        return [self.node]

    def pinned_run(self, tree: HiRadixTree) -> list[TreeNode]:
        """The nodes of the run written (top-down)."""
        return tree.path_tail(self.node, len(self.keys))

    def landed(self, tree: HiRadixTree) -> None:
        """Every page is in L3 on every rank: mark the run's nodes."""
        tree.mark_stored(self.node, len(self.keys))

    def count(self, counters: CacheCounters, r: L3Write, page_size: int) -> None:
        counters.l3_backup_tokens_total += r.written * page_size
        counters.l3_backup_present_tokens_total += r.present * page_size
        counters.l3_backup_failed_tokens_total += r.failed * page_size


@dataclass(frozen=True, slots=True)
class ComponentWrite:
    """A write of one component's records (``todo``: its pages, L2 ids and the nodes
    pinned until it landed), by ``codec``; ``keys`` and ``sent`` as :class:`PageWrite`."""

    codec: ComponentRecords
    todo: RecordWrites
    keys: list[PageKey]
    sent: bool

    def unpin(self, tree: HiRadixTree) -> None:
        for n in self.todo.pins:
            tree.dec_host_ref(n)

    def pinned(self) -> list[TreeNode]:
        """The nodes it pinned in L2 (each with its path)."""
        return list(self.todo.pins)

    def landed(self, tree: HiRadixTree) -> None:
        """The full KV's mark covers the pages; component values carry none."""

    def count(self, counters: CacheCounters, r: L3Write, page_size: int) -> None:
        self.codec.count_written(counters, r.written, r.failed)


class Writes:
    """The L3 writes of one attached tier (a party of ``sync``)."""

    def __init__(
        self,
        *,
        controller: StorageController,
        keys: TierKeys,
        tree: HiRadixTree,
        counters: CacheCounters,
        sync: CacheSync,
        components: tuple[ComponentRecords, ...],
        mark: int | None = None,
        announces: bool = False,
    ) -> None:
        self._controller = controller
        self._keys = keys
        self._tree = tree
        self._counters = counters
        self._op_ids = sync.op_ids
        self._components = components
        self._ops: dict[int, PageWrite | ComponentWrite] = {}
        """Every write in flight, on every rank (sent here or not): the negative cache
        forgets its keys when it is queued and again once it landed."""
        self._got = LocalRecords()
        self._mark = mark
        """``watermark``: L2 pages the tree may hold before the coldest are written ahead
        of eviction (None: every run is written when it lands in L2)."""
        self._changes = 0
        """Writes issued and applied so far (a change the choice ahead depends on)."""
        self._seen: tuple[int, ...] | None = None
        """What :meth:`write_ahead` last chose on (its skip test)."""
        self._pause = 0
        """Syncs :meth:`write_ahead` still skips after a failed write."""
        self._next_pause = 1
        """The pause after the next failed write (doubles per failure, 1 after a success)."""
        self._failed: set[int] = set()
        """Ids of nodes whose pages' write failed: not on their way, so not announced."""
        self._announces = announces
        """Whether :meth:`announce` announces (``PrefetchConfig.announce_writes``)."""

    def __len__(self) -> int:
        return len(self._ops)

    def on_host_backup(self, nodes: list[TreeNode]) -> None:
        """A run of spans (top-down, one path) just landed in L2: write it to L3, unless
        the policy writes ahead of eviction instead (``watermark``)."""
        if self._mark is None:
            self._write_run(nodes)

    def write_path(self, node: TreeNode) -> bool:
        """Write to L3 now every span of the path to ``node`` that is in L2 and neither in
        L3 (``stored``) nor being written, as one op per contiguous run (with the
        component values a hit at the run's end needs); each run stays pinned in L2 until
        every rank agreed it landed, then is marked ``stored`` (a failed write leaves it
        unmarked). Returns whether the whole path is in L3 or being written once the call
        returns (False: a span of it is in L1 alone and cannot be written from L2).
        Decided on tree state alone: every rank issues the same ops (MLA: rank 0 sends)."""
        runs, whole = path_runs(self._tree, node, self.in_flight())
        for run in runs:
            self._write_run(run)
        self._counters.l3_ahead_writes_total += len(runs)
        return whole

    def write_ahead(self) -> int:
        """``watermark``: once the tree's L2 pages pass the high mark, write the coldest L2
        pages not yet clean (:func:`~hicache.cache.l3.ahead.ahead_runs`); returns the ops
        issued (0 under other policies). Called at the end of each sync (every rank).
        After a write that failed on some rank it pauses for 1 sync, then 2, 4, ... (at most
        :data:`MAX_PAUSE_SYNCS`) until one succeeds, so a failing backend is not asked to
        write the same spans again at every step."""
        if self._mark is None:
            return 0
        if self._pause:  # a write failed lately: the backend may be failing
            self._pause -= 1
            return 0
        s = self._tree.stats()
        if s.host_pages <= self._mark:
            return 0
        # The choice (a walk of every node) changes only with L2's spans or the writes:
        # skipped while neither changed since the last one (agreed values only).
        seen = (s.host_pages, s.nodes, self._counters.host_evicted_tokens_total, self._changes)
        if seen == self._seen:
            return 0
        runs = ahead_runs(self._tree, self._mark, self.in_flight())
        for run in runs:
            self._write_run(run)
        self._counters.l3_ahead_writes_total += len(runs)
        self._seen = (*seen[:3], self._changes)
        return len(runs)

    def in_flight(self) -> InFlight:
        """The spans being written and the L2 pins the writes in flight hold (by node id);
        runs are recorded by their last node and length, so spans split since are in."""
        tree = self._tree
        nodes: set[int] = set()
        pins: Counter[int] = Counter()
        for w in self._ops.values():
            if isinstance(w, PageWrite):
                nodes.update(id(n) for n in tree.path_tail(w.node, len(w.keys)))
            for n in w.pinned():
                x: TreeNode | None = n
                while x is not None and x.parent is not None:
                    pins[id(x)] += 1
                    x = x.parent
        return InFlight(frozenset(nodes), pins)

    def _write_run(self, nodes: list[TreeNode]) -> None:
        """Write a run of spans in L2 (top-down, one path) to L3 as one op."""
        tree = self._tree
        last = nodes[-1]
        n = sum(tree.num_pages(x) for x in nodes)
        keys = self._keys.of(tree.path_key(last), last.tenant)[-n:]
        host = PageIds("q")
        for x in nodes:
            assert x.host is not None
            host += x.host
        tree.inc_host_ref(last)  # the L2 source stays until written (on every rank)
        self._changes += 1
        op_id = next(self._op_ids)
        sent = self._keys.writer  # MLA: rank 0 alone writes the latent KV every rank holds
        self._ops[op_id] = PageWrite(last, keys, sent)
        self._controller.forget_misses(keys)  # every rank: a lower one may write them
        if sent:
            self._controller.write(op_id, keys, host)
        self.write_components(nodes)

    def announce(self, last: TreeNode) -> int:
        """A request ending at ``last`` is about to answer: announce the pages of its path
        on their way to L3 (in L2 or being copied there, not ``stored``: the deepest such
        run, below any span not backed up) and wait, a few milliseconds at most
        (:data:`ANNOUNCE_WAIT_S`), until that is stored. Returns the pages announced.
        Nothing unless this tier announces (``announce_writes``), under ``watermark`` (no
        write is due) or on a rank that writes nothing."""
        if not self._announces or self._mark is not None or not self._keys.writer:
            return 0
        tree = self._tree
        node: TreeNode | None = last
        while node is not None and node.parent is not None and node.host is None:
            node = node.parent  # not backed up (L2 full): not on its way
        if node is None or node.parent is None:
            return 0
        end, pages = node, 0
        failed = self._failed
        while (
            node.parent is not None
            and node.host is not None
            and not node.stored
            and id(node) not in failed
        ):
            pages += tree.num_pages(node)
            node = node.parent
        if not pages:
            return 0
        keys = self._keys.of(tree.path_key(end), end.tenant)[-pages:]
        self._controller.announce(keys, ANNOUNCE_TTL_S, ANNOUNCE_WAIT_S)
        self._counters.l3_announced_pages_total += pages
        return pages

    def write_components(self, nodes: list[TreeNode]) -> None:
        """Write, for each component, the L2 values a hit at the end of ``nodes`` (one
        path, top-down, in L2) needs (:meth:`ComponentRecords.writes`) to L3, each under
        its page's key in the component namespace; the codec's pins hold them in L2 until
        the write's record arrives."""
        if not self._components or not nodes:
            return
        last = nodes[-1]
        for c in self._components:
            todo = c.writes(nodes)
            if todo is None:
                continue
            c.host_ready()  # the L1 -> L2 copies have landed
            keys = self._keys.of(self._tree.path_key(last), last.tenant, c.name)
            for n in todo.pins:
                self._tree.inc_host_ref(n)  # its L2 ids stay until written
            op_id = next(self._op_ids)
            written = [keys[j - 1] for j in todo.pages]
            sent = self._keys.sends(c.name)  # tracked and pinned alike on every rank
            self._ops[op_id] = ComponentWrite(c, todo, written, sent)
            self._controller.forget_misses(written)
            if sent:
                self._controller.write_component(op_id, c.name, written, todo.ids)

    # ------------------------------------------------------------------ the sync's party

    def claim(self, record: Record) -> bool:
        mine = isinstance(record, L3Write) and record.op_id in self._ops
        if mine:
            self._got.put(record)
        return mine

    def votes(self) -> list[Vote]:
        """Whether each write landed here (one not sent here: at once), with value 1 when
        every page of it is in L3 (written or present), else 0 (the agreed minimum says
        whether the pages are in L3 on every rank)."""
        got = self._got.writes
        out = []
        for op, w in sorted(self._ops.items()):
            r = got.get(op)
            arrived = r is not None or not w.sent
            out.append(Vote(op, arrived=arrived, value=int(r is None or r.failed == 0)))
        return out

    def apply_agreed(self, v: Verdict) -> bool:
        """Apply write ``v.op_id`` once it landed on every rank: mark what is in L3 on
        every rank, unpin, count."""
        w = self._ops.get(v.op_id)
        if not v.arrived or w is None:
            return False
        del self._ops[v.op_id]
        self._changes += 1
        r = self._got.writes.pop(v.op_id, None) or L3Write(v.op_id, 0, 0, 0)
        # landed: a miss a lookup saw before it landed is forgotten (after that lookup)
        self._controller.forget_misses(w.keys)
        if v.value:
            w.landed(self._tree)
            self._next_pause = 1
        else:  # agreed: the ranks pause alike
            if isinstance(w, PageWrite):
                if len(self._failed) > MAX_FAILED_NODES:
                    self._failed.clear()
                self._failed.update(id(n) for n in w.pinned_run(self._tree))
            self._pause = self._next_pause
            self._next_pause = min(2 * self._next_pause, MAX_PAUSE_SYNCS)
        w.unpin(self._tree)
        w.count(self._counters, r, self._keys.page_size)
        return True

    def apply_deferred(self) -> None:
        """At the end of each sync made outside (every rank, the same tree): write ahead of
        eviction (``watermark``, :meth:`write_ahead`)."""
        self.write_ahead()

    def give_up(self) -> None:
        """Unpin every write still open (the controller closed): a late put reads stale
        bytes, and its checksum fails."""
        for w in self._ops.values():
            w.unpin(self._tree)
        self._ops.clear()
        self._got.clear()
