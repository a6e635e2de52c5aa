"""What the engine says about itself: :class:`EngineHealth` (is the loop running and
going round), :class:`EngineStats` (the cache's stats and the scheduler's queues, read
on the engine thread and published as an immutable record, :class:`StatsPublisher`) and
:class:`AgreementTotals` (what tensor-parallel agreement has cost so far)."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from hicache.cache import HiCache
from hicache.cache.report import cache_stats
from hicache.engine.admission import QueueGate
from hicache.engine.drivers.leader import Leader
from hicache.engine.run_state import EngineState, RunState
from hicache.engine.step.scheduler import Scheduler
from hicache.metrics import CacheStats
from hicache.rates import RateFit

log = logging.getLogger(__name__)

STALL_AFTER_S = 120.0
""":meth:`Engine.health` reports a loop that has not gone round for this long as stalled."""


@dataclass(frozen=True, slots=True)
class EngineHealth:
    """What :meth:`Engine.health` found. ``healthy``: the loop runs and makes progress.

    ``alive``: the engine thread is running its loop. ``reason``: why it is not healthy
    (None when it is). ``last_loop_age_s``: seconds since the loop last went round (None
    before it started). ``failed_steps``: scheduler steps that raised in a row.
    ``failed_forwards``: forwards that raised in a row (each failed its batch's requests;
    0 once one succeeds).
    """

    healthy: bool
    alive: bool
    reason: str | None
    last_loop_age_s: float | None
    failed_steps: int
    failed_forwards: int = 0


@dataclass(frozen=True, slots=True)
class AgreementTotals:
    """Under tensor parallelism, rank 0's ``seconds`` so far in the step's collectives that
    are not the model's (the step-input broadcast, ``cache.sync()``, the sampled-token
    broadcast) and the ``steps`` they cover (``seconds / steps``: the mean per step).
    0 and 0.0 with one rank."""

    steps: int
    seconds: float


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What the engine thread read at one point: the cache's stats, requests in the
    running batch and in the waiting queue, and requests the cache has admitted (holding
    pages). ``queued``: sequences counted against ``max_queued_requests`` (reserved or
    waiting, never yet admitted); ``refused``: reservations refused so far (HTTP 429/503);
    ``reclaimed``: running sequences retracted so far to give a lent slot back (the group
    cap, see :mod:`hicache.engine.step.scheduler`); ``parked``: requests a prefill/decode role
    holds while the other instance of their room does its half (:mod:`hicache.engine.role`);
    ``open_rooms``: a prefill instance's rooms not closed yet (:attr:`Role.open_rooms
    <hicache.engine.role.Role.open_rooms>`); ``fenced_pages``: L1 pages of ended requests a decode instance keeps out of use while the
    prefill instance may still write them (:meth:`RequestEnds.fence
    <hicache.engine.step.ends.RequestEnds.fence>`).
    ``prefill``: rank 0's prefill tokens per second, from its own forwards (None: no
    prefill timed yet; :mod:`hicache.engine.step.prefill_timer`).
    ``at``: when (``time.monotonic()`` seconds). Immutable: published by the loop
    (:attr:`Engine.published_stats`) and read by any thread without a lock."""

    cache: CacheStats
    running: int
    waiting: int
    admitted: int
    queued: int = 0
    refused: int = 0
    reclaimed: int = 0
    parked: int = 0
    open_rooms: int = 0
    fenced_pages: int = 0
    prefill: RateFit | None = None
    at: float = 0.0


def health_of(
    leader: Leader | None,
    state: RunState,
    rank_failure: str | None,
    *,
    limit: int,
    stall_after_s: float,
) -> EngineHealth:
    """The health of the engine whose rank 0 driver is ``leader`` (None: never started)
    and whose lifecycle is ``state`` (see :meth:`Engine.health`); ``limit``: failed steps
    or forwards in a row that make it unhealthy. A follower rank that has stopped
    answering (no heartbeat for :data:`~hicache.engine.heartbeat.SILENT_AFTER_S`) makes
    it unhealthy, naming the rank, until it answers again. Once the engine is told to
    stop, or its loop has failed, it is unhealthy for good: from that moment until the
    server's port closes (stopping the followers takes seconds, and their heartbeats
    are no longer read then)."""
    thread = None if leader is None else leader.thread
    alive = thread is not None and thread.is_alive() and not state.loop_ended
    last_loop = None if leader is None else leader.last_loop
    failed_steps = 0 if leader is None else leader.failed_steps
    age = None if last_loop is None else time.monotonic() - last_loop
    ranks = None if leader is None else leader.ranks
    silent = None if ranks is None else ranks.silent()
    reason: str | None = None
    if rank_failure is not None:
        reason = f"{rank_failure}; the engine stopped"
    elif not alive:
        if state.state is EngineState.NEW and state.exit_reason is None:
            reason = "the engine is not started"
        else:
            reason = state.exit_reason or "the engine thread is not running"
    elif leader is not None and leader.failing is not None:  # stopping the ranks
        reason = leader.failing
    elif state.state is not EngineState.RUNNING:  # told to stop: ends its round
        reason = "the engine is stopping"
    elif silent is not None:  # a frozen follower: the loop waits in a collective for it
        reason = silent
    elif age is not None and age > stall_after_s:
        reason = f"the engine loop has not gone round for {age:.0f} s"
    scheduler = leader.core.scheduler if alive and leader is not None else None
    failed_forwards = scheduler.failed_forwards if scheduler is not None else 0
    if reason is None and failed_steps >= limit:
        reason = f"the last {failed_steps} scheduler steps failed"
    elif reason is None and failed_forwards >= limit:
        forward_error = scheduler.forward_error if scheduler is not None else None
        reason = (
            f"the last {failed_forwards} forwards failed, each failing its requests"
            f" (last: {forward_error})"
        )
    return EngineHealth(
        healthy=reason is None,
        alive=alive,
        reason=reason,
        last_loop_age_s=age,
        failed_steps=failed_steps,
        failed_forwards=failed_forwards,
    )


def read_stats(cache: HiCache, scheduler: Scheduler, queue: QueueGate) -> EngineStats:
    """The stats now (the engine thread: it reads the cache)."""
    counts = queue.counts()
    return EngineStats(
        cache=cache_stats(cache),
        running=len(scheduler.running),
        waiting=len(scheduler.waiting),
        admitted=len(cache.admitted),
        queued=counts.queued,
        refused=counts.refused,
        reclaimed=scheduler.reclaimed,
        parked=len(scheduler.ends.parked),
        open_rooms=scheduler.role.open_rooms,
        fenced_pages=scheduler.ends.fenced_pages,
        prefill=scheduler.prefill_timer.rate(),
        at=time.monotonic(),
    )


class StatsPublisher:
    """The last :class:`EngineStats` read (:attr:`published`, replaced whole, read by any
    thread without a lock), refreshed by :meth:`publish` at the end of a round."""

    def __init__(self) -> None:
        self.published: EngineStats | None = None
        self._tried = -math.inf  # time.monotonic() of the last read attempt

    def publish(
        self, cache: HiCache, scheduler: Scheduler, queue: QueueGate, interval_s: float
    ) -> None:
        """Read and publish when the last read is ``interval_s`` old (the engine thread).
        A failure keeps the last record (and is logged)."""
        now = time.monotonic()
        if now - self._tried < interval_s:
            return
        self._tried = now
        try:
            self.published = read_stats(cache, scheduler, queue)
        except Exception:
            log.exception("reading the engine's stats failed; the last ones stay published")


__all__ = [
    "STALL_AFTER_S",
    "EngineHealth",
    "EngineStats",
    "StatsPublisher",
    "health_of",
    "read_stats",
]
