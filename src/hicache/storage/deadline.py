"""Deadlines for blocking backend calls: a small pool of daemon worker threads.

:meth:`DeadlineRunner.call` runs a network call on a worker, waits at most ``timeout_s`` and
returns a :class:`CallResult` instead of raising. Invariants: an overrunning call keeps
running (Python cannot cancel it) and is counted in :attr:`DeadlineRunner.stuck` until it
returns, and backends refuse new calls while any is stuck; one made with
``writes_host=True`` stays counted in :attr:`DeadlineRunner.stuck_host_writers` until its
last byte has landed (:meth:`DeadlineRunner.wait_host_writes` waits for 0: what
:meth:`hicache.storage.base.HiCacheStorage.host_writes_settled` reports); workers are
daemon threads, so a call stuck forever never blocks exit. Nothing runs until
:meth:`start`; :meth:`close` stops idle workers (stuck ones are abandoned). Thread-safe.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["CallResult", "DeadlineRunner"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class CallResult(Generic[T]):
    """Outcome of one call: ``value`` when it returned in time, else why not."""

    value: T | None = None
    error: BaseException | None = None
    timed_out: bool = False
    refused: bool = False
    """True when the call was not started because an earlier call is still stuck."""

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out and not self.refused


_Job = tuple[Callable[[], Any], "Future[Any]"]


class DeadlineRunner:
    """Runs callables on ``workers`` daemon threads with a per-call deadline."""

    def __init__(self, name: str, workers: int = 4) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers!r} is invalid; must be an int >= 1")
        self._name = name
        self._workers = workers
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._stuck = 0
        self._stuck_host = 0
        self._inflight = 0
        self._running = False

    @property
    def running(self) -> bool:
        return self._running

    @property
    def stuck(self) -> int:
        """Calls that overran their deadline and have not returned yet."""
        with self._lock:
            return self._stuck

    @property
    def stuck_host_writers(self) -> int:
        """Stuck calls made with ``writes_host=True``: each may still write host pages."""
        with self._lock:
            return self._stuck_host

    def wait_host_writes(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds until no ``writes_host`` call is stuck; True then.

        A call's count is dropped only after it returned, so True means none of them can
        write any more. Valid after :meth:`close` too (stuck calls run on regardless).
        """
        with self._idle:
            return self._idle.wait_for(lambda: self._stuck_host == 0, timeout=max(timeout_s, 0.0))

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every submitted call to return; True if none is left."""
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout=max(timeout_s, 0.0))

    def start(self) -> None:
        """Start the worker threads (idempotent)."""
        with self._lock:
            if self._running:
                return
            self._running = True
            for i in range(self._workers):
                t = threading.Thread(target=self._work, name=f"{self._name}-io-{i}", daemon=True)
                t.start()
                self._threads.append(t)

    def close(self, join_s: float = 1.0) -> None:
        """Stop the workers; waits up to ``join_s`` seconds per idle worker (idempotent)."""
        with self._lock:
            if not self._running:
                return
            self._running = False
            threads, self._threads = self._threads, []
        for _ in threads:
            self._queue.put(None)
        for t in threads:
            t.join(join_s)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            fn, fut = job
            try:
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn())
                except BaseException as e:  # report everything to the waiter
                    fut.set_exception(e)
            finally:
                # drop this call's references before waiting for the next: a result held
                # here (a get's 64 MiB of records) would stay alive while the worker idles
                # and be freed inside the next call's time
                del job, fn, fut
                with self._idle:
                    self._inflight -= 1
                    self._idle.notify_all()

    def call(
        self,
        fn: Callable[[], T],
        timeout_s: float,
        *,
        refuse_if_stuck: bool = True,
        writes_host: bool = False,
    ) -> CallResult[T]:
        """Run ``fn`` on a worker and wait at most ``timeout_s`` seconds for it.

        Never raises for ``fn``'s failures: they come back as ``error``. With
        ``refuse_if_stuck`` the call is refused while an earlier call is stuck.
        ``writes_host``: ``fn`` writes into host-pool pages, so if it overruns it is counted
        in :attr:`stuck_host_writers` until it returns.
        """
        if not self._running:
            return CallResult(error=RuntimeError(f"{self._name}: runner is not started"))
        if refuse_if_stuck and self.stuck:
            return CallResult(refused=True)
        fut: Future[T] = Future()
        with self._lock:
            self._inflight += 1
        self._queue.put((fn, fut))
        try:
            return CallResult(value=fut.result(timeout=max(timeout_s, 0.0)))
        except FutureTimeout:
            if fut.cancel():  # never started: nothing left running
                return CallResult(timed_out=True)
            with self._lock:
                self._stuck += 1
                self._stuck_host += writes_host
            fut.add_done_callback(lambda _f: self._unstick(writes_host))
            return CallResult(timed_out=True)
        except Exception as e:
            return CallResult(error=e)

    def _unstick(self, writes_host: bool) -> None:
        """A stuck call returned (runs after ``fn`` returned, on its worker)."""
        with self._idle:
            self._stuck -= 1
            self._stuck_host -= writes_host
            self._idle.notify_all()
