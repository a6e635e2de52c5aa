"""OpenAI-compatible request bodies (validated) and response builders.

Unknown fields are ignored, as clients send many optional ones; known fields with a wrong
type or value are rejected with a 400 naming the field (see ``server.py``): here by
pydantic, in :class:`SamplingParams` (seed range, finite temperature) and in
:meth:`Engine.validate` (prompt, cache_salt, priority), all with ``param`` set.

Extensions to OpenAI's fields (SGLang's names): ``top_k``, ``cache_salt`` (at most
:data:`MAX_CACHE_SALT_CHARS` characters) and ``priority`` (a signed 64-bit int; larger =
more important, kept on the request for the ``priority`` eviction policy).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from hicache.engine.engine import MAX_CACHE_SALT_CHARS, PRIORITY_MAX, PRIORITY_MIN
from hicache.engine.request import CachedTokens, RequestOutput
from hicache.engine.sampling import SamplingParams


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=False)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1, description="only n=1 is supported")
    cache_salt: str = Field(default="", max_length=MAX_CACHE_SALT_CHARS)
    priority: StrictInt | None = Field(default=None, ge=PRIORITY_MIN, le=PRIORITY_MAX)

    @property
    def request_priority(self) -> int:
        """``priority``, 0 when not given."""
        return 0 if self.priority is None else self.priority

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        """The request's sampling parameters; raises ``InvalidRequest`` naming the field."""
        stop: list[str] = (
            [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        )
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_tokens or default_max_tokens,
            stop=[s for s in stop if s],
            seed=self.seed,
        )


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is text or a list of token ids."""

    prompt: str | list[int]

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: str | list[int]) -> str | list[int]:
        if len(v) == 0:
            raise ValueError("the prompt is empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: messages rendered by the tokenizer's chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @field_validator("messages")
    @classmethod
    def _has_messages(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages is empty")
        return v

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling(default_max_tokens)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(out: RequestOutput) -> dict[str, Any]:
    """OpenAI usage plus ``cached_tokens_details`` per tier."""
    c: CachedTokens = out.cached
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": c.total},
        "cached_tokens_details": {"device": c.device, "host": c.host, "storage": c.storage},
    }


def completion_body(rid: str, model: str, out: RequestOutput) -> dict[str, Any]:
    reason = out.finish_reason.value if out.finish_reason else None
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": out.text, "finish_reason": reason, "logprobs": None}],
        "usage": usage(out),
    }


def completion_chunk(rid: str, model: str, out: RequestOutput) -> dict[str, Any]:
    reason = out.finish_reason.value if out.finished and out.finish_reason else None
    body: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "text": out.delta_text, "finish_reason": reason, "logprobs": None}
        ],
    }
    if out.finished:
        body["usage"] = usage(out)
    return body


def chat_body(rid: str, model: str, out: RequestOutput) -> dict[str, Any]:
    reason = out.finish_reason.value if out.finish_reason else None
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": out.text},
                "finish_reason": reason,
            }
        ],
        "usage": usage(out),
    }


def chat_chunk(rid: str, model: str, out: RequestOutput, *, first: bool) -> dict[str, Any]:
    reason = out.finish_reason.value if out.finished and out.finish_reason else None
    delta: dict[str, Any] = {"content": out.delta_text}
    if first:
        delta["role"] = "assistant"
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": reason}],
    }
    if out.finished:
        body["usage"] = usage(out)
    return body


def error_body(
    message: str, *, param: str | None = None, kind: str = "invalid_request_error"
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
