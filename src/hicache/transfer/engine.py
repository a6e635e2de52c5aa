"""TransferEngine: one worker thread that runs device <-> host page copies in FIFO order.

The owner (the cache controller) submits ops and later drains :class:`Completion` records
(from the engine's own queue, or from the ``sink`` it was given: the cache's one
completion queue); the worker touches nothing but the two pools, the op's
:class:`LayerProgress` and the completion queue. Page lists are snapshotted at submit time
(copied to CPU int64), so the caller may reuse its tensors at once; the *pages* themselves
must stay owned by the op (not freed or rewritten) until its completion is drained.

CUDA: copies run on a side stream owned by the engine. At submit time an event is recorded
on the submitting thread's current stream and the side stream waits on it before the op
starts, so a backup reads device pages only after the kernels that wrote them, and a load
writes device pages only after earlier work queued on that stream. A load records one
event per layer (see :class:`LayerProgress`). An op's completion is posted only after its
side-stream work has finished.
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


@dataclass
class _Op:
    op_id: int
    kind: OpKind
    device_pages: torch.Tensor
    host_pages: torch.Tensor
    progress: LayerProgress | None
    ready: Any  # torch.cuda.Event recorded at submit time, or None


_NEW, _RUNNING, _CLOSED = "new", "running", "closed"


def _snapshot(pages: PageList) -> torch.Tensor:
    if isinstance(pages, torch.Tensor):
        return pages.detach().to(device="cpu", copy=True)
    return torch.tensor(list(pages), dtype=torch.int64)


class TransferEngine:
    """Runs :class:`PageCopier` ops between ``device_pool`` and ``host_pool`` on one thread.

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
    ) -> None:
        check_compatible(device_pool, host_pool)
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.copier = copier
        self._hook = layer_hook
        self._name = name
        self._device = device_pool.device
        self._cuda = self._device.type == "cuda"
        self._ops: queue.Queue[_Op | None] = queue.Queue()
        self._completions: queue.SimpleQueue[Completion] = queue.SimpleQueue()
        self._post = sink if sink is not None else self._completions.put
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._state = _NEW
        self._thread: threading.Thread | None = None
        self._stream: Any = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker thread (and, on CUDA, create the copy stream)."""
        with self._lock:
            if self._state != _NEW:
                raise RuntimeError(f"TransferEngine cannot start: it is {self._state}")
            if self._cuda:
                self._stream = torch.cuda.Stream(device=self._device)
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._state = _RUNNING
        self._thread.start()

    def close(self, *, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop accepting ops, finish (or with ``cancel``, drop) queued ones, join the worker.

        Cancelled ops post ``ok=False`` completions with error ``"cancelled"``; the op in
        progress always finishes. Idempotent; a never-started engine just becomes closed.
        ``timeout`` bounds the join (seconds).
        """
        with self._lock:
            if self._state == _CLOSED:
                return
            was_running = self._state == _RUNNING
            self._state = _CLOSED
        if not was_running:
            return
        if cancel:
            while True:
                try:
                    op = self._ops.get_nowait()
                except queue.Empty:
                    break
                if op is not None:
                    self._finish(op, ok=False, error="cancelled", seconds=0.0)
        self._ops.put(None)
        assert self._thread is not None
        self._thread.join(timeout)

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
            self._ops.put(op)

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

    def wait_idle(self, timeout: float | None = None) -> None:
        """Block until every submitted op has posted its completion; TimeoutError otherwise."""
        with self._idle:
            if not self._idle.wait_for(lambda: self._pending == 0, timeout):
                raise TimeoutError(f"{self._pending} transfer ops still pending after {timeout} s")

    # -- worker --------------------------------------------------------------------------
    def _run(self) -> None:
        ctx = torch.cuda.device(self._device) if self._cuda else contextlib.nullcontext()
        with ctx:
            while True:
                op = self._ops.get()
                if op is None:
                    return
                self._execute(op)

    def _execute(self, op: _Op) -> None:
        t0 = time.perf_counter()
        try:
            stream_ctx = torch.cuda.stream(self._stream) if self._cuda else contextlib.nullcontext()
            with stream_ctx:
                if op.ready is not None:
                    self._stream.wait_event(op.ready)
                if op.kind == "backup":
                    self.copier.backup(
                        self.device_pool, self.host_pool, op.device_pages, op.host_pages
                    )
                else:
                    self._load(op)
                if self._cuda:
                    self._stream.synchronize()
        except Exception as exc:
            if op.progress is not None:
                op.progress.fail(exc)
            self._finish(
                op, ok=False, error=f"{type(exc).__name__}: {exc}", seconds=time.perf_counter() - t0
            )
            return
        self._finish(op, ok=True, error=None, seconds=time.perf_counter() - t0)

    def _load(self, op: _Op) -> None:
        progress = op.progress
        assert progress is not None

        def done(layer: int) -> None:
            event = None
            if self._cuda:
                event = torch.cuda.Event()
                event.record(self._stream)
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
            self._pending -= 1
            self._idle.notify_all()

    def __repr__(self) -> str:
        return (
            f"TransferEngine(state={self._state}, pending={self.pending}, copier={self.copier!r})"
        )
