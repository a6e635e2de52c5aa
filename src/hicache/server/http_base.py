"""HTTP plumbing shared by the server's routes: OpenAI error responses for any status (a
failed request's status by its kind: :data:`FAILURE_STATUS`), the request body limit (a
413), and the ``param`` an error names (pydantic locations, SGLang's spelling of sampling
fields).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hicache.failures import FailureKind, failure_kind
from hicache.server.responses import error_body, kind_for_status

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
"""Largest request body accepted by default (``--max-request-bytes``): 8 MiB."""
_PYDANTIC_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    *,
    kind: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    """OpenAI's error object with HTTP ``status``: ``type`` is ``kind`` (by default the
    status's, :func:`kind_for_status`) and ``code`` a string or null, as OpenAI types it
    (``model_not_found``, ``invalid_api_key`` ...), never the status number."""
    return JSONResponse(
        error_body(message, param=param, kind=kind or kind_for_status(status), code=code),
        status_code=status,
    )


FAILURE_STATUS: dict[FailureKind, int] = {
    FailureKind.INTERNAL: 500,
    FailureKind.REFUSED: 400,
    FailureKind.PEER_TIMEOUT: 504,
    FailureKind.PEER_FAILED: 502,
    FailureKind.STOPPING: 503,
}
"""The HTTP status of a request that failed, by its kind (:mod:`hicache.failures`): the
one place a failure becomes a status. 502, 503 and 504 are statuses a router retries (on
another instance); 400 is not (the request would fail again)."""


def failure_response(error: str) -> JSONResponse:
    """The error response of a request that failed with ``error`` (its status by its kind,
    :data:`FAILURE_STATUS`); a 503 says when to retry."""
    status = FAILURE_STATUS[failure_kind(error)]
    response = error_response(status, error)
    if status == 503:
        response.headers["Retry-After"] = "1"
    return response


def bad_request(message: str, param: str | None = None) -> JSONResponse:
    return error_response(400, message, param)


def invalid_body(exc: ValidationError) -> JSONResponse:
    """The 400 of a body its pydantic model refused: its first error, naming the field."""
    first = exc.errors()[0]
    param = param_of(first.get("loc", ()))
    return bad_request(f"{param or 'body'}: {first.get('msg')}", param=param)


def unparsable_body(cause: BaseException | None) -> str:
    """Why a body could not be read as JSON, from the exception its parser raised:
    not UTF-8, nested too deeply, or a number too long to convert."""
    if isinstance(cause, UnicodeDecodeError):
        return (
            f"the body is not valid UTF-8: byte {cause.object[cause.start]:#04x} at position"
            f" {cause.start} ({cause.reason}); JSON bodies must be UTF-8 text"
        )
    if isinstance(cause, RecursionError):
        return (
            "the body is nested too deeply: its JSON arrays and objects nest deeper than the"
            f" parser's limit (about {sys.getrecursionlimit()} levels)"
        )
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return (
            "the body has a number out of range: an integer with more than"
            f" {sys.get_int_max_str_digits()} digits"
        )
    if isinstance(cause, ValueError):
        return f"the body is not valid JSON: {cause}"
    return "the body could not be read as JSON"


def param_of(loc: Sequence[Any]) -> str | None:
    """The field a pydantic error location names, without ``body`` and union tags:
    ``("body", "prompt", "list[int]", 0)`` -> ``prompt``; ``messages[0].content``."""
    out = ""
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, int):
            if out:
                out += f"[{part}]"
            continue
        text = str(part)
        if text in _PYDANTIC_TAGS or "[" in text or "-" in text:
            if text.startswith("function-"):
                continue
            break  # a union member's tag: what follows is inside that member
        out = f"{out}.{text}" if out else text
    return out or None


_NATIVE_NAMES = {
    "max_tokens": "max_new_tokens",
    "seed": "sampling_seed",
    "min_tokens": "min_new_tokens",
}
_NATIVE_TOP = (
    "text",
    "input_ids",
    "lora_path",
    "image_data",
    "cache_salt",
    "priority",
    "session_id",
    "parent_session_id",
    "session_ttl_ms",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "return_logprob",
    "logprob_start_len",
    "background",
    "return_bytes",
    "return_entropy",
    "top_logprobs_num",
)


def native_param(param: str | None) -> str | None:
    """A sampling field's name as ``/generate`` spells it: ``sampling_params.<name>``."""
    if param is None or param in _NATIVE_TOP or param.startswith("sampling_params"):
        return param
    return f"sampling_params.{_NATIVE_NAMES.get(param, param)}"


class BodyLimit:
    """ASGI middleware: a 413 (OpenAI error object) for a body over ``max_bytes``, by
    ``Content-Length`` or as it streams in. The body is read here (it is small by then)
    and replayed to the app; later ``receive`` calls (disconnect checks) pass through."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        for key, value in scope.get("headers", []):
            if key == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
        buffered: list[Message] = []
        seen = 0
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413, f"the request body is larger than {self.max_bytes} bytes (--max-request-bytes)"
        )
        await response(scope, receive, send)
