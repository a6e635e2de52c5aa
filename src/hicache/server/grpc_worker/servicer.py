"""smg's ``SglangScheduler`` service over an :class:`~hicache.engine.front.engine.Engine`:
what ``hicache serve --grpc-mode`` answers on its gRPC port.

The RPCs smg 1.13 calls on an SGLang worker: ``HealthCheck`` (registration and its health
checks: the engine's health, as ``GET /health``), ``GetModelInfo``, ``GetServerInfo``,
``GetLoads`` (polled), ``SubscribeKvEvents`` (at registration: the engine's KV event
hub, :mod:`hicache.kv_events`, as smg's ``KvEventBatch`` stream), ``GetTokenizer`` (when
the tokenizer path it is told does not load where smg runs), ``Generate`` (streamed;
token ids in, token ids out: smg tokenizes and detokenizes), ``Abort`` (a dropped stream)
and ``FlushCache`` (its ``POST /flush_cache``). One :class:`~hicache.server.state.ServerState`
with the HTTP app: the same keys (:mod:`.keys`), validation (:mod:`.generate_request`),
fan-out, queue bound and metrics. Invariants: a request that cannot be served ends its
call with ``INVALID_ARGUMENT`` naming the field, never an exception out of the handler; a
call that goes away (cancelled, deadline) aborts its engine requests at once, as a dropped
HTTP client does; a full waiting queue is ``RESOURCE_EXHAUSTED`` (``UNAVAILABLE`` when the
engine is not healthy).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Collection
from typing import NoReturn

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from hicache.disagg.links import LinksFull
from hicache.engine.admission import AdmissionRefused, EngineUnhealthy
from hicache.engine.front.engine import EngineStats
from hicache.engine.sampling import InvalidRequest
from hicache.failures import FailureKind, failure_kind
from hicache.kv_events import ReplayUnavailable, SubscriberLagged, SubscriptionClosed
from hicache.kv_events.proto import to_protos
from hicache.server.fanout import Ending, Fanout
from hicache.server.grpc_worker.generate_reply import SequenceReply
from hicache.server.grpc_worker.generate_request import GrpcInvalid, grpc_param, plan_generate
from hicache.server.grpc_worker.info import loads_reply, model_info_reply, server_info_reply
from hicache.server.grpc_worker.keys import GrpcKeys
from hicache.server.grpc_worker.tokenizer_bundle import TokenizerBundle, tokenizer_bundle
from hicache.server.responses import new_id
from hicache.server.state import ServerState

__all__ = ["FLUSH_POLL_S", "KV_EVENTS_POLL_S", "SchedulerServicer"]

log = logging.getLogger(__name__)

FLUSH_POLL_S = 0.05
"""How often ``FlushCache`` with a ``timeout_s`` tries again while requests run."""
KV_EVENTS_POLL_S = 0.01
"""How often a ``SubscribeKvEvents`` stream looks for new batches (seconds)."""
_STATS_WAIT_S = 5.0

_FAILURE_CODES = {
    FailureKind.INTERNAL: grpc.StatusCode.INTERNAL,
    FailureKind.REFUSED: grpc.StatusCode.FAILED_PRECONDITION,
    FailureKind.PEER_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    FailureKind.PEER_FAILED: grpc.StatusCode.UNAVAILABLE,
    FailureKind.STOPPING: grpc.StatusCode.UNAVAILABLE,
}
"""The status of a call whose request failed, by the failure's kind (as HTTP's
:data:`~hicache.server.http_base.FAILURE_STATUS`: 500, 400, 504, 502, 503)."""


class _Call:
    """A gRPC call as the fan-out's client: gone once cancelled (or its deadline passed)."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.context = context

    async def is_disconnected(self) -> bool:
        return bool(self.context.cancelled())


class SchedulerServicer(pb_grpc.SglangSchedulerServicer):
    """The service (see the module docstring) over ``state``'s engine. ``keys``: the
    worker's keys; ``eos_ids``: the model's end-of-sequence ids (what ``GetModelInfo``
    reports and a ``stop`` finish is matched against)."""

    def __init__(self, state: ServerState, keys: GrpcKeys, eos_ids: Collection[int]) -> None:
        self.state = state
        self.engine = state.engine
        self.keys = keys
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.started_at = time.time()
        self._running: dict[str, Fanout] = {}
        """Generate calls in flight by request id (what ``Abort`` names)."""
        self._aborted: set[str] = set()
        self._bundle: TokenizerBundle | None = None
        self._bundle_error: str | None = None
        try:
            self._bundle = tokenizer_bundle(self.engine.model.path, self.engine.model.tokenizer)
        except OSError as exc:
            self._bundle_error = str(exc)
            log.warning("GetTokenizer will fail: %s", exc)

    # ------------------------------------------------------------------ helpers

    async def _guard(self, rpc: str, context: grpc.aio.ServicerContext) -> None:
        """End the call unless its key lets it call ``rpc``."""
        denied = self.keys.check(rpc, context.invocation_metadata())
        if denied is not None:
            await context.abort(denied.code, denied.message)

    async def _stats(self, context: grpc.aio.ServicerContext) -> EngineStats:
        """The engine's last published stats, else a fresh read; UNAVAILABLE when none."""
        published = self.engine.published_stats
        if published is not None:
            return published
        try:
            return await asyncio.to_thread(self.engine.stats, _STATS_WAIT_S)
        except (RuntimeError, TimeoutError) as exc:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"the engine's stats are not available: {exc}"
            )
            raise AssertionError("unreachable") from None  # abort raises

    def _decode(self, ids: list[int]) -> str:
        """``ids`` as the engine's text (special tokens skipped)."""
        return str(self.engine.model.tokenizer.decode(ids, skip_special_tokens=True))

    # ------------------------------------------------------------------ generation

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        await self._guard("Generate", context)
        rid = request.request_id or new_id("grpc")
        if rid in self._running:
            await _invalid(context, f"request_id {rid!r} is in flight already", "request_id")
        state = self.state
        try:
            plan = plan_generate(state, request)
        except GrpcInvalid as exc:
            await _invalid(context, str(exc), exc.param)
        try:
            fan = state.fanout(_Call(context), plan.plan.jobs, plan.plan.fields)
        except AdmissionRefused as exc:
            code = (
                grpc.StatusCode.UNAVAILABLE
                if isinstance(exc, EngineUnhealthy)
                else grpc.StatusCode.RESOURCE_EXHAUSTED
            )
            await context.abort(code, str(exc))
        except InvalidRequest as exc:
            await _invalid(context, str(exc), grpc_param(exc.param))
        replies = {
            job.index: SequenceReply(
                rid,
                job.index,
                params=job.request.params,
                prompt=plan.prompt,
                stream=plan.stream,
                stream_interval=plan.stream_interval,
                logprobs=plan.plan.logprobs is not None,
                # a prefill instance's half of a pair: its decode instance answers them
                prompt_logprobs=plan.plan.prompt_lp is not None
                and not state.answered_elsewhere(job),
                logprob_start=plan.logprob_start,
                eos_ids=self.eos_ids,
                decode=self._decode,
            )
            for job in plan.plan.jobs
        }
        self._running[rid] = fan
        error: str | None = None
        try:
            async with contextlib.aclosing(fan.events()) as events:
                async for ev in events:
                    out = ev.output
                    if out.finished:
                        state.finished(out, rid, fan.session)
                        if out.error:
                            error = out.error
                            break
                    for msg in replies[ev.index].messages(out):
                        yield msg
        except LinksFull as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:
            self._running.pop(rid, None)
        if error is not None:
            await context.abort(_FAILURE_CODES[failure_kind(error)], error)
        if rid in self._aborted:
            self._aborted.discard(rid)
            await context.abort(grpc.StatusCode.CANCELLED, f"request {rid} was aborted (Abort)")
        if fan.ending is Ending.SUBMIT_FAILED:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"the engine is not running: {fan.error}"
            )
        if fan.ending is Ending.ENGINE_STOPPED:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, self.engine.health().reason or "the engine stopped"
            )

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        await self._guard("Abort", context)
        fan = self._running.get(request.request_id)
        if fan is None:
            return pb.AbortResponse(
                success=False, message=f"request {request.request_id!r} is not in flight"
            )
        self._aborted.add(request.request_id)
        fan.abort_all("abort")
        log.debug("abort %s: %s", request.request_id, request.reason or "no reason given")
        return pb.AbortResponse(success=True, message=f"request {request.request_id} aborted")

    # ------------------------------------------------------------------ the worker

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthCheckResponse:
        await self._guard("HealthCheck", context)
        now = self.engine.health()
        if now.healthy:
            return pb.HealthCheckResponse(healthy=True, message="ok")
        return pb.HealthCheckResponse(
            healthy=False, message=now.reason or "the engine is not healthy"
        )

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        await self._guard("GetModelInfo", context)
        return model_info_reply(self.state, self.eos_ids)

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        await self._guard("GetServerInfo", context)
        stats = await self._stats(context)
        return server_info_reply(self.state, stats, self.started_at)

    async def GetLoads(
        self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetLoadsResponse:
        await self._guard("GetLoads", context)
        if request.HasField("dp_rank") and request.dp_rank != 0:
            await _invalid(
                context,
                f"dp_rank={request.dp_rank} is invalid: this worker has one data-parallel rank, 0",
                "dp_rank",
            )
        stats = await self._stats(context)
        return loads_reply(self.state, stats, request.include)

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.FlushCacheResponse:
        """Empty L1 and L2 once no request is in flight: at once (``timeout_s`` 0), or
        within ``timeout_s`` seconds; ``success`` false when requests ran all along."""
        await self._guard("FlushCache", context)
        if not request.timeout_s >= 0:  # NaN as well
            await _invalid(context, f"timeout_s={request.timeout_s} is invalid: >= 0", "timeout_s")
        deadline = time.monotonic() + request.timeout_s
        while True:
            try:
                flushed = await asyncio.to_thread(self.engine.flush_cache)
            except RuntimeError as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"not flushed: {exc}")
            except TimeoutError as exc:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"not flushed: {exc}")
            if flushed:
                return common_pb2.FlushCacheResponse(success=True, message="L1 and L2 emptied")
            if time.monotonic() >= deadline:
                return common_pb2.FlushCacheResponse(
                    success=False,
                    message="not flushed: requests are in flight (give timeout_s to wait for them)",
                )
            await asyncio.sleep(FLUSH_POLL_S)

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        await self._guard("GetTokenizer", context)
        bundle = self._bundle
        if bundle is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the tokenizer cannot be bundled: {self._bundle_error}",
            )
            return
        for data, sha256 in bundle.chunks():
            yield common_pb2.GetTokenizerChunk(data=data, sha256=sha256)

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        """The engine's KV event batches (:attr:`Engine.kv_events`), from a resync
        (``start_sequence_number`` 0: ``AllBlocksCleared`` then every resident page) or
        from the kept history after a cursor (``OUT_OF_RANGE`` when it does not reach
        back); a subscriber that falls behind its bounded buffer is cut off with
        ``DATA_LOSS`` (smg resubscribes from 0). Polled every :data:`KV_EVENTS_POLL_S`:
        the engine never waits on a stream."""
        await self._guard("SubscribeKvEvents", context)
        hub = self.engine.kv_events
        if hub is None:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                "SubscribeKvEvents: KV events are off on this worker (--kv-events-config"
                " '{\"enable_kv_cache_events\": false}')",
            )
            return
        try:
            sub = hub.subscribe(request.start_sequence_number)
        except ReplayUnavailable as exc:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, f"start_sequence_number: {exc}")
        except SubscriptionClosed as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        try:
            await context.send_initial_metadata(())  # the subscriber's call resolves now
            while True:
                try:
                    batch = sub.get(timeout=0)
                except SubscriberLagged as exc:
                    await context.abort(grpc.StatusCode.DATA_LOSS, str(exc))
                except SubscriptionClosed as exc:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
                if batch is None:
                    await asyncio.sleep(KV_EVENTS_POLL_S)
                    continue
                for message in to_protos(batch):
                    yield message
        finally:
            sub.close()


async def _invalid(context: grpc.aio.ServicerContext, message: str, param: str) -> NoReturn:
    """End the call with INVALID_ARGUMENT, the message naming ``param`` first
    (``"<param>: "``)."""
    lead = f"{param}: "
    text = message if message.startswith(lead) else lead + message
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, text)
    raise AssertionError("unreachable")  # abort raises
