"""Per-request parameters at the OpenAI API: a bad value is a 400 whose error object names
the field in ``param``, never a dead engine thread or a failed batch; values at the edge
of what is allowed are served. ``priority`` reaches the request; ``cache_salt`` is bounded.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.config import CacheConfig
from hicache.engine.front.engine import MAX_CACHE_SALT_CHARS, Engine, EngineConfig
from hicache.engine.step.scheduler import SchedulerConfig
from hicache.server.app import create_app
from tests.helpers.engine_fixtures import engine_model

MODEL = "tiny-random-llama"
PROMPT = list(range(300, 345))
CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Engine]]:
    config = EngineConfig(
        model_path=MODEL,
        dtype="float32",
        device="cpu",
        cache=CacheConfig(page_size=4, device_tokens=512, hicache_ratio=2.0),
        scheduler=SchedulerConfig(max_running_requests=8, chunked_prefill_size=32),
        context_length=128,
    )
    engine = Engine(config, loaded=engine_model(MODEL)).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Config(create_app(engine, "tiny"), host="127.0.0.1", port=port)
    uv.log_level = "warning"
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
    yield url, engine
    srv.should_exit = True
    thread.join(10)
    engine.close()


def post(url: str, path: str, body: dict[str, Any], timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=timeout)


BAD: list[tuple[dict[str, Any], str]] = [
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 10**40}, "seed"),
    ({"temperature": -1}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"cache_salt": "s" * (MAX_CACHE_SALT_CHARS + 1)}, "cache_salt"),
    ({"cache_salt": "s" * 10**6}, "cache_salt"),
    ({"priority": "high"}, "priority"),
    ({"priority": True}, "priority"),
    ({"priority": 1.5}, "priority"),
    ({"priority": 2**63}, "priority"),
    ({"priority": -(2**63) - 1}, "priority"),
    ({"n": 0}, "n"),
    ({"n": 65}, "n"),
]


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize(("extra", "param"), BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_value_is_a_400_naming_the_field(
    server: tuple[str, Engine], route: str, extra: dict[str, Any], param: str
) -> None:
    url, engine = server
    if route == "completions":
        r = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **extra}, 10)
    else:
        r = post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **extra}, 10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]
    assert err["type"] == "invalid_request_error"
    assert engine.alive


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_non_finite_json_numbers_are_refused(server: tuple[str, Engine], field: str) -> None:
    url, _ = server
    for literal in ("Infinity", "NaN", "-Infinity"):
        raw = f'{{"prompt": {json.dumps(PROMPT)}, "max_tokens": 2, "{field}": {literal}}}'
        r = httpx.post(
            f"{url}/v1/completions",
            content=raw,
            headers={"content-type": "application/json"},
            timeout=10,
        )
        assert r.status_code == 400, (literal, r.text)
        assert r.json()["error"]["param"] == field


def test_prompt_problems_name_prompt_or_messages(server: tuple[str, Engine]) -> None:
    url, _ = server
    r = post(url, "/v1/completions", {"prompt": [1, 2, 10**9]}, 10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = post(url, "/v1/completions", {"prompt": list(range(300))}, 10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    long_chat = [{"role": "user", "content": "word " * 400}]
    r = post(url, "/v1/chat/completions", {"messages": long_chat}, 10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages" and "context length" in r.text


def completion_text(url: str, **fields: Any) -> str:
    r = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, **fields})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    return str(r.json()["choices"][0]["text"])


def test_edge_values_are_served(server: tuple[str, Engine]) -> None:
    """The values that used to kill the engine or its batch, and the bounds themselves."""
    url, engine = server
    greedy = completion_text(url, temperature=0)
    assert completion_text(url, temperature=1e-40) == greedy  # below 1e-6: greedy
    assert completion_text(url, temperature=1e-40, top_k=2**63) == greedy
    sampled = completion_text(url, temperature=1.0, seed=5)
    assert completion_text(url, temperature=1.0, seed=5, top_k=2**63) == sampled  # = off
    assert completion_text(url, temperature=1.0, seed=5, top_k=10**30) == sampled
    for seed in (2**64 - 1, -(2**63), -1, 0):
        completion_text(url, temperature=0.7, seed=seed)
    completion_text(url, cache_salt="s" * MAX_CACHE_SALT_CHARS)
    for priority in (-(2**63), 0, 2**63 - 1):
        completion_text(url, priority=priority)
    r = post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "priority": 4})
    assert r.status_code == 200, r.text
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    assert engine.health().healthy


def test_priority_reaches_the_request(server: tuple[str, Engine]) -> None:
    url, engine = server
    release = threading.Event()
    engine.call(lambda: release.wait(10))  # hold the loop so the request stays queued
    body = {"prompt": PROMPT[::-1], "max_tokens": 4, "temperature": 0, "priority": 7}
    done: list[httpx.Response] = []
    client = threading.Thread(target=lambda: done.append(post(url, "/v1/completions", body)))
    client.start()
    time.sleep(0.5)  # the request reaches the engine's inbox, behind the held call
    queued = engine.call(
        lambda: [
            r.priority for r in [*engine.core.scheduler.waiting, *engine.core.scheduler.running]
        ]
    )
    release.set()
    assert queued.result(timeout=10) == [7]
    client.join(30)
    assert done and done[0].status_code == 200, done


# ---------------------------------------------------------------------- fuzz (issue 9)

_JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(["\ud800", "text", "json_object", "none", "required", ""]),
)
_JSON = st.recursive(
    _JSON_LEAF,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
_FIELDS = [
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "seed",
    "n",
    "stream",
    "stream_options",
    "echo",
    "logprobs",
    "top_logprobs",
    "suffix",
    "best_of",
    "response_format",
    "tools",
    "tool_choice",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "text",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "cache_salt",
    "priority",
    "session_id",
    "parent_session_id",
]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    route=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/generate"]),
    body=st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=5),
)
def test_fuzzed_bodies_never_500(
    server: tuple[str, Engine], route: str, body: dict[str, Any]
) -> None:
    """Any mix of known fields with any JSON values: served or refused (4xx naming the
    problem), never a 500, and the engine keeps serving."""
    url, engine = server
    base: dict[str, Any] = {
        "/v1/completions": {"prompt": PROMPT[:8], "max_tokens": 2},
        "/v1/chat/completions": {"messages": CHAT, "max_tokens": 2},
        "/generate": {"input_ids": PROMPT[:8], "sampling_params": {"max_new_tokens": 2}},
    }[route]
    raw = json.dumps({**base, **body}).encode("utf-8", "surrogatepass")
    r = httpx.post(
        f"{url}{route}", content=raw, headers={"content-type": "application/json"}, timeout=60
    )
    assert r.status_code in (200, 400, 413), r.text
    if r.status_code != 200:
        assert r.json()["error"]["message"]
    assert engine.alive


# ---------------------------------------------------------------------- named refusals (issue 17)


def raw_post(url: str, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(
        f"{url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=30
    )


def refused(r: httpx.Response, param: str | None, *words: str) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    err: dict[str, Any] = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert err["code"] is None or isinstance(err["code"], str), err
    for word in words:
        assert word in err["message"], (word, err["message"])
    return err


def test_at_most_four_stop_strings_on_the_openai_routes(server: tuple[str, Engine]) -> None:
    url, _ = server
    five = ["a1", "b2", "c3", "d4", "e5"]
    r = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stop": five})
    refused(r, "stop", "5", "at most 4")
    r = post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "stop": five})
    refused(r, "stop", "at most 4")
    r = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stop": five[:4]})
    assert r.status_code == 200, r.text
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "stop": five * 2}}
    assert post(url, "/generate", body).status_code == 200  # SGLang takes any number


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": [True, False], "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": [[300, 301], [True]], "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": PROMPT, "stop_token_ids": [True]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"true": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"1_0": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"messages": CHAT, "stop_token_ids": [False]}, "stop_token_ids"),
        ("/generate", {"input_ids": [True, False]}, "input_ids"),
        ("/generate", {"input_ids": [[300], [True]]}, "input_ids"),
        (
            "/generate",
            {"input_ids": PROMPT, "sampling_params": {"stop_token_ids": [True]}},
            "sampling_params.stop_token_ids",
        ),
    ],
)
def test_booleans_are_not_token_ids(
    server: tuple[str, Engine], path: str, body: dict[str, Any], param: str
) -> None:
    url, engine = server
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] in (param, f"{param}[0]"), err  # the list, or its element
    assert engine.alive


def test_logprob_start_len_lies_within_the_prompt(server: tuple[str, Engine]) -> None:
    """SGLang's -1 (the default: output tokens only) or 0 .. len(prompt) with
    return_logprob; anything else is a 400 naming the field and the range."""
    url, _ = server
    base = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
    for start in (10**6, len(PROMPT) + 1, -7, -2):
        r = post(url, "/generate", {**base, "logprob_start_len": start})
        refused(r, "logprob_start_len", str(start), f"0 to {len(PROMPT)}", "-1")
    r = post(url, "/generate", {**base, "input_ids": [PROMPT, PROMPT[:5]], "logprob_start_len": 6})
    refused(r, "logprob_start_len", "0 to 5", "shortest")
    for start, entries in ((-1, None), (0, len(PROMPT)), (40, len(PROMPT) - 40), (45, 0)):
        r = post(url, "/generate", {**base, "logprob_start_len": start})
        assert r.status_code == 200, (start, r.text)
        meta = r.json()["meta_info"]
        got = len(meta["input_token_logprobs"]) if "input_token_logprobs" in meta else None
        assert got == entries, (start, got)
    r = post(url, "/generate", {**base, "return_logprob": False, "logprob_start_len": 10**6})
    assert r.status_code == 200, r.text  # ignored without return_logprob, as SGLang's
    r = post(url, "/generate", {**base, "return_logprob": False, "logprob_start_len": -7})
    refused(r, "logprob_start_len")


def test_logprob_start_len_reuses_the_cache_on_both_apis(server: tuple[str, Engine]) -> None:
    """lm-eval's shape: one context (40 tokens), choices after it, scored from position 40
    (``/v1/completions``: echo + logprobs + SGLang's ``logprob_start_len``; ``/generate``:
    ``return_logprob``). The second choice reuses the context's pages up to the page floor
    of 39 (36 tokens); the context's positions come back null (echo) or are left out
    (``/generate``); the scored ones equal a run that computes the whole prompt (the
    tolerance of tests/engine/test_logprob_reuse.py)."""
    url, engine = server
    ctx, start, cap = PROMPT[:40], 40, 36
    choices = [PROMPT[40:], [7, 8, 9]]
    echo = {"echo": True, "logprobs": 2, "max_tokens": 1, "temperature": 0}
    assert engine.flush_cache()
    full = [post(url, "/v1/completions", {**echo, "prompt": ctx + c}).json() for c in choices]
    assert [f["usage"]["prompt_tokens_details"]["cached_tokens"] for f in full] == [0, 0]
    assert engine.flush_cache()
    for c, f in zip(choices, full, strict=True):
        r = post(url, "/v1/completions", {**echo, "prompt": ctx + c, "logprob_start_len": start})
        assert r.status_code == 200, r.text
        body = r.json()
        got = body["choices"][0]["logprobs"]["token_logprobs"]
        want = f["choices"][0]["logprobs"]["token_logprobs"]
        assert got[:start] == [None] * start and None not in got[start:]
        assert got[start:] == pytest.approx(want[start:], abs=1e-4)
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (0 if c is choices[0] else cap)
    native = {"return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 2}
    r = post(url, "/generate", {**native, "input_ids": [*ctx, 1, 2, 3]})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["cached_tokens"] == cap
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == [1, 2, 3] and all(e[0] is not None for e in entries)


def test_logprob_start_len_on_completions_is_checked(server: tuple[str, Engine]) -> None:
    url, engine = server
    base = {"prompt": PROMPT, "max_tokens": 1, "echo": True, "logprobs": 1}
    r = post(url, "/v1/completions", {**base, "logprob_start_len": -1})
    refused(r, "logprob_start_len", "greater than or equal to 0")
    r = post(url, "/v1/completions", {**base, "logprob_start_len": "x"})
    refused(r, "logprob_start_len")
    r = post(url, "/v1/completions", {**base, "logprob_start_len": len(PROMPT) + 1})
    refused(r, "logprob_start_len", f"logprob_start_len={len(PROMPT) + 1}", f"0 to {len(PROMPT)}")
    for drop in ("echo", "logprobs"):
        body = {k: v for k, v in base.items() if k != drop}
        r = post(url, "/v1/completions", {**body, "logprob_start_len": 3})
        refused(r, "logprob_start_len", "echo=true with logprobs")
    r = post(url, "/v1/completions", {**base, "logprob_start_len": len(PROMPT)})
    assert r.status_code == 200, r.text  # the prompt's length: no prompt position scored
    assert r.json()["choices"][0]["logprobs"]["token_logprobs"][: len(PROMPT)] == [None] * len(
        PROMPT
    )
    assert engine.alive


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_unparsable_bodies_say_why(server: tuple[str, Engine], path: str) -> None:
    """Not UTF-8, nested too deeply, a number too long: a 400 saying which."""
    url, engine = server
    r = raw_post(url, path, b'{"prompt": "caf\xe9", "max_tokens": 2}')
    refused(r, None, "not valid UTF-8", "0xe9", "position 15")
    r = raw_post(url, path, b'{"prompt": ' + b"[" * 10000 + b"]" * 10000 + b"}")
    refused(r, None, "nested too deeply")
    r = raw_post(url, path, b'{"max_tokens": ' + b"7" * 5000 + b"}")
    refused(r, None, "number out of range", "4300 digits")
    r = raw_post(url, path, b'{"max_tokens": 2,}')
    refused(r, None, "not valid JSON", "position")
    assert engine.alive
