"""L3 threads: lookups and reads (L3 -> L2) on one thread, writes (L2 -> L3) on another.

Like the L1<->L2 controller it knows page ids and keys, never the tree. Component records
(recurrent-state snapshots, ``docs/l3-keys.md``) ride on the same ops: a lookup may carry
the component keys of its pages (looked up one by one within the full-KV hit), a read one
component record into an L2 state slot (read first: without it the pages are no hit), and
a write may store L2 state slots instead of pages. The owner (the
cache's storage tier) allocates host pages and submits ops; the threads post immutable
records (:class:`L3Lookup`, :class:`L3Read`, :class:`L3Write`) to the owner's
:class:`CompletionQueue`. Every storage call is bounded by the backend's deadline; an
error or timeout is a miss.

Late writes: a backend call that overran its deadline may still be writing into the host
pages it was handed (a zero-copy get cannot be cancelled). A read op therefore posts its
``final`` record only once the backend says no such call is left
(:meth:`HiCacheStorage.host_writes_settled`); until then the owner keeps the op's pages
out of every allocation (they are quarantined, not freed).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from hicache.controller.completions import CompletionQueue, L3Lookup, L3Read, L3Write
from hicache.controller.rank_group import RankGroup
from hicache.keys import PageKey
from hicache.lifecycle import Lifecycle
from hicache.memory import HostPool
from hicache.memory.state_pool import StatePool
from hicache.storage.base import HiCacheStorage
from hicache.tree.node import PageIds

log = logging.getLogger(__name__)

_SETTLE_POLL_S = 0.02
"""How often the prefetch thread asks a backend whether late writes have settled."""


@dataclass(frozen=True, slots=True)
class _Lookup:
    op_id: int
    keys: Sequence[PageKey]
    component_keys: Sequence[PageKey]


@dataclass(frozen=True, slots=True)
class _Read:
    op_id: int
    keys: Sequence[PageKey]
    host_pages: PageIds
    cancel: threading.Event
    state: tuple[PageKey, int] | None


@dataclass(frozen=True, slots=True)
class _Write:
    op_id: int
    keys: Sequence[PageKey]
    host_pages: PageIds
    states: bool


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
        state_pool: StatePool | None = None,
    ) -> None:
        self.storage = storage
        self.host_pool = host_pool
        self.state_pool = state_pool
        self.ranks = ranks or RankGroup()
        self._out = completions
        self._prefetch_q: queue.Queue[_Lookup | _Read | None] = queue.Queue()
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
        for t in self._threads:
            t.join(timeout_s)
            if t.is_alive():
                log.error("%s did not stop within %.0f s; abandoning it", t.name, timeout_s)
        self._threads = []
        self.storage.close()

    # ------------------------------------------------------------------ owner side

    def lookup(
        self, op_id: int, keys: Sequence[PageKey], component_keys: Sequence[PageKey] = ()
    ) -> None:
        """Queue a lookup of ``keys`` (a run from the first) and, when given, of the
        component records ``component_keys[i]`` (the state after page ``i``) within the
        run found; an :class:`L3Lookup` follows."""
        if component_keys and len(component_keys) != len(keys):
            raise ValueError(f"{len(component_keys)} component keys for {len(keys)} keys")
        self._prefetch_q.put(_Lookup(op_id, keys, component_keys))

    def read(
        self,
        op_id: int,
        keys: Sequence[PageKey],
        host_pages: PageIds,
        state: tuple[PageKey, int] | None = None,
    ) -> None:
        """Queue a read of ``keys[i]`` into ``host_pages[i]`` and, with ``state`` = (key,
        slot), of that component record into the L2 state slot first; :class:`L3Read`
        records follow, the last one with ``final`` set."""
        if len(keys) != len(host_pages):
            raise ValueError(f"read of {len(keys)} keys into {len(host_pages)} host pages")
        if state is not None and self.state_pool is None:
            raise ValueError("a state read needs the L2 state pool")
        cancel = self._cancels[op_id] = threading.Event()
        self._prefetch_q.put(_Read(op_id, keys, host_pages, cancel, state))

    def cancel(self, op_id: int) -> None:
        """Ask a read to stop after the chunk in flight (its final record still comes)."""
        ev = self._cancels.pop(op_id, None)
        if ev is not None:
            ev.set()

    def write(self, op_id: int, keys: Sequence[PageKey], host_pages: PageIds) -> None:
        """Queue a write of host pages to L3 (present keys are skipped by the backend);
        an :class:`L3Write` follows. The owner keeps the pages until it arrives."""
        self._backup_q.put(_Write(op_id, keys, host_pages, states=False))

    def write_states(self, op_id: int, keys: Sequence[PageKey], slots: PageIds) -> None:
        """Queue a write of L2 state slots as component records ``keys[i]``; an
        :class:`L3Write` follows. The owner keeps the slots (pinned) until it arrives."""
        if self.state_pool is None:
            raise ValueError("a state write needs the L2 state pool")
        if len(keys) != len(slots):
            raise ValueError(f"write of {len(keys)} keys from {len(slots)} state slots")
        self._backup_q.put(_Write(op_id, keys, slots, states=True))

    def forget(self, op_id: int) -> None:
        """The owner applied a read's final record: drop its cancel flag."""
        self._cancels.pop(op_id, None)

    # ------------------------------------------------------------------ threads

    def _prefetch_loop(self) -> None:
        settling: dict[int, int] = {}  # read op id -> its done pages, late writes pending
        while True:
            idle = False
            try:
                item = self._prefetch_q.get(timeout=_SETTLE_POLL_S if settling else None)
            except queue.Empty:
                idle, item = True, None
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
                self._out.post(self._lookup(item))
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

    def _lookup(self, op: _Lookup) -> L3Lookup:
        hit = 0
        bounds: tuple[int, ...] = ()
        try:
            hit = self.storage.batch_exists(op.keys)  # a failure is no hit
            if hit and op.component_keys:
                found = self.storage.batch_contains(op.component_keys[:hit])
                bounds = tuple(i + 1 for i, f in enumerate(found) if f)
        except Exception:  # backends fail soft already; this is a last guard
            log.exception("L3 lookup op %d failed", op.op_id)
        return L3Lookup(op.op_id, hit, bounds)

    def _read(self, op: _Read) -> int:
        """Read ``op`` chunk by chunk, posting progress; returns the leading pages intact
        (0 when its component record could not be read)."""
        chunk = self.storage.options.max_batch_pages
        done = 0
        try:
            if op.state is not None:
                assert self.state_pool is not None
                key, slot = op.state
                if not self.storage.batch_get_state([key], self.state_pool, [slot])[0]:
                    return 0
            for start in range(0, len(op.keys), chunk):
                if op.cancel.is_set():
                    break
                keys = op.keys[start : start + chunk]
                pages = list(op.host_pages[start : start + chunk])
                ok = self.storage.batch_get(keys, self.host_pool, pages)
                good = next((i for i, o in enumerate(ok) if not o), len(ok))
                done = start + good
                if good < len(ok):
                    break  # a miss ends the usable prefix
                self._out.post(L3Read(op.op_id, done, final=False))
        except Exception:  # backends fail soft already; this is a last guard
            log.exception("L3 read op %d failed", op.op_id)
        return done

    def _backup_loop(self) -> None:
        while (item := self._backup_q.get()) is not None:
            written = present = 0
            try:
                if item.states:
                    assert self.state_pool is not None
                    result = self.storage.batch_set_state(
                        item.keys, self.state_pool, list(item.host_pages)
                    )
                else:
                    result = self.storage.batch_set(
                        item.keys, self.host_pool, list(item.host_pages)
                    )
                written, present = result.written, result.present
            except Exception:
                log.exception("L3 write op %d failed", item.op_id)
            self._out.post(L3Write(item.op_id, len(item.keys), written, present))
