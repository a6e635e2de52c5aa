"""The bounded waiting queue: sequences are reserved before they are submitted.

A client request (``n`` copies of each of its prompts) becomes several engine requests,
some submitted later (the copies wait for the first copy's first token). So that a
request is never refused half-way, its sequences are reserved at once
(:meth:`QueueGate.reserve`: all or it raises); a :class:`Reservation` hands out one
:class:`QueueSlot` per submitted sequence and gives back the rest when closed. A slot
counts as *queued* from its reservation until its request is first admitted (or ends
unadmitted); a retracted request does not count again. ``max_queued`` None: no bound. The
gate is shared by the server's threads and the engine thread; one lock guards the count.
Nothing here imports the engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from hicache.engine.sampling import InvalidRequest

__all__ = [
    "DEFAULT_MAX_QUEUED_REQUESTS",
    "RETRY_AFTER_S",
    "AdmissionRefused",
    "EngineUnhealthy",
    "QueueFull",
    "QueueGate",
    "QueueSlot",
    "Reservation",
    "reserve_places",
]

DEFAULT_MAX_QUEUED_REQUESTS = 1024
"""Sequences queued at most by default (``--max-queued-requests``); see
``docs/configuration.md`` for why it is bounded."""
RETRY_AFTER_S = 1
"""Seconds a refused client is told to wait (``Retry-After``)."""


class AdmissionRefused(Exception):
    """The queue cannot take ``requested`` more sequences now: ``queued`` are queued
    (reserved, not yet admitted) out of ``limit``. ``retry_after_s``: when to try again."""

    def __init__(self, message: str, *, requested: int, queued: int, limit: int) -> None:
        super().__init__(message)
        self.requested = requested
        self.queued = queued
        self.limit = limit
        self.retry_after_s = RETRY_AFTER_S


class QueueFull(AdmissionRefused):
    """The queue is full and the engine is healthy: retry later (HTTP 429)."""


class EngineUnhealthy(AdmissionRefused):
    """The queue is full and the engine is not healthy (``reason``), so it will not drain
    soon (HTTP 503)."""

    def __init__(
        self, message: str, *, requested: int, queued: int, limit: int, reason: str
    ) -> None:
        super().__init__(message, requested=requested, queued=queued, limit=limit)
        self.reason = reason


class QueueSlot:
    """One queued sequence's place; :meth:`release` (idempotent) gives it back."""

    __slots__ = ("_gate", "_released")

    def __init__(self, gate: QueueGate) -> None:
        self._gate = gate
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Give the place back (at the first admission, or when the request ends)."""
        if not self._released:
            self._released = True
            self._gate._give_back(1)


class Reservation:
    """``size`` queue places taken at once for one client request. :meth:`take` hands
    one out per submitted sequence; :meth:`close` (idempotent; also as a context manager)
    gives back those never handed out."""

    __slots__ = ("_gate", "_left", "_lock", "size")

    def __init__(self, gate: QueueGate, size: int) -> None:
        self._gate = gate
        self.size = size
        self._left = size
        self._lock = threading.Lock()

    @property
    def left(self) -> int:
        """Places not yet handed out (nor given back)."""
        return self._left

    def take(self) -> QueueSlot:
        """One place for a sequence being submitted; RuntimeError when none is left (a
        caller submitting more sequences than it reserved)."""
        with self._lock:
            if self._left <= 0:
                raise RuntimeError(f"a reservation of {self.size} sequences is used up")
            self._left -= 1
        return QueueSlot(self._gate)

    def close(self) -> None:
        with self._lock:
            left, self._left = self._left, 0
        if left:
            self._gate._give_back(left)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class QueueCounts:
    """One reading of the gate: sequences ``queued`` (reserved, not yet admitted) out of
    ``limit`` (None: unbounded), and ``refused`` reservations so far."""

    queued: int
    limit: int | None
    refused: int


class QueueGate:
    """Counts queued sequences against ``max_queued`` (None: no bound); see the module
    docstring."""

    def __init__(self, max_queued: int | None) -> None:
        self.max_queued = max_queued
        self._queued = 0
        self._refused = 0
        self._lock = threading.Lock()

    def counts(self) -> QueueCounts:
        with self._lock:
            return QueueCounts(self._queued, self.max_queued, self._refused)

    def reserve(self, sequences: int) -> Reservation:
        """Take ``sequences`` places at once, or none (:class:`QueueFull` when they do not
        fit). ValueError when ``sequences`` < 1 or more than the bound (such a request can
        never be queued: a client error, not back-pressure)."""
        if isinstance(sequences, bool) or not isinstance(sequences, int) or sequences < 1:
            raise ValueError(f"sequences={sequences!r} is invalid; must be an int >= 1")
        limit = self.max_queued
        if limit is not None and sequences > limit:
            raise ValueError(
                f"the request has {sequences} sequences (prompts x n) but at most {limit}"
                " can be queued (--max-queued-requests)"
            )
        with self._lock:
            queued = self._queued
            if limit is None or queued + sequences <= limit:
                self._queued += sequences
                return Reservation(self, sequences)
            self._refused += 1
        raise QueueFull(
            f"the server is busy: {queued} sequences are queued, at most {limit}"
            f" (--max-queued-requests); this request needs {sequences}; retry later",
            requested=sequences,
            queued=queued,
            limit=limit,
        )

    def _give_back(self, n: int) -> None:
        with self._lock:
            self._queued -= n
            assert self._queued >= 0, "more queue places given back than taken"


def reserve_places(
    gate: QueueGate, sequences: int, unhealthy: Callable[[], str | None]
) -> Reservation:
    """``gate.reserve(sequences)`` as the engine answers it: :class:`QueueFull` when they
    do not fit, :class:`EngineUnhealthy` instead when ``unhealthy()`` says why the engine
    is not healthy (None: it is), and :class:`~hicache.engine.sampling.InvalidRequest`
    (``n``) for more sequences than the bound could ever hold."""
    try:
        return gate.reserve(sequences)
    except QueueFull as exc:
        reason = unhealthy()
        if reason is None:
            raise
        raise EngineUnhealthy(
            f"{exc}; the engine is not healthy: {reason}",
            requested=exc.requested,
            queued=exc.queued,
            limit=exc.limit,
            reason=reason,
        ) from None
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="n") from None
