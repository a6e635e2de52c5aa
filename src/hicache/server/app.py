"""The HTTP server (FastAPI) over an :class:`Engine`: OpenAI's API and SGLang's native one.

:func:`create_app` assembles the app: the body limit (``max_request_bytes``: 413), the
error handlers, one :class:`~hicache.server.state.ServerState` and the routes, by endpoint
family: :mod:`~hicache.server.openai_routes` (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``), :mod:`~hicache.server.native_routes`
(``/generate``), :mod:`~hicache.server.session_routes` (``/hicache/sessions``),
:mod:`~hicache.server.admin_routes` (``/health``, ``/metrics``,
``/flush_cache``, ``/hicache/storage-backend``) and :mod:`~hicache.server.router_routes`
(what SGLang's router reads). Invariants: every error status answers OpenAI's error object
(a 400 names the field in ``param``); a parameter the server cannot honour is refused,
never ignored; every route's key is declared in
:data:`~hicache.server.access.ROUTE_ACCESS` and checked before the body is read; a full
waiting queue is a 429 with ``Retry-After`` (503 when unhealthy); a client that goes away
aborts its engine requests at once. Every route, parameter and status:
``docs/api.md``; keys: ``docs/security.md``.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hicache.disagg.links import LinksFull
from hicache.engine.admission import AdmissionRefused
from hicache.engine.front.engine import Engine
from hicache.server.access import AccessGuard
from hicache.server.admin_routes import add_admin_routes
from hicache.server.http_base import (
    DEFAULT_MAX_REQUEST_BYTES,
    BodyLimit,
    bad_request,
    error_response,
    param_of,
    unparsable_body,
)
from hicache.server.native_routes import add_native_routes
from hicache.server.openai_routes import add_openai_routes
from hicache.server.restore_routes import add_restore_routes
from hicache.server.router_routes import add_router_routes
from hicache.server.session_routes import add_session_routes
from hicache.server.state import ServerState, refusal_response


def create_app(
    engine: Engine,
    model_name: str | None = None,
    *,
    model_aliases: Sequence[str] = (),
    admin_api_key: str | None = None,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    metrics_require_api_key: bool = False,
) -> FastAPI:
    """The app serving ``engine``. The engine must be started (and is not closed here).

    ``api_key``: when set, the inference endpoints (``/v1/*``, ``/generate``) and the
    documentation (``/docs``, ``/redoc``, ``/openapi.json``) need ``Authorization: Bearer
    <api_key>``. Admin endpoints (``/flush_cache``, L3 attach/detach) need
    ``Authorization: Bearer <admin_api_key>``; without a configured admin key they are
    refused (403). ``metrics_require_api_key``: ``/metrics`` needs ``api_key`` too (it is
    open by default). ``max_request_bytes``: larger bodies get a 413.
    ``model_aliases``: names besides ``model_name`` that a body's ``model`` may give (all
    listed by ``/v1/models``); any other gets a 404 ``model_not_found``.
    """
    app = FastAPI(title="hicache", version="0.1.0")
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    state = ServerState(
        engine,
        model_name or engine.model.name,
        aliases=model_aliases,
        api_key=api_key,
        admin_api_key=admin_api_key,
    )
    app.state.hicache = state
    # added last, so it runs first: the key before the body limit reads any body
    app.add_middleware(AccessGuard, state=state, metrics_require_api_key=metrics_require_api_key)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            loc = first.get("loc", ())
            where = f" at position {loc[-1]}" if loc and isinstance(loc[-1], int) else ""
            why = (first.get("ctx") or {}).get("error") or first.get("msg", "")
            return bad_request(f"the body is not valid JSON: {why}{where}")
        param = param_of(first.get("loc", ()))
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        return bad_request(f"{param or 'body'}: {msg}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _httperror_response(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI's body parse
            return bad_request(unparsable_body(exc.__cause__))
        response = error_response(exc.status_code, str(exc.detail))
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        return response

    @app.exception_handler(AdmissionRefused)
    async def _refused(_: Request, exc: AdmissionRefused) -> JSONResponse:
        return refusal_response(exc)  # the waiting queue is full: 429, or 503 if unhealthy

    @app.exception_handler(LinksFull)
    async def _links_full(_: Request, exc: LinksFull) -> JSONResponse:
        response = error_response(503, str(exc))  # every link to a prefill instance is busy
        response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    add_openai_routes(app, state)
    add_native_routes(app, state)
    add_admin_routes(app, state)
    add_restore_routes(app, state)
    add_router_routes(app, state)
    add_session_routes(app, state)
    return app


__all__ = ["create_app"]
