"""Operations endpoints: ``GET /health``, ``GET /metrics`` (Prometheus), and the admin
``POST /flush_cache`` and ``PUT`` / ``DELETE /hicache/storage-backend``.

The keys are checked by :class:`~hicache.server.access.AccessGuard` from its table
(:data:`~hicache.server.access.ROUTE_ACCESS`), before a route runs or its body is read:
nothing about a body is told to a stranger. The admin routes need ``--admin-api-key``
and are refused when none is configured; ``/metrics`` is open unless
``--metrics-require-api-key``.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError

from hicache.server.http_base import bad_request, error_response, invalid_body
from hicache.server.responses import error_body
from hicache.server.state import ServerState
from hicache.storage.registry import parse_extra_config


class StorageBackendBody(BaseModel):
    """``PUT /hicache/storage-backend``."""

    model_config = ConfigDict(extra="forbid")

    backend: str
    extra_config: dict[str, Any] | str | None = None
    prefetch_policy: Literal["best_effort", "wait_complete", "timeout"] = "timeout"


def add_admin_routes(app: FastAPI, state: ServerState) -> None:
    """Register ``/health``, ``/metrics``, ``/flush_cache`` and ``/hicache/storage-backend``."""
    engine = state.engine

    @app.get("/health")
    async def health() -> Response:
        """200 ``{"status": "ok"}`` while the engine loop runs, goes round and its steps
        succeed; else 503 with ``status`` ``unavailable`` and an OpenAI error object saying
        why (see :meth:`~hicache.engine.front.engine.Engine.health`)."""
        now = engine.health()
        if now.healthy:
            return JSONResponse({"status": "ok"})
        body = error_body(now.reason or "the engine is not healthy", kind="service_unavailable")
        return JSONResponse({"status": "unavailable", **body}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        """The engine's last published stats (never a call on the engine thread) and the
        server's request metrics; ``hicache_stats_age_seconds`` says how old the former are."""
        state.metrics.refresh()
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        try:
            ok = await asyncio.to_thread(engine.flush_cache)
        except (RuntimeError, TimeoutError) as exc:  # not running, or stuck
            return error_response(
                503, f"the cache could not be flushed: {exc or type(exc).__name__}"
            )
        if not ok:
            return error_response(409, "requests are in flight; flush when idle")
        return JSONResponse({"status": "ok", "message": "L1 and L2 emptied (L3 untouched)"})

    @app.put("/hicache/storage-backend")
    async def attach_storage(http: Request) -> Response:
        try:
            body = StorageBackendBody.model_validate_json(await http.body())
        except ValidationError as exc:
            return invalid_body(exc)
        try:
            extra = (
                parse_extra_config(body.extra_config)
                if not isinstance(body.extra_config, dict)
                else body.extra_config
            )
            await asyncio.to_thread(
                engine.attach_storage, body.backend, extra, body.prefetch_policy
            )
        except ValueError as exc:
            return bad_request(str(exc))
        except RuntimeError as exc:  # busy, already attached, or unreachable backend
            return error_response(409, str(exc))
        return JSONResponse({"status": "ok", "backend": body.backend})

    @app.delete("/hicache/storage-backend")
    async def detach_storage() -> Response:
        try:
            had = await asyncio.to_thread(engine.detach_storage)
        except RuntimeError as exc:
            return error_response(409, str(exc))
        return JSONResponse({"status": "ok", "detached": had})
