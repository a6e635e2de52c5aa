"""Everything a plain server serves, through a prefill/decode pair over HTTP: output
``logprobs``, prompt logprobs with ``logprob_start_len``, ``n`` = 2 (one room for the
prompt, or one per sequence as smg's chat route sends them), seeded sampling, streamed
and not, on ``/v1/completions``, ``/v1/chat/completions`` and ``/generate``. Each body
goes to both instances at once, with the bootstrap fields smg adds; the decode
instance's answer (the one smg returns) equals a plain server's, over Mooncake's
transfer engine and NIXL.

Tolerance: token ids and texts are compared exactly; a log probability within
:data:`TOL`. Every instance computes fp32 logits on this CPU, and the pair's KV is the
bytes its prefill computed, but a position's logits can come out of a differently
shaped forward than the plain server's (another chunk, a cached prefix, two sequences
decoded together or not), and ATen's x86 kernels block their sums by shape: the last
bits of a logit move (fp32 eps 1.2e-7 relative, logits of order 1-10), and a
log-softmax over the 32k-token vocabulary adds its own rounding; 1e-4 is two orders
above that and far below any logprob difference that means another distribution.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from hicache.engine.front.engine import Engine
from tests.disagg.test_pd_engine import assert_idle, free_port, make_engine
from tests.helpers.api_fixtures import serve

MODEL = "tiny-random-llama"
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest"
TOL = 1e-4
VOLATILE = {"id", "created", "e2e_latency", "ttft", "usage", "system_fingerprint"}
"""Keys whose values differ between any two answers (ids, times, the cache report)."""
CACHE_KEYS = {"cached_tokens", "cached_tokens_details", "prompt_tokens_details", "sglext"}
_rooms = itertools.count(1000)


@dataclass(frozen=True)
class Servers:
    """A plain server and a pair, served over HTTP: their URLs, the prefill's bootstrap
    port, and the decode instance's engine."""

    plain: str
    prefill: str
    decode: str
    port: int
    decode_engine: Engine


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def servers(request: pytest.FixtureRequest) -> Iterator[Servers]:
    port = free_port()
    # the default health bound (3 s): the machine may be loaded, and no test here waits
    # for a silent peer; a room whose other side never comes fails within 5 s
    opts = {"transfer_backend": request.param, "room_timeout_s": 5.0}
    engines: list[Engine] = []
    try:
        engines.append(make_engine(MODEL))
        engines.append(make_engine(MODEL, "prefill", port=port, **opts))
        engines.append(make_engine(MODEL, "decode", port=port, **opts))
        plain, prefill, decode = engines
        with serve(plain) as a, serve(prefill) as b, serve(decode) as c:
            yield Servers(a, b, c, port, decode)
        assert_idle(prefill, decode)
    finally:
        for e in reversed(engines):
            e.close()


def post(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The answer's JSON (one item), or each event of a stream."""
    if not body.get("stream"):
        r = httpx.post(f"{url}{path}", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return [r.json()]
    events = []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def through_pair(
    prefill: str, decode: str, port: int, path: str, body: dict[str, Any], rooms: int = 1
) -> list[dict[str, Any]]:
    """``body`` sent to both instances at once with bootstrap fields (``rooms`` > 1: an
    array of that many, as smg sends for a chat's ``n``); the decode's answer."""
    if rooms == 1:
        fields: dict[str, Any] = {
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": port,
            "bootstrap_room": next(_rooms),
        }
    else:
        fields = {
            "bootstrap_host": ["127.0.0.1"] * rooms,
            "bootstrap_port": [port] * rooms,
            "bootstrap_room": [next(_rooms) for _ in range(rooms)],
        }
    with ThreadPoolExecutor(2) as ex:
        p = ex.submit(post, prefill, path, {**body, **fields})
        d = ex.submit(post, decode, path, {**body, **fields})
        p.result()
        return d.result()


def merged(path: str, events: list[dict[str, Any]], stream: bool) -> list[Any]:
    """Each choice of an answer, in index order; a stream's events joined into one answer
    per choice (its texts and logprob lists concatenated; ``/generate``'s chunks are
    cumulative: each index's last one)."""
    if path == "/generate":
        last: dict[int, Any] = {}
        for e in events:
            for item in e if isinstance(e, list) else [e]:
                last[item.get("index", 0)] = item
        return [strip(last[i]) for i in sorted(last)]
    if not stream:
        return [strip(c) for c in events[0]["choices"]]
    by_index: dict[int, dict[str, Any]] = {}
    for e in events:
        for c in e.get("choices") or []:
            acc = by_index.setdefault(c["index"], {"text": "", "tokens": [], "logprobs": []})
            acc["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
            lp = c.get("logprobs")
            if lp is not None and "content" in lp:  # chat
                acc["logprobs"] += lp["content"] or []
            elif lp is not None:  # completions
                acc["tokens"] += lp["tokens"]
                pairs = zip(lp["token_logprobs"], lp["top_logprobs"], strict=True)
                acc["logprobs"] += [list(x) for x in pairs]
            if c.get("finish_reason"):
                acc["finish_reason"] = c["finish_reason"]
    return [strip(by_index[i]) for i in sorted(by_index)]


def strip(value: Any) -> Any:
    """``value`` without :data:`VOLATILE` and :data:`CACHE_KEYS` entries (the pair's
    cache report is the prefill's, another cache than the plain server's)."""
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items() if k not in VOLATILE | CACHE_KEYS}
    if isinstance(value, list | tuple):
        return [strip(v) for v in value]
    return value


def assert_close(got: Any, want: Any, where: str = "") -> None:
    """``got`` equals ``want``, floats within :data:`TOL`."""
    if isinstance(want, float) or isinstance(got, float):
        assert isinstance(got, int | float) and isinstance(want, int | float), (where, got, want)
        assert math.isclose(got, want, rel_tol=0, abs_tol=TOL), (where, got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (where, got, want)
        for k in want:
            assert_close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_close(g, w, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


def for_model(body: dict[str, Any], model: str, stream: bool) -> dict[str, Any]:
    """``body`` of :data:`CASES` for a server of ``model`` (its OpenAI ``model`` field),
    streamed or not."""
    return {**body, "stream": stream} | ({"model": model} if "model" in body else {})


COMPLETION = {"model": "tiny", "prompt": TEXT, "max_tokens": 6}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": TEXT}], "max_tokens": 6}
GENERATE = {"text": TEXT, "sampling_params": {"max_new_tokens": 6}}

CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    "completion logprobs": (
        "/v1/completions",
        {**COMPLETION, "temperature": 0, "logprobs": 3},
        1,
    ),
    "completion prompt logprobs from 5, seeded": (
        "/v1/completions",
        {**COMPLETION, "temperature": 1.0, "seed": 7, "echo": True, "logprobs": 2}
        | {"logprob_start_len": 5},
        1,
    ),
    "completion n=2 seeded, one room": (
        "/v1/completions",
        {**COMPLETION, "temperature": 1.0, "seed": 11, "n": 2, "logprobs": 1},
        1,
    ),
    "chat logprobs n=2 seeded, a room per sequence": (
        "/v1/chat/completions",
        {**CHAT, "temperature": 0.8, "seed": 3, "n": 2, "logprobs": True, "top_logprobs": 2},
        2,
    ),
    "chat n=2 greedy": ("/v1/chat/completions", {**CHAT, "temperature": 0, "n": 2}, 2),
    "generate prompt logprobs from 3": (
        "/generate",
        {**GENERATE, "return_logprob": True, "logprob_start_len": 3, "top_logprobs_num": 2}
        | {"sampling_params": {"max_new_tokens": 6, "temperature": 0}},
        1,
    ),
    "generate n=2 seeded logprobs from 0": (
        "/generate",
        {**GENERATE, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 1}
        | {"sampling_params": {"max_new_tokens": 6, "n": 2, "sampling_seed": 5}},
        1,
    ),
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_pair_answers_as_a_plain_server(servers: Servers, case: str, stream: bool) -> None:
    path, body, rooms = CASES[case]
    body = for_model(body, "tiny", stream)
    want = merged(path, post(servers.plain, path, body), stream)
    got = merged(
        path, through_pair(servers.prefill, servers.decode, servers.port, path, body, rooms), stream
    )
    assert len(want) == body.get("n", body.get("sampling_params", {}).get("n", 1))
    assert_close(got, want)


def test_a_failed_room_fails_its_copies_without_computing_them(servers: Servers) -> None:
    """``n`` = 3 on the decode instance alone (the prefill never hears of the room): the
    room fails at its timeout, and the copies waiting for the first are not run (each
    would compute the prompt on the decode instance for an answer that is an error)."""
    forwards = servers.decode_engine.core.scheduler.forwards
    body = {**COMPLETION, "n": 3, "bootstrap_host": "127.0.0.1", "bootstrap_port": servers.port}
    r = httpx.post(
        f"{servers.decode}/v1/completions",
        json={**body, "bootstrap_room": next(_rooms)},
        timeout=60,
    )
    assert r.status_code >= 500 and "room" in r.json()["error"]["message"], r.text
    assert servers.decode_engine.core.scheduler.forwards == forwards
