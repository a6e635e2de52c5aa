"""One client request's engine requests: submit them, merge their outputs, watch the client.

An HTTP request becomes one or more engine requests (``n`` choices, a batch of prompts), one
engine *group*. :class:`Fanout` submits them, yields every output as an :class:`Event` in
arrival order, and ends with an :class:`Ending` (all finished, the client went away, or
the engine stopped). Copies of one prompt are submitted once the first copy has its first
token, so they find its KV in the prefix cache (not at all when the first fails before
its first token). Invariants: every job holds a place in the
engine's bounded waiting queue from the start (a
:class:`~hicache.engine.admission.Reservation`), so a later copy is never refused half-way;
places of jobs never submitted are given back, and their claimed prefill rooms end
(:meth:`Engine.refused <hicache.engine.front.engine.Engine.refused>`), also when the fan-out
is dropped unrun; the client is polled every :data:`DISCONNECT_POLL_S`, streaming or not,
and a disconnect aborts every unfinished engine request at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import weakref
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from hicache.engine.admission import Reservation
from hicache.engine.front.engine import Engine
from hicache.engine.front.validation import ValidRequest
from hicache.engine.request import RequestOutput
from hicache.engine.session import SessionHint

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.02
"""How often the client connection is checked while its request runs."""
_ENGINE_CHECK_S = 0.5
_groups = itertools.count()


class Client(Protocol):
    """Whoever waits for a fan-out's outputs: an HTTP request (Starlette's), or a gRPC
    call (:mod:`hicache.server.grpc_worker`)."""

    async def is_disconnected(self) -> bool:
        """Whether the client has gone away (its request should be aborted)."""
        ...


@dataclass(frozen=True, slots=True)
class Job:
    """One engine request of an HTTP request, validated (:meth:`Engine.validate`: it is
    submitted as it is). ``after``: the index of the job whose first output releases this
    one (None: submitted at once)."""

    index: int
    request: ValidRequest
    after: int | None = None


@dataclass(frozen=True, slots=True)
class Event:
    """An output of job ``index``."""

    index: int
    output: RequestOutput


class Ending(str, enum.Enum):
    """How a :class:`Fanout` ended."""

    DONE = "done"
    """Every job finished (normally or with an error)."""
    DISCONNECTED = "client_disconnected"
    """The client went away; every unfinished job was aborted."""
    ENGINE_STOPPED = "engine_stopped"
    """The engine stopped running before every job finished."""
    SUBMIT_FAILED = "submit_failed"
    """A job could not be submitted (the engine is not running)."""


class Fanout:
    """Runs ``jobs`` for one HTTP request; iterate :meth:`events`, then read :attr:`ending`.

    ``on_abort(reason)`` is called once per engine request this fanout aborts.
    ``reservation``: queue places for every job, taken with :meth:`Engine.reserve`
    (None: each submit reserves its own, and may be refused); closed when the run ends.
    ``session``: the agent-session hint every job carries (one client request's), kept
    for whoever accounts its outputs.
    """

    def __init__(
        self,
        engine: Engine,
        jobs: Sequence[Job],
        http: Client,
        *,
        on_abort: Callable[[str], None] | None = None,
        reservation: Reservation | None = None,
        session: SessionHint | None = None,
    ) -> None:
        self.engine = engine
        self.session = session
        self.jobs = list(jobs)
        self.reservation = reservation
        if reservation is not None:  # places given back even if events() never runs
            weakref.finalize(self, reservation.close)
        self._rids: dict[int, str] = {}
        # rooms of jobs never submitted end even if events() never runs
        weakref.finalize(self, _end_unsubmitted, engine, self.jobs, self._rids, "not submitted")
        self.group = f"grp-{next(_groups)}"
        """The engine group of every job (one client request)."""
        self.http = http
        self.on_abort = on_abort
        self.ending: Ending | None = None
        self.error: str | None = None
        """Why a submit failed (with :attr:`Ending.SUBMIT_FAILED`)."""
        self._finished: set[int] = set()
        self._started: set[int] = set()
        self._queue: asyncio.Queue[Event | Ending] = asyncio.Queue()

    def _submit(self, job: Job) -> None:
        loop = asyncio.get_running_loop()
        queue = self._queue

        def on_output(out: RequestOutput) -> None:  # on the engine thread
            loop.call_soon_threadsafe(queue.put_nowait, Event(job.index, out))

        self._rids[job.index] = self.engine.submit_valid(
            job.request,
            on_output,
            group=self.group,
            reservation=self.reservation,
        )

    def _release(self, index: int) -> None:
        """Submit the jobs waiting for job ``index``'s first output."""
        for job in self.jobs:
            if job.after == index and job.index not in self._rids:
                self._submit(job)

    def _drop_waiting(self, index: int) -> None:
        """Job ``index`` failed before its first token: the jobs waiting for it are not
        submitted (the answer is an error whatever they give; on a decode instance they
        would compute the prompt its room failed to bring); their rooms end with the
        run (:func:`_end_unsubmitted`)."""
        for job in self.jobs:
            if job.after == index and job.index not in self._rids:
                self._finished.add(job.index)

    def abort_all(self, reason: str) -> None:
        """Abort every submitted, unfinished job (idempotent per job)."""
        for index, rid in list(self._rids.items()):
            if index in self._finished:
                continue
            self._finished.add(index)
            with contextlib.suppress(RuntimeError):  # not running: nothing to abort
                self.engine.abort(rid)
            if self.on_abort is not None:
                self.on_abort(reason)

    def _close_reservation(self) -> None:
        """Give back the queue places of jobs never submitted (idempotent)."""
        if self.reservation is not None:
            self.reservation.close()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await self.http.is_disconnected():
                self.abort_all(Ending.DISCONNECTED.value)
                self._queue.put_nowait(Ending.DISCONNECTED)
                return

    async def events(self) -> AsyncGenerator[Event, None]:
        """Every output of every job, until all finished or the run ends early."""
        try:
            for job in self.jobs:
                if job.after is None:
                    self._submit(job)
        except RuntimeError as exc:  # not running, or closing
            self.error = str(exc)
            self.ending = Ending.SUBMIT_FAILED
            self.abort_all("engine_stopped")
            self._close_reservation()
            _end_unsubmitted(self.engine, self.jobs, self._rids, self.error)
            return
        watcher = asyncio.create_task(self._watch())
        try:
            while len(self._finished) < len(self.jobs):
                try:
                    item = await asyncio.wait_for(self._queue.get(), timeout=_ENGINE_CHECK_S)
                except TimeoutError:
                    if not self.engine.alive and self._queue.empty():
                        self.ending = Ending.ENGINE_STOPPED
                        return
                    continue
                if isinstance(item, Ending):
                    self.ending = item
                    return
                if item.index in self._finished:
                    continue
                if item.index not in self._started:
                    self._started.add(item.index)
                    try:
                        if item.output.finished and item.output.error:
                            self._drop_waiting(item.index)
                        else:
                            self._release(item.index)
                    except RuntimeError as exc:
                        self.error = str(exc)
                        self.ending = Ending.SUBMIT_FAILED
                        return
                if item.output.finished:
                    self._finished.add(item.index)
                yield item
            self.ending = Ending.DONE
        finally:
            watcher.cancel()
            self._close_reservation()
            if self.ending is None:  # the consumer stopped iterating (client gone)
                self.ending = Ending.DISCONNECTED
            why = self.error or f"the request ended ({self.ending.value}) before it was submitted"
            _end_unsubmitted(self.engine, self.jobs, self._rids, why)
            if self.ending is not Ending.DONE:
                reason = (
                    "engine_stopped" if self.ending is Ending.ENGINE_STOPPED else self.ending.value
                )
                self.abort_all(reason)


def _end_unsubmitted(
    engine: Engine, jobs: Sequence[Job], submitted: dict[int, str], why: str
) -> None:
    """End the rooms of ``jobs`` not in ``submitted`` (idempotent: a closed room stays)."""
    for job in jobs:
        if job.index not in submitted:
            with contextlib.suppress(Exception):  # a finalizer: never raise
                engine.refused(job.request, why)
