"""The OpenAI-compatible HTTP server (FastAPI) over an :class:`Engine`.

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (both with ``stream``),
``/v1/models``, ``/health``, ``/metrics`` (Prometheus) and ``POST /flush_cache``.
Bad requests get a 400 whose OpenAI error object names the problem and, in ``param``, the
field; the server keeps serving. A client that disconnects aborts its request, which frees
everything it held. A request that fails in the engine gets a 500 (a streamed one: an
``error`` event before ``[DONE]``); when the engine is not running, requests get a 503 and
``/health`` answers 503 with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict

from hicache.engine.engine import Engine
from hicache.engine.metrics import EngineMetrics
from hicache.engine.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
    error_body,
    new_id,
)
from hicache.engine.request import RequestOutput
from hicache.engine.sampling import InvalidRequest
from hicache.storage.registry import parse_extra_config

log = logging.getLogger(__name__)
DEFAULT_MAX_TOKENS = 128


def _bad_request(message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, param=param), status_code=400)


def _unavailable(message: str) -> JSONResponse:
    return JSONResponse(error_body(message, kind="service_unavailable"), status_code=503)


class StorageBackendBody(BaseModel):
    """``PUT /hicache/storage-backend``."""

    model_config = ConfigDict(extra="forbid")

    backend: str
    extra_config: dict[str, Any] | str | None = None
    prefetch_policy: Literal["best_effort", "wait_complete", "timeout"] = "timeout"


def create_app(
    engine: Engine, model_name: str | None = None, *, admin_api_key: str | None = None
) -> FastAPI:
    """The app serving ``engine``. The engine must be started (and is not closed here).

    Admin endpoints (L3 attach/detach) need ``Authorization: Bearer <admin_api_key>``;
    without a configured key they are refused.
    """
    app = FastAPI(title="hicache", version="0.1.0")
    name = model_name or engine.model.name
    metrics = EngineMetrics(engine)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        msg = f"{loc or 'body'}: {first.get('msg', 'invalid request')}"
        return _bad_request(msg, param=loc or None)

    async def _outputs(
        rid: str, outputs: asyncio.Queue[RequestOutput], http: Request
    ) -> AsyncIterator[RequestOutput]:
        """``rid``'s outputs up to its final one; ends early (without a finished output)
        when the client goes away or the engine stops running."""
        finished = False
        try:
            while True:
                try:
                    out = await asyncio.wait_for(outputs.get(), timeout=0.5)
                except TimeoutError:
                    if await http.is_disconnected():
                        return
                    if not engine.alive and outputs.empty():
                        return
                    continue
                finished = out.finished
                yield out
                if finished:
                    metrics.observe(out)
                    return
        finally:
            if not finished:
                with contextlib.suppress(RuntimeError):  # not running: nothing to abort
                    engine.abort(rid)

    async def _serve(
        http: Request,
        prompt_ids: list[int],
        body: CompletionRequest | ChatCompletionRequest,
        full: Callable[[str, str, RequestOutput], dict[str, Any]],
        chunk: Callable[[str, str, RequestOutput, bool], dict[str, Any]],
        prefix: str,
        prompt_param: str,
    ) -> Response:
        priority = body.request_priority
        try:
            params = body.sampling(DEFAULT_MAX_TOKENS)
            engine.validate(prompt_ids, params, cache_salt=body.cache_salt, priority=priority)
        except InvalidRequest as exc:
            return _bad_request(
                str(exc), param=prompt_param if exc.param == "prompt" else exc.param
            )
        except ValueError as exc:
            return _bad_request(str(exc))
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def on_output(out: RequestOutput) -> None:  # on the engine thread
            loop.call_soon_threadsafe(queue.put_nowait, out)

        try:
            engine_rid = engine.submit(
                prompt_ids, params, on_output, cache_salt=body.cache_salt, priority=priority
            )
        except RuntimeError as exc:  # not running, or closing
            return _unavailable(f"the engine is not running: {exc}")
        rid = new_id(prefix)
        outputs = _outputs(engine_rid, queue, http)
        if not body.stream:
            last: RequestOutput | None = None
            async for out in outputs:
                last = out
            if last is None or not last.finished:
                if not engine.alive:
                    return _unavailable(engine.health().reason or "the engine stopped")
                return JSONResponse(error_body("client disconnected"), status_code=499)
            if last.error:
                return JSONResponse(error_body(last.error, kind="server_error"), status_code=500)
            return JSONResponse(full(rid, name, last))

        async def sse() -> AsyncIterator[str]:
            first = True
            error: str | None = None
            finished = False
            async for out in outputs:
                if out.delta_text or out.finished:
                    yield f"data: {json.dumps(chunk(rid, name, out, first))}\n\n"
                    first = False
                finished, error = out.finished, out.error
            if not finished and not engine.alive:
                error = engine.health().reason or "the engine stopped"
            if error:
                yield f"data: {json.dumps(error_body(error, kind='server_error'))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request) -> Response:
        if isinstance(body.prompt, str):
            ids = list(engine.tokenizer.encode(body.prompt, add_special_tokens=False))
            if not ids:
                return _bad_request("the prompt encodes to no tokens", param="prompt")
        else:
            ids = list(body.prompt)
        return await _serve(
            http,
            ids,
            body,
            completion_body,
            lambda r, m, o, _f: completion_chunk(r, m, o),
            "cmpl",
            "prompt",
        )

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: Request) -> Response:
        try:
            ids = engine.tokenizer.apply_chat_template(
                [m.model_dump() for m in body.messages], add_generation_prompt=True, tokenize=True
            )
        except Exception as exc:
            return _bad_request(f"messages could not be rendered: {exc}", param="messages")
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return await _serve(
            http,
            list(ids),
            body,
            chat_body,
            lambda r, m, o, f: chat_chunk(r, m, o, first=f),
            "chatcmpl",
            "messages",
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "owned_by": "hicache", "created": 0}],
        }

    @app.get("/health")
    async def health() -> Response:
        """200 ``{"status": "ok"}`` while the engine loop runs and goes round; else 503
        with ``status`` ``unavailable`` and an OpenAI error object saying why."""
        state = engine.health()
        if state.healthy:
            return JSONResponse({"status": "ok"})
        body = error_body(state.reason or "the engine is not healthy", kind="service_unavailable")
        return JSONResponse({"status": "unavailable", **body}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        await asyncio.to_thread(metrics.refresh)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        try:
            ok = await asyncio.to_thread(engine.flush_cache)
        except (RuntimeError, TimeoutError) as exc:  # not running, or stuck
            return _unavailable(f"the cache could not be flushed: {exc or type(exc).__name__}")
        if not ok:
            return JSONResponse(
                error_body("requests are in flight; flush when idle", kind="conflict"),
                status_code=409,
            )
        return JSONResponse({"status": "ok", "message": "L1 and L2 emptied (L3 untouched)"})

    def _admin(http: Request) -> JSONResponse | None:
        given = http.headers.get("authorization", "")
        if admin_api_key is None or not secrets.compare_digest(given, f"Bearer {admin_api_key}"):
            return JSONResponse(
                error_body("admin API key missing or wrong", kind="unauthorized"), status_code=401
            )
        return None

    @app.put("/hicache/storage-backend")
    async def attach_storage(body: StorageBackendBody, http: Request) -> Response:
        if (denied := _admin(http)) is not None:
            return denied
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
            return _bad_request(str(exc))
        except RuntimeError as exc:  # busy, already attached, or unreachable backend
            return JSONResponse(error_body(str(exc), kind="conflict"), status_code=409)
        return JSONResponse({"status": "ok", "backend": body.backend})

    @app.delete("/hicache/storage-backend")
    async def detach_storage(http: Request) -> Response:
        if (denied := _admin(http)) is not None:
            return denied
        try:
            had = await asyncio.to_thread(engine.detach_storage)
        except RuntimeError as exc:
            return JSONResponse(error_body(str(exc), kind="conflict"), status_code=409)
        return JSONResponse({"status": "ok", "detached": had})

    return app
