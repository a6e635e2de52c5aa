"""Restores: ``POST /hicache/prefetch``, ``GET`` and ``DELETE /hicache/prefetch/{operation_id}``.

A body names the prefix (``input_ids`` or ``text``, exactly one), its ``session_id``, an
optional ``ttl_ms`` and ``cache_salt``; the answer is the operation (``operation_id``,
``state`` ``queued``). Errors: 400 naming the field, 404 for an unknown operation, 429
over the restore bounds, 503 when the engine does not run. The engine's side:
:meth:`Engine.restore <hicache.engine.front.engine.Engine.restore>`; states and fields:
docs/api.md.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from hicache.engine.restore_book import RestoreBusy
from hicache.engine.sampling import InvalidRequest
from hicache.server.http_base import bad_request, error_response, invalid_body
from hicache.server.state import ServerState

__all__ = ["add_restore_routes"]


class RestoreBody(BaseModel):
    """``POST /hicache/prefetch``: the prefix (``input_ids`` or ``text``), its
    ``session_id``, ``ttl_ms`` and ``cache_salt``, checked by :meth:`Engine.restore
    <hicache.engine.front.engine.Engine.restore>` (any other field: 400 naming it)."""

    model_config = ConfigDict(extra="forbid")

    input_ids: list[Any] | None = None
    text: str | None = None
    session_id: Any = None
    ttl_ms: Any = None
    cache_salt: Any = ""


def add_restore_routes(app: FastAPI, state: ServerState) -> None:
    """Register the ``/hicache/prefetch`` routes on ``app``."""
    engine = state.engine

    @app.post("/hicache/prefetch")
    async def start(http: Request) -> Response:
        try:
            body = RestoreBody.model_validate_json(await http.body())
        except ValidationError as exc:
            return invalid_body(exc)
        has_ids, has_text = body.input_ids is not None, body.text is not None
        if has_ids == has_text:
            which = "both" if has_ids else "neither"
            return bad_request(
                f"give exactly one of input_ids and text (got {which})", param="input_ids"
            )
        param = "input_ids" if has_ids else "text"
        raw: str | list[int] = body.input_ids if body.input_ids is not None else body.text or ""
        try:
            (ids,) = await state.prompt_ids([raw], param)
            op = engine.restore(
                ids,
                session_id=body.session_id,
                ttl_ms=body.ttl_ms,
                cache_salt=body.cache_salt,
                param=param,
            )
        except InvalidRequest as exc:
            return bad_request(str(exc), param=exc.param)
        except RestoreBusy as exc:
            response = error_response(429, str(exc))
            response.headers["Retry-After"] = "1"
            return response
        except RuntimeError as exc:
            return error_response(503, f"the engine is not running: {exc}")
        return JSONResponse(op.body())

    @app.get("/hicache/prefetch/{operation_id}")
    async def status(operation_id: str) -> Response:
        op = engine.restore_op(operation_id)
        if op is None:
            return error_response(404, f"no restore operation {operation_id!r}")
        return JSONResponse(op.body())

    @app.delete("/hicache/prefetch/{operation_id}")
    async def cancel(operation_id: str) -> Response:
        try:
            op = await asyncio.to_thread(engine.cancel_restore, operation_id)
        except (RuntimeError, TimeoutError) as exc:
            return error_response(503, f"the restore could not be cancelled: {exc}")
        if op is None:
            return error_response(404, f"no restore operation {operation_id!r}")
        return JSONResponse(op.body())
