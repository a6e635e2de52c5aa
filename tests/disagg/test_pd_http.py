"""The bootstrap fields over HTTP on a prefill and a decode instance (each served by
uvicorn on 127.0.0.1): a request without them gets a 400 naming what is missing, and so
does a batch whose rooms match neither its prompts nor its sequences; a room
in use or just used is refused by the prefill instance; the router's no-transfer host is
served alone, as JSON on a prefill instance even when a stream is asked for;
``/health_generate`` answers on both. Statuses tell whose fault it was, the same on both
sides: a room used, a pair whose layouts differ (whichever side comes first), a host
that does not resolve and a room that is not an integer are 400s; a prefill that does not
answer (a socket nobody accepts on, a process paused with SIGSTOP) is a 504 within the
decode's health bound."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from hicache.engine.front.engine import Engine
from tests.disagg.test_pd_engine import FAST, free_port, make_engine
from tests.helpers.api_fixtures import serve

PROMPT = list(range(300, 320))


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Engine, Engine]]:
    """A prefill and a decode engine, paired."""
    port = free_port()
    prefill = make_engine("tiny-random-llama", "prefill", port=port, **FAST)
    decode: Engine | None = None
    try:
        # a name that does not resolve is allowed, so that resolving it is what fails
        allow = ("127.0.0.0/8", "no-such-host.invalid")
        decode = make_engine(
            "tiny-random-llama", "decode", port=port, bootstrap_allow=allow, **FAST
        )
        yield prefill, decode
    finally:
        if decode is not None:
            decode.close()
        prefill.close()


@pytest.fixture(scope="module")
def urls(engines: tuple[Engine, Engine]) -> Iterator[tuple[str, str, int]]:
    prefill, decode = engines
    with serve(prefill) as p_url, serve(decode) as d_url:
        yield p_url, d_url, prefill.config.disagg.bootstrap_port


def gen(url: str, **fields: Any) -> httpx.Response:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    return httpx.post(f"{url}/generate", json={**body, **fields}, timeout=60)


def error(r: httpx.Response) -> tuple[int, str, str | None]:
    e = r.json()["error"]
    return r.status_code, e["message"], e.get("param")


def test_a_request_without_its_room_is_refused_naming_the_field(urls: tuple[str, str, int]) -> None:
    p_url, d_url, port = urls
    for url, role in ((p_url, "prefill"), (d_url, "decode")):
        status, msg, param = error(gen(url))
        assert (status, param) == (400, "bootstrap_host") and f"a {role} instance needs" in msg
        status, msg, param = error(gen(url, bootstrap_host="127.0.0.1"))
        assert (status, param) == (400, "bootstrap_room") and "bootstrap_room" in msg
        chat = {
            "model": "tiny-random-llama",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
        }
        r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
        assert error(r)[0] == 400 and error(r)[2] == "bootstrap_host"
    room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port}
    batch = {"input_ids": [PROMPT, PROMPT], "sampling_params": {"max_new_tokens": 2}}
    r = httpx.post(f"{p_url}/generate", json={**batch, **room, "bootstrap_room": 5}, timeout=60)
    assert error(r)[0] == 400 and "array of 2 rooms" in error(r)[1]
    r = httpx.post(f"{p_url}/generate", json={**batch, **room, "bootstrap_room": [5]}, timeout=60)
    assert error(r)[0] == 400 and "1 entries for 2 prompts" in error(r)[1]
    status, msg, param = error(gen(p_url, **room, bootstrap_room=-1))
    assert (status, param) == (400, "bootstrap_room")
    two = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "n": 2}}
    r = httpx.post(
        f"{p_url}/generate", json={**two, **room, "bootstrap_room": [5, 6, 7]}, timeout=60
    )
    assert error(r)[0] == 400 and "3 entries for 1 prompts or 2 sequences" in error(r)[1]


def test_a_room_in_use_or_used_is_refused(urls: tuple[str, str, int]) -> None:
    p_url, d_url, _ = urls
    room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": None, "bootstrap_room": 77}
    with httpx.Client(timeout=60) as c:
        first = c.build_request(
            "POST",
            f"{d_url}/generate",
            json={
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 3, "temperature": 0},
                "stream": True,
                **room,
            },
        )
        stream = c.send(first, stream=True)  # the decode half, registered, waiting
        p1 = gen(p_url, **room)  # a null port: the instance's own bootstrap port
        assert p1.status_code == 200, p1.text
        events = [ln for ln in stream.iter_lines() if ln.startswith("data: {")]
        stream.close()
    assert '"finish_reason"' in events[-1]
    status, msg, param = error(gen(p_url, **room))
    assert (status, param) == (400, "bootstrap_room") and "room 77" in msg


def test_the_no_transfer_host_is_served_alone_and_health_generate_answers(
    urls: tuple[str, str, int],
) -> None:
    p_url, d_url, _ = urls
    alone = {"bootstrap_host": "2.2.2.2", "bootstrap_room": 1}
    streamed = gen(p_url, stream=True, **alone)  # a prefill instance answers JSON
    assert streamed.headers["content-type"].startswith("application/json")
    assert len(streamed.json()["output_ids"]) == 3  # served alone: the whole answer
    decoded = gen(d_url, **alone)
    assert decoded.json()["output_ids"] == streamed.json()["output_ids"]
    for url in (p_url, d_url):
        r = httpx.get(f"{url}/health_generate", timeout=60)
        assert r.status_code == 200, r.text


def test_bootstrap_room_must_be_an_integer(urls: tuple[str, str, int]) -> None:
    """``true`` is not room 1 (as a boolean is not a token id), on both sides."""
    p_url, d_url, port = urls
    for url in (p_url, d_url):
        for room in (True, "7", 7.0, [True]):
            status, msg, param = error(
                gen(url, bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=room)
            )
            assert (status, param) == (400, "bootstrap_room"), (url, room, msg)
        status, _, param = error(
            gen(url, bootstrap_host="127.0.0.1", bootstrap_port=True, bootstrap_room=3)
        )
        assert (status, param) == (400, "bootstrap_port")


def test_a_used_room_is_a_400_on_both_sides(urls: tuple[str, str, int]) -> None:
    """A room is single-use: reused after its pair served it, the prefill refuses the
    request and the decode its registration, each a 400 naming the room."""
    p_url, d_url, _ = urls
    room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": None, "bootstrap_room": 88}
    with ThreadPoolExecutor(2) as ex:
        d = ex.submit(gen, d_url, **room)
        p = ex.submit(gen, p_url, **room)
        assert p.result().status_code == 200 and d.result().status_code == 200
    for url in (d_url, p_url):
        status, msg, _ = error(gen(url, **room))
        assert status == 400 and "room 88" in msg, (url, status, msg)


def test_a_bootstrap_host_that_does_not_resolve_is_a_400(urls: tuple[str, str, int]) -> None:
    _, d_url, port = urls
    r = gen(d_url, bootstrap_host="no-such-host.invalid", bootstrap_port=port, bootstrap_room=91)
    status, msg, _ = error(r)
    assert status == 400 and "no-such-host.invalid" in msg and "resolve" in msg, (status, msg)


def test_a_silent_prefill_is_a_504_within_the_health_bound(urls: tuple[str, str, int]) -> None:
    """A bootstrap server that takes the connection and never answers (a paused process:
    the kernel accepts for it): the decode gives the room up after its documented bound,
    ``health_interval_s x health_failures`` (0.6 s here), with a 504 a router retries,
    not after the client's own 5 s timeout with a 500."""
    _, d_url, _ = urls
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # never accepted, never answered
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        r = gen(d_url, bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=92)
        took = time.monotonic() - t0
    status, msg, _ = error(r)
    assert status == 504 and "did not answer" in msg, (status, msg)
    bound = FAST["health_interval_s"] * FAST["health_failures"]
    assert bound <= took < bound + 1.5, took


PAUSABLE_BOOTSTRAP = """
import json, sys, time
from hicache.disagg.bootstrap import BootstrapServer, PrefillRooms
from hicache.disagg.layout import InstanceLayout
rooms = PrefillRooms(InstanceLayout.from_json(json.loads(sys.argv[2])), timeout_s=600, closed_ttl_s=60)
BootstrapServer(rooms, "127.0.0.1", int(sys.argv[1])).start()
print("up", flush=True)
time.sleep(600)
"""
"""A prefill instance's bootstrap server alone, in a process of its own (to be paused)."""


def test_a_paused_prefill_is_a_504_within_the_health_bound(
    engines: tuple[Engine, Engine], urls: tuple[str, str, int]
) -> None:
    """A prefill process paused (SIGSTOP) after the decode registered its room: the
    decode's polls go unanswered and it fails the room after its bound, counted from the
    first poll that was not answered, with a 504."""
    _, decode = engines
    _, d_url, _ = urls
    port = free_port()
    layout = json.dumps(decode.role.layout.to_json())  # type: ignore[attr-defined]
    proc = subprocess.Popen(
        [sys.executable, "-c", PAUSABLE_BOOTSTRAP, str(port), layout], stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"up"
        room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 93}
        with ThreadPoolExecutor(1) as ex:
            pending = ex.submit(gen, d_url, **room)
            time.sleep(1.0)  # registered: the decode polls the room
            assert not pending.done(), pending.result().text
            os.kill(proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            r = pending.result(timeout=30)
            took = time.monotonic() - t0
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=10)
    status, msg, _ = error(r)
    assert status == 504 and "did not answer" in msg, (status, msg)
    bound = FAST["health_interval_s"] * FAST["health_failures"]
    assert took < bound + 1.5, took


def test_a_mismatched_pair_is_a_400_on_both_sides_whichever_comes_first() -> None:
    """The pair's layouts differ (page sizes 4 and 8): each side's request is refused with
    the same status, 400 naming both values (the request as sent can never be served),
    whichever side came first."""
    port = free_port()
    with (
        make_engine("tiny-random-llama", "prefill", port=port, page_size=4, **FAST) as prefill,
        make_engine("tiny-random-llama", "decode", port=port, page_size=8, **FAST) as decode,
        serve(prefill) as p_url,
        serve(decode) as d_url,
        ThreadPoolExecutor(2) as ex,
    ):
        for room, first, second in ((32, d_url, p_url), (33, p_url, d_url)):
            fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}
            one = ex.submit(gen, first, **fields)
            time.sleep(0.5)
            two = ex.submit(gen, second, **fields)
            got = {url: error(f.result()) for url, f in ((first, one), (second, two))}
            assert [status for status, _, _ in got.values()] == [400, 400], (room, got)
            assert all("page_size differs" in msg for _, msg, _ in got.values()), got


def room_state(port: int, room: int) -> str | None:
    """``room``'s state at the prefill instance's bootstrap server (None: never seen)."""
    r = httpx.post(f"http://127.0.0.1:{port}/status", json={"rooms": [room]}, timeout=10)
    got = r.json()["rooms"][0]
    return None if got is None else str(got["state"])


def test_a_room_claimed_then_refused_ends_on_both_sides(urls: tuple[str, str, int]) -> None:
    """The prefill instance claims the room when it validates the request, then refuses
    it (``max_new_tokens`` past the context): the room fails at once, and the decode half
    ends with the reason instead of waiting, parked, for a prefill that never comes."""
    p_url, d_url, port = urls
    room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 91}
    too_long = {"max_new_tokens": 200, "temperature": 0}  # context 128
    r = gen(p_url, sampling_params=too_long, **room)
    assert error(r)[:1] == (400,) and "max_tokens=200 is too large" in error(r)[1], r.text
    assert room_state(port, 91) == "failed"
    d = httpx.post(
        f"{d_url}/generate",
        json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}, **room},
        timeout=15,
    )
    assert d.status_code >= 400 and "room 91" in d.text and "max_tokens=200" in d.text, d.text


def test_a_room_refused_by_a_full_queue_ends() -> None:
    """A prefill instance whose queue (one place) holds a request waiting for its decode
    side refuses the next one (429) after claiming its room: that room fails at once."""
    port = free_port()
    opts = {**FAST, "room_timeout_s": 30.0}
    with (
        make_engine("tiny-random-llama", "prefill", port=port, max_queued_requests=1, **opts) as e,
        serve(e) as url,
        ThreadPoolExecutor(1) as ex,
    ):
        room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port}
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}}
        # queued until room 1's decode side registers (it never does here)
        ex.submit(httpx.post, f"{url}/generate", json={**body, **room, "bootstrap_room": 1})
        deadline = time.monotonic() + 10
        while e.queue.counts().queued < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = httpx.post(f"{url}/generate", json={**body, **room, "bootstrap_room": 2}, timeout=30)
        assert r.status_code == 429, r.text
        assert room_state(port, 2) == "failed"
        e.close()  # the first request ends with the engine
