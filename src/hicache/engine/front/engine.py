"""The engine's front: its lifecycle and the API other threads call.

Other threads (the HTTP server, the CLI) talk to the engine through :meth:`Engine.reserve`
(places in the bounded waiting queue), :meth:`Engine.submit`, :meth:`Engine.abort` and
:meth:`Engine.call` (a function run on the engine thread); outputs come back through each
request's callback, on the engine thread. What the API posts becomes a step input
(:mod:`hicache.engine.step_inputs`) for :class:`~hicache.engine.step.core.EngineCore`, run by
rank 0's driver (:mod:`hicache.engine.drivers.leader`) and, with ``tp_size`` > 1
(:mod:`hicache.engine.ranks`), by every follower (:mod:`hicache.engine.drivers.follower`).
Invariants: every wait here has a deadline; the lifecycle is one state
(:class:`~hicache.engine.run_state.EngineState`); if the loop ends, everything queued or in
flight fails at once and :attr:`Engine.alive` turns False (:meth:`Engine.health` says why).
:meth:`Engine.call` runs on rank 0 alone, so its function must only read. No rank recovers
alone. Failure handling: docs/architecture.md, "The engine: one step body and its
drivers" and "Tensor-parallel ranks (the engine's side)".
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar, overload

from hicache.disagg.config import Bootstrap
from hicache.engine.admission import QueueGate, Reservation, reserve_places
from hicache.engine.config import EngineConfig
from hicache.engine.drivers.leader import Leader, RankFailure, Task
from hicache.engine.drivers.start import start_ranks
from hicache.engine.front.health import (
    STALL_AFTER_S,
    AgreementTotals,
    EngineHealth,
    EngineStats,
    StatsPublisher,
    health_of,
    read_stats,
)
from hicache.engine.front.validation import (
    MAX_CACHE_SALT_CHARS,
    PRIORITY_MAX,
    PRIORITY_MIN,
    ValidRequest,
    validate_request,
    validate_restore,
)
from hicache.engine.memory_trim import IdleTrimmer
from hicache.engine.ranks import RankProcesses
from hicache.engine.request import OutputCallback, Request, RequestOutput
from hicache.engine.restore_book import RestoreOp, RestoreState
from hicache.engine.role import Role
from hicache.engine.roles.role_setup import follower_roles, role_maker
from hicache.engine.run_state import EngineState, RunState
from hicache.engine.sampling import InvalidRequest, SamplingParams
from hicache.engine.session import SessionHint
from hicache.engine.step.build import RoleMaker, build_core
from hicache.engine.step.core import EngineCore
from hicache.engine.step.restores import restore_page_bytes
from hicache.engine.step_inputs import (
    Abort,
    AttachStorage,
    CloseSession,
    DetachStorage,
    Digest,
    EndRestore,
    FlushCache,
    StartRestore,
    StepInput,
)
from hicache.kv_events import KvEventHub, KvEventHubConfig
from hicache.kv_events.zmq_publisher import ZmqKvEventPublisher
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
        self._state = RunState()
        self._failure = RankFailure()
        self.ranks: RankProcesses | None = None
        """Rank 0's handle on the follower processes (None with one rank)."""
        self.role = Role()
        """The prefill/decode role (:mod:`hicache.engine.role`; set by :meth:`start`)."""
        self.queue = QueueGate(config.max_queued_requests)
        """Sequences queued against ``max_queued_requests`` (see :meth:`reserve`)."""
        self._stats = StatsPublisher()
        self._memory_trimmer = IdleTrimmer(config.memory_trim_interval_s)
        """Gives freed memory back to the OS after busy periods (engine thread only; kept
        across restarts)."""
        self.context_length = 0
        """The longest sequence served, prompt and output (set by :meth:`start`)."""
        events = config.kv_events
        self.kv_events: KvEventHub | None = (
            None
            if events is None
            else KvEventHub(
                KvEventHubConfig(
                    buffer_batches=events.max_queue_size, history_batches=events.history_batches
                )
            )
        )
        """The pages this instance holds, as KV events (``config.kv_events``; None: off):
        ``kv_events.subscribe(start_sequence_number)`` gives a subscriber its batches
        (:mod:`hicache.kv_events.hub`; smg's gRPC stream converts each with
        :func:`hicache.kv_events.proto.to_protos`). It lives as long as the engine object,
        across restarts; each start publishes ``AllBlocksCleared`` first."""
        self.kv_zmq: ZmqKvEventPublisher | None = None
        """The ZMQ publisher of :attr:`kv_events` while running (``publisher="zmq"``)."""

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
    def model(self) -> LoadedModel:
        """Rank 0's model: its name, configs, tokenizer (set by :meth:`start`)."""
        return self.core.model

    @property
    def agreement(self) -> AgreementTotals:
        """What agreeing with the other ranks has cost rank 0 so far (zeros with one rank,
        and before :meth:`start`)."""
        core = self._core
        if core is None:
            return AgreementTotals(steps=0, seconds=0.0)
        return AgreementTotals(
            steps=core.agreement_steps_total, seconds=core.agreement_seconds_total
        )

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

        running = cfg.scheduler.max_running_requests
        make_role = role_maker(cfg.disagg, cfg.tp_size, self._post_input, max_running=running)

        if self.kv_events is not None and cfg.kv_events and cfg.kv_events.publisher == "zmq":
            self.kv_zmq = ZmqKvEventPublisher(self.kv_events, cfg.kv_events).start()
        try:
            core = self._build(cfg, loaded, make_role)
        except BaseException:
            if self.kv_zmq is not None:
                self.kv_zmq.close()
                self.kv_zmq = None
            raise
        core.memory_trimmer = self._memory_trimmer
        if self.kv_events is not None:
            core.attach_kv_events(self.kv_events)
        self._core = core
        self.context_length = core.context_length
        self._leader = Leader(
            core, self._state, ranks=self.ranks, failure=self._failure, publish=self._publish
        )
        self.role = core.scheduler.role
        self._state.started()
        self._leader.start()
        ranks = self.ranks
        if ranks is not None:  # a rank frozen or gone: its rooms cannot end
            self.role.watch_health(lambda: ranks.failure or ranks.silent())
        return self

    def _build(
        self, cfg: EngineConfig, loaded: LoadedModel | None, make_role: RoleMaker
    ) -> EngineCore:
        """Rank 0's core: built here with one rank, with the followers spawned with several."""
        if cfg.tp_size > 1:
            if self._loaded is not None:
                raise ValueError(
                    f"tp_size={cfg.tp_size}: every rank loads its own shard of the model;"
                    " start the engine without a loaded model"
                )
            self.ranks, core = start_ranks(cfg, make_role, follower_roles(cfg))
            return core
        return build_core(cfg, loaded=loaded, make_role=make_role)

    def _post_input(self, record: StepInput) -> None:
        """Post ``record`` for the next step (the role's threads); dropped once the engine
        refuses new work (it is ending: every request ends then)."""
        leader = self._leader
        if leader is not None:
            with contextlib.suppress(RuntimeError):
                leader.post(Task(record=record))

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
        leader = self._leader
        if leader is None or self._state.state in (EngineState.NEW, EngineState.CLOSED):
            return
        deadline = time.monotonic() + timeout
        try:
            stopped = leader.stop(deadline)
            self.role.close()  # its threads read and write the pools: before the cache
            if stopped:  # the thread is done with the cache: close it here
                self.core.close_cache()
        finally:
            leader.close_ranks(deadline)
            self.ranks = None
            if self.kv_zmq is not None:  # after the cache's last event (AllBlocksCleared)
                self.kv_zmq.close(max(0.1, deadline - time.monotonic()))
                self.kv_zmq = None

    @property
    def _thread(self) -> threading.Thread | None:
        """The engine thread (rank 0's driver's), once started."""
        return None if self._leader is None else self._leader.thread

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
        call), when a follower rank has stopped answering (frozen: its heartbeat is
        :data:`~hicache.engine.heartbeat.SILENT_AFTER_S` old; healthy again once it
        answers), or when the last ``unhealthy_after_failed_steps`` scheduler steps, or
        forwards, all raised (healthy again once one succeeds).
        """
        return health_of(
            self._leader,
            self._state,
            self._failure.why,
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
        bootstrap: Bootstrap | None = None,
        session: SessionHint | None = None,
    ) -> ValidRequest:
        """The request as :meth:`submit_valid` takes it; raises :class:`InvalidRequest` (a
        ValueError) naming the problem and its field (``prompt``, ``cache_salt``,
        ``priority``, ``bootstrap_room``) when it cannot be served. ``bootstrap``: its
        room, needed on a prefill or decode instance (ignored on a plain one).
        ``session``: its agent-session hint (None: none), carried to the request."""
        valid = validate_request(
            prompt_ids,
            params,
            vocab=int(self.core.model.hf_config.vocab_size),
            context_length=self.context_length,
            cache_salt=cache_salt,
            priority=priority,
            role=self.config.disagg.mode,
            bootstrap=bootstrap,
            session=session,
        )
        if valid.bootstrap is not None:  # a prefill instance takes the room now
            why = self.role.claim(valid.bootstrap)
            if why is not None:
                raise InvalidRequest(why, param="bootstrap_room")
        return valid

    def refused(self, request: ValidRequest, why: str) -> None:
        """``request`` (made by :meth:`validate`) will not be submitted: the room its
        validation claimed ends with ``why`` (any thread). Whoever validates a request and
        then refuses it calls this, so that a claimed room always ends."""
        if request.bootstrap is not None:
            self.role.unclaim(request.bootstrap, why)

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
        return reserve_places(self.queue, sequences, self._unhealthy)

    def _unhealthy(self) -> str | None:
        health = self.health()
        return None if health.healthy else health.reason or "unknown"

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
        bootstrap: Bootstrap | None = None,
        session: SessionHint | None = None,
    ) -> str:
        """:meth:`validate`, then :meth:`submit_valid`: raises :class:`InvalidRequest` for
        a request that cannot be served."""
        valid = self.validate(
            prompt_ids,
            params,
            cache_salt=cache_salt,
            priority=priority,
            bootstrap=bootstrap,
            session=session,
        )
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
        ``on_output`` runs on the engine thread. ``group``: the client request it belongs
        to (empty: its own; the scheduler's per-group limits count a group's sequences
        together). ``reservation``: a place taken by :meth:`reserve` (without one, one is
        reserved here, which may raise :class:`~hicache.engine.admission.QueueFull`).
        RuntimeError when the engine is not running. Once queued, the request always gets
        a final output: finished, or aborted with ``error`` set (adding it failed, or the
        engine stopped first). A larger ``request.priority`` is admitted first."""
        own = reservation is None
        ticket = self.reserve(1) if reservation is None else reservation
        slot = ticket.take()
        req = Request(
            list(request.prompt_ids),
            request.params,
            cache_salt=request.cache_salt,
            session=request.session,
            priority=request.priority,
            group=group,
            queue_slot=slot,
            bootstrap=request.bootstrap,
        )
        try:
            self._running().post_request(req, on_output)
        except BaseException:
            slot.release()
            raise
        finally:
            if own:
                ticket.close()
        return req.rid

    def abort(self, rid: str) -> None:
        """Abort request ``rid`` at the next step (nothing when it has ended)."""
        self._running().post(Task(record=Abort(rid)))

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        timeout: float = DEFAULT_GENERATE_TIMEOUT_S,
        *,
        cache_salt: str = "",
        priority: int = 0,
        bootstrap: Bootstrap | None = None,
        session: SessionHint | None = None,
    ) -> RequestOutput:
        """Blocking helper: the final output of one request (``bootstrap``: its room, on a
        prefill or decode instance).

        Raises TimeoutError after ``timeout`` seconds, having aborted the request.
        """
        done: Future[RequestOutput] = Future()

        def on_output(out: RequestOutput) -> None:
            if out.finished and not done.done():
                done.set_result(out)

        rid = self.submit(
            prompt_ids,
            params,
            on_output,
            cache_salt=cache_salt,
            priority=priority,
            bootstrap=bootstrap,
            session=session,
        )
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
        local = self.core.cache.context.ranks.local_only
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
        most every ``config.stats_interval_s`` seconds, and replaces this immutable record.
        Fresh within ``stats_interval_s`` plus one round (a long forward delays it); its
        ``at`` says when it was read, and it stays as it was once the loop has ended."""
        return self._stats.published

    def _read_stats(self) -> EngineStats:
        """The stats now (engine thread only)."""
        return read_stats(self.core.cache, self.core.scheduler, self.queue)

    def _publish(self) -> None:
        self._stats.publish(
            self.core.cache, self.core.scheduler, self.queue, self.config.stats_interval_s
        )

    # ------------------------------------------------------------------ restores

    def restore(
        self,
        prompt_ids: Sequence[int],
        *,
        session_id: object,
        ttl_ms: object = None,
        cache_salt: object = "",
        param: str = "input_ids",
    ) -> RestoreOp:
        """Start restoring the whole pages of ``prompt_ids`` (``cache_salt``'s) from L3
        into L2, held for ``session_id``'s next request or ``ttl_ms`` (None: the default);
        returns the QUEUED operation (any thread). Raises :class:`InvalidRequest` naming
        the field (the prompt as ``param``), :class:`~hicache.engine.restore_book.RestoreBusy`
        over the bounds, RuntimeError when the engine is not running."""
        core = self.core
        valid = validate_restore(
            prompt_ids,
            vocab=int(core.model.hf_config.vocab_size),
            context_length=self.context_length,
            page_size=core.cache.context.page_size,
            session_id=session_id,
            ttl_ms=ttl_ms,
            cache_salt=cache_salt,
            param=param,
        )
        pages = len(valid.prompt_ids) // core.cache.context.page_size
        book = core.restores.book
        op = book.reserve(
            session_id=valid.session_id,
            tokens=len(valid.prompt_ids),
            nbytes=pages * restore_page_bytes(core.cache),
            ttl_ms=valid.ttl_ms,
        )
        record = StartRestore(
            operation_id=op.operation_id,
            prompt_ids=valid.prompt_ids,
            tenant=valid.cache_salt,
            session_id=valid.session_id,
            ttl_ms=valid.ttl_ms,
            nbytes=op.nbytes,
        )

        def drop(why: str) -> None:  # the loop ends before the record is applied
            book.change(op.operation_id, state=RestoreState.FAILED, error=why)

        try:
            self._running().post(Task(record=record, drop=drop))
        except BaseException as exc:
            drop(str(exc))
            raise
        return op

    def restore_op(self, operation_id: str) -> RestoreOp | None:
        """Restore ``operation_id`` as it is now (None: unknown); any thread, no wait."""
        return self.core.restores.book.get(operation_id)

    def cancel_restore(self, operation_id: str, timeout: float = 60.0) -> RestoreOp | None:
        """Cancel restore ``operation_id`` (its hold given back on every rank) and return
        it as it ends (one ended already keeps its state); None: unknown. Blocks until the
        next step applied it (at most ``timeout`` s)."""
        if self.core.restores.book.get(operation_id) is None:
            return None
        record = EndRestore(operation_id, RestoreState.CANCELLED.value)
        got = self._command(record).result(timeout=timeout)
        assert got is None or isinstance(got, RestoreOp)
        return got

    def flush_cache(self) -> bool:
        """Empty L1 and L2 when no request is in flight; False (nothing done) otherwise."""
        return bool(self._command(FlushCache()).result(timeout=60))

    @overload
    def rank_digests(self, *, timeout: float = 60.0) -> list[str]: ...

    @overload
    def rank_digests(
        self, *, pages_of: Sequence[int], timeout: float = 60.0
    ) -> list[dict[str, dict[int, str]]]: ...

    def rank_digests(
        self, *, pages_of: Sequence[int] | None = None, timeout: float = 60.0
    ) -> list[str] | list[dict[str, dict[int, str]]]:
        """Each rank's digest, by rank, taken at the same step on every rank (one entry with
        one rank). Without ``pages_of``: of its scheduling and cache state
        (:mod:`hicache.engine.step.rank_digest`), all equal while the ranks agree. With
        ``pages_of`` (tokens): the SHA-256 of every page its cache holds of their cached
        prefix, by ``"<component>/<tier>"`` and page index, after the copies in flight
        were applied (:func:`~hicache.engine.step.rank_digest.page_digests`; for tests and
        debugging: it reads every page)."""
        if pages_of is None:
            got = self._command(Digest()).result(timeout=timeout)
            assert isinstance(got, list)
            return [str(d) for d in got]
        record = Digest(pages_of=tuple(int(t) for t in pages_of))
        got = self._command(record).result(timeout)
        assert isinstance(got, list)
        return [
            {name: {int(i): d for i, d in pages.items()} for name, pages in json.loads(r).items()}
            for r in got
        ]

    def attach_storage(
        self, backend: str, extra_config: Mapping[str, Any] | None = None, policy: str = "timeout"
    ) -> None:
        """Attach an L3 backend at runtime (when idle). Raises ValueError on a bad config,
        RuntimeError when busy or already attached, StorageError when unreachable."""
        extra = dict(extra_config or {})
        StorageConfig.parse(backend, extra)  # a bad config is refused here, on every rank alike
        record = AttachStorage(backend=backend, extra_config=tuple(extra.items()), policy=policy)
        self._command(record).result(timeout=120)

    def close_session(self, session_id: str) -> bool:
        """End agent session ``session_id`` on every rank (its KV no longer kept in L2, its
        open restores cancelled); False when it had neither."""
        return bool(self._command(CloseSession(session_id)).result(timeout=60))

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
