"""Who may call which route: one declared table (:data:`ROUTE_ACCESS`) and the ASGI
middleware that enforces it (:class:`AccessGuard`) before any body is read.

Every route of the app, FastAPI's documentation routes included, has one entry ``(method,
path template) -> Access``; a route without one is refused (403), and
``tests/api/test_api_access.py`` walks the real route table so a new route without a
decision fails, and checks that ``docs/security.md`` lists exactly these rows
(:func:`markdown_table`). Policy: inference, documentation, ``/server_info``,
``/model_info`` and ``/health_generate`` need ``--api-key`` when set; routes that change or
discard cached state need ``--admin-api-key`` (403 when none is configured); ``/health`` is
open; ``/metrics`` and the loads are open unless ``--metrics-require-api-key``. Why each:
``docs/security.md``. :func:`key_refusal` is the one check of a key, also used by the gRPC
worker (:mod:`hicache.server.grpc_worker`) for its RPCs.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

from hicache.server.http_base import error_response
from hicache.server.state import ServerState

__all__ = [
    "ROUTE_ACCESS",
    "Access",
    "AccessGuard",
    "KeyRefusal",
    "key_refusal",
    "markdown_table",
    "route_methods",
]


class Access(enum.Enum):
    """The key a route needs."""

    OPEN = "open"
    """No key, ever."""
    INFERENCE = "api-key"
    """``--api-key`` when one is set (else open)."""
    METRICS = "metrics"
    """Open; ``--api-key`` (when set) with ``--metrics-require-api-key``."""
    ADMIN = "admin-api-key"
    """``--admin-api-key``; refused (403) when the server has none."""


_DESCRIBE = {
    Access.OPEN: "none",
    Access.INFERENCE: "`--api-key` when set, else none",
    Access.METRICS: "none; `--api-key` with `--metrics-require-api-key`",
    Access.ADMIN: "`--admin-api-key` (refused with 403 when none is configured)",
}

ROUTE_ACCESS: Mapping[tuple[str, str], Access] = MappingProxyType(
    {
        ("GET", "/health"): Access.OPEN,
        ("GET", "/metrics"): Access.METRICS,
        ("POST", "/v1/completions"): Access.INFERENCE,
        ("POST", "/v1/chat/completions"): Access.INFERENCE,
        ("GET", "/v1/models"): Access.INFERENCE,
        ("GET", "/v1/models/{model_id:path}"): Access.INFERENCE,
        ("POST", "/generate"): Access.INFERENCE,
        ("POST", "/flush_cache"): Access.ADMIN,
        ("PUT", "/hicache/storage-backend"): Access.ADMIN,
        ("DELETE", "/hicache/storage-backend"): Access.ADMIN,
        ("DELETE", "/hicache/sessions/{session_id}"): Access.INFERENCE,
        ("POST", "/hicache/prefetch"): Access.INFERENCE,
        ("GET", "/hicache/prefetch/{operation_id}"): Access.INFERENCE,
        ("DELETE", "/hicache/prefetch/{operation_id}"): Access.INFERENCE,
        ("GET", "/server_info"): Access.INFERENCE,
        ("GET", "/get_server_info"): Access.INFERENCE,
        ("GET", "/model_info"): Access.INFERENCE,
        ("GET", "/get_model_info"): Access.INFERENCE,
        ("GET", "/v1/loads"): Access.METRICS,
        ("GET", "/get_load"): Access.METRICS,
        ("GET", "/health_generate"): Access.INFERENCE,
        ("GET", "/openapi.json"): Access.INFERENCE,
        ("GET", "/docs"): Access.INFERENCE,
        ("GET", "/docs/oauth2-redirect"): Access.INFERENCE,
        ("GET", "/redoc"): Access.INFERENCE,
    }
)
"""``(method, path template)`` -> the key it needs, for every route of the app."""

_WHAT = {
    ("GET", "/health"): "liveness: 200 while the engine loop runs",
    ("GET", "/metrics"): "Prometheus metrics (the engine's published stats; never waits on it)",
    ("POST", "/v1/completions"): "OpenAI completions",
    ("POST", "/v1/chat/completions"): "OpenAI chat completions",
    ("GET", "/v1/models"): "the served model",
    ("GET", "/v1/models/{model_id:path}"): "one model",
    ("POST", "/generate"): "SGLang's native generation",
    ("POST", "/flush_cache"): "empties L1 and L2 (every tenant's)",
    ("PUT", "/hicache/storage-backend"): "attaches an L3 backend",
    ("DELETE", "/hicache/storage-backend"): "detaches the L3 backend",
    ("DELETE", "/hicache/sessions/{session_id}"): "ends an agent session's retention",
    ("POST", "/hicache/prefetch"): "restores a session's prefix from L3 into L2 and holds it",
    ("GET", "/hicache/prefetch/{operation_id}"): "a restore's state and tokens per tier",
    ("DELETE", "/hicache/prefetch/{operation_id}"): "cancels a restore (its hold given back)",
    ("GET", "/server_info"): "serving arguments under SGLang's names (what a router reads)",
    ("GET", "/get_server_info"): "`/server_info` under SGLang's older name",
    ("GET", "/model_info"): "the model: path, tokenizer, type, architectures",
    ("GET", "/get_model_info"): "`/model_info` under SGLang's older name",
    ("GET", "/v1/loads"): "load under SGLang's names (the engine's published stats)",
    ("GET", "/get_load"): "load, SGLang's older form",
    ("GET", "/health_generate"): "one greedy token through the engine: 200, else 503 and why",
    ("GET", "/openapi.json"): "the OpenAPI schema",
    ("GET", "/docs"): "Swagger UI",
    ("GET", "/docs/oauth2-redirect"): "Swagger UI's OAuth2 redirect",
    ("GET", "/redoc"): "ReDoc",
}


@dataclass(frozen=True, slots=True)
class KeyRefusal:
    """Why a call was refused its key: ``status`` 401 (key missing or wrong) or 403 (the
    call needs the admin key and the server has none), and the message to answer."""

    status: int
    message: str


def _bearer(authorization: str, key: str) -> bool:
    """Whether ``authorization`` (the header's value) is ``Bearer <key>`` (compared in
    constant time)."""
    return secrets.compare_digest(authorization.encode(), f"Bearer {key}".encode())


def key_refusal(
    access: Access,
    authorization: str,
    *,
    api_key: str | None,
    admin_api_key: str | None,
    metrics_require_api_key: bool = False,
) -> KeyRefusal | None:
    """None when a call whose ``Authorization`` value is ``authorization`` ("" when
    absent) may use a route or RPC that needs ``access``; else why not."""
    if access is Access.OPEN or (access is Access.METRICS and not metrics_require_api_key):
        return None
    if access is not Access.ADMIN:  # INFERENCE, and METRICS behind the api key
        if api_key is None or _bearer(authorization, api_key):
            return None
        return KeyRefusal(401, "API key missing or wrong (Authorization: Bearer <key>)")
    if admin_api_key is None:
        return KeyRefusal(
            403,
            "this call needs the admin key and none is configured"
            " (start the server with --admin-api-key)",
        )
    if _bearer(authorization, admin_api_key):
        return None
    return KeyRefusal(401, "admin API key missing or wrong (Authorization: Bearer <admin key>)")


def route_methods(routes: list[BaseRoute]) -> set[tuple[str, str]]:
    """``(method, path)`` of every HTTP route (HEAD, which Starlette adds to GET, left
    out: it is answered as the GET is)."""
    out: set[tuple[str, str]] = set()
    for r in routes:
        methods = getattr(r, "methods", None)
        path = getattr(r, "path", None)
        if methods is None or path is None:
            continue
        out.update((m, path) for m in methods if m != "HEAD")
    return out


def markdown_table() -> str:
    """The route table of ``docs/security.md`` (one row per route and method)."""
    lines = ["| route | what | key needed |", "|---|---|---|"]
    for (method, path), access in ROUTE_ACCESS.items():
        lines.append(
            f"| `{method} {path}` | {_WHAT.get((method, path), '')} | {_DESCRIBE[access]} |"
        )
    return "\n".join(lines)


class AccessGuard:
    """ASGI middleware: checks the key each route needs (:data:`ROUTE_ACCESS`) before the
    route runs or its body is read. An unknown path passes on (the router's 404); a known
    path with a method it does not serve passes on too (the router's 405); a route with
    no entry in the table is refused (403). ``metrics_require_api_key``: ``/metrics``
    needs ``--api-key`` (when one is set)."""

    def __init__(
        self, app: ASGIApp, *, state: ServerState, metrics_require_api_key: bool = False
    ) -> None:
        self.app = app
        self.state = state
        self.metrics_require_api_key = metrics_require_api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = _route_of(scope)
        if route is None:
            await self.app(scope, receive, send)
            return
        method = "GET" if scope["method"] == "HEAD" else scope["method"]
        access = ROUTE_ACCESS.get((method, route))
        denied: Response | None
        if access is None:
            denied = error_response(403, f"{method} {route} has no access decision; refused")
        else:
            denied = self._check(access, Request(scope))
        if denied is not None:
            await denied(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _check(self, access: Access, http: Request) -> Response | None:
        refused = key_refusal(
            access,
            http.headers.get("authorization", ""),
            api_key=self.state.api_key,
            admin_api_key=self.state.admin_api_key,
            metrics_require_api_key=self.metrics_require_api_key,
        )
        return None if refused is None else error_response(refused.status, refused.message)


def _route_of(scope: Scope) -> str | None:
    """The path template of the route serving ``scope`` with its method, else None
    (no route, or only routes of other methods)."""
    app = scope.get("app")
    router = getattr(app, "router", None)
    for r in getattr(router, "routes", ()):
        match, _ = r.matches(scope)
        if match is Match.FULL:
            return getattr(r, "path", None)
    return None
