"""``/health`` follows the forwards: after ``unhealthy_after_failed_steps`` forwards in a
row raised (each failing its batch's requests) it answers 503 naming the reason, and 200
again once a forward succeeds.

The failure is real: a forward pre-hook on the engine's own model raises while it is
armed, as a kernel that compiles in fp32 but fails in bf16 would, inside the real runner.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch

from hicache.engine.front.engine import EngineConfig
from tests.helpers.api_fixtures import make_engine, post, serve

PROMPT = list(range(300, 345))


class FailingForward:
    """A forward pre-hook raising RuntimeError while ``armed``."""

    def __init__(self) -> None:
        self.armed = True

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        if self.armed:
            raise RuntimeError("injected kernel failure (bf16)")


def health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=10)


def test_health_is_503_after_failed_forwards_and_200_once_one_succeeds() -> None:
    engine = make_engine()
    limit = engine.config.unhealthy_after_failed_steps
    assert limit == 3  # the default
    hook = FailingForward()
    handle = engine.model.model.register_forward_pre_hook(hook)
    try:
        with serve(engine) as url:
            for i in range(limit):
                assert health(url).status_code == 200, f"unhealthy after {i} failures"
                r = post(url, "/v1/completions", {"prompt": PROMPT[i:], "max_tokens": 2})
                assert r.status_code == 500, r.text
                assert "forward failed" in r.json()["error"]["message"]
            r = health(url)
            assert r.status_code == 503, r.text
            body = r.json()
            assert body["status"] == "unavailable"
            message = body["error"]["message"]
            assert f"the last {limit} forwards failed" in message, message
            assert "injected kernel failure (bf16)" in message, message
            state = engine.health()
            assert not state.healthy and state.alive and state.failed_forwards == limit
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
            assert "hicache_engine_healthy 0.0" in metrics

            hook.armed = False
            r = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert health(url).status_code == 200
            assert engine.health().failed_forwards == 0
    finally:
        handle.remove()
        engine.close()


@pytest.mark.parametrize("value", [0, -1, 1.5, "3"])
def test_unhealthy_after_failed_steps_is_validated(value: Any) -> None:
    with pytest.raises(ValueError, match="unhealthy_after_failed_steps"):
        EngineConfig(unhealthy_after_failed_steps=value)


class BlockingForward:
    """A forward pre-hook that, while ``armed``, holds the forward until ``release``."""

    def __init__(self) -> None:
        self.armed = True
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        if self.armed:
            self.entered.set()
            self.release.wait(30)


@pytest.mark.parametrize("check", ["health", "in_flight"])
def test_a_stopping_engine_is_503_on_health_and_for_its_requests_in_flight(check: str) -> None:
    """The engine is told to stop while a forward runs: ``/health`` is 503 from that
    moment (not 200 until the loop has ended its round), and the request in flight is
    answered 503 (the server is going; a router retries it elsewhere), not 500."""
    engine = make_engine()
    hook = BlockingForward()
    handle = engine.model.model.register_forward_pre_hook(hook)
    try:
        with serve(engine) as url, ThreadPoolExecutor(2) as ex:
            body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
            pending = ex.submit(post, url, "/v1/completions", body)
            assert hook.entered.wait(30), "the request never reached a forward"
            closing = ex.submit(engine.close)
            if check == "health":
                deadline = time.monotonic() + 10
                while engine.health().reason is None and time.monotonic() < deadline:
                    time.sleep(0.01)
                r = health(url)  # the forward is still held: the loop has not ended
                assert r.status_code == 503, r.text
                assert "stopping" in r.json()["error"]["message"], r.text
            else:
                time.sleep(0.5)  # told to stop while the forward is held
            hook.armed = False
            hook.release.set()
            closing.result(timeout=60)
            r = pending.result(timeout=60)
            assert r.status_code == 503, r.text
            assert r.headers.get("retry-after") == "1"
            assert "the engine was closed" in r.json()["error"]["message"], r.text
            assert health(url).status_code == 503
    finally:
        hook.release.set()
        handle.remove()
        engine.close()
