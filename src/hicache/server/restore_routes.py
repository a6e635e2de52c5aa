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
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from hicache.engine.restore_book import RestoreBusy
from hicache.engine.sampling import InvalidRequest
from hicache.server.http_base import bad_request, error_response, unparsable_body
from hicache.server.state import ServerState

__all__ = ["add_restore_routes"]

FIELDS = frozenset({"input_ids", "text", "session_id", "ttl_ms", "cache_salt"})


def add_restore_routes(app: FastAPI, state: ServerState) -> None:
    """Register the ``/hicache/prefetch`` routes on ``app``."""
    engine = state.engine

    @app.post("/hicache/prefetch")
    async def start(http: Request) -> Response:
        try:
            body = json.loads(await http.body())
        except (ValueError, RecursionError) as exc:
            return bad_request(unparsable_body(exc))
        if not isinstance(body, dict):
            return bad_request("the body must be a JSON object")
        unknown = sorted(set(body) - FIELDS)
        if unknown:
            return bad_request(f"{unknown[0]}: unknown field", param=unknown[0])
        has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
        if has_ids == has_text:
            which = "both" if has_ids else "neither"
            return bad_request(
                f"give exactly one of input_ids and text (got {which})", param="input_ids"
            )
        param = "input_ids" if has_ids else "text"
        raw = body[param]
        try:
            if has_ids and not isinstance(raw, list):
                raise InvalidRequest("input_ids must be a list of token ids", param=param)
            if has_text and not isinstance(raw, str):
                raise InvalidRequest("text must be a string", param=param)
            (ids,) = await state.prompt_ids([raw], param)
            op = engine.restore(
                ids,
                session_id=body.get("session_id"),
                ttl_ms=body.get("ttl_ms"),
                cache_salt=body.get("cache_salt", ""),
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
