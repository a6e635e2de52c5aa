"""OpenAI's endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream``, ``n`` and logprobs; completions also with batched prompts and ``echo``),
``GET /v1/models`` and ``GET /v1/models/{id}``.

A parameter the server cannot honour is refused with a 400 naming it
(:meth:`~hicache.server.protocol.SamplingFields.refuse_unsupported`), never ignored.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from hicache.engine.request import RequestOutput
from hicache.engine.sampling import InvalidRequest
from hicache.server.fanout import Ending
from hicache.server.http_base import bad_request
from hicache.server.protocol import ChatCompletionRequest, CompletionRequest, check_text
from hicache.server.responses import (
    Choice,
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
from hicache.server.state import ServerState, sse, stream

Prepare = Callable[[], Awaitable[tuple[list[list[int]], list[str]]]]
"""A body's prompts as token ids, and (for ``echo``) their texts."""


async def _openai(
    state: ServerState,
    http: Request,
    body: CompletionRequest | ChatCompletionRequest,
    prepare: Prepare,
    prompt_param: str,
) -> Response:
    """One completion or chat completion, streamed or not."""
    if (unknown := state.unknown_model(body.model)) is not None:
        return unknown
    chat = isinstance(body, ChatCompletionRequest)
    name, detok = state.name, state.detok
    try:
        body.refuse_unsupported()
        prompts, echo = await prepare()
        limit = body.completion_limit if isinstance(body, ChatCompletionRequest) else None
        max_tokens = limit if chat else body.max_tokens
        jobs = state.jobs(prompts, body, max_tokens, None, prompt_param)
    except InvalidRequest as exc:
        return bad_request(str(exc), param=exc.param)
    except ValueError as exc:
        return bad_request(str(exc))
    rid = new_id("chatcmpl" if chat else "cmpl")
    fan = state.fanout(http, jobs, body)
    want_logprobs = body.logprob_counts()[0] is not None

    def choice(index: int, out: RequestOutput) -> Choice:
        p = index // body.n
        return Choice(index, out, p, prompts[p], echo[p] if echo else "")

    if not body.stream or state.json_only:
        result = await state.collect(fan, rid)
        if isinstance(result, JSONResponse):
            return result
        choices = [choice(i, result[i]) for i in sorted(result)]
        build = chat_body if chat else completion_body
        return JSONResponse(build(rid, name, choices, detok if want_logprobs else None))

    def chunk(data: dict[str, Any]) -> str:
        """With include_usage, OpenAI's null usage on every chunk but the last, usage-only
        one; without, each choice's final chunk carries that choice's usage."""
        if body.include_usage:
            data["usage"] = None
        return sse(data)

    async def events() -> AsyncIterator[str]:
        sent_tokens: dict[int, int] = {}
        finals: dict[int, RequestOutput] = {}
        errors: list[str] = []
        async for ev in fan.events():
            i, out = ev.index, ev.output
            if i not in sent_tokens:  # first output of this choice
                sent_tokens[i] = 0
                if chat:
                    yield chunk(
                        chat_chunk(rid, name, i, {"role": "assistant", "content": ""}, None)
                    )
                elif echo:
                    c = choice(i, out)
                    lp = (
                        completion_logprobs(prompt_logprobs(out, c.prompt_ids), detok)
                        if want_logprobs
                        else None
                    )
                    yield chunk(completion_chunk(rid, name, i, c.echo_text, None, lp))
            if not (out.delta_text or out.finished):
                continue
            logprobs = None
            if want_logprobs:
                entries = output_logprobs(out, sent_tokens[i])
                logprobs = (
                    chat_logprobs(entries, detok) if chat else completion_logprobs(entries, detok)
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
                state.finished(out, rid, fan.session)
                if not body.include_usage:  # SGLang's bench_serving reads it there
                    data["usage"] = usage([choice(i, out)])
                if out.error:
                    errors.append(out.error)
            yield chunk(data)
        error = state.stream_error(fan, errors)
        if error:
            yield sse(error_body(error, kind="server_error"))
        elif body.include_usage and fan.ending is Ending.DONE:
            choices = [choice(i, finals[i]) for i in sorted(finals)]
            obj = "chat.completion.chunk" if chat else "text_completion"
            yield sse(usage_chunk(rid, name, obj, choices))
        yield "data: [DONE]\n\n"

    return stream(events())


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    """Register ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models`` on ``app``."""
    engine = state.engine

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request) -> Response:
        async def prepare() -> tuple[list[list[int]], list[str]]:
            ids = await state.prompt_ids(body.prompts, "prompt")
            if not body.echo:
                return ids, []

            def decode(q: list[int]) -> str:
                return str(engine.model.tokenizer.decode(q))

            texts = [p if isinstance(p, str) else decode(p) for p in body.prompts]
            return ids, texts

        return await _openai(state, http, body, prepare, "prompt")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: Request) -> Response:
        async def prepare() -> tuple[list[list[int]], list[str]]:
            for i, m in enumerate(body.messages):
                text = m.text()
                if text is not None:
                    check_text(text, f"messages[{i}].content")
            messages = [m.template_dict() for m in body.messages]

            def render_and_encode() -> list[int]:
                try:
                    text = engine.model.tokenizer.apply_chat_template(
                        messages, add_generation_prompt=True, tokenize=False
                    )
                except Exception as exc:
                    raise InvalidRequest(
                        f"messages could not be rendered by the chat template: {exc}",
                        param="messages",
                    ) from None
                # what apply_chat_template(tokenize=True) encodes, bounded first
                return state.encode(str(text), "messages")

            return [await state.off_loop(render_and_encode)], []

        return await _openai(state, http, body, prepare, "messages")

    def model_card(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "owned_by": "hicache",
            "created": 0,
            "root": state.name,
            "max_model_len": engine.context_length,
        }

    @app.get("/v1/models")
    async def models() -> Response:
        cards = [model_card(n) for n in state.model_names]
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if (unknown := state.unknown_model(model_id)) is not None:
            return unknown
        return JSONResponse(model_card(model_id))
