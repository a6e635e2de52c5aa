"""Agent-session hints at the API (issue 35): ``session_id``, ``parent_session_id`` and
``session_ttl_ms`` on ``/generate``, ``/v1/completions`` and ``/v1/chat/completions``
(an OpenAI client's extra body fields too), carried to the engine's request, changing no
output; a bad value is a 400 naming the field; ``/metrics`` counts requests by session
kind and outcome, exactly; the session is kept until ``DELETE /hicache/sessions/{id}`` or
its TTL.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicache.engine.front.engine import Engine
from hicache.engine.session import MAX_SESSION_ID_CHARS, SessionHint
from tests.api.test_api_health import FailingForward
from tests.helpers.api_fixtures import make_engine, post, scrape, serve, sse, wait_idle

PROMPT = list(range(300, 345))
CHAT = [{"role": "user", "content": "Say something."}]
SESSION = {"session_id": "agent-1"}
SUBAGENT = {"session_id": "agent-1/sub-2", "parent_session_id": "agent-1"}
ROUTES = ["completions", "chat", "generate"]


def body_of(route: str, hint: dict[str, Any], max_tokens: int = 6) -> tuple[str, dict[str, Any]]:
    """``(path, body)`` of a greedy request on ``route`` carrying ``hint``."""
    if route == "completions":
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
        return "/v1/completions", body | hint
    if route == "chat":
        body = {"messages": CHAT, "max_tokens": max_tokens, "temperature": 0}
        return "/v1/chat/completions", body | hint
    sampling = {"max_new_tokens": max_tokens, "temperature": 0}
    return "/generate", {"input_ids": PROMPT, "sampling_params": sampling} | hint


def answer(url: str, route: str, hint: dict[str, Any]) -> Any:
    """The greedy output of ``route`` with ``hint``: the text and the token count (or ids)."""
    path, body = body_of(route, hint)
    r = post(url, path, body)
    assert r.status_code == 200, r.text
    data = r.json()
    if route == "generate":
        return data["text"], data["output_ids"]
    choice = data["choices"][0]
    text = choice["message"]["content"] if route == "chat" else choice["text"]
    return text, data["usage"]["completion_tokens"]


@pytest.mark.parametrize("route", ROUTES)
def test_hints_are_served_and_change_no_output(server: tuple[str, Engine], route: str) -> None:
    url, _ = server
    plain = answer(url, route, {})
    assert answer(url, route, SESSION) == plain
    assert answer(url, route, SUBAGENT) == plain
    edge = {"session_id": "s" * MAX_SESSION_ID_CHARS, "parent_session_id": "agent é 🤖 x"}
    assert answer(url, route, edge) == plain
    assert answer(url, route, {"session_id": None, "parent_session_id": None}) == plain


def test_an_openai_client_sends_them_as_extra_body(server: tuple[str, Engine]) -> None:
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    plain = answer(url, "completions", {})
    got = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, extra_body=SUBAGENT
    )
    assert (got.choices[0].text, got.usage and got.usage.completion_tokens) == plain
    plain_chat = answer(url, "chat", {})
    chat = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        extra_body=SESSION,
    )
    assert (chat.choices[0].message.content, chat.usage and chat.usage.completion_tokens) == (
        plain_chat
    )
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"parent_session_id": "p"}
        )
    assert "parent_session_id" in str(refused.value)


BAD: list[tuple[dict[str, Any], str]] = [
    ({"session_id": "s" * (MAX_SESSION_ID_CHARS + 1)}, "session_id"),
    ({"session_id": "s" * 10**5}, "session_id"),
    ({"session_id": ""}, "session_id"),
    ({"session_id": 5}, "session_id"),
    ({"session_id": ["agent-1"]}, "session_id"),
    ({"session_id": {"id": "agent-1"}}, "session_id"),
    ({"session_id": "agent\n1"}, "session_id"),
    ({"session_id": "agent\x001"}, "session_id"),
    ({"session_id": "agent\t1"}, "session_id"),
    ({"session_id": "agent\x7f"}, "session_id"),
    ({"session_id": "agent\u200b1"}, "session_id"),  # a zero-width space (format)
    ({"session_id": "s", "parent_session_id": ""}, "parent_session_id"),
    ({"session_id": "s", "parent_session_id": 7}, "parent_session_id"),
    ({"session_id": "s", "parent_session_id": "p" * 257}, "parent_session_id"),
    ({"session_id": "s", "parent_session_id": "p\r"}, "parent_session_id"),
    ({"parent_session_id": "agent-1"}, "parent_session_id"),
    ({"session_id": None, "parent_session_id": "agent-1"}, "parent_session_id"),
    ({"session_id": "agent-1", "parent_session_id": "agent-1"}, "parent_session_id"),
    ({"session_id": "s", "session_ttl_ms": -1}, "session_ttl_ms"),
    ({"session_id": "s", "session_ttl_ms": 1.5}, "session_ttl_ms"),
    ({"session_id": "s", "session_ttl_ms": "5000"}, "session_ttl_ms"),
    ({"session_id": "s", "session_ttl_ms": True}, "session_ttl_ms"),
    ({"session_id": "s", "session_ttl_ms": 86_400_001}, "session_ttl_ms"),
    ({"session_id": "s", "session_ttl_ms": 10**30}, "session_ttl_ms"),
    ({"session_ttl_ms": 5000}, "session_ttl_ms"),
]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("hint", "param"), BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_hint_is_a_400_naming_the_field(
    server: tuple[str, Engine], route: str, hint: dict[str, Any], param: str
) -> None:
    url, engine = server
    path, body = body_of(route, hint, max_tokens=2)
    r = post(url, path, body, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err
    assert err["type"] == "invalid_request_error"
    assert engine.alive


@pytest.mark.parametrize("route", ROUTES)
def test_a_lone_surrogate_is_refused(server: tuple[str, Engine], route: str) -> None:
    url, _ = server
    path, body = body_of(route, {"session_id": "\ud800"}, max_tokens=2)
    raw = json.dumps(body).encode()  # ASCII escapes: the JSON text carries "\ud800"
    r = httpx.post(f"{url}{path}", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "session_id"


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_ttl_is_refused(server: tuple[str, Engine], route: str, value: str) -> None:
    url, _ = server
    path, body = body_of(route, {"session_id": "s", "session_ttl_ms": 0}, max_tokens=2)
    raw = json.dumps(body).replace('"session_ttl_ms": 0', f'"session_ttl_ms": {value}')
    r = httpx.post(f"{url}{path}", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "session_ttl_ms"


def test_the_hint_reaches_the_engines_request(server: tuple[str, Engine]) -> None:
    url, engine = server
    release = threading.Event()
    engine.call(lambda: release.wait(10))  # hold the loop: the requests stay queued
    bodies = [body_of("generate", hint) for hint in ({}, SUBAGENT)]
    done: list[httpx.Response] = []
    clients = [
        threading.Thread(target=lambda p=p, b=b: done.append(post(url, p, b))) for p, b in bodies
    ]
    for c in clients:
        c.start()
    time.sleep(0.5)  # the requests reach the engine's inbox, behind the held call
    queued = engine.call(
        lambda: [
            r.session for r in [*engine.core.scheduler.waiting, *engine.core.scheduler.running]
        ]
    )
    release.set()
    hints = queued.result(timeout=10)
    for c in clients:
        c.join(30)
    assert sorted(hints, key=lambda h: h is not None) == [
        None,
        SessionHint("agent-1/sub-2", "agent-1"),
    ]
    assert [r.status_code for r in done] == [200, 200], [r.text for r in done]


# ---------------------------------------------------------------------- metrics


def session_counts(url: str, engine: Engine) -> dict[tuple[str, str], float]:
    families = {f.name: f for f in text_string_to_metric_families(scrape(url, engine))}
    return {
        (s.labels["kind"], s.labels["outcome"]): s.value
        for s in families["hicache_session_requests"].samples
        if s.name == "hicache_session_requests_total"
    }


def test_metrics_count_requests_by_session_kind_and_outcome() -> None:
    engine = make_engine()
    hook = FailingForward()  # a forward raises while armed: its request fails (500)
    hook.armed = False
    handle = engine.model.model.register_forward_pre_hook(hook)
    try:
        with serve(engine) as url:
            zero = session_counts(url, engine)
            kinds, outcomes = ("none", "session", "subagent"), ("finished", "aborted", "failed")
            assert zero == {(k, o): 0.0 for k in kinds for o in outcomes}

            answer(url, "completions", {})  # none/finished
            path, body = body_of("completions", SESSION)
            assert post(url, path, body | {"n": 2}).status_code == 200  # 2 x session/finished
            path, body = body_of("generate", SUBAGENT)
            batch = body | {"input_ids": [PROMPT, PROMPT[:20]]}
            assert post(url, path, batch).status_code == 200  # 2 x subagent/finished
            path, body = body_of("chat", SESSION)
            with httpx.stream(
                "POST", f"{url}{path}", json=body | {"stream": True}, timeout=60
            ) as r:
                assert sse(r)[-1] == "[DONE]"  # session/finished
            for route in ROUTES:  # refused: never an engine request, not counted
                path, body = body_of(route, {"parent_session_id": "agent-1"})
                assert post(url, path, body).status_code == 400

            hook.armed = True  # subagent/failed
            path, body = body_of("completions", SUBAGENT)
            assert post(url, path, body).status_code == 500
            hook.armed = False

            release = threading.Event()  # session/aborted: the client goes while queued
            engine.call(lambda: release.wait(10))
            path, body = body_of("generate", SESSION)
            with contextlib.suppress(httpx.TimeoutException):
                post(url, path, body, timeout=0.5)
            time.sleep(0.3)  # the server sees the client gone and aborts
            release.set()
            wait_idle(engine)

            counts = session_counts(url, engine)
    finally:
        handle.remove()
        engine.close()
    expected = dict.fromkeys(zero, 0.0)
    expected.update(
        {
            ("none", "finished"): 1,
            ("session", "finished"): 3,
            ("subagent", "finished"): 2,
            ("subagent", "failed"): 1,
            ("session", "aborted"): 1,
        }
    )
    assert counts == expected


# ---------------------------------------------------------------------- retention


def live_sessions(engine: Engine) -> list[tuple[str, str]]:
    """(session, state) of every live session, read on the engine thread."""
    views = engine.call(lambda: engine.core.cache.sessions.views()).result(timeout=10)
    return [(v.session_id, v.state.value) for v in views]


def test_a_session_is_kept_until_closed(server: tuple[str, Engine]) -> None:
    url, engine = server
    assert answer(url, "generate", {"session_id": "keep-1", "session_ttl_ms": 60_000})
    wait_idle(engine)
    assert ("keep-1", "kept") in live_sessions(engine)
    r = httpx.delete(f"{url}/hicache/sessions/keep-1", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ok", "closed": "keep-1"}
    assert "keep-1" not in dict(live_sessions(engine))
    again = httpx.delete(f"{url}/hicache/sessions/keep-1", timeout=10)
    assert again.status_code == 404
    assert again.json()["error"]["param"] == "session_id"


def test_closing_an_unknown_or_bad_session(server: tuple[str, Engine]) -> None:
    url, engine = server
    r = httpx.delete(f"{url}/hicache/sessions/never-seen", timeout=10)
    assert r.status_code == 404 and "never-seen" in r.json()["error"]["message"]
    bad = httpx.delete(f"{url}/hicache/sessions/{'s' * (MAX_SESSION_ID_CHARS + 1)}", timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "session_id"
    assert engine.alive


def test_a_session_ends_at_its_ttl(server: tuple[str, Engine]) -> None:
    url, engine = server
    before = engine.stats().cache.counters["session_expired_total"]
    assert answer(url, "completions", {"session_id": "brief", "session_ttl_ms": 200})
    deadline = time.monotonic() + 10
    while "brief" in dict(live_sessions(engine)):
        assert time.monotonic() < deadline, "the session outlived its TTL"
        time.sleep(0.05)
    assert httpx.delete(f"{url}/hicache/sessions/brief", timeout=10).status_code == 404
    wait_idle(engine)
    assert engine.stats().cache.counters["session_expired_total"] == before + 1
