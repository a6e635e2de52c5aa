"""L3 threads: prefetch (L3 -> L2) and backup (L2 -> L3).

Like the L1<->L2 controller it knows page ids and keys, never the tree. The owner allocates
host pages, submits ops, and applies what the threads report on its own thread. Every
storage call is bounded by the backend's deadline; an error or timeout is a miss.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from hicache.controller.rank_group import RankGroup
from hicache.keys import PageKey
from hicache.lifecycle import Lifecycle
from hicache.memory import HostPool
from hicache.storage.base import HiCacheStorage
from hicache.tree.node import PageIds

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PrefetchOp:
    """An L3 -> L2 prefetch, in two phases run by the prefetch thread.

    Lookup (``host_pages`` is None): ``batch_exists(keys)``; the thread stores the
    consecutive hits in ``hit`` and sets ``looked_up``. Read (submitted again by the owner
    once it has allocated ``host_pages`` and cut ``keys`` to the hit): chunk by chunk;
    ``done_pages`` counts the leading pages that arrived intact and only grows. ``stop``
    asks the thread to end after the chunk in flight; ``finished`` is set when the read
    phase is over, after which no host page of the op is written any more.
    """

    op_id: int
    keys: Sequence[PageKey]
    host_pages: PageIds | None = None
    hit: int = 0
    done_pages: int = 0
    failed: bool = False
    looked_up: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True, slots=True)
class L3BackupDone:
    """A finished L2 -> L3 write: ``written`` pages stored (or already present)."""

    op_id: int
    pages: int
    written: int


class StorageController(Lifecycle):
    """Owns the L3 backend and its two worker threads.

    Lifecycle: ``start()`` starts the backend and the threads; ``close()`` stops them
    (pending backups are finished first, prefetches are stopped) and closes the backend.
    """

    def __init__(
        self, storage: HiCacheStorage, host_pool: HostPool, ranks: RankGroup | None = None
    ) -> None:
        self.storage = storage
        self.host_pool = host_pool
        self.ranks = ranks or RankGroup()
        self._prefetch_q: queue.Queue[PrefetchOp | None] = queue.Queue()
        self._backup_q: queue.Queue[tuple[int, Sequence[PageKey], PageIds] | None] = queue.Queue()
        self._done: queue.Queue[L3BackupDone] = queue.Queue()
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

    def close(self) -> None:
        """Stop both threads (finishing queued backups) and close the backend. Idempotent."""
        if not self._threads:
            return
        self._prefetch_q.put(None)
        self._backup_q.put(None)
        for t in self._threads:
            t.join()
        self._threads = []
        self.storage.close()

    # ------------------------------------------------------------------ owner side

    def prefetch(self, op: PrefetchOp) -> None:
        """Queue the next phase of ``op`` (lookup while ``host_pages`` is None, else read)."""
        self._prefetch_q.put(op)

    def agreed_hit(self, op: PrefetchOp) -> int:
        """Consecutive hits of a looked-up op that every rank has (all-reduce min)."""
        return self.ranks.min(op.hit)

    def agreed_done(self, op: PrefetchOp) -> int:
        """Pages of ``op`` every rank has (all-reduce min of ``done_pages``)."""
        return self.ranks.min(op.done_pages)

    def backup(self, op_id: int, keys: Sequence[PageKey], host_pages: PageIds) -> None:
        """Write host pages to L3 (present keys are skipped by the backend)."""
        self._backup_q.put((op_id, keys, host_pages))

    def drain_backups(self) -> list[L3BackupDone]:
        out: list[L3BackupDone] = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    # ------------------------------------------------------------------ threads

    def _prefetch_loop(self) -> None:
        chunk = self.storage.options.max_batch_pages
        while (op := self._prefetch_q.get()) is not None:
            if op.host_pages is None:  # lookup phase; a failure counts as no hit
                if not op.stop.is_set():
                    op.hit = self.storage.batch_exists(op.keys)
                op.looked_up.set()
                continue
            try:
                for start in range(0, len(op.keys), chunk):
                    if op.stop.is_set():
                        break
                    keys = op.keys[start : start + chunk]
                    pages = list(op.host_pages[start : start + chunk])
                    ok = self.storage.batch_get(keys, self.host_pool, pages)
                    good = next((i for i, o in enumerate(ok) if not o), len(ok))
                    op.done_pages = start + good
                    if good < len(ok):
                        break  # a miss ends the usable prefix
            except Exception:  # backends fail soft already; this is a last guard
                log.exception("prefetch op %d failed", op.op_id)
                op.failed = True
            finally:
                op.finished.set()

    def _backup_loop(self) -> None:
        while (item := self._backup_q.get()) is not None:
            op_id, keys, pages = item
            try:
                ok = self.storage.batch_set(keys, self.host_pool, list(pages))
                written = sum(ok)
            except Exception:
                log.exception("L3 backup op %d failed", op_id)
                written = 0
            self._done.put(L3BackupDone(op_id, len(keys), written))
