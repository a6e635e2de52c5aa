"""The engine and its HTTP server end to end, on tiny random models (CPU, fp32).

* greedy outputs are byte-identical whether the prefix came from nowhere (cold), from L1,
  from L2 after forced eviction, or was recomputed after ``/flush_cache``;
* the OpenAI-compatible API through real clients (httpx and the openai package),
  streaming included, and bad requests answered with a 400 that names the problem;
* no leak: once requests end, every L1 page is free or the tree's and every pin is zero.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from hicache.cache.report import cache_stats, check_integrity
from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.sampling import SamplingParams
from hicache.engine.step.scheduler import SchedulerConfig
from hicache.server.app import create_app
from tests.helpers.api_fixtures import scrape
from tests.helpers.engine_fixtures import engine_model
from tests.helpers.tier_walk import demote_all, run_all

MODEL = "tiny-random-llama"
PAGE = 4


def make_engine(**cache: object) -> Engine:
    cfg: dict[str, object] = dict(
        page_size=PAGE, device_tokens=256, hicache_ratio=4.0, load_back_threshold=0
    )
    cfg.update(cache)
    config = EngineConfig(
        model_path=MODEL,
        dtype="float32",
        device="cpu",
        cache=CacheConfig(**cfg),  # type: ignore[arg-type]
        scheduler=SchedulerConfig(max_running_requests=8, chunked_prefill_size=32),
        context_length=128,
    )
    return Engine(config, loaded=engine_model(MODEL)).start()


def assert_clean(engine: Engine) -> None:
    """Idle engine: no held pages, all pins zero, allocators agree with the tree."""

    def check() -> None:
        assert engine.core.scheduler.idle
        engine.core.cache.sync(wait=True)
        check_integrity(engine.core.cache)
        assert all(
            n.lock_ref == 0 and n.host_ref == 0
            for n in engine.core.cache.full.pages.tree.iter_nodes()
        )

    engine.call(check).result(timeout=30)


PROMPT = list(range(300, 345))  # 45 tokens: 11 whole pages + 1
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def test_greedy_identical_across_tiers() -> None:
    with make_engine() as engine:
        cold = engine.generate(PROMPT, GREEDY, timeout=60)
        assert cold.cached.total == 0 and len(cold.output_ids) == 12
        from_l1 = engine.generate(PROMPT, GREEDY, timeout=60)
        assert from_l1.cached.device == 44 and from_l1.cached.host == 0
        assert demote_all(engine) > 0
        from_l2 = engine.generate(PROMPT, GREEDY, timeout=60)
        assert from_l2.cached.device == 0 and from_l2.cached.host == 44
        assert engine.flush_cache()
        recomputed = engine.generate(PROMPT, GREEDY, timeout=60)
        assert recomputed.cached.total == 0
        texts = {o.text for o in (cold, from_l1, from_l2, recomputed)}
        ids = {tuple(o.output_ids) for o in (cold, from_l1, from_l2, recomputed)}
        assert len(ids) == 1 and len(texts) == 1
        assert_clean(engine)


def test_concurrent_requests_share_prefix_under_pressure() -> None:
    """Many requests on a small L1 force eviction, load back and retraction; outputs stay
    equal to each prompt's solo output."""
    with make_engine(device_tokens=96) as engine:
        prompts = [PROMPT[:20] + [500 + i] * 9 for i in range(6)]
        solo = [engine.generate(p, GREEDY, timeout=60).output_ids for p in prompts]
        assert engine.flush_cache()
        assert run_all(engine, prompts, GREEDY) == solo
        assert_clean(engine)


ADMIN_KEY = "sk-admin"


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Engine]]:
    engine = make_engine()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(
        create_app(engine, "tiny", admin_api_key=ADMIN_KEY),
        host="127.0.0.1",
        port=port,
        log_level="warning",
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    yield url, engine
    srv.should_exit = True
    thread.join(10)
    engine.close()


def test_completions_text_and_token_ids(server: tuple[str, Engine]) -> None:
    url, engine = server
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["choices"][0]["finish_reason"] == "length"
    usage = out["usage"]
    assert usage["prompt_tokens"] == 45 and usage["completion_tokens"] == 8
    assert set(usage["cached_tokens_details"]) == {"device", "host", "storage"}
    r2 = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert r2["choices"][0]["text"] == out["choices"][0]["text"]
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == 44
    text = {"prompt": "Hello there, how are", "max_tokens": 4, "temperature": 0}
    r3 = httpx.post(f"{url}/v1/completions", json=text, timeout=60)
    assert r3.status_code == 200 and r3.json()["usage"]["completion_tokens"] == 4
    assert_clean(engine)


def test_streaming_equals_non_streaming(server: tuple[str, Engine]) -> None:
    url, engine = server
    body = {"prompt": PROMPT[::-1], "max_tokens": 10, "temperature": 0}
    full = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    pieces: list[str] = []
    last: dict[str, object] = {}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        last = json.loads(ln[6:])
        pieces.append(last["choices"][0]["text"])  # type: ignore[index]
    assert "".join(pieces) == full["choices"][0]["text"]
    assert last["usage"]["completion_tokens"] == 10  # type: ignore[index]
    assert_clean(engine)


def test_chat_through_openai_client(server: tuple[str, Engine]) -> None:
    openai = pytest.importorskip("openai")
    url, engine = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    msgs = [{"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == r.choices[0].message.content
    assert client.models.list().data[0].id == "tiny"
    assert_clean(engine)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"prompt": PROMPT, "temperature": "hot"}, "temperature"),
        ({"prompt": PROMPT, "max_tokens": "many"}, "max_tokens"),
        ({"prompt": ""}, "empty"),
        ({"prompt": []}, "empty"),
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt": [1, 2, 10**9]}, "vocabulary"),
        ({"prompt": [-1, 2]}, "vocabulary"),
        ({"prompt": list(range(200))}, "context length"),
        ({"prompt": PROMPT, "top_p": 0}, "top_p"),
        ({"prompt": PROMPT, "n": 0}, "n"),
        ({"max_tokens": 3}, "prompt"),
    ],
)
def test_bad_requests_get_400(
    server: tuple[str, Engine], body: dict[str, object], needle: str
) -> None:
    url, _ = server
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_malformed_json_and_chat_errors(server: tuple[str, Engine]) -> None:
    url, engine = server
    r = httpx.post(
        f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(
        f"{url}/v1/chat/completions", json={"messages": [{"role": "pirate", "content": "x"}]}
    )
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200  # still serving
    assert_clean(engine)


def test_disconnect_mid_stream_frees_everything(server: tuple[str, Engine]) -> None:
    url, engine = server
    body = {"prompt": PROMPT[:30], "max_tokens": 100, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for ln in r.iter_lines():
            if ln.startswith("data: "):
                break  # leave after the first chunk: the client goes away
    for _ in range(100):
        if engine.call(lambda: engine.core.scheduler.idle).result(10):
            break
        time.sleep(0.05)
    assert_clean(engine)


def test_metrics_and_flush(server: tuple[str, Engine]) -> None:
    url, engine = server
    httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=60)
    text = httpx.get(f"{url}/metrics").text
    for name in (
        "hicache_cache_hit_rate",
        "hicache_host_cached_tokens",
        "hicache_host_used_tokens",
        "hicache_host_total_tokens",
        "hicache_device_evicted_tokens_total",
        "hicache_load_tokens_total",
        "hicache_backup_bytes_total",
        "hicache_ttft_seconds_bucket",
        "hicache_queue_time_seconds_bucket",
    ):
        assert name in text, name

    def count(metric: str) -> float:
        return float(next(ln for ln in text.splitlines() if ln.startswith(metric)).split()[-1])

    # every request that got a first token was admitted before: it has a queue time too
    assert count("hicache_queue_time_seconds_count") >= count("hicache_ttft_seconds_count") >= 1
    r = httpx.post(f"{url}/flush_cache", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200
    after = httpx.post(
        f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=60
    )
    assert after.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert_clean(engine)


def test_cache_salt_isolates_tenants() -> None:
    with make_engine() as engine:
        done: list[object] = []

        def run(salt: str):  # type: ignore[no-untyped-def]
            from concurrent.futures import Future

            fut: Future[object] = Future()
            engine.submit(
                PROMPT, GREEDY, lambda o: fut.set_result(o) if o.finished else None, cache_salt=salt
            )
            return fut.result(timeout=60)

        public = run("")
        acme = run("acme")
        acme_again = run("acme")
        public_again = run("")
        done += [public, acme]
        assert acme.cached.total == 0  # the public prefix is not acme's
        assert acme_again.cached.device == 44  # acme's own prefix is
        assert public_again.cached.device == 44
        assert acme.output_ids == public.output_ids
        assert_clean(engine)


def test_metrics_values_match_the_cache(server: tuple[str, Engine]) -> None:
    """The exported values, not just the names: /metrics agrees with the cache's own
    counters after a cold and a warm request of the same prompt."""
    url, engine = server
    prompt = [(13 * i + 5) % 3000 + 200 for i in range(45)]
    for _ in range(2):
        r = httpx.post(
            f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60
        )
        assert r.status_code == 200
    warm = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert warm == 44  # 11 whole pages of the 45-token prompt (the last token is computed)
    engine.call(lambda: engine.core.cache.sync(wait=True)).result(timeout=60)
    stats = engine.call(lambda: cache_stats(engine.core.cache)).result(timeout=60)
    families = {f.name: f for f in text_string_to_metric_families(scrape(url, engine))}

    def value(name: str, **labels: str) -> float:
        for s in families[name].samples:
            if s.labels == labels and not s.name.endswith("_created"):
                return s.value
        raise AssertionError(f"no sample {name} {labels}")

    c = stats.counters
    assert value("hicache_query_tokens") == c["query_tokens_total"]
    assert value("hicache_device_hit_tokens") == c["device_hit_tokens_total"]
    assert value("hicache_host_hit_tokens") == c["host_hit_tokens_total"]
    assert value("hicache_backup_tokens") == c["backup_tokens_total"]
    assert value("hicache_device_tokens", holder="cache") == stats.device_cached_tokens
    assert value("hicache_host_cached_tokens") == stats.host_cached_tokens
    assert value("hicache_host_total_tokens") == stats.host_total_tokens
    assert value("hicache_cache_hit_rate") == pytest.approx(stats.hit_rate)
    assert c["device_hit_tokens_total"] >= warm
