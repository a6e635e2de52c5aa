"""The engine: a model, the hierarchical cache and the scheduler, driven by one thread.

Other threads (the HTTP server, the CLI) talk to it through :meth:`Engine.reserve` (places
in the bounded waiting queue for one client request's sequences), :meth:`Engine.submit`,
:meth:`Engine.abort` and :meth:`Engine.call` (run a function on the engine thread, e.g. a
cache flush); outputs come back through each request's callback, called on the engine
thread.

Robustness: an exception in one task of the loop (a queued call, adding a request, one
scheduler step, an output callback) fails only the requests involved; the loop goes on.
If the loop ends anyway, every request and call still queued or in flight is failed at
once (no caller waits for ever), :attr:`Engine.alive` turns False and
:meth:`Engine.health` says why. Every wait here has a deadline.

Tensor parallelism (``tp_size`` > 1, :mod:`hicache.engine.ranks`): this engine is rank 0;
each follower process runs an engine of its own in :meth:`Engine.follow`. What the API
posts becomes a step-input record (:mod:`hicache.engine.step_inputs`) that every rank
applies at the same step; :meth:`Engine.call` runs on rank 0 alone, so its function must
only read (it must not change the cache or wait on it: a cache wait agrees with the other
ranks). No rank recovers alone: a scheduler step or a forward that raises on any rank,
or a rank that dies, stops every rank (``health`` names a dead rank).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from hicache.cache import HiCache
from hicache.cache.components.base import ServingLimits
from hicache.cache.report import cache_stats
from hicache.controller.rank_group import RankGroup
from hicache.engine.admission import (
    EngineUnhealthy,
    QueueFull,
    QueueGate,
    Reservation,
)
from hicache.engine.config import EngineConfig, config_fields
from hicache.engine.graph_setup import GraphSetup, enable_for_cache
from hicache.engine.memory_trim import IdleTrimmer
from hicache.engine.output import OutputProcessor
from hicache.engine.rank_digest import rank_state_digest
from hicache.engine.ranks import (
    RankProcesses,
    RankSetup,
    StepChannel,
    cpu_threads_per_rank,
    join_group,
    leave_group,
    rank_device,
)
from hicache.engine.request import FinishReason, OutputCallback, Request, RequestOutput
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
    StepInputs,
    Stop,
)
from hicache.engine.tp_fit import check_tp_model
from hicache.keys import Namespace
from hicache.lifecycle import Lifecycle
from hicache.metrics import CacheStats
from hicache.runner.loader import LoadedModel, default_dtype, load_model
from hicache.runner.model_runner import ModelRunner, cache_spec_of
from hicache.runner.parallel import TPGroup
from hicache.storage.registry import StorageConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_CACHE_SALT_CHARS = 256
"""Longest ``cache_salt`` accepted: each distinct salt is tenant state kept by the cache."""
PRIORITY_MIN = -(2**63)
PRIORITY_MAX = 2**63 - 1
"""``priority`` is a signed 64-bit int (SGLang's field); larger = more important."""
DEFAULT_GENERATE_TIMEOUT_S = 600.0
DEFAULT_CLOSE_TIMEOUT_S = 60.0
STALL_AFTER_S = 120.0
""":meth:`Engine.health` reports a loop that has not gone round for this long as stalled."""
STATS_INTERVAL_S = 0.25
"""The loop publishes an :class:`EngineStats` record at most this often (seconds; each
read walks the tree), at the end of a round: :attr:`Engine.published_stats`."""


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
class EngineStats:
    """What the engine thread read at one point: the cache's stats, requests in the
    running batch and in the waiting queue, and requests the cache has admitted (holding
    pages). ``queued``: sequences counted against ``max_queued_requests`` (reserved or
    waiting, never yet admitted); ``refused``: reservations refused so far (HTTP 429/503);
    ``reclaimed``: running sequences retracted so far to give a lent slot back (the group
    cap, see :mod:`hicache.engine.scheduler`).
    ``at``: when (``time.monotonic()`` seconds). Immutable: published by the loop
    (:attr:`Engine.published_stats`) and read by any thread without a lock."""

    cache: CacheStats
    running: int
    waiting: int
    admitted: int
    queued: int = 0
    refused: int = 0
    reclaimed: int = 0
    at: float = 0.0


@dataclass(frozen=True, slots=True)
class _Task:
    """One item of the engine's inbox: ``run`` on the engine thread, or ``drop(why)``
    (on whatever thread ends the loop) when the loop will never run it. ``record``: the
    step input ``run`` applies (:meth:`Engine._apply`), which every rank applies under
    tensor parallelism; None for what concerns rank 0 alone (a stats read, a call)."""

    run: Callable[[], object]
    drop: Callable[[str], None]
    record: StepInput | None = None


def _ignore(_: str) -> None:
    return None


class Engine(Lifecycle):
    """Lifecycle: ``start()`` loads the model and starts the loop; ``close()`` stops it."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        loaded: LoadedModel | None = None,
        channel: StepChannel | None = None,
    ) -> None:
        """``channel``: a follower rank's end of the step exchange (given by
        :func:`run_follower`); rank 0 makes its own at :meth:`start` when ``tp_size`` > 1."""
        self.config = config
        self._loaded = loaded
        self._channel = channel
        self.rank = 0 if channel is None else channel.rank
        """This engine's rank (0: the server's; followers have 1 .. tp_size-1)."""
        self.ranks: RankProcesses | None = None
        """Rank 0's handle on the follower processes (None with one rank, or on a follower)."""
        self._channel_ok = True  # no collective of the step exchange has failed
        self._rank_failure: str | None = None  # why the ranks stopped (naming the rank)
        self._rank_failure_listeners: list[Callable[[str], None]] = []
        self._step_no = 0
        self._sync_s = 0.0  # seconds in cache.sync() under tensor parallelism
        self.agreement_steps_total = 0
        """Steps whose agreement :attr:`agreement_seconds_total` counts (0 with one rank)."""
        self._inbox: queue.Queue[_Task] = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # _gate orders posting against the loop's exit and the cache's close against it
        self._gate = threading.Lock()
        self._accepting = False  # new requests and calls are taken
        self._exit_reason: str | None = None  # set once the loop has ended (or is ending)
        self._loop_done = False  # the thread has finished every use of the cache
        self._close_cache_on_exit = False  # close() gave up waiting: the thread closes it
        self._cache_closed = False
        self._last_loop: float | None = None  # time.monotonic() of the last round
        self._failed_steps = 0
        self.queue = QueueGate(config.max_queued_requests)
        """Sequences queued against ``max_queued_requests`` (see :meth:`reserve`)."""
        self._published: EngineStats | None = None  # replaced whole, never mutated
        self._stats_tried = -math.inf  # time.monotonic() of the last read attempt
        self.stats_interval_s = STATS_INTERVAL_S
        """Seconds between two published stats records (see :attr:`published_stats`)."""
        self.model: LoadedModel
        self.cache: HiCache
        self.scheduler: Scheduler
        self.context_length = 0
        self.decode_graphs: GraphSetup | None = None
        """What turning CUDA graphs on did at start (None: not tried: off, or not CUDA)."""
        self.memory_trimmer = IdleTrimmer(config.memory_trim_interval_s)
        """Gives freed memory back to the OS after busy periods (engine thread only)."""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Engine:
        """Load the model, build the cache and start the loop. Idempotent.

        With ``tp_size`` > 1 this is rank 0: the model is checked for the split, the
        follower ranks are spawned and joined (:class:`~hicache.engine.ranks.RankProcesses`),
        and the loop starts once every rank has built its engine; a rank that fails or
        does not make it within ``dist_init_timeout_s`` fails the start
        (:class:`~hicache.engine.ranks.RankStartError`, naming it)."""
        if self._thread is not None:
            return self
        cfg = self.config
        if cfg.tp_size > 1 and self._channel is None:
            if self._loaded is not None:
                raise ValueError(
                    f"tp_size={cfg.tp_size}: every rank loads its own shard of the model;"
                    " start the engine without a loaded model"
                )
            check_tp_model(cfg.model_path, cfg.tp_size, cfg.device)  # before any process starts
            on_cuda = torch.device(cfg.device).type == "cuda"
            if not on_cuda:  # the cores shared out between the ranks
                torch.set_num_threads(cpu_threads_per_rank(cfg.tp_size))
            backend = "nccl" if on_cuda else "gloo"
            self.ranks = RankProcesses(
                cfg.tp_size,
                run_follower,
                config_fields(cfg),
                backend=backend,
                init_timeout_s=cfg.dist_init_timeout_s,
            )
            try:
                self._channel = self.ranks.start()  # stops what it started when it fails
            except BaseException:
                self.ranks = None
                raise
            try:
                self._build()
                self.ranks.wait_ready()
            except BaseException:
                self.ranks.close(timeout=5.0, broken=True)
                self.ranks = None
                self._channel = None
                raise
            self.ranks.watch(self._on_rank_failure)
        else:
            self._build()
        self._stop.clear()
        self._exit_reason = None
        self._loop_done = self._close_cache_on_exit = self._cache_closed = False
        self._failed_steps = 0
        self._last_loop = time.monotonic()
        self._accepting = True
        self._thread = threading.Thread(target=self._loop, name="hicache-engine", daemon=True)
        self._thread.start()
        return self

    def _load_model(self) -> None:
        """Load the model (or take the one given), once."""
        if hasattr(self, "model"):
            return
        cfg = self.config
        dtype = cfg.dtype or default_dtype(cfg.device)
        if self._loaded is not None:
            self.model = self._loaded
            return
        # this rank's shard (the whole model with one rank), over the default group
        tp = TPGroup.single() if self._channel is None else TPGroup(self.rank, cfg.tp_size)
        self.model = load_model(cfg.model_path, dtype=dtype, device=cfg.device, tp=tp)

    def _build(self) -> None:
        """The model, the cache (with L3 when configured), the runner and the scheduler:
        what every rank builds alike."""
        cfg = self.config
        self._load_model()
        model = self.model.model
        # what the model caches: full KV and a spec per extra component, each its own store
        spec = cache_spec_of(model, self.model.dtype)
        cache_cfg = cfg.cache
        if cfg.device_cache_gb is not None:  # every component's L1 pool counted
            token_bytes = spec.device_token_bytes(cache_cfg)
            tokens = int(int(cfg.device_cache_gb * 1e9) // token_bytes)
            cache_cfg = dataclasses.replace(cache_cfg, device_tokens=tokens)
        limits = ServingLimits(
            chunk_tokens=cfg.scheduler.chunked_prefill_size,
            max_running=cfg.scheduler.max_running_requests,
        )
        channel = self._channel  # with several ranks, the cache agrees over its gloo group
        ranks = None if channel is None else RankGroup(channel.group)
        self.cache = HiCache(cache_cfg, spec, cfg.device, limits=limits, ranks=ranks).start()
        if cfg.storage is not None:
            try:
                self._attach(cfg.storage, cfg.storage_prefetch_policy)
            except BaseException:
                self.cache.close()
                raise
        runner = ModelRunner(
            self.model.model,
            self.cache.full.device_pool,
            self.cache.stores.runner_pools(),
            attention_backend=cfg.attention_backend,
        )
        if runner.recurrent:
            log.info(
                "%s has recurrent layers: cached prefixes resume from state snapshots taken"
                " at the last page boundary of each prompt",
                self.model.name,
            )
        max_pos = int(getattr(self.model.hf_config, "max_position_embeddings", 2048))
        self.context_length = min(cfg.context_length or max_pos, max_pos)
        self.decode_graphs = self._enable_decode_graphs(runner)
        tok = self.model.tokenizer
        eos = _eos_ids(self.model)
        output = OutputProcessor(tok, eos, self.context_length)
        self.scheduler = Scheduler(
            self.cache,
            runner,
            output,
            cfg.scheduler,
            tokens=channel,
            abort_later=None if channel is None else self._abort_later,
        )

    def _enable_decode_graphs(self, runner: ModelRunner) -> GraphSetup | None:
        """Capture decode CUDA graphs (``cuda_graph_max_bs``) on a CUDA device, before the
        loop starts; None when off or not on CUDA. A failure leaves decode eager."""
        cfg = self.config
        max_running = cfg.scheduler.max_running_requests
        max_bs = max_running if cfg.cuda_graph_max_bs is None else cfg.cuda_graph_max_bs
        if max_bs == 0 or torch.device(cfg.device).type != "cuda":
            return None
        try:
            return enable_for_cache(
                runner,
                self.cache,
                max_bs=min(max_bs, max_running),
                context_length=self.context_length,
            )
        except Exception as exc:  # capture and probe failures are handled inside; any other
            log.warning("CUDA graphs for decode are off: %r; decode runs eagerly", exc)
            runner.use_decode_graphs(None)
            return GraphSetup(enabled=False, reason=f"set-up failed: {exc!r}")

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
        thread = self._thread
        if thread is None:
            return
        deadline = time.monotonic() + timeout
        self._accepting = False
        self._stop.set()  # the loop ends its round, then fails what is queued or in flight
        self._wake.set()
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._gate:
            handed_over = not self._loop_done
            if handed_over:
                self._close_cache_on_exit = True
        if handed_over:
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
            self._close_cache()
        finally:
            self._close_ranks(deadline)

    def _close_ranks(self, deadline: float) -> None:
        """Join the followers (told to stop by the loop's last broadcast), kill stragglers."""
        ranks = self.ranks
        if ranks is None:
            return
        self.ranks = None
        ranks.close(
            timeout=max(5.0, deadline - time.monotonic()),
            broken=not self._channel_ok or self._rank_failure is not None,
        )

    @property
    def rank_failure(self) -> str | None:
        """Why the ranks stopped on their own, naming the rank: a follower that died, or
        rank 0's loop that failed (which then made every follower leave); None while they
        run (and with one rank)."""
        return self._rank_failure

    def on_rank_failure(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(why)`` (on a watcher thread, or the engine thread) when the
        ranks stop on their own (:attr:`rank_failure`); the engine has stopped then (the
        server exits)."""
        self._rank_failure_listeners.append(listener)
        if self._rank_failure is not None:
            listener(self._rank_failure)

    def _on_rank_failure(self, why: str) -> None:
        """A follower died (the watcher's thread): stop the loop, tell the listeners."""
        self._rank_failure = why
        self._stop.set()
        self._wake.set()
        for listener in list(self._rank_failure_listeners):
            try:
                listener(why)
            except Exception:
                log.exception("a rank failure listener failed")

    def _close_cache(self) -> None:
        with self._gate:
            if self._cache_closed:
                return
            self._cache_closed = True
        if self._channel is None:
            self.cache.close()
            return
        try:  # its last flush agrees with the other ranks: with one gone, it fails
            self.cache.close()
        except Exception as exc:
            log.error(
                "rank %d: closing the cache did not finish its agreed flush (%s: %s); its"
                " workers are stopped",
                self.rank,
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )

    @property
    def alive(self) -> bool:
        """Whether the engine thread is running its loop (started, not ended, not crashed)."""
        thread = self._thread
        return thread is not None and thread.is_alive() and self._exit_reason is None

    def health(self, stall_after_s: float = STALL_AFTER_S) -> EngineHealth:
        """Is the loop running and going round? Cheap; callable from any thread.

        Not healthy when the thread is not running (never started, closed or crashed), when
        the loop has not gone round for ``stall_after_s`` seconds (stuck in a step or a
        call), or when the last ``unhealthy_after_failed_steps`` scheduler steps, or
        forwards, all raised (healthy again once one succeeds).
        """
        age = None if self._last_loop is None else time.monotonic() - self._last_loop
        alive = self.alive
        reason: str | None = None
        if self._rank_failure is not None:
            reason = f"{self._rank_failure}; the engine stopped"
        elif not alive:
            if self._thread is None and self._exit_reason is None:
                reason = "the engine is not started"
            else:
                reason = self._exit_reason or "the engine thread is not running"
        elif alive and age is not None and age > stall_after_s:
            reason = f"the engine loop has not gone round for {age:.0f} s"
        failed_forwards = self.scheduler.failed_forwards if alive else 0
        limit = self.config.unhealthy_after_failed_steps
        if reason is None and self._failed_steps >= limit:
            reason = f"the last {self._failed_steps} scheduler steps failed"
        elif reason is None and failed_forwards >= limit:
            reason = (
                f"the last {failed_forwards} forwards failed, each failing its requests"
                f" (last: {self.scheduler.forward_error})"
            )
        return EngineHealth(
            healthy=reason is None,
            alive=alive,
            reason=reason,
            last_loop_age_s=age,
            failed_steps=self._failed_steps,
            failed_forwards=failed_forwards,
        )

    # ------------------------------------------------------------------ API (any thread)

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def resumable_prefix(self) -> bool:
        """Whether requests reuse cached prefixes (L1/L2/L3 hits). For a model with
        recurrent layers (Qwen3-Next, Nemotron-H) a hit resumes only at a boundary where the
        cache holds a state snapshot (see :mod:`hicache.cache.components.snapshots`)."""
        return self.scheduler.resumable_prefix

    def validate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        cache_salt: str = "",
        priority: int = 0,
    ) -> None:
        """Raise :class:`InvalidRequest` (a ValueError) naming the problem and its field
        (``prompt``, ``cache_salt``, ``priority``) when a request cannot be served."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        vocab = int(self.model.hf_config.vocab_size)
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(
                f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})", param="prompt"
            )
        params.check_vocab(vocab)  # logit_bias and stop_token_ids
        if len(prompt_ids) >= self.context_length:
            raise InvalidRequest(
                f"the prompt has {len(prompt_ids)} tokens; the context length is"
                f" {self.context_length} (at least one token must be generated)",
                param="prompt",
            )
        if not isinstance(cache_salt, str) or len(cache_salt) > MAX_CACHE_SALT_CHARS:
            shown = len(cache_salt) if isinstance(cache_salt, str) else type(cache_salt).__name__
            raise InvalidRequest(
                f"cache_salt ({shown}) is invalid; must be a string of at most"
                f" {MAX_CACHE_SALT_CHARS} characters",
                param="cache_salt",
            )
        if (
            isinstance(priority, bool)
            or not isinstance(priority, int)
            or not PRIORITY_MIN <= priority <= PRIORITY_MAX
        ):
            raise InvalidRequest(
                f"priority={priority!r} is invalid; must be an int in"
                f" [{PRIORITY_MIN}, {PRIORITY_MAX}]",
                param="priority",
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
        """Queue a request; returns its id. ``on_output`` runs on the engine thread.

        ``priority``: larger is more important (SGLang's field): admitted first.
        ``group``: the client request it belongs to (empty: its own); the scheduler's
        per-group limits count a group's sequences together. ``reservation``: a place
        taken by :meth:`reserve` (without one, a place is reserved here, which may raise
        :class:`~hicache.engine.admission.QueueFull`).
        Raises :class:`InvalidRequest` for a request that cannot be served, RuntimeError
        when the engine is not running. Once queued, the request always gets a final
        output: finished normally, or aborted with ``error`` set when adding it failed or
        the engine stopped first.
        """
        self.validate(prompt_ids, params, cache_salt=cache_salt, priority=priority)
        own = reservation is None
        ticket = self.reserve(1) if reservation is None else reservation
        req = Request(
            list(prompt_ids),
            params,
            on_output,
            cache_salt=cache_salt,
            priority=priority,
            group=group,
            queue_slot=ticket.take(),
        )
        record = NewRequest.of(
            rid=req.rid,
            prompt_ids=req.prompt_ids,
            params=params,
            cache_salt=cache_salt,
            priority=priority,
            group=req.group,
            arrival=req.arrival,
        )
        try:
            self._post(lambda: self._apply(record, req), lambda why: self._fail(req, why), record)
        except BaseException:
            req.leave_queue()
            raise
        finally:
            if own:
                ticket.close()
        return req.rid

    def abort(self, rid: str) -> None:
        """Abort request ``rid`` at the next step (nothing when it has ended)."""
        record = Abort(rid)
        self._post(lambda: self._apply(record), record=record)

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
        fut: Future[T] = Future()

        def run() -> None:
            try:
                with self.cache.ranks.local_only("inside Engine.call (run on rank 0 alone)"):
                    fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

        def drop(why: str) -> None:
            if not fut.done():
                fut.set_exception(RuntimeError(why))

        self._post(run, drop)
        return fut

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
        return self._published

    def _read_stats(self) -> EngineStats:
        """The stats now (engine thread only)."""
        counts = self.queue.counts()
        return EngineStats(
            cache=cache_stats(self.cache),
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            admitted=len(self.cache.admitted),
            queued=counts.queued,
            refused=counts.refused,
            reclaimed=self.scheduler.reclaimed,
            at=time.monotonic(),
        )

    def _publish_stats(self) -> None:
        """Publish a new :class:`EngineStats` when the last is ``stats_interval_s`` old
        (engine thread, end of a round). A failure keeps the last one (and is logged)."""
        now = time.monotonic()
        if now - self._stats_tried < self.stats_interval_s:
            return
        self._stats_tried = now
        try:
            self._published = self._read_stats()
        except Exception:
            log.exception("reading the engine's stats failed; the last ones stay published")

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

    def _command(self, record: StepInput) -> Future[object]:
        """Post the control ``record`` (applied by every rank at the next step); rank 0's
        result, or its exception, comes in the future."""
        fut: Future[object] = Future()

        def run() -> None:
            try:
                fut.set_result(self._apply(record))
            except BaseException as exc:
                fut.set_exception(exc)

        def drop(why: str) -> None:
            if not fut.done():
                fut.set_exception(RuntimeError(why))

        self._post(run, drop, record)
        return fut

    def _apply(self, item: StepInput, local: Request | None = None) -> object:
        """Apply one step input on this rank (the engine thread; every rank applies the
        same records in the same order). ``local``: rank 0's own request for a
        :class:`NewRequest` (with its client's callback); a follower builds one without."""
        if isinstance(item, NewRequest):
            req = local
            if req is None:
                req = Request(
                    list(item.prompt_ids),
                    item.sampling,
                    None,  # outputs are reported by rank 0 alone
                    rid=item.rid,
                    cache_salt=item.cache_salt,
                    priority=item.priority,
                    group=item.group,
                    arrival=item.arrival,
                )
            self._add(req)
            return None
        if isinstance(item, Abort):
            self.scheduler.abort(item.rid)
            return None
        if isinstance(item, FlushCache):
            if not self.scheduler.idle:
                return False
            self.cache.reset()
            return True
        if isinstance(item, AttachStorage):
            if not self.scheduler.idle:
                raise RuntimeError("requests are in flight; attach storage when idle")
            config = StorageConfig.parse(item.backend, dict(item.extra_config))
            self._attach(config, item.policy)
            return None
        if isinstance(item, DetachStorage):
            if not self.scheduler.idle:
                raise RuntimeError("requests are in flight; detach storage when idle")
            return self.cache.detach_storage()
        if isinstance(item, Digest):
            sched = self.scheduler
            mine = rank_state_digest(self.cache, sched.waiting, sched.running)
            return [mine] if self._channel is None else self._channel.gather(mine)
        return None  # Stop: handled by the loops

    # ------------------------------------------------------------------ L3

    def _attach(self, storage_config: StorageConfig, policy: str) -> None:
        prefetch = storage_config.prefetch_config(policy)
        if self.cache.full.host is None:
            raise ValueError("an L3 storage backend needs --enable-hierarchical-cache")
        namespace = Namespace.for_spec(
            self.cache.spec,
            model=self.model.name,
            weights_fingerprint=self.model.fingerprint,
            layout=self.cache.config.mem_layout,
            page_size=self.cache.page_size,
            tp_size=self.config.tp_size,
            tp_rank=self.rank,
        )
        self.cache.attach_storage(storage_config.create(namespace), namespace, prefetch)

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

    # ------------------------------------------------------------------ loop

    def _post(
        self,
        fn: Callable[[], object],
        drop: Callable[[str], None] = _ignore,
        record: StepInput | None = None,
    ) -> None:
        """Queue ``fn`` for the loop; ``drop(why)`` runs instead if the loop ends first.
        ``record``: the step input ``fn`` applies (broadcast to every rank before it runs).

        Raises RuntimeError when the engine is not running or is closing.
        """
        with self._gate:
            if self._thread is None or self._exit_reason is not None:
                raise RuntimeError(self._exit_reason or "the engine is not running")
            if not self._accepting:
                raise RuntimeError("the engine is closing")
            self._inbox.put(_Task(fn, drop, record))
        self._wake.set()

    def _add(self, req: Request) -> None:
        """Hand ``req`` to the scheduler (engine thread); a failure fails ``req`` alone."""
        try:
            self.scheduler.add(req)
        except Exception as exc:
            log.exception("could not queue %s", req.rid)
            self._fail(req, f"the request could not be queued: {type(exc).__name__}: {exc}")

    def _held(self, req: Request) -> bool:
        return any(r is req for r in (*self.scheduler.waiting, *self.scheduler.running))

    def _fail(self, req: Request, why: str, *, direct: bool = False) -> None:
        """End ``req`` with ``error`` = ``why``: through the scheduler when it holds it
        (which then releases what it holds), else (or when ``direct``) by telling its
        client directly."""
        if req.final_reported:
            return
        req.error = req.error or why
        if not direct and self._held(req):
            req.aborted = True
            return
        req.leave_queue()
        req.finish_reason = FinishReason.ABORT
        req.final_reported = True
        if req.on_output is None:
            return
        try:
            req.on_output(self.scheduler.output.report(req))
        except BaseException:  # a broken consumer must not stop the engine (or its cleanup)
            log.exception("output callback of %s failed", req.rid)

    def _abort_all(self, why: str, max_s: float = 10.0, max_failures: int = 3) -> None:
        """Abort every request in flight and step until the scheduler has released them;
        those it cannot release (``max_failures`` failed steps, or ``max_s`` seconds) are
        failed directly, their pages left where they are."""
        reqs = self.scheduler.in_flight  # with those ended whose final report is pending
        for req in reqs:
            if req.finished:
                continue
            req.aborted = True
            req.error = req.error or why
        deadline = time.monotonic() + max_s
        failures = 0
        while not self.scheduler.idle and failures < max_failures:
            if time.monotonic() > deadline:
                break
            try:
                self.scheduler.step()
            except Exception:
                failures += 1
                log.exception("aborting in-flight requests: a scheduler step failed")
        for req in reqs:
            self._fail(req, why, direct=True)

    def _take_inbox(self) -> list[_Task]:
        """Every task posted so far, oldest first (the inbox left empty)."""
        tasks: list[_Task] = []
        while True:
            try:
                tasks.append(self._inbox.get_nowait())
            except queue.Empty:
                return tasks

    @staticmethod
    def _run_tasks(tasks: list[_Task]) -> None:
        """Run ``tasks`` in order; one that raises is logged and the rest still run."""
        for task in tasks:
            try:
                task.run()
            except Exception:
                log.exception("an engine task failed")

    def _run_inbox(self) -> None:
        self._run_tasks(self._take_inbox())

    def _exchange_inputs(self, channel: StepChannel) -> None:
        """Rank 0 under tensor parallelism: take the inbox, broadcast its records as this
        step's :class:`StepInputs` (always, also when empty), then run its tasks in order
        (each record's task applies the record, as every follower does)."""
        tasks = self._take_inbox()
        records = tuple(t.record for t in tasks if t.record is not None)
        try:
            channel.inputs(StepInputs(self._step_no, records))
        except BaseException as exc:
            self._channel_ok = False
            why = f"the ranks could not exchange a step's inputs: {type(exc).__name__}: {exc}"
            for task in tasks:
                try:
                    task.drop(why)
                except Exception:
                    log.exception("failing an engine task")
            raise
        self._run_tasks(tasks)

    def _sync_cache(self) -> None:
        """Bring the cache's asynchronous completions in, once per step on every rank: with
        several ranks, what they all have, agreed in one collective (:meth:`HiCache.sync`;
        with one rank it is ``poll``)."""
        if self._channel is None:
            self.cache.sync()
            return
        began = time.perf_counter()
        self.cache.sync()
        self._sync_s += time.perf_counter() - began
        self.agreement_steps_total += 1

    @property
    def agreement_seconds_total(self) -> float:
        """Under tensor parallelism, this rank's seconds so far in the step's collectives
        that are not the model's: the step-input broadcast, ``cache.sync()`` (its one
        all-reduce and applying what was agreed) and the sampled-token broadcast; over
        :attr:`agreement_steps_total` the mean per step. 0.0 with one rank."""
        channel = self._channel
        return 0.0 if channel is None else self._sync_s + channel.seconds

    def _loop(self) -> None:
        reason = "the engine was closed"
        channel = self._channel
        try:
            while not self._stop.is_set():
                self._last_loop = time.monotonic()
                if channel is None:
                    self._run_inbox()
                else:
                    self._exchange_inputs(channel)
                self._sync_cache()
                try:
                    busy = self.scheduler.step()
                    self._failed_steps = 0
                except Exception as exc:
                    if channel is not None:  # no rank may recover alone: the ranks stop
                        self._channel_ok = False
                        raise
                    log.exception("scheduler step failed; aborting in-flight requests")
                    busy = False
                    self._failed_steps += 1
                    self._abort_all(f"scheduler step failed: {type(exc).__name__}: {exc}")
                self._step_no += 1
                self._publish_stats()
                self.memory_trimmer.after_round(busy or not self.scheduler.idle)
                if not busy:  # idle, or only waiting for L3 prefetches: poll those often
                    # (at most 50 ms: the followers wait in the next broadcast meanwhile)
                    self._wake.wait(timeout=0.002 if self.scheduler.waiting else 0.05)
                    self._wake.clear()
            if channel is not None:
                reason = self._stop_ranks(channel, reason)
        except BaseException as exc:
            reason = f"the engine loop died: {type(exc).__name__}: {exc}"
            failure = self._failed_rank()
            if failure is not None:
                reason = f"{failure}; the engine stopped"
            log.critical("%s", reason, exc_info=failure is None)
            if failure is None and channel is not None:
                why = f"rank 0 stopped: {type(exc).__name__}: {exc}"
                self._break_ranks(why)
                reason = f"{why}; the engine stopped"
        finally:
            self._end_loop(reason)

    def _break_ranks(self, why: str) -> None:
        """Rank 0's loop failed on its own (a step or a forward that raised here): stop
        every follower now (one waiting in a collective with rank 0 would wait for its
        timeout), leave the group, and stop as for a dead rank (``why`` is
        :attr:`rank_failure`; the server exits)."""
        self._channel_ok = False
        if self.ranks is not None:
            self.ranks.terminate()
        leave_group()
        self._on_rank_failure(why)

    def _failed_rank(self) -> str | None:
        """Why a follower died, if one did (waiting a moment for its exit to be seen)."""
        if self._rank_failure is not None:
            return self._rank_failure
        return None if self.ranks is None else self.ranks.dead_rank(wait_s=1.0)

    def _stop_ranks(self, channel: StepChannel, reason: str) -> str:
        """The loop was told to stop: broadcast a :class:`Stop` (unless a follower died,
        which is then the reason returned)."""
        if self._rank_failure is not None:
            return f"{self._rank_failure}; the engine stopped"
        try:
            channel.inputs(StepInputs(self._step_no, (Stop(reason),)))
        except Exception as exc:
            self._channel_ok = False
            log.error("telling the ranks to stop failed: %s: %s", type(exc).__name__, exc)
        return reason

    def follow(self) -> int:
        """A follower rank's loop (its main thread, after :meth:`_build`): each step, the
        inputs rank 0 broadcast, applied in order; the cache's completions; the scheduler's
        step. Ends at a :class:`Stop` (returns 0) or when a step fails here, or an exchange
        with rank 0 fails or times out (rank 0 gone; returns 1). Outputs are rank 0's:
        this rank's requests have no callbacks."""
        channel = self._channel
        if channel is None:
            raise RuntimeError("follow() runs on a follower rank (an engine given a channel)")
        code = 0
        reason = "rank 0 stopped the engine"
        try:
            while True:
                self._last_loop = time.monotonic()
                inputs = channel.inputs(None)
                stop = inputs.stop
                for item in inputs.items:
                    if item is stop:
                        continue
                    try:
                        self._apply(item)
                    except Exception:  # rank 0 reports it to its caller
                        log.exception("rank %d: applying %s failed", self.rank, type(item).__name__)
                if stop is not None:
                    reason = stop.reason
                    break
                self._sync_cache()
                busy = self.scheduler.step()
                self._step_no += 1
                self.memory_trimmer.after_round(busy or not self.scheduler.idle)
        except BaseException as exc:
            code = 1
            reason = f"rank {self.rank} stopped: {type(exc).__name__}: {exc}"
            log.error("%s", reason)
        try:
            if not self.scheduler.idle:
                self._abort_all(reason)
        except BaseException:
            log.exception("rank %d: releasing the requests in flight", self.rank)
        self._close_cache()
        return code

    def _end_loop(self, reason: str) -> None:
        """The loop's last act: refuse new work, fail what is queued or in flight, and close
        the cache if close() has handed that over."""
        with self._gate:
            self._exit_reason = reason
        for task in self._take_inbox():
            try:
                task.drop(reason)
            except BaseException:
                log.exception("failing a queued engine task")
        try:
            if not self.scheduler.idle:
                self._abort_all(reason)
        except BaseException:  # e.g. a callback raising SystemExit again: finish cleanup
            log.exception("failing the requests in flight")
            for req in self.scheduler.in_flight:
                self._fail(req, reason, direct=True)
        with self._gate:
            self._loop_done = True
            close_cache = self._close_cache_on_exit
        if close_cache:
            try:
                self._close_cache()
            except BaseException:
                log.exception("closing the cache after the engine thread ended")


def run_follower(setup: RankSetup, fields: dict[str, Any], conn: Any) -> None:
    """The main of follower rank ``setup.rank`` (a spawned process): join the group, build
    the engine (``EngineConfig(**fields)``, see :func:`~hicache.engine.config.config_fields`) on this rank's
    device, say so on ``conn`` (``("joining",)``, ``("joined",)``, ``("ready",)``, or
    ``("error", line)``
    before exiting 1), then :meth:`Engine.follow` until told to stop."""
    config = EngineConfig(**fields)
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s %(levelname)s rank {setup.rank}: %(message)s"
    )
    if torch.device(config.device).type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(setup.size))
    code = 1
    try:
        try:
            conn.send(("joining",))
            channel = join_group(setup)
        except BaseException as exc:
            conn.send(("error", f"could not join the process group: {_line(exc)}"))
            return
        conn.send(("joined",))
        device = rank_device(config.device, setup.rank)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        engine = Engine(dataclasses.replace(config, device=device), channel=channel)
        try:
            engine._build()
        except BaseException as exc:
            conn.send(("error", _line(exc)))
            return
        conn.send(("ready",))
        code = engine.follow()
    finally:
        with contextlib.suppress(OSError):
            conn.close()
        leave_group()
        os._exit(code)  # no interpreter teardown that could wait on a broken group


def _line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _eos_ids(model: LoadedModel) -> set[int]:
    ids: set[int] = set()
    for source in (model.hf_config, getattr(model.model, "generation_config", None)):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    tok_eos = getattr(model.tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int):
        ids.add(tok_eos)
    return ids
