"""What every route of one app shares (:class:`ServerState`): the engine, the served
model names, the keys, the metrics, and the steps from a parsed body to engine requests
and back: prompts tokenized off the event loop, ``n`` jobs per prompt validated by the
engine, the fan-out that runs them, and the error response when they did not finish.

Tokenizing cannot stall other requests: a text whose lower bound on tokens
(:mod:`~hicache.server.prompt_bound`) already reaches the context length is refused before
any tokenizing, and the others are tokenized on a pool of :data:`TOKENIZE_THREADS` threads
(Hugging Face fast tokenizers release the GIL while encoding), one task per HTTP request,
so one large prompt holds one thread and the rest keep being served.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi.responses import JSONResponse, StreamingResponse

from hicache.disagg.config import DisaggMode
from hicache.engine.admission import AdmissionRefused, EngineUnhealthy
from hicache.engine.front.engine import Engine
from hicache.engine.request import RequestOutput
from hicache.engine.sampling import InvalidRequest
from hicache.engine.session import SessionHint, session_kind
from hicache.server.bootstrap_fields import BootstrapFields, bootstraps, copy_bootstrap
from hicache.server.fanout import Client, Ending, Fanout, Job
from hicache.server.http_base import error_response, failure_response
from hicache.server.metrics import EngineMetrics
from hicache.server.prompt_bound import NoBound, TokenBound, token_bound
from hicache.server.protocol import SamplingFields, check_text
from hicache.server.responses import Detokenizer

log = logging.getLogger(__name__)
T = TypeVar("T")

TOKENIZE_THREADS = 4
"""Threads that tokenize prompts and render chat templates; each HTTP request's prompts
are one task, so this many large prompts can be tokenized at once while requests with
token ids (and ``/health``) never wait for them."""


def sse(data: dict[str, Any]) -> str:
    """One server-sent event carrying ``data`` as JSON."""
    return f"data: {json.dumps(data)}\n\n"


def stream(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream")


class ServerState:
    """One app's shared state (built by :func:`~hicache.server.app.create_app`).

    ``name``: the served model's name, the one responses carry; ``aliases``: other names
    a body's ``model`` may give for it (:meth:`unknown_model`). ``api_key``: when set, the
    inference endpoints need ``Authorization: Bearer <api_key>`` (:meth:`authorized`);
    ``admin_api_key``: the admin endpoints' key (:meth:`admin`), without which they are
    refused. Which route needs which key is :data:`hicache.server.access.ROUTE_ACCESS`,
    enforced by its guard.
    """

    def __init__(
        self,
        engine: Engine,
        name: str,
        *,
        aliases: Sequence[str] = (),
        api_key: str | None,
        admin_api_key: str | None,
    ) -> None:
        self.engine = engine
        self.name = name
        self.model_names: tuple[str, ...] = tuple(dict.fromkeys((name, *aliases)))
        """The names ``/v1/models`` lists, each once: ``name`` first, then the aliases."""
        implicit = (engine.model.name, getattr(engine.config, "model_path", None))
        self.accepted_models = frozenset((*self.model_names, *(n for n in implicit if n)))
        """Every name a body's ``model`` may give: the listed ones, and also the model's
        own name and the path it was loaded from (SGLang's default served name, which
        SGLang-style clients send), accepted without being listed."""
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.json_only = engine.config.disagg.mode is DisaggMode.PREFILL
        """A prefill instance answers with one JSON body even when a stream is asked for
        (the router reads it whole; the decode instance streams)."""
        self.metrics = EngineMetrics(engine, name)
        self.detok = Detokenizer(engine.model.tokenizer)
        self.token_bound: TokenBound | None
        try:
            self.token_bound = token_bound(engine.model.tokenizer)
        except NoBound as exc:
            self.token_bound = None
            log.info("prompts are tokenized before their length is checked: %s", exc)
        # One encode here, before the pool's threads share the tokenizer: transformers
        # resets a tokenizer's saved truncation/padding on its first encode, the only
        # call that writes to it (concurrent with another encode, that write would fail)
        engine.model.tokenizer.encode("a", add_special_tokens=False)
        self.before_encode: Callable[[str], None] | None = None
        """Called on the tokenizing thread with each text that passed the bound, just
        before it is encoded (tests hold a prompt there); None: nothing is called."""
        self._tokenize_pool = ThreadPoolExecutor(
            max_workers=TOKENIZE_THREADS, thread_name_prefix="hicache-tokenize"
        )

    # ------------------------------------------------------------------ prompts

    def unknown_model(self, model: str | None) -> JSONResponse | None:
        """None when a body's ``model`` names the served model (or is absent), else
        OpenAI's 404 ``model_not_found``."""
        if model is None or model in self.accepted_models:
            return None
        served = ", ".join(repr(n) for n in self.model_names)
        return error_response(
            404,
            f"the model {model!r} does not exist; this server serves {served} (GET /v1/models)",
            param="model",
            kind="invalid_request_error",
            code="model_not_found",
        )

    # ------------------------------------------------------------------ prompts

    async def off_loop(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the tokenizing pool, not on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn)

    def check_length(self, text: str, param: str) -> None:
        """Refuse ``text`` (:class:`InvalidRequest` naming ``param``) when its lower bound
        on tokens already reaches the context length: no tokenizing needed to know."""
        bound = self.token_bound
        if bound is None:
            return
        ctx = self.engine.context_length
        least = bound.min_tokens(text)
        if least >= ctx:
            raise InvalidRequest(
                f"{param} is too long: its {len(text)} characters are at least {least} tokens"
                f" (no token stands for more than {bound.chars_per_token} characters), and"
                f" the context length is {ctx} (at least one token must be generated)",
                param=param,
            )

    def encode(self, text: str, param: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added), after :meth:`check_length`;
        run on the pool (:meth:`off_loop`). Raises :class:`InvalidRequest` naming ``param``
        for invalid Unicode, a text too long by its bound, or no tokens."""
        check_text(text, param)
        self.check_length(text, param)
        return self._tokenize(text, param)

    def _checked(self, text: str, param: str) -> list[int]:
        """:meth:`encode` of a text whose bound :meth:`check_length` has passed already
        (checked once)."""
        check_text(text, param)
        return self._tokenize(text, param)

    def _tokenize(self, text: str, param: str) -> list[int]:
        """The token ids of a checked text (no special tokens added); none is invalid."""
        if self.before_encode is not None:
            self.before_encode(text)
        ids = list(self.engine.model.tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            raise InvalidRequest("the prompt encodes to no tokens", param=param)
        return ids

    async def prompt_ids(self, prompts: Sequence[str | list[int]], param: str) -> list[list[int]]:
        """Token ids of each prompt (texts encoded on the pool, one task for them all);
        raises :class:`InvalidRequest` naming ``param`` for an empty or invalid one, and
        for a text too long by its bound before any text is encoded."""
        texts = [(i, p) for i, p in enumerate(prompts) if isinstance(p, str)]
        out: list[list[int]] = [list(p) if not isinstance(p, str) else [] for p in prompts]
        for _, text in texts:  # every text's bound before any is encoded
            self.check_length(text, param)
        if texts:
            encoded = await self.off_loop(lambda: [self._checked(p, param) for _, p in texts])
            for (i, _), ids in zip(texts, encoded, strict=True):
                out[i] = ids
        for ids in out:
            if not ids:
                raise InvalidRequest("the prompt is empty", param=param)
        return out

    # ------------------------------------------------------------------ engine requests

    def jobs(
        self,
        prompts: Sequence[list[int]],
        body: SamplingFields,
        max_tokens: int | None,
        default_max_tokens: int | None,
        prompt_param: str,
        rooms: BootstrapFields | None = None,
    ) -> list[Job]:
        """``n`` jobs per prompt (prompt-major); copies wait for the first's first token.
        Each is validated by the engine; an error names ``prompt_param`` for the prompt,
        and ``n`` when there are more jobs than the engine's waiting queue could ever hold
        (``max_queued_requests``). ``rooms``: the body's bootstrap fields (``body``'s own
        when None), one room per prompt on a prefill or decode instance, which its first
        copy takes (a prefill instance runs no other copy of it:
        :func:`~hicache.server.bootstrap_fields.copy_bootstrap`). A refusal ends the
        rooms the jobs validated so far have claimed (:meth:`Engine.refused`)."""
        jobs: list[Job] = []
        try:
            self._jobs(jobs, prompts, body, max_tokens, default_max_tokens, prompt_param, rooms)
        except InvalidRequest as exc:
            self.refuse(jobs, str(exc))
            raise
        return jobs

    def answered_elsewhere(self, job: Job) -> bool:
        """Whether ``job`` is a prefill instance's half of a pair: its decode instance
        answers the client, prompt logprobs included."""
        b = job.request.bootstrap
        return (
            self.engine.config.disagg.mode is DisaggMode.PREFILL and b is not None and b.transfers
        )

    def refuse(self, jobs: Sequence[Job], why: str) -> None:
        """``jobs`` will not be submitted: the rooms they claimed end with ``why``."""
        for job in jobs:
            self.engine.refused(job.request, why)

    def _jobs(
        self,
        jobs: list[Job],
        prompts: Sequence[list[int]],
        body: SamplingFields,
        max_tokens: int | None,
        default_max_tokens: int | None,
        prompt_param: str,
        rooms: BootstrapFields | None,
    ) -> None:
        """:meth:`jobs`' work: appends each validated job to ``jobs`` at once (so that a
        refusal after it ends its room)."""
        ctx = self.engine.context_length
        mode = self.engine.config.disagg.mode
        per_prompt = bootstraps(
            body if rooms is None else rooms, len(prompts), body.n, self.engine.config.disagg
        )
        session = body.session_hint()
        for p, ids in enumerate(prompts):
            room = max(1, ctx - len(ids))
            if max_tokens is not None:
                limit = max_tokens
            elif default_max_tokens is not None:
                limit = min(default_max_tokens, room)
            else:
                limit = room  # SGLang's default: what remains of the context
            for c in range(body.n):
                runs, bootstrap = copy_bootstrap(per_prompt[p], c, mode)
                if not runs:
                    continue  # a later copy: the decode instance runs it
                params = body.sampling(limit, c)
                try:
                    valid = self.engine.validate(
                        ids,
                        params,
                        cache_salt=body.cache_salt,
                        priority=body.request_priority,
                        bootstrap=bootstrap,
                        session=session,
                    )
                except InvalidRequest as exc:
                    param = prompt_param if exc.param == "prompt" else exc.param
                    raise InvalidRequest(str(exc), param=param) from None
                index = p * body.n + c
                jobs.append(Job(index, valid, after=None if c == 0 else p * body.n))
                if max_tokens is not None and len(ids) + max_tokens > ctx:
                    raise InvalidRequest(
                        f"max_tokens={max_tokens} is too large: the prompt has {len(ids)}"
                        f" tokens and the context length is {ctx}, so at most"
                        f" {ctx - len(ids)} tokens can be generated",
                        param="max_tokens",
                    )
        bound = self.engine.config.max_queued_requests
        if bound is not None and len(jobs) > bound:
            raise InvalidRequest(
                f"the request has {len(jobs)} sequences ({len(prompts)} prompts x n={body.n})"
                f" but at most {bound} can be queued (--max-queued-requests)",
                param="n",
            )

    def fanout(self, http: Client, jobs: Sequence[Job], body: SamplingFields) -> Fanout:
        """The fan-out running ``jobs`` for ``http``, one engine group, with a place in
        the engine's waiting queue reserved for every job first; its aborts are counted
        (by reason, and by ``body``'s session kind).

        Raises :class:`~hicache.engine.admission.QueueFull` (or ``EngineUnhealthy``)
        when the queue cannot take them all: the app answers :func:`refusal_response`,
        and the rooms the jobs claimed end (:meth:`refuse`).
        """
        try:
            reservation = self.engine.reserve(len(jobs))
        except (AdmissionRefused, InvalidRequest) as exc:
            self.refuse(jobs, str(exc))
            raise
        session = body.session_hint()

        def count_abort(reason: str) -> None:
            self.metrics.count_abort(reason, session_kind(session))

        return Fanout(
            self.engine,
            jobs,
            http,
            on_abort=count_abort,
            reservation=reservation,
            session=session,
        )

    def finished(self, out: RequestOutput, rid: str, session: SessionHint | None) -> None:
        """Account a final output of a request with hint ``session`` (metrics, one debug
        line)."""
        self.metrics.observe(out, session_kind(session))
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

    async def collect(self, fan: Fanout, rid: str) -> dict[int, RequestOutput] | JSONResponse:
        """The final output of every job, or the error response."""
        last: dict[int, RequestOutput] = {}
        async for ev in fan.events():
            last[ev.index] = ev.output
            if ev.output.finished:
                self.finished(ev.output, rid, fan.session)
        if fan.ending is Ending.SUBMIT_FAILED:
            return error_response(503, f"the engine is not running: {fan.error}")
        if fan.ending is Ending.ENGINE_STOPPED:
            return error_response(503, self.engine.health().reason or "the engine stopped")
        if fan.ending is Ending.DISCONNECTED:
            return error_response(499, "client disconnected")
        for out in last.values():
            if out.error:
                return failure_response(out.error)
        return last

    def stream_error(self, fan: Fanout, errors: list[str]) -> str | None:
        """Why a finished stream failed (its first request error, or the engine's), or None."""
        if errors:
            return errors[0]
        if fan.ending is Ending.SUBMIT_FAILED:
            return f"the engine is not running: {fan.error}"
        if fan.ending is Ending.ENGINE_STOPPED:
            return self.engine.health().reason or "the engine stopped"
        return None


def refusal_response(exc: AdmissionRefused) -> JSONResponse:
    """The answer to a request the waiting queue refused: 429 with ``Retry-After`` (the
    queue is full), or 503 with it when the engine is not healthy; OpenAI's error object."""
    status = 503 if isinstance(exc, EngineUnhealthy) else 429
    response = error_response(status, str(exc))
    response.headers["Retry-After"] = str(exc.retry_after_s)
    return response
