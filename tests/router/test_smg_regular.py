"""hicache servers behind SGLang's real router (``smg launch``), regular mode.

smg registers a ``hicache serve --host 127.0.0.1`` worker as an SGLang worker (its
``/server_info`` answers, its ``/version`` does not) and polls its ``/v1/loads``;
greedy answers through smg equal the worker's own; smg's ``POST /flush_cache`` fan-out
empties the worker's cache; ``cache_aware`` routing gets more prompt tokens from the
workers' caches than ``round_robin`` on a multi-tenant shared-prefix workload; and a
worker that dies is taken out by smg's health checks while the survivor answers.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

import httpx

from hicache.bench.serverproc import ServerProcess
from tests.helpers.smg import Smg
from tests.router.conftest import ROUTER_KEY, StartWorker

ADMIN = {"Authorization": f"Bearer {ROUTER_KEY}"}
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to"


def generate(url: str, text: str, max_new_tokens: int = 8, **headers: str) -> dict[str, Any]:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    r = httpx.post(f"{url}/generate", json=body, headers=headers or ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def chat(url: str, content: str) -> dict[str, Any]:
    body = {
        "model": "tiny-random-llama",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def streamed_text(url: str, prompt: str) -> str:
    """The text of a streamed greedy ``/v1/completions`` answer, its deltas joined."""
    body = {
        "model": "tiny-random-llama",
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    parts: list[str] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=ADMIN, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                parts.extend(c["text"] for c in event["choices"])
    return "".join(parts)


def flush(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/flush_cache", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text


def finished_requests(server: ServerProcess) -> float:
    """``hicache_requests_total`` summed over finish reasons (requests it answered)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("hicache_requests_total{")
    )


def test_smg_registers_an_sglang_worker_and_routes_to_it(
    workers: Sequence[ServerProcess],
) -> None:
    worker = workers[0]
    info = httpx.get(f"{worker.url}/server_info", timeout=10).json()
    with Smg(worker_urls=[worker.url], policy="cache_aware", api_key=ROUTER_KEY) as smg:
        entry = smg.worker(worker.url)
        assert entry is not None
        assert entry["runtime_type"] == "sglang", entry
        assert entry["worker_type"] == "regular"
        labels = entry["labels"]
        assert labels["model_path"] == "tiny-random-llama"
        assert labels["served_model_name"] == "tiny-random-llama"
        assert labels["max_running_requests"] == str(info["max_running_requests"])
        assert labels["architectures"] == '["LlamaForCausalLM"]'
        # the load monitor is on, and reads the worker's /v1/loads
        (polled,) = smg.wait_workers(
            lambda ws: bool(ws and ws[0].get("engine_load")),
            15,
            "the worker's load polled",
        )
        load = polled["engine_load"]["loads"][0]
        assert load["max_total_num_tokens"] == info["max_total_num_tokens"]
        assert load["max_running_requests"] == info["max_running_requests"]
        log = smg.log_text()
        assert "Detected HTTP backend via /server_info (no /version): sglang" in log
        assert "Starting load monitor for group tiny-random-llama:regular:http" in log

        # greedy answers through smg are the worker's own
        direct = generate(worker.url, PROMPT)
        routed = generate(smg.url, PROMPT)
        assert routed["text"] == direct["text"]
        assert routed["output_ids"] == direct["output_ids"]
        assert routed["meta_info"]["prompt_tokens"] == direct["meta_info"]["prompt_tokens"]
        direct_chat = chat(worker.url, "Name three colours.")
        routed_chat = chat(smg.url, "Name three colours.")
        assert routed_chat["choices"][0]["message"] == direct_chat["choices"][0]["message"]
        assert (
            routed_chat["usage"]["completion_tokens"] == direct_chat["usage"]["completion_tokens"]
        )

        # streamed too: the events' text adds up to the worker's own answer
        assert streamed_text(smg.url, PROMPT) == streamed_text(worker.url, PROMPT) != ""

        # smg's flush reaches the worker: the prompt it had cached is gone
        assert generate(worker.url, PROMPT)["meta_info"]["cached_tokens"] > 0
        r = httpx.post(f"{smg.url}/flush_cache", headers=smg.headers, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["workers_flushed"] == 1
        assert generate(worker.url, PROMPT)["meta_info"]["cached_tokens"] == 0

        # and smg's /health_generate reaches the worker's
        r = httpx.get(f"{smg.url}/health_generate", headers=smg.headers, timeout=30)
        assert r.status_code == 200, r.text


def tenant_prompts(tenants: int, per_tenant: int) -> list[str]:
    """A multi-tenant workload: each tenant's long system prompt (about 250 tokens, its
    own words) and a short question, tenants interleaved (t0, t1, t2, t0, ...)."""
    rng = random.Random(25)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
        for _ in range(400)
    ]
    systems = [
        f"System prompt of tenant {t}: " + " ".join(rng.choice(words) for _ in range(120))
        for t in range(tenants)
    ]
    return [
        f"{systems[t]}\nQuestion {q} of tenant {t}: what is {q * 7 + t}?"
        for q in range(per_tenant)
        for t in range(tenants)
    ]


def cached_share(smg: Smg, prompts: list[str]) -> tuple[float, int, int]:
    """Prompt tokens the workers served from cache over all, for ``prompts`` sent one by
    one through ``smg`` (and the two sums)."""
    cached = total = 0
    for text in prompts:
        meta = generate(smg.url, text, max_new_tokens=2, **smg.headers)["meta_info"]
        cached += meta["cached_tokens"]
        total += meta["prompt_tokens"]
    return cached / total, cached, total


def test_cache_aware_gets_more_cache_hits_than_round_robin(
    workers: Sequence[ServerProcess],
) -> None:
    prompts = tenant_prompts(tenants=3, per_tenant=4)
    urls = [w.url for w in workers]
    shares = {}
    for policy in ("round_robin", "cache_aware"):
        for w in workers:
            flush(w)
        with Smg(worker_urls=urls, policy=policy, api_key=ROUTER_KEY) as smg:
            shares[policy] = cached_share(smg, prompts)
    rr, ca = shares["round_robin"][0], shares["cache_aware"][0]
    assert ca > rr, shares
    # round robin sends each tenant to both workers (two cold prefills per tenant);
    # cache_aware keeps a tenant on one (one cold prefill per tenant)
    assert ca - rr > 0.1, shares


def test_a_dead_worker_is_taken_out_and_the_survivor_answers(
    workers: Sequence[ServerProcess], start_worker: StartWorker
) -> None:
    survivor = workers[0]
    doomed = start_worker()
    with Smg(
        worker_urls=[survivor.url, doomed.url],
        policy="round_robin",
        api_key=ROUTER_KEY,
        health_check_interval_s=1,
        health_failure_threshold=1,
    ) as smg:
        assert doomed.proc is not None
        doomed.proc.kill()
        doomed.proc.wait(10)
        smg.wait_workers(
            lambda ws: not any(w["url"] == doomed.url and w.get("is_healthy") for w in ws),
            20,
            f"{doomed.url} marked unhealthy or removed",
        )
        before = finished_requests(survivor)
        for i in range(6):
            generate(smg.url, f"{PROMPT} {i}", max_new_tokens=2, **smg.headers)
        assert finished_requests(survivor) == before + 6
        entry = smg.worker(survivor.url)
        assert entry is not None and entry["is_healthy"]
    doomed.close()
