"""The engine thread under faults: one request's failure stays its own, a dead or stuck
loop shows on ``/health``, every wait has a deadline, and ``close()`` closes the cache only
once the engine thread is done with it.

Faults are real: parameters that bypass validation (what a buggy caller could hand over),
callbacks that raise, a call that holds the engine thread. Nothing under test is mocked.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn

from hicache.cache.report import cache_stats, check_integrity
from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.request import FinishReason, RequestOutput
from hicache.engine.sampling import SamplingParams
from hicache.engine.step.scheduler import SchedulerConfig
from hicache.server.app import create_app
from tests.helpers.engine_fixtures import engine_model
from tests.helpers.kvdata import FailingLoads

MODEL = "tiny-random-llama"
PROMPT = list(range(300, 345))
LONG = SamplingParams(temperature=0, max_tokens=60)


def make_engine() -> Engine:
    config = EngineConfig(
        model_path=MODEL,
        dtype="float32",
        device="cpu",
        cache=CacheConfig(page_size=4, device_tokens=512, hicache_ratio=2.0),
        scheduler=SchedulerConfig(max_running_requests=8, chunked_prefill_size=32),
        context_length=128,
    )
    return Engine(config, loaded=engine_model(MODEL)).start()


def forced(params: SamplingParams, **fields: object) -> SamplingParams:
    """``params`` with fields set past validation."""
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


class Collect:
    """An output callback keeping every report; ``final`` resolves with the last one."""

    def __init__(self, on_each: Callable[[RequestOutput], None] | None = None) -> None:
        self.outputs: list[RequestOutput] = []
        self.final: Future[RequestOutput] = Future()
        self.first: Future[RequestOutput] = Future()
        self.on_each = on_each

    def __call__(self, out: RequestOutput) -> None:
        self.outputs.append(out)
        if not self.first.done():
            self.first.set_result(out)
        if out.finished and not self.final.done():
            self.final.set_result(out)
        if self.on_each is not None:
            self.on_each(out)


ADMIN_KEY = "sk-admin"


@contextmanager
def serving(engine: Engine) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(engine, "tiny", admin_api_key=ADMIN_KEY)
    config = uvicorn.Config(app, host="127.0.0.1", port=port)
    config.log_level = "warning"
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            httpx.get(f"{url}/v1/models", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(10)


def wait_idle(engine: Engine, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not engine.call(lambda: engine.core.scheduler.idle).result(timeout=within_s):
        assert time.monotonic() < deadline, "the engine did not become idle"
        time.sleep(0.02)


def test_failed_generator_creation_fails_only_its_request() -> None:
    """seed >= 2**64 used to kill the engine thread while /health kept saying ok."""
    with make_engine() as engine, serving(engine) as url:
        good = Collect()
        engine.submit(PROMPT, LONG, good)
        good.first.result(timeout=30)  # running when the bad one arrives
        bad = Collect()
        engine.submit(PROMPT[:20], forced(SamplingParams(temperature=1.0), seed=2**64), bad)
        failed = bad.final.result(timeout=30)
        assert failed.finish_reason is FinishReason.ABORT and failed.error
        assert "seed" in failed.error or "Overflow" in failed.error, failed.error
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        done = good.final.result(timeout=60)
        assert done.error is None and done.finish_reason is FinishReason.LENGTH
        assert len(done.output_ids) == 60
        assert engine.alive and engine.health().healthy
        wait_idle(engine)


def test_raising_call_and_callback_fail_only_themselves() -> None:
    with make_engine() as engine:

        def boom() -> int:
            raise ZeroDivisionError("on purpose")

        with pytest.raises(ZeroDivisionError):
            engine.call(boom).result(timeout=10)

        def broken(out: RequestOutput) -> None:
            raise ValueError("consumer bug")

        broken_cb = Collect(on_each=broken)
        good = Collect()
        engine.submit(PROMPT, LONG, broken_cb)
        engine.submit(PROMPT[::-1], LONG, good)
        assert good.final.result(timeout=60).finish_reason is FinishReason.LENGTH
        assert broken_cb.final.result(timeout=30).finish_reason is FinishReason.ABORT
        assert engine.alive and engine.health().healthy
        assert engine.call(lambda: 7).result(timeout=10) == 7
        wait_idle(engine)


def test_sampling_failure_in_one_row_spares_the_batch() -> None:
    """temperature 1e-40 / top_k >= 2**63 used to fail sampling for the whole batch, so
    every request in flight was aborted; here a row that cannot be sampled fails alone."""
    with make_engine() as engine:
        good = Collect()
        engine.submit(PROMPT, LONG, good)
        good.first.result(timeout=30)
        bad = Collect()
        engine.submit(PROMPT[:20], forced(SamplingParams(temperature=1.0), top_p="x"), bad)
        assert bad.final.result(timeout=30).error
        done = good.final.result(timeout=60)
        assert done.error is None and len(done.output_ids) == 60


def test_dead_loop_shows_on_health_and_fails_fast() -> None:
    engine = make_engine()
    try:
        with serving(engine) as url:
            assert httpx.get(f"{url}/health", timeout=5).json() == {"status": "ok"}

            def die(out: RequestOutput) -> None:
                raise SystemExit("a consumer that takes the thread down")

            engine.submit(PROMPT, LONG, Collect(on_each=die))
            deadline = time.monotonic() + 30
            while engine.alive:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            r = httpx.get(f"{url}/health", timeout=5)
            assert r.status_code == 503, r.text
            assert r.json()["status"] == "unavailable"
            assert "SystemExit" in r.json()["error"]["message"]
            health = engine.health()
            assert not health.healthy and not health.alive
            with pytest.raises(RuntimeError, match="died"):
                engine.submit(PROMPT, LONG)
            with pytest.raises(RuntimeError):
                engine.call(lambda: 1)
            body = {"prompt": PROMPT, "max_tokens": 4}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
            assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
            admin = {"authorization": f"Bearer {ADMIN_KEY}"}
            r = httpx.post(f"{url}/flush_cache", headers=admin, timeout=10)
            assert r.status_code == 503
            metrics = httpx.get(f"{url}/metrics", timeout=10)
            assert metrics.status_code == 200 and "hicache_engine_healthy 0.0" in metrics.text
    finally:
        started = time.monotonic()
        engine.close(timeout=10)
        assert time.monotonic() - started < 5  # the thread is gone: nothing to wait for


def test_stalled_loop_is_unhealthy_and_generate_has_a_deadline() -> None:
    with make_engine() as engine:
        engine.call(lambda: time.sleep(1.0))  # holds the engine thread
        time.sleep(0.3)
        stalled = engine.health(stall_after_s=0.2)
        assert not stalled.healthy and "gone round" in (stalled.reason or "")
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not finish"):
            engine.generate(PROMPT, LONG, timeout=0.2)
        assert time.monotonic() - started < 1.0
        wait_idle(engine)  # the timed-out request was aborted, not left running
        assert engine.health().healthy


def record_cache_close(engine: Engine) -> list[dict[str, Any]]:
    """Wrap ``engine.core.cache.close`` to note when, and on which thread, it ran."""
    calls: list[dict[str, Any]] = []
    real_close = engine.core.cache.close
    engine_thread = engine._thread
    assert engine_thread is not None

    def close() -> None:
        calls.append(
            {
                "at": time.monotonic(),
                "engine_thread_alive": engine_thread.is_alive(),
                "on_engine_thread": threading.current_thread() is engine_thread,
            }
        )
        real_close()

    engine.core.cache.close = close  # type: ignore[method-assign]
    return calls


def test_close_stops_the_thread_before_the_cache_and_ends_requests() -> None:
    engine = make_engine()
    calls = record_cache_close(engine)
    running = Collect()
    engine.submit(PROMPT, SamplingParams(temperature=0, max_tokens=80), running)
    running.first.result(timeout=30)
    queued_call = engine.call(lambda: time.sleep(0.01))
    engine.close(timeout=30)
    assert calls and not calls[0]["engine_thread_alive"]
    final = running.final.result(timeout=1)  # told, not left waiting
    assert final.finish_reason is FinishReason.ABORT
    queued_call.exception(timeout=1)  # ran or was failed; never left pending
    engine.close()  # idempotent
    assert len(calls) == 1


def test_close_does_not_close_the_cache_under_a_stuck_thread() -> None:
    engine = make_engine()
    calls = record_cache_close(engine)
    release = threading.Event()
    engine.call(lambda: release.wait(10))  # the engine thread is stuck in here
    time.sleep(0.1)
    started = time.monotonic()
    engine.close(timeout=0.3)
    assert time.monotonic() - started < 2  # close() has a deadline
    assert calls == []  # not closed under the running thread
    with pytest.raises(RuntimeError):
        engine.submit(PROMPT, LONG)  # no longer accepting
    released_at = time.monotonic()
    release.set()
    deadline = time.monotonic() + 10
    while not calls:
        assert time.monotonic() < deadline, "the thread did not close the cache on exit"
        time.sleep(0.02)
    assert calls[0]["at"] >= released_at and calls[0]["on_engine_thread"]
    assert not engine.alive
    engine.close(timeout=5)
    assert len(calls) == 1


def test_a_failed_load_back_recomputes_and_answers_as_cold() -> None:
    """Every L2 -> L1 load fails after its layer 0 (the injected copy failure). A request
    whose prefix is in L2 only recomputes it: the same greedy tokens as a cold run, no
    error to the client, one load fallback counted (it used to end with finish_reason
    abort, "loading the cached prefix failed")."""
    params = SamplingParams(temperature=0, max_tokens=8)
    with make_engine() as engine:
        cold = engine.generate(PROMPT, params, timeout=60)
        assert cold.cached.total == 0

        def demote() -> None:
            engine.core.cache.sync(wait=True)
            engine.core.cache.full.pages.evict_device(10**6)  # the prompt's KV is in L2 only now

        engine.call(demote).result(timeout=30)
        hook = FailingLoads()
        hook.on = True
        assert engine.core.cache.full.pages.host_pool is not None
        engine.core.cache.full.pages.host.controller._engine._hook = (
            hook  # the transfer worker's hook
        )
        out = engine.generate(PROMPT, params, timeout=60)
        assert hook.fired.is_set()
        assert out.error is None and out.finish_reason is FinishReason.LENGTH
        assert out.output_ids == cold.output_ids and out.cached.host == 0
        counters = engine.call(lambda: cache_stats(engine.core.cache)).result().counters
        assert counters["load_fallbacks_total"] == 1 and counters["load_failures_total"] == 1
        hook.on = False
        again = engine.generate(PROMPT, params, timeout=60)  # the recompute was cached
        assert again.output_ids == cold.output_ids and again.cached.device == 44

        def check() -> None:
            engine.core.cache.sync(wait=True)
            check_integrity(engine.core.cache)
            assert all(
                n.lock_ref == 0 and n.host_ref == 0
                for n in engine.core.cache.full.pages.tree.iter_nodes()
            )

        engine.call(check).result(timeout=30)
