"""The prefill side's sender: writes each finished prefill's pages into the pages the
decode side registered for its room (:class:`PrefillSender`, one thread).

The engine hands over a :class:`SendJob` once a request's prefill is done (its first
token sampled, its pages held by its cache handle until the job ends). The sender waits
for the room's registration (:class:`~hicache.disagg.bootstrap.PrefillRooms`), checks
the pair (the same prompt), writes every store's pages the decode side lacks
(:func:`plan_spans`), closes the room (``SUCCESS`` with the first token, else ``FAILED``
or ``ABORTED``) and reports to the engine (``done(rid, error)``), which then releases the
request's pages. It never touches the cache: the pages it reads stay held meanwhile.

An abort from the decode side is seen between two writes (at most ``batch_bytes`` apart):
the sender stops, the room closes ``ABORTED``, and only then may the decode side free its
pages.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hicache.disagg.bootstrap import PrefillRooms
from hicache.disagg.layout import Registration
from hicache.disagg.pages import PoolGeometry, page_spans
from hicache.disagg.rooms import RoomResult
from hicache.disagg.transport import Span, TransferFailed, Transport

log = logging.getLogger(__name__)

__all__ = ["PrefillSender", "SendJob", "SourcePages", "plan_spans"]

BATCH_BYTES = 64 << 20
"""Bytes written between two looks at the room's abort flag."""


@dataclass(frozen=True, slots=True)
class SourcePages:
    """One store's pages of a request on the prefill side: ``pages[i]`` of the pool
    ``geometry`` describes holds sequence page ``first + i``."""

    name: str
    geometry: PoolGeometry
    first: int
    pages: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SendJob:
    """A prefill that is done: request ``rid`` of ``room``, its prompt's ``prompt_len``
    and ``prompt_hash``, its pages per store (``sources``, the full KV first) and what
    the decode side gets with them (``result``)."""

    rid: str
    room: int
    prompt_len: int
    prompt_hash: str
    sources: tuple[SourcePages, ...]
    result: RoomResult


def plan_spans(job: SendJob, reg: Registration) -> list[Span]:
    """The copies that give the decode side every page it registered beyond its
    ``skip_pages``: per store, sequence page ``p`` from the job's page to the
    registration's. ValueError naming the store and page when the pair cannot be served
    (another prompt, a store or page the prefill does not hold)."""
    if (reg.prompt_len, reg.prompt_hash) != (job.prompt_len, job.prompt_hash):
        raise ValueError(
            f"room {job.room}: the decode side's prompt ({reg.prompt_len} tokens) is not the"
            f" prefill side's ({job.prompt_len} tokens): both must tokenize the same prompt"
        )
    sources = {s.name: s for s in job.sources}
    spans: list[Span] = []
    for target in reg.targets:
        src = sources.get(target.name)
        if src is None:
            raise ValueError(f"room {job.room}: the prefill side holds no store {target.name!r}")
        begin = max(target.first, reg.skip_pages)
        end = target.first + len(target.pages)
        if begin >= end:
            continue
        if begin < src.first or end > src.first + len(src.pages):
            raise ValueError(
                f"room {job.room}: store {target.name!r} pages [{begin}, {end}) are wanted but"
                f" the prefill side holds [{src.first}, {src.first + len(src.pages)})"
            )
        spans += page_spans(
            src.geometry,
            src.pages[begin - src.first : end - src.first],
            PoolGeometry.from_dict(target.geometry),
            target.pages[begin - target.first : end - target.first],
        )
    return spans


class PrefillSender:
    """One thread that serves :class:`SendJob` s in the order their rooms become ready;
    see the module docstring. ``done(rid, error)`` is called on the sender's thread once
    per job (``error`` None: the decode side has every page). ``timeout_s``: one
    transfer's bound."""

    def __init__(
        self,
        rooms: PrefillRooms,
        transport: Transport,
        done: Callable[[str, str | None], None],
        *,
        timeout_s: float,
    ) -> None:
        self.rooms = rooms
        self.transport = transport
        self._done = done
        self._timeout_s = timeout_s
        self._jobs: queue.Queue[SendJob] = queue.Queue()
        self._cancelled: queue.Queue[tuple[int, str]] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hicache-pd-sender", daemon=True)
        self.sent_bytes = 0
        """Bytes written so far (read by metrics; the sender thread writes it)."""

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: SendJob) -> None:
        """Send ``job`` once its room is registered (any thread)."""
        self._jobs.put(job)
        self.rooms.poke()

    def cancel(self, room: int, why: str) -> None:
        """The prefill side gives ``room`` up (its client went away): a job not yet sent
        ends with ``why``."""
        self._cancelled.put((room, why))
        self.rooms.poke()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread; jobs not sent end with an error (reported through ``done``)."""
        self._stop.set()
        self.rooms.poke()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        pending: dict[int, SendJob] = {}
        try:
            while not self._stop.is_set():
                while not self._jobs.empty():
                    job = self._jobs.get_nowait()
                    pending[job.room] = job
                while not self._cancelled.empty():
                    room, why = self._cancelled.get_nowait()
                    if room in pending:
                        self._end(pending.pop(room), error=why)
                self.rooms.expire()
                progressed = False
                for room, job in list(pending.items()):
                    status = self.rooms.status([room])[0]
                    if status is not None and status.state.closed:  # expired or aborted
                        del pending[room]
                        self._report(job, status.error or f"room {room} {status.state.value}")
                        progressed = True
                        continue
                    reg = self.rooms.start(room)
                    if reg is not None:
                        del pending[room]
                        self._send(job, reg)
                        progressed = True
                if not progressed:
                    self.rooms.wait(0.05)
        except BaseException:
            log.exception("the PD sender thread failed")
            raise
        finally:
            for job in pending.values():
                self._end(job, error="the prefill instance is stopping")
            while not self._jobs.empty():
                self._end(self._jobs.get_nowait(), error="the prefill instance is stopping")

    def _send(self, job: SendJob, reg: Registration) -> None:
        try:
            spans = plan_spans(job, reg)
            self._write(job, reg.endpoint, spans)
        except ValueError as exc:  # the pair cannot be served (names the room)
            log.warning("%s", exc)
            self._end(job, error=str(exc))
            return
        except TransferFailed as exc:
            why = f"room {job.room}: sending the pages to the decode instance failed: {exc}"
            log.warning("%s", why)
            self._end(job, error=why)
            return
        if self.rooms.aborted(job.room):
            self._end(job, error=f"room {job.room}: the decode side aborted it")
            return
        self._end(job, result=job.result)

    def _write(self, job: SendJob, endpoint: str, spans: Sequence[Span]) -> None:
        """Write ``spans`` in batches of about :data:`BATCH_BYTES`, looking at the room's
        abort flag between them; TransferFailed past the job's bound."""
        deadline = time.monotonic() + self._timeout_s
        batch: list[Span] = []
        size = 0
        for i, span in enumerate(spans):
            batch.append(span)
            size += span.nbytes
            if size < BATCH_BYTES and i + 1 < len(spans):
                continue
            if self.rooms.aborted(job.room):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferFailed(
                    f"room {job.room}: the transfer took over {self._timeout_s:g} s"
                )
            self.transport.write(endpoint, batch, left)
            self.sent_bytes += size
            batch, size = [], 0

    def _end(
        self, job: SendJob, *, result: RoomResult | None = None, error: str | None = None
    ) -> None:
        self.rooms.close(job.room, result=result, error=error)
        self._report(job, None if result is not None else error or "failed")

    def _report(self, job: SendJob, error: str | None) -> None:
        try:
            self._done(job.rid, error)
        except Exception:
            log.exception("reporting the end of room %d failed", job.room)
