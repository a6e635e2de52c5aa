"""The HTTP server (FastAPI) over an :class:`Engine`: OpenAI's API and SGLang's native one.

Endpoints (all listed, with every parameter, in ``docs/api.md``): ``/v1/completions``,
``/v1/chat/completions`` (both with ``stream``, ``n`` and logprobs; completions also with
batched prompts and ``echo``), ``/v1/models``, ``/v1/models/{id}``, SGLang's
``/generate``, ``/health``, ``/metrics`` (Prometheus), ``POST /flush_cache`` and the admin
``/hicache/storage-backend``.

Errors: every status (400, 401, 404, 405, 413, 500, 503 ...) answers OpenAI's error
object; a 400 names the field in ``param``. A parameter the server cannot honour is
refused, never ignored. With ``api_key`` set, the inference endpoints need
``Authorization: Bearer <api_key>``; the admin endpoints need the separate admin key,
checked before the body is read. Bodies beyond ``max_request_bytes`` get a 413. Prompts
are tokenized off the event loop. A client that goes away (streaming or not) aborts its
engine requests at once, which frees everything they held.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hicache.engine.engine import Engine
from hicache.engine.request import RequestOutput
from hicache.engine.sampling import InvalidRequest
from hicache.server.fanout import Ending, Event, Fanout, Job
from hicache.server.http_base import (
    DEFAULT_MAX_REQUEST_BYTES,
    BodyLimit,
    bad_request,
    error_response,
    native_param,
    param_of,
)
from hicache.server.metrics import EngineMetrics
from hicache.server.native import DEFAULT_MAX_NEW_TOKENS, GenerateRequest, generate_body
from hicache.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    check_text,
)
from hicache.server.responses import (
    Choice,
    Detokenizer,
    chat_body,
    chat_chunk,
    chat_logprobs,
    completion_body,
    completion_chunk,
    completion_logprobs,
    error_body,
    new_id,
    output_logprobs,
    prompt_logprobs,
    usage,
    usage_chunk,
)
from hicache.storage.registry import parse_extra_config

log = logging.getLogger(__name__)
T = TypeVar("T")


class StorageBackendBody(BaseModel):
    """``PUT /hicache/storage-backend``."""

    model_config = ConfigDict(extra="forbid")

    backend: str
    extra_config: dict[str, Any] | str | None = None
    prefetch_policy: Literal["best_effort", "wait_complete", "timeout"] = "timeout"


def create_app(
    engine: Engine,
    model_name: str | None = None,
    *,
    admin_api_key: str | None = None,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """The app serving ``engine``. The engine must be started (and is not closed here).

    ``api_key``: when set, the inference endpoints (``/v1/*``, ``/generate``,
    ``/flush_cache``) need ``Authorization: Bearer <api_key>``. Admin endpoints (L3
    attach/detach) need ``Authorization: Bearer <admin_api_key>``; without a configured
    admin key they are refused. ``max_request_bytes``: larger bodies get a 413.
    """
    app = FastAPI(title="hicache", version="0.1.0")
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    name = model_name or engine.model.name
    metrics = EngineMetrics(engine)
    tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-tokenize")
    detok = Detokenizer(engine.tokenizer)

    async def off_loop(fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(tokenize_pool, fn)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return bad_request(f"the body is not valid JSON: {first.get('msg', '')}")
        param = param_of(first.get("loc", ()))
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        return bad_request(f"{param or 'body'}: {msg}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _httperror_response(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = error_response(exc.status_code, str(exc.detail))
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        return response

    def _authorized(http: Request) -> JSONResponse | None:
        if api_key is None:
            return None
        given = http.headers.get("authorization", "")
        if secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            return None
        return error_response(401, "API key missing or wrong (Authorization: Bearer <key>)")

    # ------------------------------------------------------------------ prompts

    def _encode(text: str, param: str) -> list[int]:
        check_text(text, param)
        ids = list(engine.tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            raise InvalidRequest("the prompt encodes to no tokens", param=param)
        return ids

    async def _prompt_ids(prompts: Sequence[str | list[int]], param: str) -> list[list[int]]:
        texts = [(i, p) for i, p in enumerate(prompts) if isinstance(p, str)]
        out: list[list[int]] = [list(p) if not isinstance(p, str) else [] for p in prompts]
        if texts:
            encoded = await off_loop(lambda: [_encode(p, param) for _, p in texts])
            for (i, _), ids in zip(texts, encoded, strict=True):
                out[i] = ids
        for ids in out:
            if not ids:
                raise InvalidRequest("the prompt is empty", param=param)
        return out

    def _jobs(
        prompts: Sequence[list[int]],
        body: SamplingFields,
        max_tokens: int | None,
        default_max_tokens: int | None,
        prompt_param: str,
    ) -> list[Job]:
        """``n`` jobs per prompt (prompt-major); copies wait for the first's first token."""
        ctx = engine.context_length
        jobs = []
        for p, ids in enumerate(prompts):
            room = max(1, ctx - len(ids))
            if max_tokens is not None:
                limit = max_tokens
            elif default_max_tokens is not None:
                limit = min(default_max_tokens, room)
            else:
                limit = room  # SGLang's default: what remains of the context
            for c in range(body.n):
                params = body.sampling(limit, c)
                try:
                    engine.validate(
                        ids, params, cache_salt=body.cache_salt, priority=body.request_priority
                    )
                except InvalidRequest as exc:
                    param = prompt_param if exc.param == "prompt" else exc.param
                    raise InvalidRequest(str(exc), param=param) from None
                if max_tokens is not None and len(ids) + max_tokens > ctx:
                    raise InvalidRequest(
                        f"max_tokens={max_tokens} is too large: the prompt has {len(ids)}"
                        f" tokens and the context length is {ctx}, so at most"
                        f" {ctx - len(ids)} tokens can be generated",
                        param="max_tokens",
                    )
                index = p * body.n + c
                jobs.append(Job(index, ids, params, after=None if c == 0 else p * body.n))
        return jobs

    def _count_abort(reason: str) -> None:
        metrics.aborted.labels(reason=reason).inc()

    def _fanout(http: Request, jobs: Sequence[Job], body: Any) -> Fanout:
        return Fanout(
            engine,
            jobs,
            http,
            cache_salt=body.cache_salt,
            priority=body.request_priority,
            on_abort=_count_abort,
        )

    def _finished(out: RequestOutput, rid: str) -> None:
        metrics.observe(out)
        log.debug(
            "%s %s: %d prompt tokens (%d cached: %d device, %d host, %d storage), %d generated,"
            " finish %s, TTFT %s",
            rid,
            out.rid,
            out.prompt_tokens,
            out.cached.total,
            out.cached.device,
            out.cached.host,
            out.cached.storage,
            out.completion_tokens,
            out.finish_reason.value if out.finish_reason else None,
            f"{out.ttft_s:.3f} s" if out.ttft_s is not None else "-",
        )

    async def _collect(fan: Fanout, rid: str) -> dict[int, RequestOutput] | JSONResponse:
        """The final output of every job, or the error response."""
        last: dict[int, RequestOutput] = {}
        async for ev in fan.events():
            last[ev.index] = ev.output
            if ev.output.finished:
                _finished(ev.output, rid)
        if fan.ending is Ending.SUBMIT_FAILED:
            return error_response(503, f"the engine is not running: {fan.error}")
        if fan.ending is Ending.ENGINE_STOPPED:
            return error_response(503, engine.health().reason or "the engine stopped")
        if fan.ending is Ending.DISCONNECTED:
            return error_response(499, "client disconnected")
        for out in last.values():
            if out.error:
                return error_response(500, out.error)
        return last

    def _stream_end(fan: Fanout, errors: list[str]) -> str | None:
        if errors:
            return errors[0]
        if fan.ending is Ending.SUBMIT_FAILED:
            return f"the engine is not running: {fan.error}"
        if fan.ending is Ending.ENGINE_STOPPED:
            return engine.health().reason or "the engine stopped"
        return None

    def _sse(data: dict[str, Any]) -> str:
        return f"data: {json.dumps(data)}\n\n"

    def _stream(gen: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(gen, media_type="text/event-stream")

    # ------------------------------------------------------------------ OpenAI

    async def _openai(
        http: Request,
        body: CompletionRequest | ChatCompletionRequest,
        prepare: Callable[[], Awaitable[tuple[list[list[int]], list[str]]]],
        prompt_param: str,
    ) -> Response:
        if (denied := _authorized(http)) is not None:
            return denied
        chat = isinstance(body, ChatCompletionRequest)
        try:
            body.refuse_unsupported()
            prompts, echo = await prepare()
            limit = body.completion_limit if isinstance(body, ChatCompletionRequest) else None
            max_tokens = limit if chat else body.max_tokens
            jobs = _jobs(prompts, body, max_tokens, None, prompt_param)
        except InvalidRequest as exc:
            return bad_request(str(exc), param=exc.param)
        except ValueError as exc:
            return bad_request(str(exc))
        rid = new_id("chatcmpl" if chat else "cmpl")
        fan = _fanout(http, jobs, body)
        want_logprobs = body.logprob_counts()[0] is not None

        def choice(index: int, out: RequestOutput) -> Choice:
            p = index // body.n
            return Choice(index, out, p, prompts[p], echo[p] if echo else "")

        if not body.stream:
            result = await _collect(fan, rid)
            if isinstance(result, JSONResponse):
                return result
            choices = [choice(i, result[i]) for i in sorted(result)]
            build = chat_body if chat else completion_body
            return JSONResponse(build(rid, name, choices, detok if want_logprobs else None))

        async def sse() -> AsyncIterator[str]:
            sent_tokens: dict[int, int] = {}
            finals: dict[int, RequestOutput] = {}
            errors: list[str] = []
            async for ev in fan.events():
                i, out = ev.index, ev.output
                if i not in sent_tokens:  # first output of this choice
                    sent_tokens[i] = 0
                    if chat:
                        yield _sse(
                            chat_chunk(rid, name, i, {"role": "assistant", "content": ""}, None)
                        )
                    elif echo:
                        c = choice(i, out)
                        lp = (
                            completion_logprobs(prompt_logprobs(out, c.prompt_ids), detok)
                            if want_logprobs
                            else None
                        )
                        yield _sse(completion_chunk(rid, name, i, c.echo_text, None, lp))
                if not (out.delta_text or out.finished):
                    continue
                logprobs = None
                if want_logprobs:
                    entries = output_logprobs(out, sent_tokens[i])
                    logprobs = (
                        chat_logprobs(entries, detok)
                        if chat
                        else completion_logprobs(entries, detok)
                    )
                sent_tokens[i] = len(out.output_ids)
                reason = out.finish_reason.value if out.finished and out.finish_reason else None
                if chat:
                    delta = {"content": out.delta_text} if out.delta_text else {}
                    data = chat_chunk(rid, name, i, delta, reason, logprobs)
                else:
                    data = completion_chunk(rid, name, i, out.delta_text, reason, logprobs)
                if out.finished:
                    finals[i] = out
                    _finished(out, rid)
                    data["usage"] = usage([choice(i, out)])
                    if out.error:
                        errors.append(out.error)
                yield _sse(data)
            error = _stream_end(fan, errors)
            if error:
                yield _sse(error_body(error, kind="server_error"))
            elif body.include_usage and fan.ending is Ending.DONE:
                choices = [choice(i, finals[i]) for i in sorted(finals)]
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield _sse(usage_chunk(rid, name, obj, choices))
            yield "data: [DONE]\n\n"

        return _stream(sse())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request) -> Response:
        async def prepare() -> tuple[list[list[int]], list[str]]:
            ids = await _prompt_ids(body.prompts, "prompt")
            if not body.echo:
                return ids, []

            def decode(q: list[int]) -> str:
                return str(engine.tokenizer.decode(q))

            texts = [p if isinstance(p, str) else decode(p) for p in body.prompts]
            return ids, texts

        return await _openai(http, body, prepare, "prompt")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: Request) -> Response:
        async def prepare() -> tuple[list[list[int]], list[str]]:
            for i, m in enumerate(body.messages):
                text = m.text()
                if text is not None:
                    check_text(text, f"messages[{i}].content")
            messages = [m.template_dict() for m in body.messages]

            def render() -> list[int]:
                ids = engine.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True
                )
                return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

            try:
                return [await off_loop(render)], []
            except Exception as exc:
                raise InvalidRequest(
                    f"messages could not be rendered by the chat template: {exc}",
                    param="messages",
                ) from None

        return await _openai(http, body, prepare, "messages")

    def _model_card() -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "owned_by": "hicache",
            "created": 0,
            "root": name,
            "max_model_len": engine.context_length,
        }

    @app.get("/v1/models")
    async def models(http: Request) -> Response:
        if (denied := _authorized(http)) is not None:
            return denied
        return JSONResponse({"object": "list", "data": [_model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, http: Request) -> Response:
        if (denied := _authorized(http)) is not None:
            return denied
        if model_id != name:
            return error_response(
                404, f"the model {model_id!r} does not exist; this server serves {name!r}"
            )
        return JSONResponse(_model_card())

    # ------------------------------------------------------------------ SGLang native

    @app.post("/generate")
    async def generate(body: GenerateRequest, http: Request) -> Response:
        if (denied := _authorized(http)) is not None:
            return denied
        sp = body.sampling_params
        try:
            raw, batched = body.prompts()
            param = "text" if body.text is not None else "input_ids"
            prompts = await _prompt_ids(raw, param)
            logprobs, prompt_lp = body.logprob_counts()
            fields = sp.as_openai(logprobs=logprobs, prompt_logprobs=prompt_lp)
            fields.cache_salt = body.cache_salt
            fields.priority = body.priority
            jobs = _jobs(prompts, fields, sp.max_new_tokens, DEFAULT_MAX_NEW_TOKENS, param)
        except InvalidRequest as exc:
            return bad_request(str(exc), param=native_param(exc.param))
        except ValueError as exc:
            return bad_request(str(exc))
        rid = body.rid or new_id("gen")
        fan = _fanout(http, jobs, fields)
        start = time.perf_counter()
        many = batched or sp.n > 1

        def result(index: int, out: RequestOutput) -> dict[str, Any]:
            ids = prompts[index // sp.n]
            inp = None
            if prompt_lp is not None:
                inp = prompt_logprobs(out, ids)[max(0, body.logprob_start_len) :]
            return generate_body(
                f"{rid}-{index}" if many else rid,
                out,
                e2e_latency=time.perf_counter() - start,
                output_entries=output_logprobs(out) if logprobs is not None else None,
                input_entries=inp,
                text=detok if body.return_text_in_logprobs else None,
                index=index if many else None,
            )

        if not body.stream:
            collected = await _collect(fan, rid)
            if isinstance(collected, JSONResponse):
                return collected
            results = [result(i, collected[i]) for i in sorted(collected)]
            return JSONResponse(results if many else results[0])

        async def sse() -> AsyncIterator[str]:
            errors: list[str] = []
            ev: Event
            async for ev in fan.events():
                if not (ev.output.delta_text or ev.output.finished):
                    continue
                if ev.output.finished:
                    _finished(ev.output, rid)
                    if ev.output.error:
                        errors.append(ev.output.error)
                yield _sse(result(ev.index, ev.output))
            error = _stream_end(fan, errors)
            if error:
                yield _sse(error_body(error, kind="server_error"))
            yield "data: [DONE]\n\n"

        return _stream(sse())

    # ------------------------------------------------------------------ operations

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
    async def flush_cache(http: Request) -> Response:
        if (denied := _authorized(http)) is not None:
            return denied
        try:
            ok = await asyncio.to_thread(engine.flush_cache)
        except (RuntimeError, TimeoutError) as exc:  # not running, or stuck
            return error_response(
                503, f"the cache could not be flushed: {exc or type(exc).__name__}"
            )
        if not ok:
            return error_response(409, "requests are in flight; flush when idle")
        return JSONResponse({"status": "ok", "message": "L1 and L2 emptied (L3 untouched)"})

    def _admin(http: Request) -> JSONResponse | None:
        given = http.headers.get("authorization", "")
        if admin_api_key is None or not secrets.compare_digest(
            given.encode(), f"Bearer {admin_api_key}".encode()
        ):
            return error_response(401, "admin API key missing or wrong")
        return None

    @app.put("/hicache/storage-backend")
    async def attach_storage(http: Request) -> Response:
        if (denied := _admin(http)) is not None:
            return denied  # the key first: nothing about the body is told to a stranger
        try:
            body = StorageBackendBody.model_validate_json(await http.body())
        except ValidationError as exc:
            first = exc.errors()[0]
            param = param_of(first.get("loc", ()))
            return bad_request(f"{param or 'body'}: {first.get('msg')}", param=param)
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
    async def detach_storage(http: Request) -> Response:
        if (denied := _admin(http)) is not None:
            return denied
        try:
            had = await asyncio.to_thread(engine.detach_storage)
        except RuntimeError as exc:
            return error_response(409, str(exc))
        return JSONResponse({"status": "ok", "detached": had})

    return app


__all__ = ["StorageBackendBody", "create_app"]
