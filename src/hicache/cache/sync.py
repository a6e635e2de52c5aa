"""The one owner of a cache's asynchronous results: :class:`CacheSync`.

Worker threads (L1<->L2 transfer, L3 prefetch and backup) only move bytes and post
immutable records to one :class:`~hicache.controller.CompletionQueue`. :class:`CacheSync`
owns it and everything that turns records into cache changes, below the facade and beside
the tiers and stores (which report to it): the records received, the tensor-parallel
:class:`~hicache.controller.agreement.Agreement` (one rank: its verdict is its vote), the
parties with ops in flight (:class:`Party`: the L2 tier, the L3 slot, and while attached
the L3 prefetches and writes), the agreed waits (:meth:`CacheSync.wait_until`), the
admitted requests (:attr:`CacheSync.holders`), :meth:`CacheSync.fail_holders`, and the
restore rates this rank's records measure (:attr:`CacheSync.restore_meter`).
Records are applied only in :meth:`CacheSync.sync` (once per step, every rank) and inside
explicit waits, party by party in op order. **The re-entrancy rule** (here only): while
applying or waiting the cache is *inside* (:attr:`CacheSync.inside`): nothing syncs,
waits or applies what was deferred (that waits for the end of a :meth:`sync` made
outside). Details: docs/architecture.md, "Who owns asynchronous results".
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Protocol

from hicache.cache.request import CacheRequest
from hicache.controller import CompletionQueue, L3Lookup, L3Read
from hicache.controller.agreement import Agreement, Verdict, Vote
from hicache.controller.completions import Record
from hicache.controller.rank_group import RankGroup
from hicache.rates import RateFit, RestoreMeter
from hicache.transfer import Completion
from hicache.tree import HiRadixTree, TreeNode

__all__ = ["DEFAULT_WAIT_TIMEOUT_S", "BackupSink", "CacheSync", "Party", "TransferParty"]

DEFAULT_WAIT_TIMEOUT_S = 60.0
"""Longest the owner waits for copies in flight before giving up with TimeoutError."""

_WAIT_POLL_S = 0.0005
"""Longest pause of a wait between two rounds in which nothing was applied (seconds); a
record posted on this rank ends the pause at once."""


class Party(Protocol):
    """An owner of ops in flight (one lane of the agreement): it keeps its workers'
    records, votes on its own ops and applies what the ranks agreed."""

    def claim(self, record: Record) -> bool:
        """Keep ``record`` when it is of an op in flight here (whether it was)."""

    def votes(self) -> list[Vote]:
        """This rank's vote on every op in flight here, in op-id order."""

    def apply_agreed(self, verdict: Verdict) -> bool:
        """Apply what every rank agreed on one op; whether a record was applied."""

    def apply_deferred(self) -> None:
        """Apply what waits until a sync made outside (the module docstring's rule)."""


class TransferParty(Party, Protocol):
    """The L2 tier's side: backups it can be asked to wait for."""

    def wait_backups(self) -> bool:
        """Wait for the backups in flight; False when none was (or waiting is not allowed
        now)."""


class BackupSink(Protocol):
    """The L3 writes: runs whose L1 -> L2 backup landed are written to L3."""

    def on_host_backup(self, nodes: list[TreeNode]) -> None:
        """``nodes`` (one path, top-down) landed in L2."""


def _unmeasured() -> RateFit | None:
    return None


class CacheSync:
    """The owner of one cache's asynchronous results (see the module docstring).

    ``tree``: the cache's tree (a failed load's holders are unpinned there). ``ranks``:
    the tensor-parallel group (None: one rank). ``wait_timeout_s``: the waits' bound.
    ``token_bytes``: bytes of one token's full KV on this rank, all layers (> 0).
    """

    def __init__(
        self,
        *,
        tree: HiRadixTree,
        token_bytes: int,
        ranks: RankGroup | None = None,
        wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S,
    ) -> None:
        self.tree = tree
        self.restore_meter = RestoreMeter(token_bytes)
        """This rank's restore rates, measured from every record received
        (:meth:`_measure`): a rank's own figures, never agreed."""
        self.prefill_rate: Callable[[], RateFit | None] = _unmeasured
        """This rank's prefill estimate (tokens/s of its own forwards), from the engine
        that set it (:meth:`hicache.cache.HiCache.measure_prefill`); None until then."""
        self.ranks = ranks or RankGroup.single()
        """The tensor-parallel ranks this cache agrees with (one: its verdict is its vote)."""
        self.wait_timeout_s = wait_timeout_s
        self.completions = CompletionQueue()
        """Where every worker thread posts its records."""
        self.op_ids = itertools.count(1)
        """The L3 ops' ids (the same sequence on every rank)."""
        self.holders: set[CacheRequest] = set()
        """Admitted requests holding pages (a failed load fails those over it)."""
        self._agreement = Agreement(self.ranks)
        self._parties: tuple[Party, ...] = ()
        """The lanes of the agreement, in the order served."""
        self._transfers: TransferParty | None = None
        self._backups: BackupSink | None = None
        self._inside = 0

    # ------------------------------------------------------------------ parties

    def serve(self, *parties: Party) -> None:
        """Add ``parties``, each one lane of the agreement after those served already
        (every rank serves the same parties at the same points)."""
        self._parties = (*self._parties, *parties)

    def leave(self, *parties: Party) -> None:
        """Remove ``parties`` (their ops were given up: records of them are dropped)."""
        self._parties = tuple(p for p in self._parties if all(p is not q for q in parties))

    def serve_transfers(self, party: TransferParty) -> None:
        """Register the L2 tier (once, when it is built): a party, and the backups
        :meth:`wait_backups` waits for."""
        if self._transfers is not None:
            raise RuntimeError("the cache has an L2 tier already")
        self._transfers = party
        self.serve(party)

    def serve_backups(self, sink: BackupSink | None) -> None:
        """Where landed backups go (:meth:`backup_landed`): the attached L3 tier's writes
        (None: nowhere, no tier attached)."""
        self._backups = sink

    # ------------------------------------------------------------------ applying

    @property
    def inside(self) -> bool:
        """Whether records are being applied or a wait runs (the re-entrancy rule)."""
        return self._inside > 0

    def sync(self) -> int:
        """Agree with the other ranks on every op in flight, apply in op order what every
        rank has (with the agreed values), then what was deferred; returns the records applied.

        Every rank calls it at the same point of its step (the engine: once per step);
        it makes one all-reduce whatever this rank's state (none with one rank), plus,
        while an agreed lookup is applied, the few whose count depends on agreed values
        alone. A no-op inside (the module docstring's rule)."""
        if self._inside:
            return 0
        applied, _ = self._round(give_up=False)
        self._apply_deferred()
        return applied

    def _round(self, *, give_up: bool) -> tuple[int, bool]:
        """One agreement (``give_up``: this rank's wait is past its deadline) and its
        application, lane by lane; returns the records applied and whether some rank
        gave up."""
        self._keep(self.completions.drain())
        parties = self._parties
        step = self._agreement.agree([p.votes() for p in parties], give_up=give_up)
        applied = 0
        self._inside += 1
        try:
            for party, verdicts in zip(parties, step.lanes, strict=True):
                for v in verdicts:
                    applied += party.apply_agreed(v)
        finally:
            self._inside -= 1
        return applied, step.gave_up

    def _keep(self, records: list[Record]) -> None:
        """Measure each record, and hand it to the party whose op it is of (none: a
        detached tier's, dropped)."""
        for r in records:
            self._measure(r)
            for party in self._parties:
                if party.claim(r):
                    break

    def _measure(self, r: Record) -> None:
        """Feed :attr:`restore_meter` from one record as it arrives on this rank: a load
        back that succeeded here (its bytes and copy seconds: ``host``), an L3 read's
        progress (bytes of the pages read intact since its previous record, and the
        backend calls' seconds: ``storage``), a lookup's store call (``lookup``), each
        stamped with the monotonic clock. Whatever other ranks say of the op, this rank's
        copy took that long."""
        now = time.monotonic()
        if isinstance(r, Completion):
            if r.kind == "load" and r.ok:
                self.restore_meter.host.observe(r.nbytes, r.seconds, now)
        elif isinstance(r, L3Read) and r.nbytes:
            self.restore_meter.storage.observe(r.nbytes, r.seconds, now)
        elif isinstance(r, L3Lookup) and r.seconds:
            self.restore_meter.lookup.observe(1, r.seconds, now)

    def _apply_deferred(self) -> None:
        for party in self._parties:
            party.apply_deferred()

    # ------------------------------------------------------------------ waits

    def wait_until(self, done: Callable[[], bool], timeout_s: float | None = None) -> bool:
        """Apply agreed records until ``done()`` (a test of agreed state: the same on every
        rank); False when some rank's ``timeout_s`` (default: the cache's) passed first
        (every rank gives up in the same round). Inside, it tests ``done()`` once. Settles
        nothing (the caller may hold pins)."""
        if done():
            return True
        if self._inside:
            return False
        end = time.monotonic() + (self.wait_timeout_s if timeout_s is None else timeout_s)
        self._inside += 1
        try:
            while True:
                applied, gave_up = self._round(give_up=time.monotonic() >= end)
                if done():
                    return True
                if gave_up:
                    return False
                if not applied:  # pause until a record arrives here (or a moment passes)
                    self._keep(self.completions.wait(_WAIT_POLL_S))
        finally:
            self._inside -= 1

    def wait_backups(self) -> bool:
        """Wait for the L1 -> L2 backups in flight (not loads, see
        :meth:`HostTier.wait_backups`); False when there is no L2 tier, none is in flight,
        or the cache is inside."""
        if self._transfers is None or self._inside:
            return False
        return self._transfers.wait_backups()

    def backup_landed(self, nodes: list[TreeNode]) -> None:
        """The L1 -> L2 copy of ``nodes`` (one path, top-down) landed: hand them to L3."""
        if self._backups is not None:
            self._backups.on_host_backup(nodes)

    # ------------------------------------------------------------------ holders

    def fail_holders(self, top: TreeNode, reason: str) -> None:
        """A load under ``top`` failed: every admitted request whose prefix runs through
        ``top`` reads pages it never wrote. Mark it failed and unpin its prefix (its
        caller requeues it, which recomputes what the load could not bring, or releases it
        without keeping its KV)."""
        for req in self.holders:
            n = req.node
            while n is not None and n is not top:
                n = n.parent
            if n is None:
                continue
            if req.failed is None:
                req.failed = reason
            self.tree.dec_lock_ref(req.full.drop_pin())
