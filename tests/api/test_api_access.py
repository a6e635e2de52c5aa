"""Every route has a declared key (``hicache.server.access.ROUTE_ACCESS``), the guard
enforces it, and ``docs/security.md`` lists exactly that table.

Walks the real route table of ``create_app`` (so a new route without a decision fails
here), then calls every route without a key, with the inference key and with the admin
key, under each key configuration. The defect: ``/flush_cache`` was checked against
``--api-key`` (an inference user could wipe every tenant's L1 and L2, the admin key got a
401, and with no keys anyone could flush); ``/docs`` and ``/openapi.json`` answered
without a key when ``--api-key`` was set.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.testclient import TestClient

from hicache.engine.front.engine import Engine
from hicache.server.access import ROUTE_ACCESS, Access, markdown_table, route_methods
from hicache.server.app import create_app
from tests.helpers.api_fixtures import make_engine

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
INFERENCE_KEY = "sk-inference"
ADMIN_KEY = "sk-admin"
NO_KEY: dict[str, str] = {}
INFERENCE = {"authorization": f"Bearer {INFERENCE_KEY}"}
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}

BODIES: dict[tuple[str, str], Any] = {
    ("POST", "/v1/completions"): {"prompt": [1, 2, 3], "max_tokens": 1},
    ("POST", "/v1/chat/completions"): {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
    },
    ("POST", "/generate"): {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}},
    ("PUT", "/hicache/storage-backend"): {"bogus": 1},  # a 400 once the key passed
    ("POST", "/hicache/prefetch"): {"bogus": 1},
}
"""Bodies that a route past the guard answers without changing anything lasting."""


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    e = make_engine()
    yield e
    e.close()


def call(client: TestClient, method: str, path: str, headers: dict[str, str]) -> Any:
    url = path.replace("{model_id:path}", "tiny").replace("{operation_id}", "restore-none")
    body = BODIES.get((method, path))
    return client.request(method, url, json=body, headers=headers)


def test_every_route_has_a_decision_and_the_doc_lists_the_table(engine: Engine) -> None:
    app = create_app(engine, "tiny", api_key=INFERENCE_KEY, admin_api_key=ADMIN_KEY)
    served = route_methods(app.routes)
    undecided = served - set(ROUTE_ACCESS)
    assert not undecided, f"routes without an entry in ROUTE_ACCESS: {sorted(undecided)}"
    stale = set(ROUTE_ACCESS) - served
    assert not stale, f"ROUTE_ACCESS entries for routes the app does not serve: {sorted(stale)}"
    doc = DOC.read_text()
    table = markdown_table()
    assert table in doc, "docs/security.md's route table differs from markdown_table()"
    rows = [ln for ln in doc.splitlines() if ln.startswith("| `") and ln.count("`") >= 2]
    listed = {
        tuple(ln.split("`")[1].split(" ", 1)) for ln in rows if ln.split("`")[1][:1].isupper()
    }
    assert listed == set(ROUTE_ACCESS), listed ^ set(ROUTE_ACCESS)


def test_cache_changing_routes_need_the_admin_key() -> None:
    changing = {k for k, v in ROUTE_ACCESS.items() if v is Access.ADMIN}
    assert changing == {
        ("POST", "/flush_cache"),
        ("PUT", "/hicache/storage-backend"),
        ("DELETE", "/hicache/storage-backend"),
    }
    assert ROUTE_ACCESS[("GET", "/health")] is Access.OPEN
    assert ROUTE_ACCESS[("GET", "/metrics")] is Access.METRICS


def expected(access: Access, config: str, headers: dict[str, str]) -> int | None:
    """The status the guard answers (None: it lets the request through)."""
    keys = config != "none"
    if access is Access.OPEN:
        return None
    if access is Access.ADMIN:
        if not keys:
            return 403
        return None if headers is ADMIN else 401
    if access is Access.METRICS and config != "metrics":
        return None
    if not keys:
        return None
    return None if headers is INFERENCE else 401


CONFIGS = {
    "none": {},
    "keys": {"api_key": INFERENCE_KEY, "admin_api_key": ADMIN_KEY},
    "metrics": {
        "api_key": INFERENCE_KEY,
        "admin_api_key": ADMIN_KEY,
        "metrics_require_api_key": True,
    },
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_each_route_answers_as_its_entry_says(engine: Engine, config: str) -> None:
    app = create_app(engine, "tiny", **CONFIGS[config])
    with TestClient(app) as client:
        for (method, path), access in ROUTE_ACCESS.items():
            for name, headers in (("no key", NO_KEY), ("inference", INFERENCE), ("admin", ADMIN)):
                r = call(client, method, path, headers)
                want = expected(access, config, headers)
                what = f"{method} {path} with {name} ({config}): {r.status_code} {r.text[:200]}"
                if want is None:
                    assert r.status_code not in (401, 403), what
                    assert r.status_code < 500, what
                else:
                    assert r.status_code == want, what
                    assert r.json()["error"]["type"] in (
                        "authentication_error",
                        "permission_error",
                        "invalid_request_error",
                    ), what
                    assert "key" in r.json()["error"]["message"], what


def test_flush_needs_the_admin_key_not_the_inference_key(engine: Engine) -> None:
    app = create_app(engine, "tiny", api_key=INFERENCE_KEY, admin_api_key=ADMIN_KEY)
    with TestClient(app) as client:
        assert client.post("/flush_cache", headers=INFERENCE).status_code == 401
        assert client.post("/flush_cache").status_code == 401
        r = client.post("/flush_cache", headers=ADMIN)
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "ok"
    with TestClient(create_app(engine, "tiny")) as client:  # no keys: refused, as attach is
        r = client.post("/flush_cache")
        assert r.status_code == 403 and "--admin-api-key" in r.json()["error"]["message"]
        assert client.get("/docs").status_code == 200  # no --api-key: the docs are open
        assert client.get("/openapi.json").status_code == 200


def test_docs_need_the_api_key_when_one_is_set(engine: Engine) -> None:
    app = create_app(engine, "tiny", api_key=INFERENCE_KEY)
    with TestClient(app) as client:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert client.get(path).status_code == 401, path
            assert client.get(path, headers=INFERENCE).status_code == 200, path
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200


def test_a_route_without_a_decision_is_refused(engine: Engine) -> None:
    app: FastAPI = create_app(engine, "tiny")

    @app.get("/undecided")
    async def undecided() -> JSONResponse:
        return JSONResponse({"secret": 1})

    with TestClient(app) as client:
        r = client.get("/undecided")
        assert r.status_code == 403 and "no access decision" in r.json()["error"]["message"]
        assert client.get("/nowhere").status_code == 404
        assert client.delete("/flush_cache").status_code == 405
