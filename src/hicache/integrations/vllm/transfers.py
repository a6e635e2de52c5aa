"""The tier's IO thread: loads and stores between vLLM's rows and a hicache backend.

vLLM calls a secondary tier in its scheduler process and needs every call to return at
once. :class:`TierTransfers` owns one worker thread: :meth:`~TierTransfers.submit` queues a
:class:`Transfer` and returns; the worker runs it (``batch_set_payloads`` /
``batch_get_payloads`` over :class:`~.rows.Rows`) and posts an immutable :class:`Finished`
that the owner takes with :meth:`~TierTransfers.take`. Invariants: the worker never touches
vLLM state; it starts the backend itself, and a backend that cannot start fails every
transfer and misses every lookup, retried every :data:`RETRY_START_S` s; every backend call
has the backend's deadline and never raises, so a job always finishes. :meth:`start`
starts the thread; :meth:`close` stops it after the queued jobs (each still gets its
:class:`Finished`) and closes the backend; a context manager too.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from hicache.integrations.vllm.rows import Rows
from hicache.keys import PageKey
from hicache.storage.base import HiCacheStorage
from hicache.storage.stats import SetOutcome

__all__ = ["RETRY_START_S", "Direction", "Finished", "TierTransfers", "Transfer"]

log = logging.getLogger("hicache.integrations.vllm")

RETRY_START_S = 5.0
"""Least seconds between two attempts to start a backend that failed to start."""


class Direction(str, Enum):
    STORE = "store"
    """vLLM's rows -> the backend (vLLM's cascade)."""
    LOAD = "load"
    """The backend -> vLLM's rows (vLLM's promotion)."""


@dataclass(frozen=True, slots=True)
class Transfer:
    """One vLLM job: ``keys[i]`` (vLLM offload keys) pairs with row ``chunk_ids[i]`` and
    hicache key ``page_keys[i]``."""

    job_id: int
    direction: Direction
    keys: tuple[bytes, ...]
    page_keys: tuple[PageKey, ...]
    chunk_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.keys) == len(self.page_keys) == len(self.chunk_ids):
            raise ValueError(
                f"job {self.job_id}: {len(self.keys)} keys, {len(self.page_keys)} page keys "
                f"and {len(self.chunk_ids)} chunk ids must pair up"
            )


@dataclass(frozen=True, slots=True)
class Finished:
    """The outcome of one :class:`Transfer`.

    ``done``: the keys now in place (a store: stored or already present; a load: their rows
    hold checked records); ``failed``: the others (for a load: absent, corrupt, foreign,
    stale, timed out or a backend error; those rows are untouched). ``seconds``: wall time
    of the backend call; ``nbytes``: payload bytes moved (rows of ``done`` keys actually
    written or read).
    """

    job_id: int
    direction: Direction
    done: tuple[bytes, ...]
    failed: tuple[bytes, ...]
    seconds: float
    nbytes: int

    @property
    def success(self) -> bool:
        return not self.failed


_STOP = None


class TierTransfers:
    """The worker thread over ``storage`` (unstarted) and vLLM's rows ``flat``
    (``row_bytes`` each; see :func:`~.rows.flat_rows`)."""

    def __init__(
        self,
        storage: HiCacheStorage,
        flat: memoryview,
        row_bytes: int,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.storage = storage
        self._flat = flat
        self._row_bytes = row_bytes
        self._clock = clock
        self._jobs: queue.SimpleQueue[Transfer | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Finished] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._in_flight = 0
        """Jobs submitted whose :class:`Finished` is not posted yet (under ``_idle``)."""
        self._thread: threading.Thread | None = None
        self._closed = False
        self._next_start = 0.0
        self._tried = threading.Event()
        """Set once the worker has tried to start the backend (whatever the outcome)."""

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        if self._closed:
            raise RuntimeError("TierTransfers is closed; create a new one")
        self._thread = threading.Thread(target=self._run, name="hicache-vllm-tier", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Finish the queued jobs, stop the thread, close the backend (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._jobs.put(_STOP)
            self._thread.join()
        self.storage.close()

    def __enter__(self) -> TierTransfers:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- owner's side ------------------------------------------------------------------
    def submit(self, transfer: Transfer) -> None:
        """Queue ``transfer``; returns at once. Its :class:`Finished` comes from :meth:`take`."""
        if self._thread is None or self._closed:
            raise RuntimeError("TierTransfers is not running; call start() first")
        with self._idle:
            self._in_flight += 1
        self._jobs.put(transfer)

    def take(self) -> list[Finished]:
        """Every :class:`Finished` posted since the last call, in completion order."""
        out: list[Finished] = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    @property
    def busy(self) -> bool:
        """True while a submitted job's :class:`Finished` has not been taken yet."""
        with self._idle:
            return self._in_flight > 0 or not self._done.empty()

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until every submitted job has posted its :class:`Finished` (True), or
        ``timeout_s`` passed (False). Each backend call has a deadline, so this ends."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout_s)

    def ready(self, timeout_s: float = 0.0) -> bool:
        """True once the backend has started (lookups answer misses until then). Waits up
        to ``timeout_s`` seconds for the worker's first attempt to start it."""
        self._tried.wait(timeout_s)
        return self.storage.started

    # -- worker ------------------------------------------------------------------------
    def _run(self) -> None:
        self._ensure_started()
        self._tried.set()
        while True:
            try:  # while the backend is down, wake up to try it again
                wait = None if self.storage.started else RETRY_START_S
                job = self._jobs.get(timeout=wait)
            except queue.Empty:
                self._ensure_started()
                continue
            if job is _STOP:
                return
            try:
                finished = self._transfer(job)
            except Exception:  # a bug, not a backend failure (those never raise)
                log.exception("vLLM tier job %d failed", job.job_id)
                finished = Finished(job.job_id, job.direction, (), job.keys, 0.0, 0)
            self._done.put(finished)
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    def _ensure_started(self) -> bool:
        st = self.storage
        if st.started:
            return True
        now = self._clock()
        if now < self._next_start:
            return False
        self._next_start = now + RETRY_START_S
        try:
            st.start()
        except Exception as e:  # StorageError, or any failure of a custom backend
            log.warning(
                "hicache %s backend for the vLLM tier did not start (%s); its chunks are "
                "misses until it does (next try in %.0f s)",
                st.name,
                e,
                RETRY_START_S,
            )
            return False
        return True

    def _transfer(self, job: Transfer) -> Finished:
        if not job.keys:
            return Finished(job.job_id, job.direction, (), (), 0.0, 0)
        if not self._ensure_started():
            return Finished(job.job_id, job.direction, (), job.keys, 0.0, 0)
        load = job.direction is Direction.LOAD
        rows = Rows(self._flat, self._row_bytes, job.chunk_ids, for_get=load)
        t0 = self._clock()
        if load:
            ok = self.storage.batch_get_payloads(list(job.page_keys), rows)
            moved = sum(ok)
        else:
            res = self.storage.batch_set_payloads(list(job.page_keys), rows)
            ok = [o is not SetOutcome.FAILED for o in res.outcomes]
            moved = res.written
        seconds = self._clock() - t0
        done = tuple(k for k, good in zip(job.keys, ok, strict=True) if good)
        failed = tuple(k for k, good in zip(job.keys, ok, strict=True) if not good)
        return Finished(job.job_id, job.direction, done, failed, seconds, moved * self._row_bytes)
