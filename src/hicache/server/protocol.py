"""OpenAI-compatible request bodies, validated (responses: :mod:`hicache.server.responses`).

Every field OpenAI (or SGLang) defines that changes the answer is served or refused with a
400 naming it (``param``). Undeclared fields go through :mod:`hicache.server.fields`:
refused when they would change the answer, accepted when they change nothing, accepted
and logged once when no schema knows them. Wrong types or values are rejected by pydantic,
:class:`SamplingParams` and :meth:`Engine.validate`, all with ``param`` set (what is refused
and why: ``docs/api.md``). Extensions (SGLang's names): ``top_k``, ``min_tokens``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``cache_salt`` (at most
:data:`MAX_CACHE_SALT_CHARS` characters), ``priority`` (signed 64-bit; larger = more
important, for the ``priority`` eviction policy), and the agent-session hint
``session_id`` / ``parent_session_id`` (:mod:`hicache.engine.session`; OpenAI clients send
them as extra body fields), and ``max_load_tokens`` (vLLM's name: the most prompt tokens
restored from L2 and L3). Responses carry SGLang's cache report:
``usage.prompt_tokens_details.cached_tokens`` and, per tier, ``usage.cached_tokens_details``
and ``sglext.cached_tokens_details``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from hicache.engine.front.engine import MAX_CACHE_SALT_CHARS, PRIORITY_MAX, PRIORITY_MIN
from hicache.engine.sampling import SEED_MAX, InvalidRequest, SamplingParams
from hicache.engine.session import SessionHint, session_hint
from hicache.server.bootstrap_fields import BootstrapFields
from hicache.server.fields import check_extra_fields

MAX_N = 64
"""Most choices (``n``) one request may ask for: each is one engine request."""
MAX_LOGPROBS = 20
"""Most alternatives per token (``logprobs`` / ``top_logprobs``), as OpenAI allows."""
MAX_BATCH = 256
"""Most prompts in one batched ``/v1/completions`` request."""
MAX_STOP = 4
"""Most ``stop`` strings on the OpenAI routes, as OpenAI allows (``/generate`` takes more,
as SGLang's does)."""

TokenIds = list[StrictInt]
"""A list of token ids: integers only (``true`` is not the token 1)."""


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


class SamplingFields(BootstrapFields):
    """The fields both OpenAI routes share. Undeclared ones are kept (``model_extra``) for
    :func:`~hicache.server.fields.check_extra_fields`."""

    model_config = ConfigDict(extra="allow", strict=False)

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
    session_id: str | None = None
    parent_session_id: str | None = None
    session_ttl_ms: Any = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    max_load_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: TokenIds | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    user: str | None = None

    @property
    def request_priority(self) -> int:
        """``priority``, 0 when not given."""
        return 0 if self.priority is None else self.priority

    def session_hint(self) -> SessionHint | None:
        """The agent-session hint of ``session_id``, ``parent_session_id`` and
        ``session_ttl_ms`` (None for none); :class:`InvalidRequest` naming the field for a bad one."""
        return session_hint(self.session_id, self.parent_session_id, self.session_ttl_ms)

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
        check_extra_fields(self.model_extra)
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise InvalidRequest(
                f"stop has {len(self.stop)} strings; at most {MAX_STOP} are allowed",
                param="stop",
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
                if not (key.isascii() and key.isdigit()):
                    raise InvalidRequest(
                        f"logit_bias key {key!r} is not a token id (a non-negative integer"
                        " in decimal digits)",
                        param="logit_bias",
                    )
                token = int(key)
                if not -100.0 <= value <= 100.0:
                    raise InvalidRequest(
                        f"logit_bias[{key}]={value!r} is invalid; must be in [-100, 100]",
                        param="logit_bias",
                    )
                bias[token] = float(value)
            extras["logit_bias"] = bias
        if self.min_tokens:
            extras["min_tokens"] = self.min_tokens
        if self.max_load_tokens is not None:
            extras["max_load_tokens"] = self.max_load_tokens
        if self.ignore_eos:
            extras["ignore_eos"] = True
        if self.stop_token_ids:
            extras["stop_token_ids"] = tuple(self.stop_token_ids)
        return extras

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """``(logprobs, prompt_logprobs)`` for :class:`SamplingParams` (None = off)."""
        return None, None

    def logprob_start(self) -> int:
        """The first prompt position whose logprob is asked (``logprob_start_len``; 0:
        every one), used when :meth:`logprob_counts` asks for prompt logprobs."""
        return 0

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
            if self.logprob_start():
                kwargs["logprob_start_len"] = self.logprob_start()
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

    prompt: str | TokenIds | list[str] | list[TokenIds]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    logprob_start_len: int | None = Field(default=None, ge=0)
    """SGLang's field as an extension, with ``echo`` and ``logprobs``: the prompt tokens'
    logprobs from this position on (those before it are null); a request that sets it
    reuses a cached prefix of up to ``logprob_start_len - 1`` tokens."""

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
        if self.logprob_start_len is not None and (self.logprobs is None or not self.echo):
            raise InvalidRequest(
                f"logprob_start_len={self.logprob_start_len} applies to the prompt's logprobs,"
                " which only echo=true with logprobs returns",
                param="logprob_start_len",
            )

    def logprob_counts(self) -> tuple[int | None, int | None]:
        if self.logprobs is None:
            return None, None
        return self.logprobs, (self.logprobs if self.echo else None)

    def logprob_start(self) -> int:
        return self.logprob_start_len or 0


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
