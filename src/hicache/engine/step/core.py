"""The one step body every rank runs: :class:`EngineCore`.

A step (:meth:`EngineCore.step`) is the same on every rank and for every driver: apply
the step's :class:`~hicache.engine.step_inputs.StepInputs` in order
(:meth:`EngineCore.apply`), ``cache.sync()`` (agreed with several ranks), one scheduler
step; it returns its outputs as data (:class:`StepResult`: the reports, the aborts for the
next step). What differs between ranks is data, not code: rank 0 keeps its own requests
until their :class:`~hicache.engine.step_inputs.NewRequest` is applied
(:attr:`EngineCore.clients`); followers build theirs from the record, report nothing and
take rank 0's sampled tokens. A scheduler step that raises comes out as
:class:`StepFailed`; each driver (:mod:`hicache.engine.drivers.leader`,
:mod:`hicache.engine.drivers.follower`) decides what that ends. Runs on the thread that
drives the core. The step, its drivers and their error policy: docs/architecture.md, "The
engine: one step body and its drivers".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from hicache.cache import HiCache
from hicache.engine.config import EngineConfig
from hicache.engine.memory_trim import IdleTrimmer
from hicache.engine.ranks import StepChannel
from hicache.engine.request import Request
from hicache.engine.restore_book import RestoreBook, RestoreState
from hicache.engine.step.ends import StepOutputs
from hicache.engine.step.graph_setup import GraphSetup
from hicache.engine.step.rank_digest import page_digests, rank_state_digest
from hicache.engine.step.restores import StepRestores, restore_page_bytes
from hicache.engine.step.scheduler import Scheduler
from hicache.engine.step_inputs import (
    Abort,
    AttachStorage,
    CloseSession,
    DetachStorage,
    Digest,
    EndRestore,
    FlushCache,
    NewRequest,
    PagesArrived,
    RoomEnded,
    RoomFailed,
    StartRestore,
    StepInput,
    StepInputs,
    Stop,
)
from hicache.heads import record_group
from hicache.keys import HEAD_RECORDS, Namespace
from hicache.kv_events import AllBlocksCleared, KvEventHub, ResidencyRecorder
from hicache.runner.loader import LoadedModel
from hicache.spec import AttentionKind
from hicache.storage.registry import StorageConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Applied:
    """What applying one step input gave: its ``value``, or the ``error`` it raised."""

    value: object = None
    error: Exception | None = None


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one step did: whether a ``forward`` ran, and the ``outputs`` it left for its
    driver (:class:`~hicache.engine.step.ends.StepOutputs`)."""

    forward: bool
    outputs: StepOutputs


class StepFailed(Exception):
    """The scheduler step of :meth:`EngineCore.step` raised ``error`` (the driver decides
    what that ends: with one rank the requests in flight, with several every rank)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


class EngineCore:
    """The model, the cache and the scheduler of one rank, and the step they take.

    ``channel``: this rank's end of the step exchange (None with one rank). Built by
    :func:`~hicache.engine.step.build.build_core`."""

    def __init__(
        self,
        config: EngineConfig,
        model: LoadedModel,
        cache: HiCache,
        scheduler: Scheduler,
        *,
        context_length: int,
        decode_graphs: GraphSetup | None,
        channel: StepChannel | None,
    ) -> None:
        self.config = config
        self.model = model
        self.cache = cache
        self.scheduler = scheduler
        self.context_length = context_length
        self.decode_graphs = decode_graphs
        """What turning CUDA graphs on did at start (None: not tried: off, or not CUDA)."""
        self.channel = channel
        self.rank = 0 if channel is None else channel.rank
        self.clients: dict[str, Request] = {}
        """Rank 0: ``rid ->`` the request built for its caller (with its queue place) of
        each record posted and not yet applied (put by the posting thread before the post,
        taken by :meth:`apply`); empty on followers."""
        self.step_no = 0
        self.sync_s = 0.0
        """Seconds in ``cache.sync()`` so far under tensor parallelism."""
        self.agreement_steps_total = 0
        """Steps whose agreement :attr:`agreement_seconds_total` counts (0 with one rank)."""
        self.memory_trimmer = IdleTrimmer(config.memory_trim_interval_s)
        """Gives freed memory back to the OS after busy periods (engine thread only)."""
        self.restores = StepRestores(
            cache,
            RestoreBook(max_ops=config.restore_max_ops, max_bytes=restore_max_bytes(config, cache)),
        )
        """This rank's restores (``POST /hicache/prefetch``); rank 0's book is the API's."""
        self.kv_events: KvEventHub | None = None
        """Where this core publishes its cache's KV events (rank 0, events on), or None."""
        self._kv_recorder: ResidencyRecorder | None = None

    # ------------------------------------------------------------------ KV events

    def attach_kv_events(self, hub: KvEventHub) -> None:
        """Report the cache's residency changes to ``hub`` from now on (before the loop
        starts). The cache is new and empty: subscribers first hear ``AllBlocksCleared``
        (what an earlier core published is gone)."""
        recorder = ResidencyRecorder(self.cache.context.page_size)
        self.cache.observe_residency(recorder)
        self._kv_recorder = recorder
        self.kv_events = hub
        hub.publish([AllBlocksCleared()])

    def publish_kv_events(self) -> None:
        """Publish what the cache's pages did since the last call as one batch (engine
        thread; once per step). Nothing without KV events."""
        if self._kv_recorder is not None and self.kv_events is not None:
            self.kv_events.publish(self._kv_recorder.drain())

    # ------------------------------------------------------------------ the step

    def step(
        self, inputs: StepInputs, applied: Callable[[int, Applied], None] | None = None
    ) -> StepResult:
        """Apply ``inputs`` in order, sync the cache, run one scheduler step; returns
        whether a forward ran and the step's outputs. ``applied(i, outcome)`` is told the
        outcome of ``inputs.items[i]`` right after it is applied (rank 0 answers its callers
        there); without it a failure is logged and the step goes on. At a :class:`Stop` the
        inputs are applied and nothing else is done (no forward). Raises
        :class:`StepFailed` when the scheduler step raises (its outputs so far are then
        left for :meth:`take`)."""
        stop = False
        for i, item in enumerate(inputs.items):
            if isinstance(item, Stop):
                stop = True
                continue
            try:
                outcome = Applied(value=self.apply(item))
            except Exception as exc:
                if applied is None:  # rank 0 reports it to its caller: one line here
                    log.warning(
                        "rank %d: %s refused: %s", self.rank, type(item).__name__, error_line(exc)
                    )
                    log.debug("rank %d: %s", self.rank, type(item).__name__, exc_info=exc)
                outcome = Applied(error=exc)
            if applied is not None:
                applied(i, outcome)
        if stop:
            self.publish_kv_events()
            return StepResult(False, self.take())
        self.sync_cache()
        try:
            self.restores.advance(
                self.spare_l1_pages
            )  # as agreed at this sync: alike on every rank
            watched = self.restores.watch(self.scheduler.waiting)
            busy = self.scheduler.step()
            self.restores.left(watched, self.scheduler.waiting)
        except Exception as exc:
            raise StepFailed(exc) from exc
        finally:
            self.step_no += 1
            self.publish_kv_events()
        self.memory_trimmer.after_round(busy or not self.scheduler.idle)
        return StepResult(busy, self.take())

    def take(self) -> StepOutputs:
        """The outputs left since the last step or call: those of requests ended outside
        a step (:meth:`abort_all`, :meth:`fail`) or of a step that raised."""
        return self.scheduler.ends.take()

    def apply(self, item: StepInput) -> object:
        """Apply one step input on this rank (every rank applies the same records in the
        same order); returns what rank 0 answers its caller (a flush's success, a digest)."""
        if isinstance(item, NewRequest):
            self.add(self.request_of(item))
            return None
        if isinstance(item, Abort):
            self.scheduler.abort(item.rid)
            return None
        if isinstance(item, FlushCache):
            if not self.scheduler.idle:
                return False
            self.restores.end_all(RestoreState.CANCELLED, "the cache was flushed")
            self.cache.reset()
            return True
        if isinstance(item, StartRestore):
            return self.restores.start(item)
        if isinstance(item, EndRestore):
            return self.restores.end(item)
        if isinstance(item, AttachStorage):
            if not self.scheduler.idle:
                raise RuntimeError("requests are in flight; attach storage when idle")
            storage = StorageConfig.parse(item.backend, dict(item.extra_config))
            self.agreed(
                "the L3 attach",
                lambda: self.attach(storage, item.policy),
                undo=self._undo_attach,
                after="no rank attached it",
            )
            return None
        if isinstance(item, DetachStorage):
            if not self.scheduler.idle:
                raise RuntimeError("requests are in flight; detach storage when idle")
            return self.agreed(
                "the L3 detach",
                self.cache.l3.detach,
                undo=None,
                after="the backend is detached on every rank",
            )
        if isinstance(item, PagesArrived):
            self.scheduler.pages_arrived(item)
            return None
        if isinstance(item, RoomEnded):
            self.scheduler.room_ended(item)
            return None
        if isinstance(item, RoomFailed):
            self.scheduler.room_failed(item)
            return None
        if isinstance(item, CloseSession):  # closed: what restores hold for it goes too
            held = not item.expired and self.restores.end_session(
                item.session_id, "the session was closed"
            )
            return self.cache.sessions.close(item.session_id, expired=item.expired) or held
        if isinstance(item, Digest):
            sched = self.scheduler
            if item.pages_of is not None:
                mine = json.dumps(page_digests(self.cache, item.pages_of))
            else:
                mine = rank_state_digest(self.cache, sched.waiting, sched.running)
            return [mine] if self.channel is None else self.channel.gather(mine)
        return None  # Stop: the drivers end there

    def spare_l1_pages(self) -> int:
        """Free L1 pages that no request queued or running may need: the free pages less,
        for each such request, the pages of its prompt and ``max_tokens`` (an upper bound:
        what it holds already counts again). The same on every rank."""
        sched, ps = self.scheduler, self.cache.context.page_size
        need = sum(
            -(-(len(r.prompt_ids) + r.params.max_tokens) // ps)
            for r in (*sched.waiting, *sched.running)
        )
        return self.cache.full.pages.device.allocator.free_pages - need

    def request_of(self, item: NewRequest) -> Request:
        """The request ``item`` describes: rank 0's own (with its queue place, taken out of
        :attr:`clients`), or, on a follower, one built from the record (it reports
        nothing: outputs are rank 0's alone)."""
        req = self.clients.pop(item.rid, None)
        if req is not None:
            return req
        return Request(
            list(item.prompt_ids),
            item.sampling,
            rid=item.rid,
            cache_salt=item.cache_salt,
            priority=item.priority,
            group=item.group,
            arrival=item.arrival,
            bootstrap=item.bootstrap,
            session=item.session,
        )

    def add(self, req: Request) -> None:
        """Hand ``req`` to the scheduler; a failure fails ``req`` alone."""
        try:
            self.scheduler.add(req)
        except Exception as exc:
            log.exception("could not queue %s", req.rid)
            self.fail(req, f"the request could not be queued: {type(exc).__name__}: {exc}")

    def sync_cache(self) -> None:
        """Bring the cache's asynchronous completions in, once per step on every rank:
        with several ranks, what they all have, agreed in one collective."""
        if self.channel is None:
            self.cache.sync()
            return
        began = time.perf_counter()
        self.cache.sync()
        self.sync_s += time.perf_counter() - began
        self.agreement_steps_total += 1

    @property
    def agreement_seconds_total(self) -> float:
        """Under tensor parallelism, this rank's seconds so far in the step's collectives
        that are not the model's: the step-input broadcast, ``cache.sync()`` and the
        sampled-token broadcast. 0.0 with one rank."""
        return 0.0 if self.channel is None else self.sync_s + self.channel.seconds

    # ------------------------------------------------------------------ ending requests

    def fail(self, req: Request, why: str, *, direct: bool = False) -> None:
        """End ``req`` with ``error`` = ``why`` (:meth:`RequestEnds.fail
        <hicache.engine.step.ends.RequestEnds.fail>`)."""
        self.scheduler.ends.fail(req, why, direct=direct)

    def abort_all(self, why: str, max_s: float = 10.0, max_failures: int = 3) -> None:
        """Abort every request in flight and step until the scheduler has released them;
        those it cannot release (``max_failures`` failed steps, or ``max_s`` seconds) are
        failed directly, their pages left where they are."""
        reqs = self.scheduler.in_flight  # with those ended whose final report is pending
        self.scheduler.role.alone()  # its steps below are this rank's alone
        self.scheduler.drop_parked(why)  # the other instance's side is not waited for
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
            self.fail(req, why, direct=True)
        self.publish_kv_events()

    def fail_in_flight(self, why: str) -> None:
        """The last act of a driver: end every request in flight (:meth:`abort_all`), or,
        when even that raises, tell each client directly."""
        try:
            if not self.scheduler.idle:
                self.abort_all(why)
        except BaseException:  # e.g. a callback raising SystemExit again: finish cleanup
            log.exception("rank %d: failing the requests in flight", self.rank)
            for req in self.scheduler.in_flight:
                self.fail(req, why, direct=True)

    def agreed(
        self,
        what: str,
        act: Callable[[], T],
        *,
        undo: Callable[[], None] | None,
        after: str,
    ) -> T:
        """Run ``act`` on this rank and agree its outcome with the others (one gather of
        each rank's error line, none with one rank): its value when it succeeded on every
        rank. When every rank failed alike (a refusal: the same state everywhere) this
        rank's own error is raised. When some ranks failed, those that succeeded run
        ``undo`` (None: the outcome is the same state anyway) and every rank raises
        RuntimeError naming each rank that failed and its message, then ``after`` (what
        state every rank is in)."""
        error: Exception | None = None
        value: T | None = None
        try:
            value = act()
        except Exception as exc:
            error = exc
        if self.channel is None:
            if error is not None:
                raise error
            return value  # type: ignore[return-value]
        lines = self.channel.gather("" if error is None else error_line(error))
        failed = [(rank, line) for rank, line in enumerate(lines) if line]
        if not failed:
            return value  # type: ignore[return-value]
        if error is not None and len(failed) == len(lines) and len(set(lines)) == 1:
            raise error
        if error is None and undo is not None:
            undo()
        which = "; ".join(f"rank {rank}: {line}" for rank, line in failed)
        raise RuntimeError(f"{what} failed on {which}; {after}")

    # ------------------------------------------------------------------ cache

    def _undo_attach(self) -> None:
        """Detach a backend this rank just attached (no op ran on it: nothing to wait for,
        and no rank joins a collective for it)."""
        with self.cache.context.ranks.local_only("while undoing an L3 attach"):
            self.cache.l3.detach(timeout_s=0.0)

    def attach(self, storage_config: StorageConfig, policy: str) -> None:
        """Attach the L3 backend ``storage_config`` under this rank's namespace."""
        attach_l3(self.cache, self.model, self.config, self.rank, storage_config, policy)

    def close_cache(self) -> None:
        """Close the cache (once: the caller decides who, see
        :class:`~hicache.engine.run_state.RunState`). With several ranks its last flush
        agrees with the others: with one of them gone it fails, and is logged. Its pages
        are gone: subscribers to its KV events hear ``AllBlocksCleared``."""
        if self.kv_events is not None:
            self.publish_kv_events()
            self.cache.observe_residency(None)
            self._kv_recorder = None
            self.kv_events.publish([AllBlocksCleared()])
        if self.channel is None:
            self.cache.close()
            return
        try:
            self.cache.close()
        except Exception as exc:
            log.error(
                "rank %d: closing the cache did not finish its agreed flush (%s: %s); its"
                " workers are stopped",
                self.rank,
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )


def restore_max_bytes(config: EngineConfig, cache: HiCache) -> int:
    """L2 bytes restores may hold: ``config.restore_max_bytes``, or half the L2 pool."""
    if config.restore_max_bytes is not None:
        return config.restore_max_bytes
    return max(1, cache.full.pages.host.num_pages * restore_page_bytes(cache) // 2)


def error_line(exc: BaseException) -> str:
    """``exc`` as one line: its type and the first line of its message."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _head_group(cache: HiCache, model: LoadedModel, config: EngineConfig) -> int:
    """K/V heads per L3 record of an MHA page (1 for MLA, whose latent is one record)."""
    if cache.context.spec.attention is AttentionKind.MLA:
        return 1
    lcm = config.storage_tp_lcm or config.tp_size
    return record_group(model.model.heads.num_kv_heads, lcm)


def attach_l3(
    cache: HiCache,
    model: LoadedModel,
    config: EngineConfig,
    rank: int,
    storage_config: StorageConfig,
    policy: str,
) -> None:
    """Attach the L3 backend ``storage_config`` to ``cache`` under rank ``rank``'s
    namespace (model identity, layout, page size; MHA pages as one record per group of
    K/V heads sized by ``config.storage_tp_lcm``, shared by every TP size dividing it,
    written by the lowest rank holding each group; MLA as the one latent record, written
    by rank 0)."""
    prefetch = dataclasses.replace(
        storage_config.prefetch_config(policy),
        negative_ttl_s=config.negative_ttl_s,
        negative_max_entries=config.storage_negative_entries,
    )
    if config.disagg.decode_offload:  # its answers' L3 writes land after they ended
        prefetch = dataclasses.replace(prefetch, announce_writes=True)
    if not cache.context.config.enable_hierarchical_cache:
        raise ValueError("an L3 storage backend needs --enable-hierarchical-cache")
    namespace = Namespace.for_spec(
        cache.context.spec,
        model=model.name,
        weights_fingerprint=model.fingerprint,
        layout=cache.context.config.mem_layout,
        page_size=cache.context.page_size,
        tp_size=config.tp_size,
        tp_rank=rank,
        head_records=True,
        head_group=_head_group(cache, model, config),
    )
    storage = storage_config.create(namespace)
    if namespace.records == HEAD_RECORDS:
        storage.use_heads(model.model.heads)  # the heads the model computes on this rank
    cache.l3.attach(storage, namespace, prefetch)


__all__ = [
    "Applied",
    "EngineCore",
    "StepFailed",
    "attach_l3",
    "error_line",
    "restore_max_bytes",
]
