"""A live HTTP server over a tiny CPU engine, for the API tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn

from hicache.cache.report import check_integrity
from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.step.scheduler import SchedulerConfig
from hicache.server.app import create_app
from tests.helpers.engine_fixtures import engine_model

MODEL = "tiny-random-llama"
CONTEXT = 128


def make_engine(
    context_length: int = CONTEXT,
    max_running: int = 8,
    per_group: int | None = None,
    disable_radix_cache: bool = False,
    **fields: Any,
) -> Engine:
    """A started engine over :data:`MODEL` (CPU, float32, 4-token pages, 1024 device
    tokens, 32-token prefill chunks): ``max_running`` slots, at most ``per_group`` of
    them per group (None: the scheduler's default), no prefix reuse with
    ``disable_radix_cache``, other :class:`EngineConfig`
    ``fields`` as given (an L3 backend, queue bound, ...)."""
    config = EngineConfig(
        model_path=MODEL,
        dtype="float32",
        device="cpu",
        cache=CacheConfig(page_size=4, device_tokens=1024, hicache_ratio=2.0),
        scheduler=SchedulerConfig(
            max_running_requests=max_running,
            chunked_prefill_size=32,
            max_running_requests_per_group=per_group,
            disable_radix_cache=disable_radix_cache,
        ),
        context_length=context_length,
        **fields,
    )
    return Engine(config, loaded=engine_model(MODEL)).start()


@contextmanager
def serve(engine: Engine, **app_kwargs: Any) -> Iterator[str]:
    """Serve ``create_app(engine, "tiny", **app_kwargs)``; yields the base URL."""
    with serve_app(create_app(engine, "tiny", **app_kwargs)) as url:
        yield url


@contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """Serve ``app`` (an ASGI app) on a free local port; yields the base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(uv)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    try:
        yield url
    finally:
        srv.should_exit = True
        thread.join(10)


def wait_idle(engine: Engine, timeout: float = 30.0) -> None:
    """Wait until the scheduler is idle and the cache holds no request."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        idle = engine.call(
            lambda: engine.core.scheduler.idle and len(engine.core.cache.admitted) == 0
        )
        if idle.result(10):
            return
        time.sleep(0.02)
    raise AssertionError("the engine did not go idle")


def assert_clean(engine: Engine) -> None:
    """Idle, no request holds a page, and every structure passes its integrity check."""
    wait_idle(engine)
    engine.call(lambda: check_integrity(engine.core.cache)).result(30)
    assert engine.call(lambda: len(engine.core.cache.admitted)).result(10) == 0


def post(
    url: str, path: str, body: dict[str, Any], timeout: float = 60, **kw: Any
) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=timeout, **kw)


def sse(r: httpx.Response) -> list[Any]:
    """The JSON payloads of a streamed response, ``"[DONE]"`` kept as a string."""
    import json

    out: list[Any] = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def scrape(url: str, engine: Engine, timeout: float = 30.0) -> str:
    """``GET /metrics`` once the engine has published stats read after this call (a
    scrape exports the last published ones, up to ``EngineConfig.stats_interval_s`` old)."""
    asked = time.monotonic()
    end = asked + timeout
    while (stats := engine.published_stats) is None or stats.at <= asked:
        assert time.monotonic() < end, "the engine published no stats"
        time.sleep(0.01)
    return httpx.get(f"{url}/metrics", timeout=timeout).text
