"""The restore operations of an engine: id -> :class:`RestoreOp`, their bounds and TTLs.

A restore (``POST /hicache/prefetch``) brings a session's prefix from L3 into L2 and
holds it there until the session's next request is admitted, its ``ttl_ms`` passes (from
the POST; rank 0's clock decides) or it is cancelled. :class:`RestoreBook` keeps one
frozen :class:`RestoreOp` per operation, replaced at each change, and refuses a new one
(:class:`RestoreBusy`, HTTP 429) while ``max_ops`` are not ended or their L2 bytes (whole
pages of their prefixes, reserved at the POST; once ready, what each brought from L3)
would pass ``max_bytes``. Ended operations
stay readable, the most recent :data:`ENDED_KEPT` of them. Thread-safe: server threads
reserve and read, the engine thread changes (every rank keeps its own book; only rank 0's
is read and only rank 0 reserves ahead of the step).
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from hicache.cache.request import CachedTokens

__all__ = [
    "DEFAULT_RESTORE_MAX_OPS",
    "DEFAULT_TTL_MS",
    "ENDED_KEPT",
    "RestoreBook",
    "RestoreBusy",
    "RestoreOp",
    "RestoreState",
]

DEFAULT_TTL_MS = 60_000
"""A restore's hold when the POST names no ``ttl_ms``."""
DEFAULT_RESTORE_MAX_OPS = 16
"""Restores not ended at most (``--hicache-restore-max-ops``)."""
ENDED_KEPT = 1024
"""Ended operations kept for ``GET`` (oldest out first)."""


class RestoreState(str, enum.Enum):
    """Where a restore operation is."""

    QUEUED = "queued"
    """Accepted; its start is not applied yet."""
    LOADING = "loading"
    """Its L3 lookup or read runs."""
    READY = "ready"
    """Its prefix is in L2 (with what L3 had), held there."""
    FAILED = "failed"
    """It ended without a hold (``error`` says why); requests are served by recompute."""
    EXPIRED = "expired"
    """Its ``ttl_ms`` passed first; its hold is given back."""
    CANCELLED = "cancelled"
    """``DELETE``d; its hold is given back."""
    RELEASED = "released"
    """Its session's next request was admitted; its hold is given back."""

    @property
    def ended(self) -> bool:
        return self in _ENDED


_ENDED = frozenset(
    {RestoreState.FAILED, RestoreState.EXPIRED, RestoreState.CANCELLED, RestoreState.RELEASED}
)


@dataclass(frozen=True, slots=True, kw_only=True)
class RestoreOp:
    """One restore operation as the API reports it. ``tokens``: the whole pages of its
    prefix; ``resident``: tokens of it now in L1 (``device``) and L2 (``host``) and those
    it read from L3 (``storage``), once loaded; ``nbytes``: L2 bytes reserved for it;
    ``deadline``: rank 0's ``time.monotonic()`` at which it expires."""

    operation_id: str
    session_id: str
    state: RestoreState
    tokens: int
    ttl_ms: int
    nbytes: int
    deadline: float
    resident: CachedTokens | None = None
    error: str | None = None

    def body(self) -> dict[str, Any]:
        """The JSON body of ``GET /hicache/prefetch/{operation_id}``."""
        out: dict[str, Any] = {
            "operation_id": self.operation_id,
            "session_id": self.session_id,
            "state": self.state.value,
            "tokens": self.tokens,
            "ttl_ms": self.ttl_ms,
        }
        if self.resident is not None:
            r = self.resident
            out["resident_tokens"] = {"device": r.device, "host": r.host, "storage": r.storage}
        if self.error is not None:
            out["error"] = self.error
        return out


class RestoreBusy(Exception):
    """A new restore is over the bounds (HTTP 429); the message says which."""


class RestoreBook:
    """The restore operations of one rank (see the module docstring)."""

    def __init__(self, *, max_ops: int, max_bytes: int) -> None:
        self.max_ops = max_ops
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._ops: OrderedDict[str, RestoreOp] = OrderedDict()
        self._ended: OrderedDict[str, None] = OrderedDict()

    def reserve(
        self, *, session_id: str, tokens: int, nbytes: int, ttl_ms: int, now: float | None = None
    ) -> RestoreOp:
        """A new QUEUED operation (rank 0, before its start is posted); :class:`RestoreBusy`
        when it would pass a bound."""
        at = time.monotonic() if now is None else now
        with self._lock:
            live = [op for op in self._ops.values() if not op.state.ended]
            if len(live) >= self.max_ops:
                raise RestoreBusy(
                    f"{len(live)} restores are in progress or held, the most allowed"
                    f" (--hicache-restore-max-ops={self.max_ops}); retry later"
                )
            held = sum(op.nbytes for op in live)
            if held + nbytes > self.max_bytes:
                raise RestoreBusy(
                    f"this restore needs {nbytes} bytes of L2 and restores hold {held} of"
                    f" the {self.max_bytes} allowed (--hicache-restore-max-bytes); retry later"
                )
            op = RestoreOp(
                operation_id=f"restore-{uuid.uuid4().hex}",
                session_id=session_id,
                state=RestoreState.QUEUED,
                tokens=tokens,
                ttl_ms=ttl_ms,
                nbytes=nbytes,
                deadline=at + ttl_ms / 1000,
            )
            self._ops[op.operation_id] = op
            return op

    def put(self, op: RestoreOp) -> None:
        """Add ``op`` as it is (a follower's, from the record), unless known already."""
        with self._lock:
            self._ops.setdefault(op.operation_id, op)

    def get(self, operation_id: str) -> RestoreOp | None:
        with self._lock:
            return self._ops.get(operation_id)

    def change(self, operation_id: str, **changes: Any) -> RestoreOp | None:
        """Replace ``operation_id``'s record with ``changes`` (None: unknown); an ended
        operation changes no more."""
        with self._lock:
            op = self._ops.get(operation_id)
            if op is None or op.state.ended:
                return op
            op = dataclasses.replace(op, **changes)
            self._ops[operation_id] = op
            if op.state.ended:
                self._ended[operation_id] = None
                while len(self._ended) > ENDED_KEPT:
                    old, _ = self._ended.popitem(last=False)
                    self._ops.pop(old, None)
            return op

    def due(self, now: float | None = None) -> list[str]:
        """Operations started and not ended whose deadline has passed (rank 0's clock),
        oldest first. A QUEUED one is left to the round after its start is applied (its
        start is posted as it is reserved), so that no rank ends it before it started."""
        at = time.monotonic() if now is None else now
        with self._lock:
            return [
                i
                for i, op in self._ops.items()
                if op.state is not RestoreState.QUEUED and not op.state.ended and op.deadline <= at
            ]

    def live(self) -> list[RestoreOp]:
        """Operations not ended, oldest first."""
        with self._lock:
            return [op for op in self._ops.values() if not op.state.ended]
