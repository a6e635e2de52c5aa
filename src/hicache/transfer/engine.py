"""TransferEngine: a few worker threads that run device <-> host page copies.

The owner (the cache controller) submits ops and later drains :class:`Completion` records
(from the engine's own queue, or the ``sink`` it was given); the workers touch nothing but
the two pools, the op's :class:`LayerProgress` and the completion queue. Invariants: page
lists are snapshotted at submit (CPU int64), but the pages stay owned by the op until its
completion is drained; an op starts before earlier ones end only when it shares no written
page with them (a load writes device pages, a backup host pages), else it waits as if the
queue were FIFO; at most ``workers`` ops run at once (default 4). CUDA: each worker copies
on its own side stream, ordered after the submitting stream by an event; a load records
one event per layer; an op's completion is posted only after its side-stream work
finished. The ordering argued: ``docs/architecture.md``, "Copies between L1 and L2".
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from hicache.memory.base import PageList
from hicache.memory.device_pool import DevicePool
from hicache.memory.host_pool import HostPool
from hicache.transfer.base import PageCopier
from hicache.transfer.plan import check_compatible
from hicache.transfer.progress import LayerProgress

__all__ = ["Completion", "LayerHook", "OpKind", "TransferEngine"]

OpKind = Literal["backup", "load"]
LayerHook = Callable[[int, int], None]
"""Test hook called on the worker as ``hook(op_id, layer)`` after each loaded layer is marked."""


@dataclass(frozen=True)
class Completion:
    """The outcome of one op, posted by the worker.

    ``nbytes`` is the op's size (``pages * page_bytes``); ``seconds`` the time the worker
    spent on it (not the time it waited in the queue); ``error`` is ``"Type: message"``
    when ``ok`` is False.
    """

    op_id: int
    kind: OpKind
    ok: bool
    error: str | None
    nbytes: int
    seconds: float


@dataclass(eq=False)
class _Op:
    op_id: int
    kind: OpKind
    device_pages: torch.Tensor
    host_pages: torch.Tensor
    progress: LayerProgress | None
    ready: Any  # torch.cuda.Event recorded at submit time, or None
    device_set: frozenset[int] = frozenset()
    host_set: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        self.device_set = frozenset(self.device_pages.tolist())
        self.host_set = frozenset(self.host_pages.tolist())


def _conflict(earlier: _Op, later: _Op) -> bool:
    """Whether ``later`` must wait for ``earlier``: they share a page one of them writes
    (device pages unless both are backups, which only read them; host pages unless both
    are loads)."""
    if (earlier.kind == "load" or later.kind == "load") and earlier.device_set & later.device_set:
        return True
    return (earlier.kind == "backup" or later.kind == "backup") and bool(
        earlier.host_set & later.host_set
    )


_NEW, _RUNNING, _CLOSED = "new", "running", "closed"


def _snapshot(pages: PageList) -> torch.Tensor:
    if isinstance(pages, torch.Tensor):
        return pages.detach().to(device="cpu", copy=True)
    return torch.tensor(list(pages), dtype=torch.int64)


class TransferEngine:
    """Runs :class:`PageCopier` ops between ``device_pool`` and ``host_pool`` on
    ``workers`` threads (see the module docstring for the order).

    Lifecycle: construct, :meth:`start` (or ``with``), submit, :meth:`close`. Submitting
    before ``start`` or after ``close`` raises RuntimeError. A failing op posts a
    Completion with ``ok=False`` (and fails its LayerProgress); the engine keeps running.
    """

    def __init__(
        self,
        device_pool: DevicePool,
        host_pool: HostPool,
        copier: PageCopier,
        *,
        layer_hook: LayerHook | None = None,
        name: str = "hicache-transfer",
        sink: Callable[[Completion], None] | None = None,
        workers: int = 4,
    ) -> None:
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"workers={workers!r} is invalid; must be an int >= 1")
        check_compatible(device_pool, host_pool)
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.copier = copier
        self._hook = layer_hook
        self._name = name
        self._device = device_pool.device
        self._cuda = self._device.type == "cuda"
        self._workers = workers
        self._queued: list[_Op] = []  # submitted, not started; in submission order
        self._running: list[_Op] = []
        self._completions: queue.SimpleQueue[Completion] = queue.SimpleQueue()
        self._post = sink if sink is not None else self._completions.put
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # an op finished or was queued
        self._pending = 0
        self._pending_backups = 0
        self._state = _NEW
        self._threads: list[threading.Thread] = []

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker threads (on CUDA each creates its copy stream)."""
        with self._lock:
            if self._state != _NEW:
                raise RuntimeError(f"TransferEngine cannot start: it is {self._state}")
            self._threads = [
                threading.Thread(target=self._run, name=f"{self._name}-{i}", daemon=True)
                for i in range(self._workers)
            ]
            self._state = _RUNNING
        for t in self._threads:
            t.start()

    def close(self, *, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop accepting ops, finish (or with ``cancel``, drop) queued ones, join the workers.

        Cancelled ops post ``ok=False`` completions with error ``"cancelled"``; ops in
        progress always finish. Idempotent; a never-started engine just becomes closed.
        ``timeout`` bounds each join (seconds).
        """
        with self._lock:
            if self._state == _CLOSED:
                return
            was_running = self._state == _RUNNING
            self._state = _CLOSED
            dropped: list[_Op] = []
            if cancel:
                dropped, self._queued = self._queued, []
            self._idle.notify_all()
        if not was_running:
            return
        for op in dropped:
            self._finish(op, ok=False, error="cancelled", seconds=0.0)
        for t in self._threads:
            t.join(timeout)

    def __enter__(self) -> TransferEngine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- submission ----------------------------------------------------------------------
    def submit_backup(self, op_id: int, device_pages: PageList, host_pages: PageList) -> None:
        """Queue a D -> H copy of all layers of ``device_pages[i]`` into ``host_pages[i]``."""
        self._submit(
            _Op(op_id, "backup", _snapshot(device_pages), _snapshot(host_pages), None, None)
        )

    def submit_load(
        self, op_id: int, host_pages: PageList, device_pages: PageList
    ) -> LayerProgress:
        """Queue an H -> D copy, layer by layer; the returned progress tracks the layers."""
        progress = LayerProgress(
            self.device_pool.spec.num_layers, self._device if self._cuda else None
        )
        self._submit(
            _Op(op_id, "load", _snapshot(device_pages), _snapshot(host_pages), progress, None)
        )
        return progress

    def _submit(self, op: _Op) -> None:
        with self._lock:
            if self._state != _RUNNING:
                raise RuntimeError(f"TransferEngine is {self._state}; cannot submit op {op.op_id}")
            if self._cuda:
                op.ready = torch.cuda.Event()
                op.ready.record(torch.cuda.current_stream(self._device))
            self._pending += 1
            if op.kind == "backup":
                self._pending_backups += 1
            self._queued.append(op)
            self._idle.notify_all()

    # -- results -------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Ops submitted whose completion has not been posted yet."""
        with self._lock:
            return self._pending

    def drain_completions(self) -> list[Completion]:
        """All completions posted so far, oldest first (non-blocking); always empty when
        the engine was given a ``sink`` (the completions went there)."""
        out: list[Completion] = []
        while True:
            try:
                out.append(self._completions.get_nowait())
            except queue.Empty:
                return out

    @property
    def pending_backups(self) -> int:
        """Backups submitted whose completion has not been posted yet."""
        with self._lock:
            return self._pending_backups

    def wait_idle(self, timeout: float | None = None) -> None:
        """Block until every submitted op has posted its completion; TimeoutError otherwise."""
        with self._idle:
            if not self._idle.wait_for(lambda: self._pending == 0, timeout):
                raise TimeoutError(f"{self._pending} transfer ops still pending after {timeout} s")

    def wait_backups(self, timeout: float | None = None) -> None:
        """Block until every backup submitted so far has posted its completion (loads may
        still run); TimeoutError otherwise. A backup waits only for earlier ops sharing a
        page with it, so this waits for no load that copies other pages."""
        with self._idle:
            if not self._idle.wait_for(lambda: self._pending_backups == 0, timeout):
                raise TimeoutError(
                    f"{self._pending_backups} backups still pending after {timeout} s"
                )

    # -- worker --------------------------------------------------------------------------
    def _take(self) -> _Op | None:
        """Under the lock: the first queued op that no earlier op (running or queued)
        conflicts with, moved to running; None when there is none."""
        for i, op in enumerate(self._queued):
            earlier = self._running + self._queued[:i]
            if not any(_conflict(e, op) for e in earlier):
                del self._queued[i]
                self._running.append(op)
                return op
        return None

    def _run(self) -> None:
        ctx = torch.cuda.device(self._device) if self._cuda else contextlib.nullcontext()
        with ctx:
            stream = torch.cuda.Stream(device=self._device) if self._cuda else None
            while True:
                with self._idle:
                    op = self._take()
                    while op is None:
                        if self._state == _CLOSED and not self._queued:
                            return
                        self._idle.wait()
                        op = self._take()
                self._execute(op, stream)

    def _execute(self, op: _Op, stream: Any) -> None:
        t0 = time.perf_counter()
        try:
            stream_ctx = (
                torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
            )
            with stream_ctx:
                if op.ready is not None:
                    stream.wait_event(op.ready)
                if op.kind == "backup":
                    self.copier.backup(
                        self.device_pool, self.host_pool, op.device_pages, op.host_pages
                    )
                else:
                    self._load(op, stream)
                if stream is not None:
                    stream.synchronize()
        except Exception as exc:
            if op.progress is not None:
                op.progress.fail(exc)
            self._finish(
                op, ok=False, error=f"{type(exc).__name__}: {exc}", seconds=time.perf_counter() - t0
            )
            return
        self._finish(op, ok=True, error=None, seconds=time.perf_counter() - t0)

    def _load(self, op: _Op, stream: Any) -> None:
        progress = op.progress
        assert progress is not None

        def done(layer: int) -> None:
            event = None
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
            progress.mark_layer_done(layer, event)
            if self._hook is not None:
                self._hook(op.op_id, layer)

        self.copier.load_layers(
            self.device_pool, self.host_pool, op.host_pages, op.device_pages, done
        )

    def _finish(self, op: _Op, *, ok: bool, error: str | None, seconds: float) -> None:
        if not ok and op.progress is not None and not op.progress.failed:
            op.progress.fail(RuntimeError(error))
        nbytes = op.device_pages.numel() * self.device_pool.page_bytes
        self._post(Completion(op.op_id, op.kind, ok, error, nbytes, seconds))
        with self._idle:
            if op in self._running:
                self._running.remove(op)
            self._pending -= 1
            if op.kind == "backup":
                self._pending_backups -= 1
            self._idle.notify_all()

    def __repr__(self) -> str:
        return (
            f"TransferEngine(state={self._state}, pending={self.pending}, copier={self.copier!r})"
        )
