"""SGLang's native endpoint: ``POST /generate`` (bodies: :mod:`hicache.server.native`).

One prompt or a batch (``text`` or ``input_ids``), ``sampling_params.n`` copies each,
streamed (cumulative chunks, as SGLang's) or not; errors name the field as ``/generate``
spells it (``sampling_params.max_new_tokens``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from hicache.engine.request import RequestOutput
from hicache.engine.sampling import InvalidRequest
from hicache.server.fanout import Event, Job
from hicache.server.http_base import bad_request, native_param
from hicache.server.native import DEFAULT_MAX_NEW_TOKENS, GenerateRequest, generate_body
from hicache.server.protocol import SamplingFields
from hicache.server.responses import error_body, new_id, output_logprobs, prompt_logprobs
from hicache.server.state import ServerState, sse, stream


@dataclass(frozen=True)
class NativePlan:
    """A ``/generate`` body made into engine requests: ``fields`` (the body in the OpenAI
    model's terms, which the fan-out reads), the validated ``jobs`` (``n`` per prompt,
    prompt-major), and the logprobs asked: ``logprobs`` per output token and
    ``prompt_lp`` per prompt token (None: not asked; else the number of alternatives)."""

    fields: SamplingFields
    jobs: list[Job]
    logprobs: int | None
    prompt_lp: int | None


def native_plan(
    state: ServerState, body: GenerateRequest, prompts: list[list[int]], param: str
) -> NativePlan:
    """The engine requests of ``body`` whose prompts are ``prompts`` (token ids; ``param``
    names them in errors). Raises :class:`InvalidRequest` naming the field as ``/generate``
    spells it (before :func:`~hicache.server.http_base.native_param`). Shared by
    ``/generate`` and the gRPC worker's ``Generate``."""
    sp = body.sampling_params
    body.check_logprob_start([len(p) for p in prompts])
    logprobs, prompt_lp = body.logprob_counts()
    fields = sp.as_openai(
        logprobs=logprobs, prompt_logprobs=prompt_lp, logprob_start=body.logprob_start()
    )
    fields.cache_salt = body.cache_salt
    fields.priority = body.priority
    fields.session_id = body.session_id
    fields.parent_session_id = body.parent_session_id
    fields.session_ttl_ms = body.session_ttl_ms
    jobs = state.jobs(prompts, fields, sp.max_new_tokens, DEFAULT_MAX_NEW_TOKENS, param, rooms=body)
    return NativePlan(fields, jobs, logprobs, prompt_lp)


def add_native_routes(app: FastAPI, state: ServerState) -> None:
    """Register ``/generate`` on ``app``."""

    @app.post("/generate")
    async def generate(body: GenerateRequest, http: Request) -> Response:
        sp = body.sampling_params
        try:
            raw, batched = body.prompts()
            param = "text" if body.text is not None else "input_ids"
            prompts = await state.prompt_ids(raw, param)
            plan = native_plan(state, body, prompts, param)
        except InvalidRequest as exc:
            return bad_request(str(exc), param=native_param(exc.param))
        except ValueError as exc:
            return bad_request(str(exc))
        rid = body.rid or new_id("gen")
        fields, jobs, logprobs, prompt_lp = plan.fields, plan.jobs, plan.logprobs, plan.prompt_lp
        fan = state.fanout(http, jobs, fields)
        start = time.perf_counter()
        many = batched or sp.n > 1
        # a prefill instance's half of a pair sends no input_token_logprobs: its decode
        # instance answers them whole, and smg prepends the prefill's to the decode's
        elsewhere = {job.index for job in jobs if state.answered_elsewhere(job)}

        def result(index: int, out: RequestOutput) -> dict[str, Any]:
            ids = prompts[index // sp.n]
            inp = None
            if prompt_lp is not None and index not in elsewhere:
                inp = prompt_logprobs(out, ids)[max(0, body.logprob_start_len) :]
            return generate_body(
                f"{rid}-{index}" if many else rid,
                out,
                e2e_latency=time.perf_counter() - start,
                output_entries=output_logprobs(out) if logprobs is not None else None,
                input_entries=inp,
                text=state.detok if body.return_text_in_logprobs else None,
                index=index if many else None,
            )

        if not body.stream or state.json_only:
            collected = await state.collect(fan, rid)
            if isinstance(collected, JSONResponse):
                return collected
            results = [result(i, collected[i]) for i in sorted(collected)]
            return JSONResponse(results if many else results[0])

        async def events() -> AsyncIterator[str]:
            errors: list[str] = []
            ev: Event
            async for ev in fan.events():
                if not (ev.output.delta_text or ev.output.finished):
                    continue
                if ev.output.finished:
                    state.finished(ev.output, rid, fan.session)
                    if ev.output.error:
                        errors.append(ev.output.error)
                yield sse(result(ev.index, ev.output))
            error = state.stream_error(fan, errors)
            if error:
                yield sse(error_body(error, kind="server_error"))
            yield "data: [DONE]\n\n"

        return stream(events())
