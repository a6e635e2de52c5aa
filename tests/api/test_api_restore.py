"""Restores at the API (issue 35, item 3): ``POST /hicache/prefetch`` -> ``GET`` states
with exact tokens per tier -> released by the session's next request; ``DELETE``; 400
naming the field, 404, 429.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from hicache.engine.front.engine import Engine
from tests.helpers.api_fixtures import make_engine, post, serve, wait_idle

PROMPT = list(range(300, 345))  # 45 tokens: 11 whole pages of 4
WHOLE = 44


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Engine]]:
    engine = make_engine(
        storage_backend="memory",
        storage_extra_config={
            "store": f"api-restore-{time.monotonic_ns()}",
            "prefetch_threshold": 4,
        },
    )
    try:
        with serve(engine) as url:
            yield url, engine
    finally:
        engine.close()


def generate(url: str, **hint: Any) -> dict[str, Any]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    r = post(url, "/generate", body | hint)
    assert r.status_code == 200, r.text
    return r.json()


def only_in_l3(engine: Engine) -> None:
    wait_idle(engine)
    engine.call(lambda: engine.core.cache.sync(wait=True)).result(timeout=60)
    assert engine.flush_cache()


def state_of(url: str, op_id: str, until: set[str]) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        r = httpx.get(f"{url}/hicache/prefetch/{op_id}", timeout=10)
        assert r.status_code == 200, r.text
        if r.json()["state"] in until:
            return r.json()
        assert time.monotonic() < deadline, r.json()
        time.sleep(0.01)


def test_restore_ready_then_released_by_the_sessions_next_request(
    server: tuple[str, Engine],
) -> None:
    url, engine = server
    first = generate(url)
    only_in_l3(engine)
    r = post(url, "/hicache/prefetch", {"input_ids": PROMPT, "session_id": "s1", "ttl_ms": 60000})
    assert r.status_code == 200, r.text
    op = r.json()
    assert op["state"] == "queued" and op["tokens"] == WHOLE and op["session_id"] == "s1"
    ready = state_of(url, op["operation_id"], {"ready"})
    assert ready["resident_tokens"] == {"device": WHOLE, "host": WHOLE, "storage": WHOLE}
    again = generate(url, session_id="s1")
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] == WHOLE
    done = state_of(url, op["operation_id"], {"released"})
    assert done["resident_tokens"]["host"] == WHOLE
    r = httpx.delete(f"{url}/hicache/prefetch/{op['operation_id']}", timeout=30)
    assert r.status_code == 200 and r.json()["state"] == "released"  # ended: kept


def test_a_text_restore_and_its_cancel(server: tuple[str, Engine]) -> None:
    url, _ = server
    r = post(url, "/hicache/prefetch", {"text": "hello there, a few words", "session_id": "s2"})
    assert r.status_code == 200, r.text
    op_id = r.json()["operation_id"]
    state_of(url, op_id, {"ready", "failed"})
    r = httpx.delete(f"{url}/hicache/prefetch/{op_id}", timeout=30)
    assert r.status_code == 200 and r.json()["state"] in ("cancelled", "failed")


def test_closing_a_session_that_only_restores_ends_its_hold(server: tuple[str, Engine]) -> None:
    url, engine = server
    generate(url)
    only_in_l3(engine)
    r = post(url, "/hicache/prefetch", {"input_ids": PROMPT, "session_id": "s3"})
    assert r.status_code == 200, r.text
    op_id = r.json()["operation_id"]
    state_of(url, op_id, {"ready"})
    closed = httpx.delete(f"{url}/hicache/sessions/s3", timeout=30)
    assert closed.status_code == 200, closed.text  # no request yet, but a hold to end
    assert state_of(url, op_id, {"cancelled"})["error"] == "the session was closed"
    assert httpx.delete(f"{url}/hicache/sessions/s3", timeout=30).status_code == 404


def test_unknown_operations_are_404(server: tuple[str, Engine]) -> None:
    url, _ = server
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{url}/hicache/prefetch/restore-nope", timeout=10)
        assert r.status_code == 404, r.text
        assert "restore-nope" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"session_id": "s"}, "input_ids"),  # neither
        ({"input_ids": PROMPT, "text": "x", "session_id": "s"}, "input_ids"),  # both
        ({"input_ids": PROMPT, "session_id": "s", "ttl_ms": -1}, "ttl_ms"),
        ({"input_ids": PROMPT, "session_id": "s", "ttl_ms": "100"}, "ttl_ms"),
        ({"input_ids": PROMPT, "session_id": "s", "ttl_ms": 1.5}, "ttl_ms"),
        ({"input_ids": PROMPT, "session_id": "s", "ttl_ms": 86_400_001}, "ttl_ms"),
        ({"input_ids": PROMPT}, "session_id"),
        ({"input_ids": PROMPT[:3], "session_id": "s"}, "input_ids"),  # under a page
        ({"input_ids": [10**9], "session_id": "s"}, "input_ids"),
        ({"input_ids": PROMPT, "session_id": "s", "tll_ms": 5}, "tll_ms"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(
    server: tuple[str, Engine], body: dict[str, Any], param: str
) -> None:
    url, _ = server
    r = post(url, "/hicache/prefetch", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_nan_ttl_is_400_naming_it(server: tuple[str, Engine]) -> None:
    url, _ = server
    raw = '{"input_ids": [1, 2, 3, 4], "session_id": "s", "ttl_ms": NaN}'
    r = httpx.post(
        f"{url}/hicache/prefetch",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "ttl_ms" and "ttl_ms=nan" in r.text


def test_over_the_bound_is_429(server: tuple[str, Engine]) -> None:
    url, engine = server
    book = engine.core.restores.book
    body = {"input_ids": PROMPT, "session_id": "s3"}
    book.max_ops = 1
    try:
        first = post(url, "/hicache/prefetch", body)
        assert first.status_code == 200, first.text
        r = post(url, "/hicache/prefetch", body)
        assert r.status_code == 429, r.text
        assert "--hicache-restore-max-ops=1" in r.json()["error"]["message"]
    finally:
        book.max_ops = 16
    httpx.delete(f"{url}/hicache/prefetch/{first.json()['operation_id']}", timeout=30)
