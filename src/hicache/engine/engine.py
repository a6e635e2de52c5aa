"""The engine's front: its lifecycle and the API other threads call.

Other threads (the HTTP server, the CLI) talk to the engine through :meth:`Engine.reserve`
(places in the bounded waiting queue for one client request's sequences),
:meth:`Engine.submit`, :meth:`Engine.abort` and :meth:`Engine.call` (run a function on the
engine thread, e.g. a cache read); outputs come back through each request's callback,
called on the engine thread. What the API posts becomes a step input
(:mod:`hicache.engine.step_inputs`) for the one step body
(:class:`~hicache.engine.core.EngineCore`), run by rank 0's driver
(:mod:`hicache.engine.leader`) and, under tensor parallelism (``tp_size`` > 1,
:mod:`hicache.engine.ranks`), by every follower process (:mod:`hicache.engine.follower`).

Robustness: an exception in one task of the loop (a queued call, adding a request, one
scheduler step, an output callback) fails only the requests involved; the loop goes on.
If the loop ends anyway, every request and call still queued or in flight is failed at
once (no caller waits for ever), :attr:`Engine.alive` turns False and
:meth:`Engine.health` says why. Every wait here has a deadline. The lifecycle is one
state (:class:`~hicache.engine.run_state.EngineState`).

:meth:`Engine.call` runs on rank 0 alone, so under tensor parallelism its function must
only read (it must not change the cache or wait on it: a cache wait agrees with the other
ranks). No rank recovers alone: a scheduler step or a forward that raises on any rank, or
a rank that dies, stops every rank (``health`` names a dead rank).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from hicache.cache import HiCache
from hicache.engine.admission import EngineUnhealthy, QueueFull, QueueGate, Reservation
from hicache.engine.build import build_core
from hicache.engine.config import EngineConfig
from hicache.engine.core import Client, EngineCore
from hicache.engine.graph_setup import GraphSetup
from hicache.engine.health import (
    STALL_AFTER_S,
    EngineHealth,
    EngineStats,
    StatsPublisher,
    health_of,
    read_stats,
)
from hicache.engine.leader import Leader, RankFailure, Task, start_ranks
from hicache.engine.memory_trim import IdleTrimmer
from hicache.engine.ranks import RankProcesses
from hicache.engine.request import OutputCallback, RequestOutput, new_rid
from hicache.engine.run_state import EngineState, RunState
from hicache.engine.sampling import InvalidRequest, SamplingParams
from hicache.engine.scheduler import Scheduler
from hicache.engine.step_inputs import (
    Abort,
    AttachStorage,
    DetachStorage,
    Digest,
    FlushCache,
    NewRequest,
    StepInput,
)
from hicache.engine.validation import (
    MAX_CACHE_SALT_CHARS,
    PRIORITY_MAX,
    PRIORITY_MIN,
    ValidRequest,
    validate_request,
)
from hicache.lifecycle import Lifecycle
from hicache.runner.loader import LoadedModel
from hicache.storage.registry import StorageConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_GENERATE_TIMEOUT_S = 600.0
DEFAULT_CLOSE_TIMEOUT_S = 60.0


class Engine(Lifecycle):
    """Lifecycle: ``start()`` loads the model and starts the loop; ``close()`` stops it."""

    def __init__(self, config: EngineConfig, *, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self._loaded = loaded  # given by the caller (one rank only)
        self._core: EngineCore | None = None
        self._leader: Leader | None = None
        self._thread: threading.Thread | None = None
        self._state = RunState()
        self._failure = RankFailure()
        self.ranks: RankProcesses | None = None
        """Rank 0's handle on the follower processes (None with one rank)."""
        self.queue = QueueGate(config.max_queued_requests)
        """Sequences queued against ``max_queued_requests`` (see :meth:`reserve`)."""
        self._stats = StatsPublisher()
        self.memory_trimmer = IdleTrimmer(config.memory_trim_interval_s)
        """Gives freed memory back to the OS after busy periods (engine thread only)."""
        # rank 0's core's parts, set by start(): the cache, the scheduler, the model, ...
        self.cache: HiCache
        self.scheduler: Scheduler
        self.model: LoadedModel
        self.context_length = 0
        self.decode_graphs: GraphSetup | None = None
        """What turning CUDA graphs on did at start (None: not tried: off, or not CUDA)."""

    # ------------------------------------------------------------------ what it runs

    @property
    def core(self) -> EngineCore:
        """Rank 0's step body and what it owns (set by :meth:`start`); RuntimeError before."""
        if self._core is None:
            raise RuntimeError("the engine is not started")
        return self._core

    @property
    def state(self) -> EngineState:
        return self._state.state

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def resumable_prefix(self) -> bool:
        """Whether requests reuse cached prefixes (L1/L2/L3 hits). For a model with
        recurrent layers (Qwen3-Next, Nemotron-H) a hit resumes only at a boundary where the
        cache holds a state snapshot (see :mod:`hicache.cache.components.snapshots`)."""
        return self.scheduler.resumable_prefix

    @property
    def agreement_steps_total(self) -> int:
        """Steps whose agreement :attr:`agreement_seconds_total` counts (0 with one rank)."""
        return 0 if self._core is None else self._core.agreement_steps_total

    @property
    def agreement_seconds_total(self) -> float:
        """Under tensor parallelism, rank 0's seconds so far in the step's collectives that
        are not the model's (the step-input broadcast, ``cache.sync()``, the sampled-token
        broadcast); over :attr:`agreement_steps_total` the mean per step. 0.0 with one rank."""
        return 0.0 if self._core is None else self._core.agreement_seconds_total

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Engine:
        """Load the model, build the cache and start the loop. Idempotent.

        With ``tp_size`` > 1 this is rank 0: the model is checked for the split, the
        follower ranks are spawned and joined (:class:`~hicache.engine.ranks.RankProcesses`),
        and the loop starts once every rank has built its core; a rank that fails or
        does not make it within ``dist_init_timeout_s`` fails the start
        (:class:`~hicache.engine.ranks.RankStartError`, naming it)."""
        if self._state.state not in (EngineState.NEW, EngineState.CLOSED):
            return self
        cfg = self.config
        loaded = self._loaded if self._core is None else self._core.model  # loaded once
        if cfg.tp_size > 1:
            if self._loaded is not None:
                raise ValueError(
                    f"tp_size={cfg.tp_size}: every rank loads its own shard of the model;"
                    " start the engine without a loaded model"
                )
            self.ranks, core = start_ranks(cfg)
            # a report that fails on rank 0 aborts its request on every rank, next step
            core.scheduler.abort_later = self._abort_later
        else:
            core = build_core(cfg, loaded=loaded)
        core.memory_trimmer = self.memory_trimmer
        self._core = core
        self.cache, self.scheduler, self.model = core.cache, core.scheduler, core.model
        self.context_length, self.decode_graphs = core.context_length, core.decode_graphs
        self._leader = Leader(
            core, self._state, ranks=self.ranks, failure=self._failure, publish=self._publish
        )
        self._state.started()
        self._thread = threading.Thread(target=self._leader.run, name="hicache-engine", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = DEFAULT_CLOSE_TIMEOUT_S) -> None:
        """Stop the engine thread, then close the cache. Idempotent; waits ``timeout`` s at most.

        In order: (1) new requests and calls are refused; (2) the loop is told to stop; at
        the end of its round the engine thread fails what is queued and aborts what is in
        flight (clients get ``finish_reason`` abort and an ``error``); (3) the thread is
        joined; (4) only once it has finished with the cache is the cache closed,
        since that thread is the only one using it. If the thread does not stop within the
        deadline (stuck in a forward or a call), the cache is not closed under it: an error
        is logged and the thread closes the cache itself when its loop ends.
        """
        thread, leader = self._thread, self._leader
        if thread is None or leader is None or self._state.state is EngineState.CLOSED:
            return
        deadline = time.monotonic() + timeout
        self._state.stop()  # the loop ends its round, then fails what is queued or in flight
        leader.wake()
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if not self._state.hand_over():
            log.error(
                "the engine thread did not stop within %.1f s; the cache stays open until the"
                " thread ends, and the thread closes it then",
                timeout,
            )
            self._close_ranks(deadline)
            return
        thread.join(timeout=max(1.0, deadline - time.monotonic()))  # past its last cache use
        self._thread = None
        try:
            self.core.close_cache()
        finally:
            self._close_ranks(deadline)

    def _close_ranks(self, deadline: float) -> None:
        """Join the followers (told to stop by the loop's last broadcast), kill stragglers."""
        ranks, leader = self.ranks, self._leader
        if ranks is None:
            return
        self.ranks = None
        broken = self._failure.why is not None or (leader is not None and leader.ranks_broken)
        ranks.close(timeout=max(5.0, deadline - time.monotonic()), broken=broken)

    @property
    def rank_failure(self) -> str | None:
        """Why the ranks stopped on their own, naming the rank: a follower that died, or
        rank 0's loop that failed (which then made every follower leave); None while they
        run (and with one rank)."""
        return self._failure.why

    def on_rank_failure(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(why)`` (on a watcher thread, or the engine thread) when the
        ranks stop on their own (:attr:`rank_failure`); the engine has stopped then (the
        server exits)."""
        self._failure.listen(listener)

    @property
    def alive(self) -> bool:
        """Whether the engine thread is running its loop (started, not ended, not crashed)."""
        thread = self._thread
        return thread is not None and thread.is_alive() and not self._state.loop_ended

    def health(self, stall_after_s: float = STALL_AFTER_S) -> EngineHealth:
        """Is the loop running and going round? Cheap; callable from any thread.

        Not healthy when the thread is not running (never started, closed or crashed), when
        the loop has not gone round for ``stall_after_s`` seconds (stuck in a step or a
        call), or when the last ``unhealthy_after_failed_steps`` scheduler steps, or
        forwards, all raised (healthy again once one succeeds).
        """
        leader = self._leader
        alive = self.alive
        return health_of(
            alive=alive,
            started=self._state.state is not EngineState.NEW or self._thread is not None,
            exit_reason=self._state.exit_reason,
            rank_failure=self._failure.why,
            last_loop=None if leader is None else leader.last_loop,
            failed_steps=0 if leader is None else leader.failed_steps,
            scheduler=self.scheduler if alive else None,
            limit=self.config.unhealthy_after_failed_steps,
            stall_after_s=stall_after_s,
        )

    # ------------------------------------------------------------------ API (any thread)

    def validate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        cache_salt: str = "",
        priority: int = 0,
    ) -> ValidRequest:
        """The request as :meth:`submit_valid` takes it; raises :class:`InvalidRequest` (a
        ValueError) naming the problem and its field (``prompt``, ``cache_salt``,
        ``priority``) when it cannot be served."""
        return validate_request(
            prompt_ids,
            params,
            vocab=int(self.model.hf_config.vocab_size),
            context_length=self.context_length,
            cache_salt=cache_salt,
            priority=priority,
        )

    def reserve(self, sequences: int) -> Reservation:
        """Take ``sequences`` places in the bounded waiting queue at once, for one client
        request's sequences (its prompts x ``n``), before any is submitted: each
        :meth:`submit` with ``reservation`` then uses one, and ``close()`` gives back the
        rest. Callable from any thread.

        Raises :class:`~hicache.engine.admission.QueueFull` when they do not fit (retry
        later), :class:`~hicache.engine.admission.EngineUnhealthy` instead when the engine
        is not healthy (:meth:`health`), and :class:`InvalidRequest` (``n``) for more
        sequences than ``max_queued_requests`` could ever hold.
        """
        try:
            return self.queue.reserve(sequences)
        except QueueFull as exc:
            health = self.health()
            if health.healthy:
                raise
            raise EngineUnhealthy(
                f"{exc}; the engine is not healthy: {health.reason}",
                requested=exc.requested,
                queued=exc.queued,
                limit=exc.limit,
                reason=health.reason or "unknown",
            ) from None
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="n") from None

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        on_output: OutputCallback | None = None,
        *,
        cache_salt: str = "",
        priority: int = 0,
        group: str = "",
        reservation: Reservation | None = None,
    ) -> str:
        """:meth:`validate`, then :meth:`submit_valid`: raises :class:`InvalidRequest` for
        a request that cannot be served."""
        valid = self.validate(prompt_ids, params, cache_salt=cache_salt, priority=priority)
        return self.submit_valid(valid, on_output, group=group, reservation=reservation)

    def submit_valid(
        self,
        request: ValidRequest,
        on_output: OutputCallback | None = None,
        *,
        group: str = "",
        reservation: Reservation | None = None,
    ) -> str:
        """Queue ``request`` (made by :meth:`validate`, not checked again); returns its id.
        ``on_output`` runs on the engine thread.

        ``request.priority``: larger is more important (SGLang's field): admitted first.
        ``group``: the client request it belongs to (empty: its own); the scheduler's
        per-group limits count a group's sequences together. ``reservation``: a place
        taken by :meth:`reserve` (without one, a place is reserved here, which may raise
        :class:`~hicache.engine.admission.QueueFull`). RuntimeError when the engine is not
        running. Once queued, the request always gets a final output: finished normally,
        or aborted with ``error`` set when adding it failed or the engine stopped first.
        """
        own = reservation is None
        ticket = self.reserve(1) if reservation is None else reservation
        slot = ticket.take()
        rid = new_rid()
        record = NewRequest.of(
            rid=rid,
            prompt_ids=request.prompt_ids,
            params=request.params,
            cache_salt=request.cache_salt,
            priority=request.priority,
            group=group or rid,
            arrival=time.perf_counter(),
        )
        try:
            self._running().post_request(record, Client(on_output, slot, request.params))
        except BaseException:
            slot.release()
            raise
        finally:
            if own:
                ticket.close()
        return rid

    def abort(self, rid: str) -> None:
        """Abort request ``rid`` at the next step (nothing when it has ended)."""
        self._running().post(Task(record=Abort(rid)))

    def _abort_later(self, rid: str) -> None:
        """Abort ``rid`` at the next step on every rank (the engine thread, when rank 0's
        report of it failed: a rank must not end a request on its own)."""
        with contextlib.suppress(RuntimeError):  # closing: everything ends anyway
            self.abort(rid)

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        timeout: float = DEFAULT_GENERATE_TIMEOUT_S,
        *,
        cache_salt: str = "",
        priority: int = 0,
    ) -> RequestOutput:
        """Blocking helper: the final output of one request.

        Raises TimeoutError after ``timeout`` seconds, having aborted the request.
        """
        done: Future[RequestOutput] = Future()

        def on_output(out: RequestOutput) -> None:
            if out.finished and not done.done():
                done.set_result(out)

        rid = self.submit(prompt_ids, params, on_output, cache_salt=cache_salt, priority=priority)
        try:
            return done.result(timeout=timeout)
        except TimeoutError:
            with contextlib.suppress(RuntimeError):  # not running: nothing left to abort
                self.abort(rid)
            raise TimeoutError(f"request {rid} did not finish within {timeout} s") from None

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the engine thread between steps; its result comes in the future.

        The future fails with RuntimeError if the loop ends before running ``fn``; a
        caller still bounds its wait (``.result(timeout=...)``) as ``fn`` may be slow.
        With ``tp_size`` > 1 ``fn`` runs on rank 0 alone: it may read, not change the cache
        or wait on it (flush, attach and detach have their own methods, run on every rank);
        a cache call that would need the ranks to agree (a flush, a wait for copies) fails
        the future with :class:`~hicache.controller.rank_group.LocalOnlyError` at once
        instead of blocking rank 0 in a collective no other rank joins.
        """
        local = self.cache.ranks.local_only
        return self._running().call(fn, lambda: local("inside Engine.call (run on rank 0 alone)"))

    def stats(self, timeout: float = 30.0) -> EngineStats:
        """The cache's stats and the scheduler's queues, read on the engine thread between
        steps now (blocks; call off an event loop). RuntimeError when the engine is not
        running, TimeoutError when it does not answer within ``timeout`` seconds. A reader
        that must not wait (a metrics scrape) takes :attr:`published_stats` instead."""
        return self.call(self._read_stats).result(timeout=timeout)

    @property
    def published_stats(self) -> EngineStats | None:
        """The last stats record the loop published (None before the first), without
        waiting: the loop reads the cache (its owner's thread) at the end of a round, at
        most every :attr:`stats_interval_s` seconds, and replaces this immutable record.
        Fresh within ``stats_interval_s`` plus one round (a long forward delays it); its
        ``at`` says when it was read, and it stays as it was once the loop has ended."""
        return self._stats.published

    @property
    def stats_interval_s(self) -> float:
        """Seconds between two published stats records (see :attr:`published_stats`)."""
        return self._stats.interval_s

    @stats_interval_s.setter
    def stats_interval_s(self, seconds: float) -> None:
        self._stats.interval_s = seconds

    def _read_stats(self) -> EngineStats:
        """The stats now (engine thread only)."""
        return read_stats(self.cache, self.scheduler, self.queue)

    def _publish(self) -> None:
        self._stats.publish(self.cache, self.scheduler, self.queue)

    def flush_cache(self) -> bool:
        """Empty L1 and L2 when no request is in flight; False (nothing done) otherwise."""
        return bool(self._command(FlushCache()).result(timeout=60))

    def rank_digests(self, timeout: float = 60.0) -> list[str]:
        """Each rank's digest of its scheduling and cache state, by rank, taken at the same
        step on every rank (:mod:`hicache.engine.rank_digest`): all equal while the ranks
        agree. One entry with one rank."""
        got = self._command(Digest()).result(timeout=timeout)
        assert isinstance(got, list)
        return [str(d) for d in got]

    def attach_storage(
        self, backend: str, extra_config: Mapping[str, Any] | None = None, policy: str = "timeout"
    ) -> None:
        """Attach an L3 backend at runtime (when idle). Raises ValueError on a bad config,
        RuntimeError when busy or already attached, StorageError when unreachable."""
        extra = dict(extra_config or {})
        StorageConfig.parse(backend, extra)  # a bad config is refused here, on every rank alike
        record = AttachStorage(backend=backend, extra_config=tuple(extra.items()), policy=policy)
        self._command(record).result(timeout=120)

    def detach_storage(self) -> bool:
        """Detach the L3 backend (when idle); False when none was attached."""
        return bool(self._command(DetachStorage()).result(timeout=120))

    def _command(self, record: StepInput) -> Future[object]:
        """Post the control ``record`` (applied by every rank at the next step); rank 0's
        result, or its exception, comes in the future."""
        return self._running().command(record)

    def _running(self) -> Leader:
        """Rank 0's driver; RuntimeError when the engine was never started."""
        if self._leader is None:
            raise RuntimeError("the engine is not running")
        return self._leader


__all__ = [
    "MAX_CACHE_SALT_CHARS",
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "Engine",
    "EngineConfig",
    "EngineHealth",
    "EngineStats",
    "ValidRequest",
]
