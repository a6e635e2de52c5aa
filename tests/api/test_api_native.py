"""SGLang's native ``/generate`` and the cache report SGLang's tools read.

The request shapes are those ``sglang.bench_serving`` sends (``--backend sglang``: text or
``input_ids``, ``sampling_params`` with ``max_new_tokens`` / ``ignore_eos``, ``stream``,
``lora_path: null``, ``return_logprob``, ``logprob_start_len: -1``; ``--backend
sglang-oai`` / ``sglang-oai-chat``: ``best_of: 1``, ``ignore_eos``); the fields read back
are ``text``, ``meta_info.completion_tokens`` and the cache report
(``meta_info.cached_tokens``, ``meta_info.cached_tokens_details``,
``usage.prompt_tokens_details.cached_tokens``, ``sglext.cached_tokens_details``).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from hicache.engine.front.engine import Engine
from hicache.server.protocol import engine_supports
from tests.helpers.api_fixtures import assert_clean, post, sse

PROMPT = [(11 * i + 7) % 3000 + 200 for i in range(45)]


def bench_payload(prompt: str | list[int], stream: bool, **extra: Any) -> dict[str, Any]:
    """What ``bench_serving --backend sglang`` posts (ignore_eos only when served)."""
    sampling: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": 6}
    if engine_supports("ignore_eos"):
        sampling["ignore_eos"] = True
    return {
        ("text" if isinstance(prompt, str) else "input_ids"): prompt,
        "sampling_params": sampling,
        "stream": stream,
        "lora_path": None,
        "return_logprob": False,
        "logprob_start_len": -1,
        **extra,
    }


def test_generate_reports_the_cache_per_tier(server: tuple[str, Engine]) -> None:
    url, engine = server
    cold = post(url, "/generate", bench_payload(PROMPT, False))
    assert cold.status_code == 200, cold.text
    body = cold.json()
    meta = body["meta_info"]
    assert meta["prompt_tokens"] == 45 and meta["completion_tokens"] == len(body["output_ids"])
    assert meta["cached_tokens"] == 0
    assert set(meta["cached_tokens_details"]) == {"device", "host", "storage"}
    assert meta["finish_reason"]["type"] in ("length", "stop")
    warm = post(url, "/generate", bench_payload(PROMPT, False)).json()
    assert warm["meta_info"]["cached_tokens"] == 44  # 11 whole pages of 4
    assert warm["meta_info"]["cached_tokens_details"]["device"] == 44
    assert warm["text"] == body["text"]
    assert_clean(engine)


def test_generate_stream_is_cumulative(server: tuple[str, Engine]) -> None:
    url, engine = server
    full = post(url, "/generate", bench_payload(PROMPT[::-1], False)).json()
    with httpx.stream(
        "POST", f"{url}/generate", json=bench_payload(PROMPT[::-1], True), timeout=60
    ) as r:
        assert r.status_code == 200
        events = sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts)  # bench_serving reads these as running totals
    assert chunks[-1]["text"] == full["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    assert "cached_tokens" in chunks[-1]["meta_info"]
    assert_clean(engine)


def test_generate_text_prompt_and_sampling_params(server: tuple[str, Engine]) -> None:
    url, _ = server
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 3}}
    r = post(url, "/generate", body)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3
    body = {
        "text": "Hello",
        "sampling_params": {
            "max_new_tokens": 4,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "sampling_seed": 3,
            "stop": ["zzz"],
        },
    }
    a = post(url, "/generate", body).json()
    b = post(url, "/generate", body).json()
    assert a["meta_info"]["completion_tokens"] == 4
    assert a["output_ids"] == b["output_ids"]  # sampling_seed: reproducible
    no_limit = post(url, "/generate", {"input_ids": PROMPT[:10]}).json()
    assert no_limit["meta_info"]["completion_tokens"] <= 128


def test_generate_batch_and_n(server: tuple[str, Engine]) -> None:
    url, engine = server
    out = post(
        url,
        "/generate",
        {"text": ["Hello", "The sky"], "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
    ).json()
    assert isinstance(out, list) and [o["index"] for o in out] == [0, 1]
    out = post(
        url,
        "/generate",
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "n": 2, "temperature": 0}},
    ).json()
    assert len(out) == 2 and out[0]["output_ids"] == out[1]["output_ids"]
    assert_clean(engine)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"input_ids": PROMPT, "sampling_params": {"json_schema": "{}"}},
            "sampling_params.json_schema",
        ),
        ({"input_ids": PROMPT, "sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
        ({"input_ids": PROMPT, "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
        ({"input_ids": PROMPT, "sampling_params": {"min_p": 0.1}}, "sampling_params.min_p"),
        (
            {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}},
            "sampling_params.max_new_tokens",
        ),
        (
            {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 500}},
            "sampling_params.max_new_tokens",
        ),
        (
            {"input_ids": PROMPT, "sampling_params": {"temperature": -1}},
            "sampling_params.temperature",
        ),
        ({"input_ids": PROMPT, "lora_path": "adapter"}, "lora_path"),
        ({"input_ids": PROMPT, "image_data": "x.png"}, "image_data"),
        ({"input_ids": [1, 2, 10**9]}, "input_ids"),
        ({"sampling_params": {}}, "text"),
        ({"text": "a", "input_ids": [1]}, "text"),
    ],
)
def test_generate_refuses_what_it_cannot_serve(
    server: tuple[str, Engine], body: dict[str, Any], param: str
) -> None:
    url, _ = server
    r = post(url, "/generate", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_generate_logprobs_or_refusal(server: tuple[str, Engine]) -> None:
    url, _ = server
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    r = post(url, "/generate", body)
    if not engine_supports("logprobs"):
        assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.logprobs"
        return
    meta = r.json()["meta_info"]
    assert len(meta["output_token_logprobs"]) == 3
    for (lp, tid, _), top in zip(
        meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True
    ):
        assert lp <= 0 and isinstance(tid, int) and len(top) == 2
    assert r.json()["output_ids"] == [t for _, t, _ in meta["output_token_logprobs"]]


def test_openai_responses_carry_sglangs_cache_report(server: tuple[str, Engine]) -> None:
    url, engine = server
    prompt = [(3 * i + 1) % 3000 + 200 for i in range(45)]
    body = {
        "model": "tiny",
        "prompt": prompt,
        "temperature": 0.0,
        "best_of": 1,
        "max_tokens": 4,
        "stream": False,
    }
    if engine_supports("ignore_eos"):
        body["ignore_eos"] = True
    post(url, "/v1/completions", body)
    warm = post(url, "/v1/completions", body).json()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 44
    assert warm["sglext"]["cached_tokens_details"] == {"device": 44, "host": 0, "storage": 0}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        events = sse(r)
    finals = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finals and finals[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 44
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi there, friend."}],
        "temperature": 0.0,
        "max_tokens": 3,
        "stream": False,
    }
    post(url, "/v1/chat/completions", chat)
    again = post(url, "/v1/chat/completions", chat).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["sglext"]["cached_tokens_details"]["device"] > 0
    assert_clean(engine)


def test_max_load_tokens_caps_what_comes_back_from_l2(server: tuple[str, Engine]) -> None:
    """``max_load_tokens`` (``sampling_params`` on ``/generate``, top level on the OpenAI
    routes): at most that many prompt tokens are restored from L2, whole pages; a bad value
    is a 400 naming the field."""
    url, engine = server
    prompt = [(5 * i + 3) % 3000 + 200 for i in range(45)]
    body = bench_payload(prompt, False)

    def only_in_l2() -> None:
        engine.core.cache.sync(wait=True)
        engine.core.cache.full.pages.evict_device(1024 // 4)

    post(url, "/generate", body)
    engine.call(only_in_l2).result(timeout=60)
    capped = {**body, "sampling_params": {**body["sampling_params"], "max_load_tokens": 22}}
    got = post(url, "/generate", capped).json()["meta_info"]["cached_tokens_details"]
    assert got == {"device": 0, "host": 20, "storage": 0}  # 5 whole pages of 4
    engine.call(only_in_l2).result(timeout=60)
    comp = {"model": "tiny", "prompt": prompt, "temperature": 0.0, "max_tokens": 2}
    r = post(url, "/v1/completions", {**comp, "max_load_tokens": 12})
    assert r.json()["sglext"]["cached_tokens_details"] == {"device": 0, "host": 12, "storage": 0}
    bad = post(url, "/v1/completions", {**comp, "max_load_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_load_tokens"
    capped["sampling_params"]["max_load_tokens"] = "lots"
    bad = post(url, "/generate", capped)
    assert bad.status_code == 400 and "max_load_tokens" in bad.text
    assert_clean(engine)
