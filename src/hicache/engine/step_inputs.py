"""What one engine step takes in: immutable, picklable records that rank 0 broadcasts.

Under tensor parallelism (``tp_size`` > 1) every rank runs the same scheduler over the same
cache, so every input that changes them must reach every rank, in the same order, before
the step that uses it: new requests, aborts and control commands. The closures the server
threads post to rank 0's inbox cannot cross processes, so each one is described by a
record here; rank 0 broadcasts a step's records (:class:`StepInputs`, one per step, empty
when idle) and every rank, rank 0 included, applies the same records in order
(:meth:`hicache.engine.step.core.EngineCore.apply`). With one rank nothing is broadcast and the
records are applied where they were posted.

A record carries values only (no callbacks, no locks, no tensors): a follower rebuilds
from it what rank 0 built from the client's call. :class:`NewRequest` carries the
request's ``arrival`` (``time.perf_counter()``, a system-wide monotonic clock on Linux)
because the scheduler orders retractions by it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hicache.disagg.config import Bootstrap
from hicache.engine.request import Request
from hicache.engine.sampling import SamplingParams
from hicache.engine.session import SessionHint
from hicache.logprob import TokenLogprob


def _params_fields(params: SamplingParams) -> tuple[tuple[str, Any], ...]:
    """``params`` as plain ``(field, value)`` pairs (the frozen ``logit_bias`` proxy as a
    dict), which pickle and rebuild the same :class:`SamplingParams`."""
    out: list[tuple[str, Any]] = []
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if isinstance(value, Mapping):
            value = dict(value)
        out.append((f.name, value))
    return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class NewRequest:
    """A request to queue: everything the scheduler reads of it, nothing of its client.

    ``rid``: its id, the same on every rank (aborts and the runner's per-request state go by
    it). ``prompt_ids``: the prompt's token ids. ``arrival``: ``time.perf_counter()`` when
    rank 0 took it (the scheduler's retraction order). ``params``: rebuilt by
    :attr:`sampling`."""

    rid: str
    prompt_ids: tuple[int, ...]
    params: tuple[tuple[str, Any], ...]
    cache_salt: str = ""
    priority: int = 0
    group: str = ""
    arrival: float = 0.0
    bootstrap: Bootstrap | None = None
    session: SessionHint | None = None

    @classmethod
    def of(
        cls,
        *,
        rid: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str,
        priority: int,
        group: str,
        arrival: float,
        bootstrap: Bootstrap | None = None,
        session: SessionHint | None = None,
    ) -> NewRequest:
        return cls(
            rid=rid,
            prompt_ids=tuple(prompt_ids),
            params=_params_fields(params),
            cache_salt=cache_salt,
            priority=priority,
            group=group,
            arrival=arrival,
            bootstrap=bootstrap,
            session=session,
        )

    @classmethod
    def of_request(cls, req: Request) -> NewRequest:
        """The record of rank 0's request ``req``."""
        return cls.of(
            rid=req.rid,
            prompt_ids=req.prompt_ids,
            params=req.params,
            cache_salt=req.cache_salt,
            priority=req.priority,
            group=req.group,
            arrival=req.arrival,
            bootstrap=req.bootstrap,
            session=req.session,
        )

    @property
    def sampling(self) -> SamplingParams:
        """The request's :class:`SamplingParams`, equal to the one it was made from."""
        return SamplingParams(**dict(self.params))


@dataclass(frozen=True, slots=True)
class Abort:
    """Abort the request ``rid`` (wherever it is; nothing when it has ended)."""

    rid: str


@dataclass(frozen=True, slots=True)
class FlushCache:
    """Empty L1 and L2 when no request is in flight (rank 0 reports whether it did)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AttachStorage:
    """Attach the L3 backend ``backend`` with ``extra_config`` (``(key, value)`` pairs,
    JSON values) and the prefetch ``policy``, when idle."""

    backend: str
    extra_config: tuple[tuple[str, Any], ...] = ()
    policy: str = "timeout"


@dataclass(frozen=True, slots=True)
class DetachStorage:
    """Detach the L3 backend, when idle."""


@dataclass(frozen=True, slots=True)
class Digest:
    """Every rank digests its scheduling and cache state now
    (:func:`~hicache.engine.step.rank_digest.rank_state_digest`) and rank 0 gathers them; with
    ``pages_of``, the bytes of each page its cache holds of those tokens instead
    (:func:`~hicache.engine.step.rank_digest.page_digests`, as JSON)."""

    pages_of: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PagesArrived:
    """Decode instance: the prefill instance has written every page of request ``rid``'s
    prompt into the pages it was given (posted by the receiver's thread once the room
    closed ``SUCCESS``), and sampled ``first_token``; its cache served ``cached`` prompt
    tokens (device, host, storage). What it computed for the request besides:
    ``first_logprob`` and ``prompt_logprobs`` (when asked), ``sampler_state`` (the random
    generator's state after the first draw; None for greedy): see
    :class:`~hicache.disagg.rooms.RoomResult`."""

    rid: str
    first_token: int
    cached: tuple[int, int, int] = (0, 0, 0)
    first_logprob: TokenLogprob | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    sampler_state: bytes | None = None


@dataclass(frozen=True, slots=True)
class RoomEnded:
    """Request ``rid``'s room ended without pages to take: on a prefill instance its
    transfer is over (``error`` None: the pages were sent), on a decode instance it
    failed or was aborted (``error`` says why; no write can land in its pages any more)."""

    rid: str
    error: str | None


@dataclass(frozen=True, slots=True)
class RoomFailed:
    """Decode instance: request ``rid``'s room was given up (``error`` says why) while the
    prefill instance may still write its pages: the request ends now, its pages *fenced*
    (out of use) until a :class:`RoomEnded` of it says no write can land any more."""

    rid: str
    error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class StartRestore:
    """Start restore ``operation_id``: the whole pages ``prompt_ids`` of ``tenant``'s,
    from L3 into L2, held for ``session_id``'s next request (a follower books it with
    ``ttl_ms`` and ``nbytes`` as rank 0 did; only rank 0 keeps its deadline)."""

    operation_id: str
    prompt_ids: tuple[int, ...]
    tenant: str
    session_id: str
    ttl_ms: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class EndRestore:
    """End restore ``operation_id`` in ``state`` (``"cancelled"``: a ``DELETE``;
    ``"expired"``: rank 0's clock passed its ``ttl_ms``), giving its hold back; nothing
    when it has ended. Rank 0's caller gets the operation's record."""

    operation_id: str
    state: str


@dataclass(frozen=True, slots=True)
class CloseSession:
    """End session ``session_id``: its KV is no longer kept in L2 (rank 0 answers whether
    it was live). ``expired``: its TTL passed, by rank 0's clock (every rank ends it then,
    whatever its own clock says)."""

    session_id: str
    expired: bool = False


@dataclass(frozen=True, slots=True)
class Stop:
    """The engine stops: every rank fails what is in flight and ends its loop."""

    reason: str


StepInput = (
    NewRequest
    | Abort
    | FlushCache
    | AttachStorage
    | DetachStorage
    | Digest
    | PagesArrived
    | RoomEnded
    | RoomFailed
    | CloseSession
    | StartRestore
    | EndRestore
    | Stop
)
"""One input of a step; the records above."""


@dataclass(frozen=True, slots=True)
class StepInputs:
    """Everything step ``step`` takes in, in the order rank 0 received it (``items``; empty
    on an idle step). Every rank applies ``items`` in order, then runs the step."""

    step: int
    items: tuple[StepInput, ...] = ()

    @property
    def stop(self) -> Stop | None:
        """The :class:`Stop` record among ``items``, if any."""
        return next((i for i in self.items if isinstance(i, Stop)), None)


__all__ = [
    "Abort",
    "AttachStorage",
    "DetachStorage",
    "Digest",
    "EndRestore",
    "FlushCache",
    "NewRequest",
    "PagesArrived",
    "RoomEnded",
    "RoomFailed",
    "StartRestore",
    "StepInput",
    "StepInputs",
    "Stop",
]
