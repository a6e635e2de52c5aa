"""OpenAI response bodies and stream chunks, built from engine outputs.

Every body carries SGLang's cache report besides OpenAI's fields:
``usage.prompt_tokens_details.cached_tokens`` and, per tier (device / host / storage),
``usage.cached_tokens_details`` and ``sglext.cached_tokens_details``. Errors, whatever the
status, are OpenAI's error object (:func:`error_body`). The request side is
:mod:`hicache.server.protocol`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hicache.engine.request import CachedTokens, RequestOutput


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


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
    ids = out.output_ids
    entries = (
        _as_entry(raw[i], ids[i] if i < len(ids) else None) for i in range(start, len(raw))
    )  # only those asked for: a stream reads each token's once, not all so far per chunk
    return [e for e in entries if e is not None]


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
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error object: ``code`` is a string (``model_not_found`` ...) or null."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
