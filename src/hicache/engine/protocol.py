"""OpenAI-compatible request bodies (validated) and response builders.

Every field OpenAI defines is either served or refused with a 400 naming it (``param``);
unknown fields are ignored, as clients send many optional ones. Known fields with a wrong
type or value are rejected by pydantic, by :class:`SamplingParams` and by
:meth:`Engine.validate`, all with ``param`` set. What is refused and why: ``docs/api.md``.

Extensions to OpenAI's fields (SGLang's names): ``top_k``, ``min_tokens``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``cache_salt`` (at most
:data:`MAX_CACHE_SALT_CHARS` characters) and ``priority`` (a signed 64-bit int; larger =
more important, kept on the request for the ``priority`` eviction policy). Responses carry
SGLang's cache report: ``usage.prompt_tokens_details.cached_tokens`` and, per tier,
``usage.cached_tokens_details`` and ``sglext.cached_tokens_details``.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from hicache.engine.engine import MAX_CACHE_SALT_CHARS, PRIORITY_MAX, PRIORITY_MIN
from hicache.engine.request import CachedTokens, RequestOutput
from hicache.engine.sampling import SEED_MAX, InvalidRequest, SamplingParams

MAX_N = 64
"""Most choices (``n``) one request may ask for: each is one engine request."""
MAX_LOGPROBS = 20
"""Most alternatives per token (``logprobs`` / ``top_logprobs``), as OpenAI allows."""
MAX_BATCH = 256
"""Most prompts in one batched ``/v1/completions`` request."""


def engine_supports(name: str) -> bool:
    """Whether :class:`SamplingParams` has the field ``name`` (some land over time)."""
    return any(f.name == name for f in dataclasses.fields(SamplingParams))


def check_text(value: str, param: str) -> None:
    """Refuse text that is not valid Unicode (lone surrogates from ``\\ud800`` escapes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            f"{param} is not valid Unicode text: a lone surrogate at character {exc.start}",
            param=param,
        ) from None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=False)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    cache_salt: str = Field(default="", max_length=MAX_CACHE_SALT_CHARS)
    priority: StrictInt | None = Field(default=None, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    user: str | None = None

    @property
    def request_priority(self) -> int:
        """``priority``, 0 when not given."""
        return 0 if self.priority is None else self.priority

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage-only chunk (``stream_options.include_usage``)."""
        return self.stream_options is not None and self.stream_options.include_usage

    def refuse_unsupported(self) -> None:
        """Raise :class:`InvalidRequest` naming the first field this server cannot honour."""
        fmt = self.response_format
        if fmt is not None and fmt.get("type", "text") != "text":
            raise InvalidRequest(
                f"response_format {fmt.get('type')!r} is not supported: structured output"
                " (JSON mode, JSON schema) is not implemented; only {'type': 'text'} is"
                " accepted",
                param="response_format",
            )
        if self.tools:
            raise InvalidRequest(
                "tools are not supported: this server does not parse tool calls out of the"
                " model's output (tool calls and results in the message history are fine)",
                param="tools",
            )
        if self.tool_choice not in (None, "none"):
            raise InvalidRequest(
                f"tool_choice={self.tool_choice!r} is not supported; only 'none' is accepted",
                param="tool_choice",
            )
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest(
                "stream_options is only allowed with stream=true", param="stream_options"
            )

    def engine_extras(self) -> dict[str, Any]:
        """The :class:`SamplingParams` fields beyond the basic ones that this request sets."""
        extras: dict[str, Any] = {}
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value:
                extras[name] = float(value)
        if self.repetition_penalty is not None and self.repetition_penalty != 1.0:
            extras["repetition_penalty"] = float(self.repetition_penalty)
        if self.logit_bias:
            bias: dict[int, float] = {}
            for key, value in self.logit_bias.items():
                try:
                    token = int(key)
                except ValueError:
                    raise InvalidRequest(
                        f"logit_bias key {key!r} is not a token id", param="logit_bias"
                    ) from None
                if not -100.0 <= value <= 100.0:
                    raise InvalidRequest(
                        f"logit_bias[{key}]={value!r} is invalid; must be in [-100, 100]",
                        param="logit_bias",
                    )
                bias[token] = float(value)
            extras["logit_bias"] = bias
        if self.min_tokens:
            extras["min_tokens"] = self.min_tokens
        if self.ignore_eos:
            extras["ignore_eos"] = True
        if self.stop_token_ids:
            extras["stop_token_ids"] = tuple(self.stop_token_ids)
        return extras

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """``(logprobs, prompt_logprobs)`` for :class:`SamplingParams` (None = off)."""
        return None, None

    def sampling(self, max_tokens: int, copy: int = 0) -> SamplingParams:
        """Sampling parameters of choice ``copy`` (its seed is ``seed + copy``); raises
        :class:`InvalidRequest` naming the field, also for a field the engine lacks."""
        stop: list[str] = (
            [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        )
        kwargs = self.engine_extras()
        logprobs, prompt_logprobs = self.logprob_counts()
        if logprobs is not None:
            kwargs["logprobs"] = logprobs
        if prompt_logprobs is not None:
            kwargs["prompt_logprobs"] = prompt_logprobs
        for name in kwargs:
            if not engine_supports(name):
                param = "logprobs" if name == "prompt_logprobs" else name
                raise InvalidRequest(f"{param} is not supported by this engine yet", param=param)
        seed = self.seed
        if seed is not None and copy:
            seed = seed + copy if seed + copy <= SEED_MAX else seed - copy
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=max_tokens,
            stop=[s for s in stop if s],
            seed=seed,
            **kwargs,
        )


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a batch of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if isinstance(v, str | list) and len(v) == 0:
            raise ValueError("the prompt is empty")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, one per batch entry."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix:
            raise InvalidRequest(
                "suffix is not supported: fill-in-the-middle needs a model-specific template",
                param="suffix",
            )
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest(
                f"best_of={self.best_of} is not supported (only best_of = n = {self.n}):"
                " ranking candidates by log probability is not implemented",
                param="best_of",
            )
        if len(self.prompts) > MAX_BATCH:
            raise InvalidRequest(
                f"the batch has {len(self.prompts)} prompts; at most {MAX_BATCH} are allowed",
                param="prompt",
            )

    def logprob_counts(self) -> tuple[int | None, int | None]:
        if self.logprobs is None:
            return None, None
        return self.logprobs, (self.logprobs if self.echo else None)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(
                        f"content part type {kind!r} is not supported; only 'text' parts are"
                        " (this server serves text-only models)"
                    )
        return v

    def text(self) -> str | None:
        """The content as one string (text parts concatenated), None when absent."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template expects it: absent content (an assistant turn
        with only ``tool_calls``) as ``""``, which every template can render; the tool calls
        are passed on for templates that render them."""
        out: dict[str, Any] = {"role": self.role, "content": self.text() or ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: messages rendered by the tokenizer's chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("messages")
    @classmethod
    def _has_messages(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages is empty")
        for i, m in enumerate(v):
            if m.content is None and not (m.role == "assistant" and m.tool_calls):
                raise ValueError(
                    f"messages[{i}].content is missing (only an assistant message with"
                    " tool_calls may omit it)"
                )
        return v

    @property
    def completion_limit(self) -> int | None:
        """``max_tokens``, else ``max_completion_tokens``."""
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs=true", param="top_logprobs")

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0, None) if self.logprobs else (None, None)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------------- responses


@dataclass(frozen=True, slots=True)
class Choice:
    """One choice: its index, the engine's (last) output, and for ``echo`` the prompt."""

    index: int
    output: RequestOutput
    prompt_index: int = 0
    """Which prompt of the request this choice answers (its usage counts once)."""
    prompt_ids: Sequence[int] = ()
    echo_text: str = ""


@dataclass(frozen=True, slots=True)
class LogprobEntry:
    """A token's log probability and its most likely alternatives (id -> logprob)."""

    token_id: int
    logprob: float | None
    top: Mapping[int, float]


def _as_entry(raw: Any, token_id: int | None = None) -> LogprobEntry | None:
    """Read one entry of the engine's ``logprobs`` / ``prompt_logprobs``: an object with
    ``token_id``/``logprob`` and ``top_logprobs``/``top`` (a mapping id -> logprob or a
    sequence of pairs), a ``(token_id, logprob)`` pair, or None."""
    if raw is None:
        return None
    if isinstance(raw, LogprobEntry):
        return raw
    if isinstance(raw, tuple | list) and len(raw) >= 2 and not hasattr(raw, "token_id"):
        tid, lp = raw[0], raw[1]
        top_raw: Any = raw[2] if len(raw) > 2 else {}
    else:
        tid = getattr(raw, "token_id", token_id)
        lp = getattr(raw, "logprob", None)
        top_raw = getattr(raw, "top_logprobs", None) or getattr(raw, "top", None) or {}
    if isinstance(top_raw, Mapping):
        top = {int(k): float(v) for k, v in top_raw.items()}
    else:
        top = {}
        for item in top_raw:
            if isinstance(item, tuple | list):
                top[int(item[0])] = float(item[1])
            else:
                top[int(item.token_id)] = float(item.logprob)
    return LogprobEntry(int(tid), None if lp is None else float(lp), top)


def output_logprobs(out: RequestOutput, start: int = 0) -> list[LogprobEntry]:
    """The engine's logprobs of ``out``'s output tokens from ``start`` on."""
    raw = getattr(out, "logprobs", None)
    if raw is None:
        return []
    entries = [
        _as_entry(r, out.output_ids[i] if i < len(out.output_ids) else None)
        for i, r in enumerate(raw)
    ]
    return [e for e in entries[start:] if e is not None]


def prompt_logprobs(out: RequestOutput, prompt_ids: Sequence[int]) -> list[LogprobEntry]:
    """One entry per prompt token (the first has ``logprob`` None)."""
    raw = list(getattr(out, "prompt_logprobs", None) or [])
    if len(raw) == len(prompt_ids) - 1:
        raw = [None, *raw]
    result = []
    for i, tid in enumerate(prompt_ids):
        entry = _as_entry(raw[i], tid) if i < len(raw) else None
        result.append(entry or LogprobEntry(int(tid), None, {}))
    return result


class Detokenizer:
    """Token ids to the strings logprob objects show (one token at a time)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))


def completion_logprobs(
    entries: Sequence[LogprobEntry], token: Detokenizer, offset: int = 0
) -> dict[str, Any]:
    """OpenAI's legacy completions ``logprobs`` object; ``offset``: text before them."""
    tokens = [token(e.token_id) for e in entries]
    offsets = []
    pos = offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            None if e.logprob is None else {token(k): v for k, v in e.top.items()} for e in entries
        ],
        "text_offset": offsets,
    }


def chat_logprobs(entries: Sequence[LogprobEntry], token: Detokenizer) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` object: ``{"content": [...]}``."""

    def one(tid: int, lp: float | None) -> dict[str, Any]:
        text = token(tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**one(e.token_id, e.logprob), "top_logprobs": [one(k, v) for k, v in e.top.items()]}
            for e in entries
        ]
    }


def _reason(out: RequestOutput) -> str | None:
    return out.finish_reason.value if out.finished and out.finish_reason else None


def usage(choices: Sequence[Choice]) -> dict[str, Any]:
    """OpenAI usage over ``choices``, with the cache report per tier.

    A prompt's tokens count once however many choices it has (its first choice's report);
    completion tokens are summed over every choice.
    """
    firsts: dict[int, Choice] = {}
    for c in choices:
        firsts.setdefault(c.prompt_index, c)
    prompt = sum(c.output.prompt_tokens for c in firsts.values())
    cached = CachedTokens(
        device=sum(c.output.cached.device for c in firsts.values()),
        host=sum(c.output.cached.host for c in firsts.values()),
        storage=sum(c.output.cached.storage for c in firsts.values()),
    )
    completion = sum(c.output.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached.total},
        "cached_tokens_details": tier_details(cached),
    }


def tier_details(cached: CachedTokens) -> dict[str, int]:
    return {"device": cached.device, "host": cached.host, "storage": cached.storage}


def sglext(u: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's response extension carrying the per-tier cache report."""
    return {"cached_tokens_details": dict(u["cached_tokens_details"])}


def completion_body(
    rid: str, model: str, choices: Sequence[Choice], token: Detokenizer | None
) -> dict[str, Any]:
    items = []
    for c in choices:
        out = c.output
        logprobs = None
        if token is not None:
            entries = output_logprobs(out)
            if c.echo_text and c.prompt_ids:
                entries = prompt_logprobs(out, c.prompt_ids) + entries
            logprobs = completion_logprobs(entries, token)
        items.append(
            {
                "index": c.index,
                "text": c.echo_text + out.text,
                "finish_reason": _reason(out),
                "logprobs": logprobs,
            }
        )
    u = usage(choices)
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": items,
        "usage": u,
        "sglext": sglext(u),
    }


def completion_chunk(
    rid: str, model: str, index: int, text: str, reason: str | None, logprobs: Any = None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}],
    }


def chat_body(
    rid: str, model: str, choices: Sequence[Choice], token: Detokenizer | None
) -> dict[str, Any]:
    items = []
    for c in choices:
        out = c.output
        items.append(
            {
                "index": c.index,
                "message": {"role": "assistant", "content": out.text},
                "finish_reason": _reason(out),
                "logprobs": None if token is None else chat_logprobs(output_logprobs(out), token),
            }
        )
    u = usage(choices)
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": items,
        "usage": u,
        "sglext": sglext(u),
    }


def chat_chunk(
    rid: str,
    model: str,
    index: int,
    delta: Mapping[str, Any],
    reason: str | None,
    logprobs: Any = None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": index, "delta": dict(delta), "finish_reason": reason, "logprobs": logprobs}
        ],
    }


def usage_chunk(rid: str, model: str, obj: str, choices: Sequence[Choice]) -> dict[str, Any]:
    """The last chunk of a stream with ``include_usage``: no choices, the usage."""
    u = usage(choices)
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": u,
        "sglext": sglext(u),
    }


_KIND_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "invalid_request_error",
    503: "service_unavailable",
}


def kind_for_status(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status."""
    return _KIND_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(
    message: str,
    *,
    param: str | None = None,
    kind: str = "invalid_request_error",
    code: int | str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
