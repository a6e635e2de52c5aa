"""OpenAI request and response shapes at the HTTP level: content parts, tool calls in the
history, batched prompts, ``n`` choices, ``stream_options``, errors for every status, the
API key, the body limit, bad text, ``max_tokens`` against the context, disconnects and the
metrics that watch them."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicache.cache.report import cache_stats
from hicache.engine.front.engine import Engine
from tests.helpers.api_fixtures import (
    CONTEXT,
    assert_clean,
    make_engine,
    post,
    scrape,
    serve,
    sse,
    wait_idle,
)

PROMPT = list(range(300, 345))
CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Engine]]:
    engine = make_engine()
    with serve(engine, max_request_bytes=64 * 1024) as url:
        yield url, engine
    engine.close()


def greedy(url: str, **fields: Any) -> dict[str, Any]:
    r = post(
        url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, **fields}
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


# ---------------------------------------------------------------------- chat shapes


def test_content_parts_equal_plain_text(server: tuple[str, Engine]) -> None:
    url, _ = server
    plain = [{"role": "user", "content": "Say something nice."}]
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Say something"},
                {"type": "text", "text": " nice."},
            ],
        }
    ]
    body = {"max_tokens": 5, "temperature": 0}
    a = post(url, "/v1/chat/completions", {"messages": plain, **body}).json()
    b = post(url, "/v1/chat/completions", {"messages": parts, **body}).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    r = post(url, "/v1/chat/completions", {"messages": image, **body})
    assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]
    assert r.json()["error"]["param"].startswith("messages")


def test_tool_calls_in_history_are_served(server: tuple[str, Engine]) -> None:
    url, _ = server
    history = [
        {"role": "user", "content": "What is the weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = post(url, "/v1/chat/completions", {"messages": history, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    no_content = [{"role": "user", "content": None}]
    r = post(url, "/v1/chat/completions", {"messages": no_content, "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


# ---------------------------------------------------------------------- refused parameters


@pytest.mark.parametrize(
    ("route", "extra", "param"),
    [
        ("completions", {"suffix": "tail"}, "suffix"),
        ("completions", {"best_of": 3}, "best_of"),
        ("completions", {"response_format": {"type": "json_object"}}, "response_format"),
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format",
        ),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("chat", {"tool_choice": "required"}, "tool_choice"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"max_tokens": CONTEXT}, "max_tokens"),
    ],
)
def test_unsupported_parameters_are_refused(
    server: tuple[str, Engine], route: str, extra: dict[str, Any], param: str
) -> None:
    url, engine = server
    if route == "completions":
        r = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **extra})
    else:
        r = post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"
    assert engine.alive


def test_accepted_no_op_values(server: tuple[str, Engine]) -> None:
    """The values of refused parameters that change nothing are served."""
    url, _ = server
    base = greedy(url)
    for extra in (
        {"best_of": 1},
        {"response_format": {"type": "text"}},
        {"suffix": ""},
        {"echo": False},
    ):
        assert greedy(url, **extra)["choices"][0]["text"] == base["choices"][0]["text"]
    r = post(
        url,
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 2, "tool_choice": "none", "tools": []},
    )
    assert r.status_code == 200, r.text


def test_max_tokens_against_the_context(server: tuple[str, Engine]) -> None:
    url, _ = server
    r = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": CONTEXT - len(PROMPT) + 1})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert str(len(PROMPT)) in msg and str(CONTEXT) in msg and str(CONTEXT - len(PROMPT)) in msg
    ok = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": CONTEXT - len(PROMPT)})
    assert ok.status_code == 200
    # no max_tokens: up to the end of the context (SGLang's default), not 128 or 16
    r = post(
        url,
        "/v1/completions",
        {"prompt": PROMPT, "ignore_eos": True} if _has("ignore_eos") else {"prompt": PROMPT},
    )
    assert r.status_code == 200
    out = r.json()
    if out["choices"][0]["finish_reason"] == "length":
        assert out["usage"]["completion_tokens"] == CONTEXT - len(PROMPT)


def _has(field: str) -> bool:
    from hicache.server.protocol import engine_supports

    return engine_supports(field)


# ---------------------------------------------------------------------- n and batches


def test_n_choices_share_the_prompt(server: tuple[str, Engine]) -> None:
    url, engine = server
    prompt = [(7 * i + 11) % 2000 + 100 for i in range(41)]
    body = {"prompt": prompt, "max_tokens": 5, "n": 3, "temperature": 1.0, "seed": 9}
    engine.call(engine.core.cache.reset).result(30)  # both runs cold: the same computation
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in out["choices"]]
    assert len(set(texts)) > 1  # seeds seed, seed+1, seed+2
    assert out["usage"]["prompt_tokens"] == 41  # the prompt counts once
    assert out["usage"]["completion_tokens"] == 15
    engine.call(engine.core.cache.reset).result(30)
    again = post(url, "/v1/completions", body).json()  # reproducible: seeds seed + i
    assert [c["text"] for c in again["choices"]] == texts
    assert_clean(engine)


def test_n_copies_hit_the_first_copys_prefix(server: tuple[str, Engine]) -> None:
    url, engine = server
    engine.call(engine.core.cache.reset).result(30)
    prompt = [(5 * i + 3) % 2000 + 100 for i in range(41)]
    seen: list[Any] = []

    import hicache.server.fanout as fanout

    original = fanout.Fanout._submit

    def spy(self: Any, job: Any) -> None:
        original(self, job)
        seen.append(job.index)

    fanout.Fanout._submit = spy  # type: ignore[method-assign]
    try:
        r = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "n": 3})
    finally:
        fanout.Fanout._submit = original  # type: ignore[method-assign]
    assert r.status_code == 200
    assert seen[0] == 0 and sorted(seen) == [0, 1, 2]
    stats = engine.call(lambda: cache_stats(engine.core.cache)).result(30)
    # copies 1 and 2 found the first copy's 40 whole-page tokens in L1
    assert stats.counters["device_hit_tokens_total"] >= 2 * 40
    assert_clean(engine)


def test_n_streams_every_choice_with_its_index(server: tuple[str, Engine]) -> None:
    url, engine = server
    body = {"prompt": PROMPT, "max_tokens": 4, "n": 2, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        events = sse(r)
    assert events[-1] == "[DONE]"
    text: dict[int, str] = {0: "", 1: ""}
    finished = set()
    for ev in events[:-1]:
        c = ev["choices"][0]
        text[c["index"]] += c["text"]
        if c["finish_reason"]:
            finished.add(c["index"])
    assert finished == {0, 1}
    full = greedy(url, max_tokens=4)["choices"][0]["text"]
    assert text[0] == text[1] == full  # greedy: every choice the same
    assert_clean(engine)


def test_batched_prompts(server: tuple[str, Engine]) -> None:
    url, engine = server
    a, b = PROMPT, PROMPT[::-1]
    singles = [greedy(url, prompt=p)["choices"][0]["text"] for p in (a, b)]
    out = post(url, "/v1/completions", {"prompt": [a, b], "max_tokens": 6, "temperature": 0}).json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert [c["text"] for c in out["choices"]] == singles
    assert out["usage"]["prompt_tokens"] == 2 * len(PROMPT)
    texts = ["Hello there", "The sky is"]
    out = post(url, "/v1/completions", {"prompt": texts, "max_tokens": 3, "n": 2}).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]  # prompt-major
    r = post(url, "/v1/completions", {"prompt": [a, [1, 2, 10**9]], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = post(url, "/v1/completions", {"prompt": [1.5, 2]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert_clean(engine)


def test_echo_returns_the_prompt(server: tuple[str, Engine]) -> None:
    url, _ = server
    text = "The quick brown fox"
    plain = post(url, "/v1/completions", {"prompt": text, "max_tokens": 4, "temperature": 0}).json()
    echo = post(
        url, "/v1/completions", {"prompt": text, "max_tokens": 4, "temperature": 0, "echo": True}
    ).json()
    assert echo["choices"][0]["text"] == text + plain["choices"][0]["text"]
    body = {"prompt": text, "max_tokens": 4, "temperature": 0, "echo": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        events = sse(r)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == echo["choices"][0]["text"]


# ---------------------------------------------------------------------- streams


def test_stream_options_include_usage(server: tuple[str, Engine]) -> None:
    url, _ = server
    body = {"messages": CHAT, "max_tokens": 4, "stream": True}
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json={**body, "stream_options": {"include_usage": True}},
        timeout=60,
    ) as r:
        events = sse(r)
    last = events[-2]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    assert "cached_tokens" in last["usage"]["prompt_tokens_details"]
    assert sum(1 for e in events[:-1] if e["choices"] == []) == 1
    for flag in (False, None):
        extra = {} if flag is None else {"stream_options": {"include_usage": flag}}
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json={**body, **extra}, timeout=60
        ) as r:
            events = sse(r)
        assert all(e["choices"] for e in events[:-1])  # no usage-only chunk


# ---------------------------------------------------------------------- errors


def test_errors_are_openai_shaped(server: tuple[str, Engine]) -> None:
    url, _ = server
    for method, path, status in (
        ("GET", "/nope", 404),
        ("GET", "/v1/completions", 405),
        ("DELETE", "/v1/chat/completions", 405),
        ("GET", "/v1/models/other-model", 404),
    ):
        r = httpx.request(method, f"{url}{path}", timeout=10)
        assert r.status_code == status, (path, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    r = httpx.get(f"{url}/v1/models/tiny", timeout=10)
    assert r.status_code == 200 and r.json()["id"] == "tiny"
    r = httpx.post(
        f"{url}/v1/completions", content=b"{no", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_lone_surrogates_are_refused(server: tuple[str, Engine]) -> None:
    url, engine = server
    raw = b'{"prompt": "abc \\ud800 def", "max_tokens": 2}'
    r = httpx.post(
        f"{url}/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    raw = b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'
    r = httpx.post(
        f"{url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content", r.text
    raw = b'{"text": "\\ud800", "sampling_params": {"max_new_tokens": 2}}'
    r = httpx.post(f"{url}/generate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text", r.text
    assert engine.alive


def test_body_limit_is_a_413(server: tuple[str, Engine]) -> None:
    url, engine = server
    r = post(url, "/v1/completions", {"prompt": "word " * 20000, "max_tokens": 2})
    assert r.status_code == 413 and r.json()["error"]["code"] is None  # OpenAI: str or null

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams in
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"word " * 200
        yield b'"}'

    r = httpx.post(
        f"{url}/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413
    assert post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200
    assert engine.alive


def test_long_prompt_does_not_stall_other_requests() -> None:
    """Tokenization runs off the event loop: a short request is answered while a long
    prompt is being tokenized."""
    engine = make_engine(context_length=128)
    with serve(engine, max_request_bytes=64 * 2**20) as url:
        tok = engine.model.tokenizer
        original = tok.encode
        started = threading.Event()

        def slow_encode(text: str, **kw: Any) -> Any:
            if len(text) > 1000:
                started.set()
                time.sleep(2.0)
            return original(text, **kw)

        tok.encode = slow_encode
        try:
            slow: list[httpx.Response] = []
            t = threading.Thread(
                target=lambda: slow.append(post(url, "/v1/completions", {"prompt": "x " * 5000}))
            )
            t.start()
            assert started.wait(10)
            t0 = time.monotonic()
            assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 200
            r = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 200
            assert time.monotonic() - t0 < 1.5
            t.join(30)
            assert slow and slow[0].status_code == 400  # beyond the context
        finally:
            tok.encode = original
    engine.close()


def test_api_key_guards_inference_not_health() -> None:
    engine = make_engine()
    with serve(engine, api_key="sk-inference", admin_api_key="sk-admin") as url:
        body = {"prompt": PROMPT, "max_tokens": 2}
        r = post(url, "/v1/completions", body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        for key in ("wrong", "sk-admin"):
            r = post(url, "/v1/completions", body, headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 401
        ok = {"authorization": "Bearer sk-inference"}
        assert post(url, "/v1/completions", body, headers=ok).status_code == 200
        assert post(url, "/generate", {"input_ids": PROMPT}).status_code == 401
        assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 401
        assert httpx.get(f"{url}/v1/models", headers=ok, timeout=5).status_code == 200
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        assert httpx.get(f"{url}/metrics", timeout=30).status_code == 200
        # admin routes: the inference key is not the admin key
        r = httpx.delete(f"{url}/hicache/storage-backend", headers=ok, timeout=10)
        assert r.status_code == 401
    engine.close()


def test_admin_checks_the_key_before_the_body(server: tuple[str, Engine]) -> None:
    url, _ = server  # no admin key configured: refused whatever the body
    r = httpx.put(f"{url}/hicache/storage-backend", content=b"{not json", timeout=10)
    assert r.status_code == 403 and "--admin-api-key" in r.json()["error"]["message"]
    r = httpx.put(f"{url}/hicache/storage-backend", json={"bogus": 1}, timeout=10)
    assert r.status_code == 403


# ---------------------------------------------------------------------- disconnects


def test_dropped_non_streaming_requests_stop_and_free_everything() -> None:
    engine = make_engine(context_length=2048, max_running=64)
    with serve(engine) as url:
        body = {"prompt": PROMPT, "max_tokens": 1500, "temperature": 0}
        if _has("ignore_eos"):
            body["ignore_eos"] = True

        def drop() -> None:
            with contextlib.suppress(httpx.TimeoutException):
                httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)

        threads = [threading.Thread(target=drop) for _ in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        t0 = time.monotonic()
        r = post(url, "/v1/completions", {"prompt": PROMPT[:20], "max_tokens": 4}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert time.monotonic() - t0 < 10
        wait_idle(engine, timeout=10)
        stats = engine.call(lambda: cache_stats(engine.core.cache)).result(30)
        assert stats.device_request_tokens == 0
        generated = stats.counters.get("query_tokens_total", 0)
        assert generated >= 0
        assert_clean(engine)
        families = {f.name: f for f in text_string_to_metric_families(scrape(url, engine))}
        aborted = {
            s.labels["reason"]: s.value
            for s in families["hicache_aborted_requests"].samples
            if s.name.endswith("_total")
        }
        assert aborted["client_disconnected"] == 40
        running = families["hicache_num_running_reqs"].samples[0].value
        assert running == 0
    engine.close()


def test_dropped_stream_is_aborted_at_once(server: tuple[str, Engine]) -> None:
    url, engine = server
    body = {"prompt": PROMPT[:30], "max_tokens": 90, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    wait_idle(engine, timeout=5)
    assert_clean(engine)


def test_gauges_show_running_and_queued_requests(server: tuple[str, Engine]) -> None:
    url, engine = server
    release = threading.Event()
    engine.call(lambda: release.wait(10))  # hold the loop: requests stay queued
    threads = [
        threading.Thread(
            target=lambda: post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    time.sleep(0.5)
    release.set()
    for t in threads:
        t.join(60)
    wait_idle(engine)
    text = scrape(url, engine)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "hicache_num_running_reqs",
        "hicache_num_queue_reqs",
        "hicache_num_admitted_reqs",
        "hicache_device_tokens",
        "hicache_token_usage",
        "hicache_cache_hit_rate",
        "hicache_aborted_requests",
    ):
        assert name in families, name
    holders = {s.labels["holder"]: s.value for s in families["hicache_device_tokens"].samples}
    stats = engine.call(lambda: cache_stats(engine.core.cache)).result(30)
    assert holders["requests"] == stats.device_request_tokens == 0
    assert holders["cache"] == stats.device_cached_tokens > 0


def test_a_field_the_engine_lacks_is_refused_not_ignored(
    server: tuple[str, Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a sampling field is missing from SamplingParams (as before the engine grew
    them), a request that sets it gets a 400 naming it, never a silent no-op."""
    import hicache.server.protocol as protocol

    url, _ = server
    for field in ("ignore_eos", "logprobs", "min_tokens"):
        monkeypatch.setattr(protocol, "engine_supports", lambda name, f=field: name != f)
        body = {
            "prompt": PROMPT,
            "max_tokens": 2,
            "ignore_eos": True,
            "logprobs": 1,
            "min_tokens": 1,
        }
        r = post(url, "/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    monkeypatch.setattr(protocol, "engine_supports", lambda name: name != "ignore_eos")
    r = post(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"ignore_eos": True}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "sampling_params.ignore_eos"
    # not set: served as before
    assert post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200
