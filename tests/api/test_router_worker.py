"""What SGLang's router reads from a worker (``hicache.server.router_routes``), on a tiny
engine in this process: ``/server_info`` and ``/model_info`` (and their ``/get_*``
names), ``/v1/loads`` and its sections, ``/get_load``, ``/health_generate``, the
``sglang:`` gauges of ``/metrics``, and the fields smg adds to the bodies it forwards."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicache.engine.front.engine import Engine, EngineStats
from hicache.server.router_routes import one_token
from tests.helpers.api_fixtures import assert_clean, make_engine, post, serve, wait_idle

PROMPT = list(range(300, 345))  # 45 tokens: 11 full 4-token pages


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    e = make_engine()
    yield e
    e.close()


@pytest.fixture(scope="module")
def url(engine: Engine) -> Iterator[str]:
    with serve(engine) as u:
        yield u


def get(url: str, path: str) -> httpx.Response:
    return httpx.get(f"{url}{path}", timeout=30)


def fresh_stats(engine: Engine, timeout: float = 30.0) -> EngineStats:
    """The first stats the engine publishes after this call (what the routes read)."""
    asked = time.monotonic()
    end = asked + timeout
    while (stats := engine.published_stats) is None or stats.at <= asked:
        assert time.monotonic() < end, "the engine published no stats"
        time.sleep(0.01)
    return stats


def test_server_info_has_what_smg_reads(engine: Engine, url: str) -> None:
    r = get(url, "/server_info")
    assert r.status_code == 200
    body = r.json()
    assert body == {
        "model_path": "tiny-random-llama",
        "tokenizer_path": str(engine.model.path),
        "served_model_name": "tiny",
        "tp_size": 1,
        "dp_size": 1,
        "max_running_requests": 8,
        "max_total_num_tokens": 1024,
        "context_length": 128,
        "page_size": 4,
        "dtype": "float32",
        "device": "cpu",
        "schedule_policy": "fcfs",
        "disable_radix_cache": False,
        "enable_hierarchical_cache": True,
        "hicache_storage_backend": None,
        "disaggregation_mode": "null",
        "version": body["version"],
    }
    assert isinstance(body["version"], str) and body["version"]
    assert get(url, "/get_server_info").json() == body


def test_model_info_names_the_model(engine: Engine, url: str) -> None:
    r = get(url, "/model_info")
    assert r.status_code == 200
    assert r.json() == {
        "model_path": "tiny-random-llama",
        "tokenizer_path": str(engine.model.path),
        "served_model_name": "tiny",
        "is_generation": True,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "preferred_sampling_params": None,
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }
    assert get(url, "/get_model_info").json() == r.json()


def test_models_keep_hicache_as_owner(url: str) -> None:
    """smg classifies the worker as SGLang by its ``/server_info`` (it has no
    ``/version``), so ``owned_by`` stays hicache's (tests/router checks smg's verdict)."""
    assert get(url, "/v1/models").json()["data"][0]["owned_by"] == "hicache"
    assert get(url, "/version").status_code == 404


CORE = {
    "dp_rank",
    "num_running_reqs",
    "num_waiting_reqs",
    "num_total_reqs",
    "num_used_tokens",
    "max_total_num_tokens",
    "token_usage",
    "cache_hit_rate",
    "utilization",
    "max_running_requests",
}


def test_loads_are_the_published_stats_under_sglang_names(engine: Engine, url: str) -> None:
    """After a prompt and its repeat: the entry's figures are the engine's published
    stats (the cache holds the prompt's pages; half the looked-up tokens were hits)."""
    for _ in range(2):
        assert post(url, "/generate", {"input_ids": PROMPT, "sampling_params": {
            "max_new_tokens": 1, "temperature": 0}}).status_code == 200  # fmt: skip
    wait_idle(engine)
    stats = fresh_stats(engine)
    r = get(url, "/v1/loads?include=core,disagg,queues,memory")
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"timestamp", "version", "dp_rank_count", "loads", "aggregate"}
    assert body["dp_rank_count"] == 1 and len(body["loads"]) == 1
    entry = body["loads"][0]
    c = stats.cache
    # the prompt's pages are cache an allocation may evict: not load (SGLang's figure)
    used = c.device_total_tokens - c.device_free_tokens - c.device_evictable_tokens
    assert c.device_cached_tokens > 0 and c.hit_rate > 0 and used == c.device_held_tokens
    token_bytes = engine.core.cache.context.spec.token_bytes
    assert entry == {
        "dp_rank": 0,
        "num_running_reqs": 0,
        "num_waiting_reqs": 0,
        "num_total_reqs": 0,
        "num_used_tokens": used,
        "max_total_num_tokens": 1024,
        "token_usage": used / 1024,
        "cache_hit_rate": c.hit_rate,
        "utilization": 0.0,
        "max_running_requests": 8,
        "memory": {
            "kv_cache_gb": 1024 * token_bytes / 1e9,
            "token_capacity": 1024,
            "host_kv_cache_gb": 2048 * token_bytes / 1e9,
            "host_token_capacity": 2048,
            "host_used_tokens": c.host_total_tokens - c.host_free_tokens,
        },
        "queues": {"waiting": 0, "queued": 0},
        "disaggregation": {"mode": "null"},
    }
    assert body["aggregate"] == {
        "total_running_reqs": 0,
        "total_waiting_reqs": 0,
        "total_reqs": 0,
        "avg_token_usage": used / 1024,
        "avg_utilization": 0.0,
    }
    # the timestamp is when the engine read them: an ISO time within the last minute
    read_at = datetime.fromisoformat(body["timestamp"]).timestamp()
    assert time.time() - 60 < read_at <= time.time()


@pytest.mark.parametrize(
    ("include", "sections"),
    [
        (None, set()),
        ("core", set()),
        ("memory", {"memory"}),
        ("core,queues", {"queues"}),
        ("disagg", {"disaggregation"}),
        ("all", {"memory", "queues", "disaggregation"}),
        ("core,lora,speculative", set()),  # sections hicache does not have: ignored
    ],
)
def test_include_picks_the_sections(url: str, include: str | None, sections: set[str]) -> None:
    path = "/v1/loads" if include is None else f"/v1/loads?include={include}"
    entry = get(url, path).json()["loads"][0]
    assert set(entry) == CORE | sections


def test_get_load_is_sglangs_older_form(engine: Engine, url: str) -> None:
    wait_idle(engine)
    stats = fresh_stats(engine)
    c = stats.cache
    assert get(url, "/get_load").json() == [
        {
            "dp_rank": 0,
            "num_reqs": 0,
            "num_waiting_reqs": 0,
            "num_tokens": c.device_total_tokens - c.device_free_tokens,
        }
    ]


def _family(text: str, name: str) -> list[Any]:
    return [f for f in text_string_to_metric_families(text) if f.name == name]


def test_metrics_carry_sglang_gauges_beside_hicaches(engine: Engine, url: str) -> None:
    wait_idle(engine)
    fresh_stats(engine)
    time.sleep(engine.config.stats_interval_s)  # no request since: the next scrape is the same
    text = get(url, "/metrics").text
    pairs = {
        "sglang:num_running_reqs": "hicache_num_running_reqs",
        "sglang:num_queue_reqs": "hicache_num_queue_reqs",
        "sglang:num_used_tokens": "hicache_num_used_tokens",
        "sglang:token_usage": "hicache_token_usage",
        "sglang:max_total_num_tokens": "hicache_device_total_tokens",
        "sglang:cache_hit_rate": "hicache_cache_hit_rate",
    }
    for sglang, ours in pairs.items():
        (family,) = _family(text, sglang)
        assert family.type == "gauge"
        (sample,) = family.samples
        assert sample.labels == {"model_name": "tiny"}, sglang
        (mine,) = _family(text, ours)[0].samples
        assert sample.value == mine.value, (sglang, sample.value, mine.value)
    assert _family(text, "sglang:max_total_num_tokens")[0].samples[0].value == 1024


def test_health_generate_runs_one_token(engine: Engine, url: str) -> None:
    wait_idle(engine)
    before = engine.stats().cache.counters["query_tokens_total"]
    r = get(url, "/health_generate")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert engine.stats().cache.counters["query_tokens_total"] == before + 1
    assert_clean(engine)


def test_health_generate_is_503_with_why_when_the_engine_stopped() -> None:
    e = make_engine()
    with serve(e) as u:
        assert get(u, "/health_generate").status_code == 200
        e.close()
        r = get(u, "/health_generate")
    assert r.status_code == 503
    message = r.json()["error"]["message"]
    assert message.startswith("health generation failed: "), message
    assert "engine" in message


SMG_GENERATE_FIELDS = {
    "model": "unknown",
    "return_text_in_logprobs": False,
    "log_metrics": True,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
}
"""What smg (1.13) adds to a ``/generate`` body it forwards (read off the wire)."""


def test_generate_takes_the_fields_smg_adds(url: str) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    plain = post(url, "/generate", body)
    routed = post(url, "/generate", {**body, **SMG_GENERATE_FIELDS})
    assert plain.status_code == routed.status_code == 200
    assert routed.json()["output_ids"] == plain.json()["output_ids"]
    assert routed.json()["text"] == plain.json()["text"]


@pytest.mark.parametrize("field", ["background", "return_bytes", "return_entropy"])
@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_a_router_flag_set_true_is_refused_naming_it(url: str, path: str, field: str) -> None:
    bodies: dict[str, dict[str, Any]] = {
        "/generate": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}},
        "/v1/completions": {"prompt": PROMPT, "max_tokens": 1},
        "/v1/chat/completions": {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
        },
    }
    ok = post(url, path, {**bodies[path], field: False, "no_logs": True, "log_metrics": False})
    assert ok.status_code == 200, ok.text
    r = post(url, path, {**bodies[path], field: True})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == field
    assert f"{field}=" in error["message"] and "not supported" in error["message"]


def test_health_generate_past_its_bound_aborts_its_request(engine: Engine) -> None:
    """A bound shorter than any step: the answer says so, and the request is aborted
    (the engine ends idle, holding nothing)."""
    wait_idle(engine)
    assert asyncio.run(one_token(engine, 1e-6)) == "no token within 1e-06 s"
    assert_clean(engine)
