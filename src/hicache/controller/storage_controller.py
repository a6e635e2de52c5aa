"""L3 threads: lookups and reads (L3 -> L2) on one thread, writes (L2 -> L3) on another.

Like the L1<->L2 controller it knows page ids and keys, never the tree. The owner (the
cache's storage tier) allocates L2 ids and submits ops; the threads post immutable records
(:class:`L3Lookup`, :class:`L3Read`, :class:`L3Write`) to its :class:`CompletionQueue`.
Component records ride on the same ops (:class:`ComponentLookup`, :class:`ComponentRead`,
writes of one component's L2 ids), into each component's L2 pool named at construction
(``component_pools``: a :class:`~hicache.memory.HostPool` or a
:class:`~hicache.memory.state_pool.StatePool`). Invariants: every storage call is bounded
by the backend's deadline, an error or timeout being a miss; a read posts its ``final``
record only once :meth:`HiCacheStorage.host_writes_settled` (until then the owner keeps
its pages quarantined); the lookup thread owns the
:class:`~hicache.storage.negative.NegativeCache`, and :meth:`StorageController.forget_misses`
rides the same queue, so forgets apply in order with lookups. Announcements
(:mod:`hicache.storage.announce`): a third thread stores them (:meth:`StorageController.announce`
waits for that a few milliseconds at most); a lookup whose run stops at an announced page
waits for it, polling, at most ``announced_wait_s`` and no longer than the lookup's
:class:`~hicache.controller.announced.WaitGain` says a read of the run could pay (other ops
go on meanwhile), and never remembers that page as a miss. The flows: ``docs/architecture.md``, "Who owns asynchronous
results", "Failures" and "The next turn finds the previous answer".
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from hicache.controller.announced import ANY_GAIN, AnnouncedWaits, Stop, WaitGain, Waiting
from hicache.controller.completions import (
    CompletionQueue,
    ComponentFound,
    L3Lookup,
    L3Read,
    L3Write,
)
from hicache.controller.rank_group import RankGroup
from hicache.keys import PageKey, PreviousPage
from hicache.lifecycle import Lifecycle
from hicache.memory import HostPool
from hicache.memory.state_pool import StatePool
from hicache.storage.base import HiCacheStorage
from hicache.storage.negative import NegativeCache
from hicache.storage.stats import SetResult
from hicache.tree.node import PageIds

__all__ = ["ComponentLookup", "ComponentPool", "ComponentRead", "StorageController"]

log = logging.getLogger(__name__)

_SETTLE_POLL_S = 0.02
"""How often the prefetch thread asks a backend whether late writes have settled."""

ANNOUNCE_STUCK_S = 0.1
"""An announcement not stored this long after it was queued means a slow or hung
backend: later announcements are queued without waiting for them (seconds)."""


ComponentPool: TypeAlias = HostPool | StatePool
"""A component's L2 pool: pages (sliding-window KV) or state slots (snapshots)."""


@dataclass(frozen=True, slots=True)
class ComponentLookup:
    """One component's records to look up with a run of full-KV keys: ``keys[i]`` for
    ``i < lead + hit`` (``hit``: the full-KV keys found in a row), i.e. ``lead`` records
    before the run's first page and one per page of the run found; when no full-KV key
    is found, ``keys[i]`` for ``i < held`` (``0 <= held <= lead``: the records of
    boundaries inside the prefix the tree holds, which a fetch of records alone may
    serve)."""

    name: str
    keys: tuple[PageKey, ...]
    lead: int
    held: int = 0


@dataclass(frozen=True, slots=True)
class ComponentRead:
    """Read one component's records ``keys[i]`` into L2 id ``ids[i]`` of its pool."""

    name: str
    keys: tuple[PageKey, ...]
    ids: PageIds


@dataclass(frozen=True, slots=True)
class _Lookup:
    op_id: int
    keys: Sequence[PageKey]
    components: tuple[ComponentLookup, ...]
    previous: PreviousPage | None = None
    cancel: threading.Event | None = None
    gain: WaitGain = ANY_GAIN


@dataclass(frozen=True, slots=True)
class _Forget:
    keys: tuple[PageKey, ...]


@dataclass(frozen=True, slots=True)
class _Announce:
    keys: tuple[PageKey, ...]
    ttl_s: float
    done: threading.Event


@dataclass(frozen=True, slots=True)
class _Read:
    op_id: int
    keys: Sequence[PageKey]
    host_pages: PageIds
    cancel: threading.Event
    components: tuple[ComponentRead, ...]


@dataclass(frozen=True, slots=True)
class _Write:
    op_id: int
    keys: Sequence[PageKey]
    host_pages: PageIds
    component: str | None
    """None: full-KV pages of the host pool; else that component's L2 ids."""


class StorageController(Lifecycle):
    """Owns the L3 backend and its two worker threads.

    Lifecycle: ``start()`` starts the backend and the threads; ``close()`` stops them
    (queued writes are finished first, reads are cancelled) and closes the backend.
    """

    def __init__(
        self,
        storage: HiCacheStorage,
        host_pool: HostPool,
        completions: CompletionQueue,
        ranks: RankGroup | None = None,
        component_pools: Mapping[str, ComponentPool] | None = None,
        negative: NegativeCache | None = None,
        announced_wait_s: float = 0.0,
    ) -> None:
        self.storage = storage
        self.host_pool = host_pool
        self.component_pools: dict[str, ComponentPool] = dict(component_pools or {})
        self.ranks = ranks or RankGroup()
        self._out = completions
        self.negative = negative
        """Misses remembered (None: off); the lookup thread's alone once started."""
        self._waits: AnnouncedWaits[_Lookup] = AnnouncedWaits(storage, negative, announced_wait_s)
        """Lookups waiting for announced pages (the lookup thread's alone; ``announced_wait_s``
        the longest wait, 0: none)."""
        self._announce_q: queue.Queue[_Announce | None] = queue.Queue()
        self._unstored: tuple[float, threading.Event] | None = None
        """The oldest announcement not known stored: when it was queued (monotonic s)."""
        self._prefetch_q: queue.Queue[_Lookup | _Read | _Forget | None] = queue.Queue()
        self._backup_q: queue.Queue[_Write | None] = queue.Queue()
        self._cancels: dict[int, threading.Event] = {}
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        if self._threads:
            return
        self.storage.start()
        self._threads = [
            threading.Thread(target=self._prefetch_loop, name="hicache-l3-prefetch", daemon=True),
            threading.Thread(target=self._backup_loop, name="hicache-l3-backup", daemon=True),
            threading.Thread(target=self._announce_loop, name="hicache-l3-announce", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def close(self, timeout_s: float = 60.0) -> None:
        """Cancel reads, finish queued writes, stop both threads (each join bounded by
        ``timeout_s``) and close the backend. Idempotent."""
        if not self._threads:
            return
        for ev in self._cancels.values():
            ev.set()
        self._prefetch_q.put(None)
        self._backup_q.put(None)
        self._announce_q.put(None)
        for t in self._threads:
            t.join(timeout_s)
            if t.is_alive():
                log.error("%s did not stop within %.0f s; abandoning it", t.name, timeout_s)
        self._threads = []
        self.storage.close()

    # ------------------------------------------------------------------ owner side

    def lookup(
        self,
        op_id: int,
        keys: Sequence[PageKey],
        components: Sequence[ComponentLookup] = (),
        previous: PreviousPage | None = None,
        gain: WaitGain = ANY_GAIN,
    ) -> None:
        """Queue a lookup of ``keys`` (a run from the first) and, when given, of each
        component's records within reach of the run found (:class:`ComponentLookup`); an
        :class:`L3Lookup` follows. ``previous``: the previous spec version's key of the
        first page, hashed and probed (and counted, ``StorageStats.previous``) on the
        lookup thread when the run is empty. ``gain``: how long a wait for announced
        pages can pay, by the run it could reach (:mod:`hicache.controller.announced`).
        :meth:`cancel` before the lookup thread reaches it skips the store: its record
        says no hit."""
        for c in components:
            self._pool(c.name)
            if not 0 <= c.held <= c.lead <= len(c.keys) or len(c.keys) - c.lead > len(keys):
                raise ValueError(
                    f"{c.name}: {len(c.keys)} keys with lead {c.lead} (held {c.held}) "
                    f"for a run of {len(keys)}"
                )
        cancel = self._cancels[op_id] = threading.Event()
        self._prefetch_q.put(_Lookup(op_id, keys, tuple(components), previous, cancel, gain))

    def read(
        self,
        op_id: int,
        keys: Sequence[PageKey],
        host_pages: PageIds,
        components: Sequence[ComponentRead] = (),
    ) -> None:
        """Queue a read of ``keys[i]`` into ``host_pages[i]``, after the component records
        ``components`` (each into its L2 pool; a miss there makes the whole read a miss);
        :class:`L3Read` records follow, the last one with ``final`` set."""
        if len(keys) != len(host_pages):
            raise ValueError(f"read of {len(keys)} keys into {len(host_pages)} host pages")
        for c in components:
            self._pool(c.name)
            if len(c.keys) != len(c.ids):
                raise ValueError(f"{c.name}: read of {len(c.keys)} keys into {len(c.ids)} ids")
        cancel = self._cancels[op_id] = threading.Event()
        self._prefetch_q.put(_Read(op_id, keys, host_pages, cancel, tuple(components)))

    def forget_misses(self, keys: Sequence[PageKey]) -> None:
        """This instance writes ``keys`` (queued, or landed): lookups after this call ask
        the store about them again (a no-op without a negative cache)."""
        if self.negative is not None and keys:
            self._prefetch_q.put(_Forget(tuple(keys)))

    def announce(self, keys: Sequence[PageKey], ttl_s: float, wait_s: float) -> bool:
        """Announce that ``keys`` are being written and should land within ``ttl_s``
        seconds (:meth:`HiCacheStorage.announce`, on the announce thread); wait until that
        record is stored, at most ``wait_s`` seconds, unless an announcement queued more
        than :data:`ANNOUNCE_STUCK_S` ago is still not stored (a backend that hangs delays
        callers for that long at most). Returns whether it was stored within the wait."""
        if not keys:
            return True
        now = time.monotonic()
        done = threading.Event()
        oldest = self._unstored
        if oldest is None or oldest[1].is_set():
            self._unstored = oldest = (now, done)
        self._announce_q.put(_Announce(tuple(keys), ttl_s, done))
        if not self._threads or now - oldest[0] > ANNOUNCE_STUCK_S:
            return False
        return done.wait(wait_s)

    def cancel(self, op_id: int) -> None:
        """Ask a read to stop after the chunk in flight (its final record still comes), or
        a lookup not started yet to skip the store (its record still comes, no hit)."""
        ev = self._cancels.pop(op_id, None)
        if ev is not None:
            ev.set()

    def write(self, op_id: int, keys: Sequence[PageKey], host_pages: PageIds) -> None:
        """Queue a write of host pages to L3 (present keys are skipped by the backend);
        an :class:`L3Write` follows. The owner keeps the pages until it arrives."""
        self._backup_q.put(_Write(op_id, keys, host_pages, component=None))

    def write_component(self, op_id: int, name: str, keys: Sequence[PageKey], ids: PageIds) -> None:
        """Queue a write of component ``name``'s L2 ids as its records ``keys[i]``; an
        :class:`L3Write` follows. The owner keeps the ids (pinned) until it arrives."""
        self._pool(name)
        if len(keys) != len(ids):
            raise ValueError(f"{name}: write of {len(keys)} keys from {len(ids)} ids")
        self._backup_q.put(_Write(op_id, keys, ids, component=name))

    def _pool(self, name: str) -> ComponentPool:
        pool = self.component_pools.get(name)
        if pool is None:
            raise ValueError(
                f"no L2 pool for component {name!r}; have {sorted(self.component_pools)}"
            )
        return pool

    def _get_component(self, name: str, keys: Sequence[PageKey], ids: PageIds) -> list[bool]:
        pool = self._pool(name)
        if isinstance(pool, StatePool):
            return self.storage.batch_get_state(keys, pool, list(ids))
        return self.storage.batch_get(keys, pool, list(ids))

    def _set_component(self, name: str, keys: Sequence[PageKey], ids: PageIds) -> SetResult:
        pool = self._pool(name)
        if isinstance(pool, StatePool):
            return self.storage.batch_set_state(keys, pool, list(ids))
        return self.storage.batch_set(keys, pool, list(ids))

    def forget(self, op_id: int) -> None:
        """The owner applied a read's final record: drop its cancel flag."""
        self._cancels.pop(op_id, None)

    # ------------------------------------------------------------------ threads

    def _prefetch_loop(self) -> None:
        settling: dict[int, int] = {}  # read op id -> its done pages, late writes pending
        while True:
            idle = False
            timeout = _SETTLE_POLL_S if settling else None
            due = self._waits.timeout()
            if due is not None:
                timeout = due if timeout is None else min(timeout, due)
            try:
                item = self._prefetch_q.get(timeout=timeout)
            except queue.Empty:
                idle, item = True, None
            for w in self._waits.poll(closing=item is None and not idle):
                self._out.post(self._looked(w.op, w.asked, w.hit, w.error, waited=w))
            if settling and self._settled():
                for op_id, done in settling.items():
                    self._out.post(L3Read(op_id, done, final=True))
                settling.clear()
            if idle:
                continue
            if item is None:
                for op_id in settling:
                    log.error("L3 read op %d still has a late write in flight at close", op_id)
                return
            if isinstance(item, _Lookup):
                looked = self._lookup(item)
                if looked is not None:
                    self._out.post(looked)
                continue
            if isinstance(item, _Forget):
                if self.negative is not None:
                    self.negative.forget(item.keys)
                continue
            done = self._read(item)
            if not settling and self._settled():
                self._out.post(L3Read(item.op_id, done, final=True))
            else:
                log.warning("L3 read op %d: a backend call may still write its pages", item.op_id)
                settling[item.op_id] = done

    def _settled(self) -> bool:
        try:
            return self.storage.host_writes_settled(0.0)
        except Exception:  # cannot tell: keep the pages quarantined, ask again later
            log.exception("host_writes_settled failed")
            return False

    def _lookup(self, op: _Lookup) -> L3Lookup | None:
        """Ask the store about ``op``'s run (what the negative cache leaves of it); None
        when the run stopped at an announced page worth waiting for (the lookup waits in
        :attr:`_waits`). A lookup cancelled before this asks nothing: no hit."""
        if op.cancel is not None and self._cancels.get(op.op_id) is op.cancel:
            self._cancels.pop(op.op_id, None)  # the owner registers a read only after this
        if op.cancel is not None and op.cancel.is_set():
            return L3Lookup(op.op_id, 0)
        neg = self.negative
        asked = len(op.keys) if neg is None else neg.to_ask(op.keys)
        hit = 0
        error = ""
        seconds = 0.0
        unwaited = False
        try:
            if asked:
                began = time.perf_counter()
                run = self.storage.exists_run(op.keys[:asked])  # a failure is no hit
                seconds = time.perf_counter() - began
                hit = run.present
                error = run.why
                if hit < asked and not run.failed:
                    stop = self._waits.stopped(op, op.keys, asked, hit, op.gain)
                    if stop is Stop.WAIT:
                        return None
                    unwaited = stop is Stop.NOT_WORTH
        except Exception as exc:  # backends fail soft already; this is a last guard
            log.exception("L3 lookup op %d failed", op.op_id)
            error = f"{type(exc).__name__}: {exc}"
        return self._looked(op, asked, hit, error, seconds=seconds, unwaited=unwaited)

    def _looked(
        self,
        op: _Lookup,
        asked: int,
        hit: int,
        error: str,
        *,
        waited: Waiting[_Lookup] | None = None,
        seconds: float = 0.0,
        unwaited: bool = False,
    ) -> L3Lookup:
        """The record of lookup ``op`` whose run found ``hit`` of its ``asked`` keys
        (``waited``: after a wait for an announced page; ``unwaited``: it stopped at one
        not worth waiting for; ``seconds``: the run's store call): the previous spec's
        probe (no hit) and the component lookups done here."""
        found: list[ComponentFound] = []
        try:
            if asked and not hit and op.previous is not None:
                self.storage.probe_previous(op.previous.key())
            for c in op.components:
                n = c.lead + hit if hit else c.held
                if not n:
                    continue
                flags = self.storage.batch_contains(c.keys[:n])
                found.append(ComponentFound(c.name, tuple(i for i, f in enumerate(flags) if f)))
        except Exception as exc:  # backends fail soft already; this is a last guard
            log.exception("L3 lookup op %d failed", op.op_id)
            error = f"{type(exc).__name__}: {exc}"
        return L3Lookup(
            op.op_id,
            hit,
            tuple(found),
            skipped=len(op.keys) - asked,
            error=error,
            waited=waited is not None,
            expired=waited is not None and waited.expired,
            unwaited=unwaited,
            seconds=seconds,
        )

    def _read(self, op: _Read) -> int:
        """Read ``op`` chunk by chunk, posting progress; returns the leading pages intact
        (0 when any of its component records could not be read)."""
        chunk = self.storage.options.max_batch_pages
        done = 0
        try:
            for c in op.components:
                if c.keys and not all(self._get_component(c.name, c.keys, c.ids)):
                    return 0
            if op.components:
                self._out.post(L3Read(op.op_id, 0, final=False, records=True))
            for start in range(0, len(op.keys), chunk):
                if op.cancel.is_set():
                    break
                keys = op.keys[start : start + chunk]
                pages = list(op.host_pages[start : start + chunk])
                began = time.perf_counter()
                ok = self.storage.batch_get(keys, self.host_pool, pages)
                seconds = time.perf_counter() - began
                good = next((i for i, o in enumerate(ok) if not o), len(ok))
                done = start + good
                if good < len(ok):
                    break  # a miss ends the usable prefix
                nbytes = len(pages) * self.host_pool.page_bytes
                self._out.post(L3Read(op.op_id, done, False, nbytes=nbytes, seconds=seconds))
        except Exception:  # backends fail soft already; this is a last guard
            log.exception("L3 read op %d failed", op.op_id)
        return done

    def _backup_loop(self) -> None:
        while (item := self._backup_q.get()) is not None:
            written = present = 0
            try:
                if item.component is not None:
                    result = self._set_component(item.component, item.keys, item.host_pages)
                else:
                    result = self.storage.batch_set(
                        item.keys, self.host_pool, list(item.host_pages)
                    )
                written, present = result.written, result.present
            except Exception:
                log.exception("L3 write op %d failed", item.op_id)
            self._out.post(L3Write(item.op_id, len(item.keys), written, present))

    def _announce_loop(self) -> None:
        """Store announcements, those queued meanwhile in one call."""
        closing = False
        while not closing and (item := self._announce_q.get()) is not None:
            batch = [item]
            while True:
                try:
                    more = self._announce_q.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    closing = True
                    break
                batch.append(more)
            keys = [k for a in batch for k in a.keys]
            try:
                self.storage.announce(keys, max(a.ttl_s for a in batch))
            except Exception:  # backends fail soft already; this is a last guard
                log.exception("L3 announcement of %d pages failed", len(keys))
            finally:
                for a in batch:
                    a.done.set()
