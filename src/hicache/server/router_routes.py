"""What SGLang's router (``smg``) reads from a worker, beyond inference: who the worker is
(``/server_info``, ``/model_info``, and ``/get_server_info``, ``/get_model_info``), how loaded
it is (``/v1/loads``, ``/get_load``), and whether it can still generate
(``/health_generate``).

smg registers a worker by probing ``/v1/models``, then ``/version`` (vLLM) and
``/server_info`` (SGLang): answering ``/server_info`` (and not ``/version``) makes this an
SGLang worker, whose loads smg then polls (``/v1/loads?include=core,disagg,queues,memory``).
Invariants: fields follow SGLang's names, and a field hicache has no honest value for is
left out (smg reads it as 0), never made up; loads come from the engine's last published
stats (:attr:`Engine.published_stats`, never a wait on the engine thread), ``timestamp``
being when the engine read them; ``/health_generate`` runs one greedy one-token request,
first in the admission order, bounded by :data:`HEALTH_GENERATE_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import importlib.metadata
import time
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from hicache.disagg.config import NO_TRANSFER_HOST, Bootstrap
from hicache.engine.admission import AdmissionRefused
from hicache.engine.front.engine import PRIORITY_MAX, Engine, EngineStats
from hicache.engine.request import RequestOutput
from hicache.engine.sampling import SamplingParams
from hicache.server.http_base import error_response
from hicache.server.state import ServerState

__all__ = [
    "HEALTH_GENERATE_TIMEOUT_S",
    "LOAD_SECTIONS",
    "add_router_routes",
    "get_load_body",
    "loads_body",
    "model_info_body",
    "one_token",
    "parse_include",
    "server_info_body",
]

HEALTH_GENERATE_TIMEOUT_S = 20.0
"""Seconds ``/health_generate`` waits for its one token before answering 503 (the
request is then aborted)."""

LOAD_SECTIONS = ("core", "memory", "queues", "disagg")
"""The sections of a ``/v1/loads`` entry ``include=`` may ask for (``all``: every one).
``core`` is always there; names this server does not know are ignored, so that a router
asking for more (``lora``, ``speculative``) still gets what there is."""

_STATS_WAIT_S = 5.0


def _version() -> str:
    try:
        return importlib.metadata.version("hicache")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _model_path(engine: Engine) -> str:
    """``--model-path`` as given, else the local directory the model was read from."""
    return engine.config.model_path or str(engine.model.path)


def server_info_body(state: ServerState, stats: EngineStats) -> dict[str, Any]:
    """``/server_info``: the serving arguments smg reads (``model_path``,
    ``tokenizer_path``, ``served_model_name``, ``tp_size``, ``dp_size``,
    ``max_running_requests``, ``disaggregation_mode``, ``max_total_num_tokens``, ...),
    under SGLang's names. ``max_total_num_tokens``: the L1 capacity in tokens;
    ``context_length`` in tokens."""
    engine = state.engine
    cfg = engine.config
    body: dict[str, Any] = {
        "model_path": _model_path(engine),
        "tokenizer_path": str(engine.model.path),
        "served_model_name": state.name,
        "tp_size": cfg.tp_size,
        "dp_size": 1,
        "max_running_requests": cfg.scheduler.max_running_requests,
        "max_total_num_tokens": stats.cache.device_total_tokens,
        "context_length": engine.context_length,
        "page_size": stats.cache.page_size,
        "dtype": engine.model.dtype,
        "device": cfg.device,
        "schedule_policy": cfg.scheduler.schedule_policy,
        "disable_radix_cache": cfg.scheduler.disable_radix_cache,
        "enable_hierarchical_cache": stats.cache.host_total_tokens > 0,
        "hicache_storage_backend": cfg.storage_backend,
        "disaggregation_mode": cfg.disagg.mode.value,
        "version": _version(),
    }
    if cfg.disagg.enabled:
        body["disaggregation_transfer_backend"] = cfg.disagg.transfer_backend.value
        body["disaggregation_bootstrap_port"] = cfg.disagg.bootstrap_port
    return body


def model_info_body(state: ServerState) -> dict[str, Any]:
    """``/model_info``: the model smg labels the worker with. ``model_type`` and
    ``architectures`` from the model's Hugging Face config (None / ``[]`` when it has
    none); text generation only."""
    engine = state.engine
    hf = engine.model.hf_config
    return {
        "model_path": _model_path(engine),
        "tokenizer_path": str(engine.model.path),
        "served_model_name": state.name,
        "is_generation": True,
        "model_type": getattr(hf, "model_type", None),
        "architectures": list(getattr(hf, "architectures", None) or []),
        "preferred_sampling_params": None,
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }


def parse_include(include: str | None) -> frozenset[str]:
    """The sections of a ``/v1/loads`` answer for ``include=`` (a comma list):
    ``core`` always, ``all`` every one of :data:`LOAD_SECTIONS`, unknown names ignored."""
    asked = {p.strip() for p in (include or "").split(",") if p.strip()}
    if "all" in asked:
        return frozenset(LOAD_SECTIONS)
    return frozenset({"core", *(s for s in asked if s in LOAD_SECTIONS)})


def _wall_time(stats: EngineStats) -> str:
    """When ``stats`` were read, as an ISO 8601 UTC time."""
    at = time.time() - max(0.0, time.monotonic() - stats.at)
    return datetime.datetime.fromtimestamp(at, tz=datetime.timezone.utc).isoformat()


def loads_body(
    state: ServerState, stats: EngineStats, sections: Iterable[str] = ("core",)
) -> dict[str, Any]:
    """``/v1/loads``: one entry (``dp_rank`` 0: this server has one data-parallel rank)
    with SGLang's fields, and the aggregate over entries.

    ``num_used_tokens`` / ``max_total_num_tokens``: L1 token slots held (not free and
    not evictable cache: :attr:`~hicache.metrics.CacheStats.device_held_tokens`, SGLang's
    figure) / in all (``token_usage`` their ratio, 0..1); ``num_running_reqs``: requests in the running
    batch; ``num_waiting_reqs``: requests waiting for admission; ``cache_hit_rate``:
    prompt tokens served from L1, L2 or L3 over all looked up since start (0..1);
    ``utilization``: running requests over ``max_running_requests`` (0..1). Sections
    (:func:`parse_include`): ``memory`` (``kv_cache_gb``: L1 bytes / 1e9,
    ``token_capacity``, and L2's ``host_*`` figures), ``queues`` (``waiting``,
    ``queued``: sequences counted against ``--max-queued-requests``), ``disagg``
    (``mode``)."""
    engine = state.engine
    c = stats.cache
    used = c.device_held_tokens
    max_running = engine.config.scheduler.max_running_requests
    entry: dict[str, Any] = {
        "dp_rank": 0,
        "num_running_reqs": stats.running,
        "num_waiting_reqs": stats.waiting,
        "num_total_reqs": stats.running + stats.waiting,
        "num_used_tokens": used,
        "max_total_num_tokens": c.device_total_tokens,
        "token_usage": used / c.device_total_tokens if c.device_total_tokens else 0.0,
        "cache_hit_rate": c.hit_rate,
        "utilization": stats.running / max_running,
        "max_running_requests": max_running,
    }
    wanted = set(sections)
    if "memory" in wanted:
        full = next((u for u in c.components if u.name == "full"), None)
        token_bytes = 0 if full is None else full.unit_bytes // c.page_size
        entry["memory"] = {
            "kv_cache_gb": c.device_total_tokens * token_bytes / 1e9,
            "token_capacity": c.device_total_tokens,
            "host_kv_cache_gb": c.host_total_tokens * token_bytes / 1e9,
            "host_token_capacity": c.host_total_tokens,
            "host_used_tokens": c.host_total_tokens - c.host_free_tokens,
        }
    if "queues" in wanted:
        entry["queues"] = {"waiting": stats.waiting, "queued": stats.queued}
    if "disagg" in wanted:
        entry["disaggregation"] = {"mode": engine.config.disagg.mode.value}
    return {
        "timestamp": _wall_time(stats),
        "version": _version(),
        "dp_rank_count": 1,
        "loads": [entry],
        "aggregate": {
            "total_running_reqs": entry["num_running_reqs"],
            "total_waiting_reqs": entry["num_waiting_reqs"],
            "total_reqs": entry["num_total_reqs"],
            "avg_token_usage": entry["token_usage"],
            "avg_utilization": entry["utilization"],
        },
    }


def get_load_body(stats: EngineStats) -> list[dict[str, Any]]:
    """``/get_load`` (SGLang's older load route): one entry per data-parallel rank (one
    here): ``num_reqs`` running and waiting, ``num_waiting_reqs``, ``num_tokens`` (L1
    token slots in use)."""
    c = stats.cache
    return [
        {
            "dp_rank": 0,
            "num_reqs": stats.running + stats.waiting,
            "num_waiting_reqs": stats.waiting,
            "num_tokens": c.device_total_tokens - c.device_free_tokens,
        }
    ]


async def _stats(engine: Engine) -> EngineStats | JSONResponse:
    """The engine's last published stats, or (none published yet) a fresh read; a 503
    when neither is there."""
    published = engine.published_stats
    if published is not None:
        return published
    try:
        return await asyncio.to_thread(engine.stats, _STATS_WAIT_S)
    except (RuntimeError, TimeoutError) as exc:
        return error_response(503, f"the engine's stats are not available: {exc}")


async def one_token(engine: Engine, timeout_s: float) -> str | None:
    """Run one greedy one-token request through ``engine`` (admitted first); None when
    it produced its token within ``timeout_s`` seconds, else why not."""
    health = engine.health()
    if not health.healthy:
        return health.reason or "the engine is not healthy"
    loop = asyncio.get_running_loop()
    done: asyncio.Future[RequestOutput] = loop.create_future()

    def finish(out: RequestOutput) -> None:  # the event loop
        if not done.done():
            done.set_result(out)

    def on_output(out: RequestOutput) -> None:  # the engine thread
        if out.finished:
            loop.call_soon_threadsafe(finish, out)

    token = engine.model.tokenizer.bos_token_id
    prompt = [token if isinstance(token, int) else 0]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    # a prefill or decode instance serves it alone (the router's own no-transfer host)
    alone = Bootstrap(NO_TRANSFER_HOST, 1, 0) if engine.config.disagg.enabled else None
    try:
        rid = engine.submit(
            prompt,
            params,
            on_output,
            priority=PRIORITY_MAX,
            group="health_generate",
            bootstrap=alone,
        )
    except AdmissionRefused as exc:
        return f"the waiting queue refused the request: {exc}"
    except RuntimeError as exc:
        return f"the engine is not running: {exc}"
    try:
        out = await asyncio.wait_for(done, timeout_s)
    except TimeoutError:
        with contextlib.suppress(RuntimeError):
            engine.abort(rid)
        return f"no token within {timeout_s:g} s"
    if out.error:
        return f"the request failed: {out.error}"
    if out.completion_tokens < 1:
        return "the request finished without a token"
    return None


def add_router_routes(
    app: FastAPI,
    state: ServerState,
    *,
    health_generate_timeout_s: float = HEALTH_GENERATE_TIMEOUT_S,
) -> None:
    """Register ``/server_info``, ``/model_info`` (and their ``/get_*`` names),
    ``/v1/loads``, ``/get_load`` and ``/health_generate``."""
    engine = state.engine

    async def server_info() -> Response:
        stats = await _stats(engine)
        if isinstance(stats, JSONResponse):
            return stats
        return JSONResponse(server_info_body(state, stats))

    async def model_info() -> Response:
        return JSONResponse(model_info_body(state))

    for path in ("/server_info", "/get_server_info"):
        app.get(path)(server_info)
    for path in ("/model_info", "/get_model_info"):
        app.get(path)(model_info)

    @app.get("/v1/loads")
    async def loads(http: Request) -> Response:
        """Loads under SGLang's names; ``include``: a comma list of sections."""
        stats = await _stats(engine)
        if isinstance(stats, JSONResponse):
            return stats
        sections = parse_include(http.query_params.get("include"))
        return JSONResponse(loads_body(state, stats, sections))

    @app.get("/get_load")
    async def get_load() -> Response:
        stats = await _stats(engine)
        if isinstance(stats, JSONResponse):
            return stats
        return JSONResponse(get_load_body(stats))

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """200 once one greedy token came out of the engine; 503 with why not."""
        why = await one_token(engine, health_generate_timeout_s)
        if why is None:
            return JSONResponse({"status": "ok"})
        return error_response(503, f"health generation failed: {why}")
