"""Prefill/decode pairs at tensor-parallel sizes, equal or not: a prefill and a decode
``hicache serve`` (each a process tree of its ranks) paired over a real transport on
127.0.0.1, each request sent to both with the same room (as the router does). Greedy
answers equal a plain TP-1 server's, streamed and not; both sides end idle.

Every rank of each side writes or receives its own share (:mod:`hicache.disagg.shares`):
K/V heads split at 2 ranks and replicated at 4 for the tiny Llama (2 K/V heads), an MLA
latent whole on every rank. ``make test`` runs a representative subset; ``make
test-matrix`` the rest (marked ``matrix``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest

from hicache.bench.serverproc import ServerProcess
from hicache.services.process import free_port

PROMPT = list(range(300, 345))  # 45 tokens: 11 whole pages of 4, and 1
COMMON = ("--device", "cpu", "--page-size", "4", "--context-length", "256")
FAST: tuple[str, ...] = ()


@contextmanager
def servers(*flag_sets: list[str]) -> Iterator[list[ServerProcess]]:
    """One ``hicache serve`` per flag set, started in parallel, all stopped on exit."""
    with ExitStack() as stack:
        procs = [ServerProcess([*COMMON, *f], startup_timeout_s=180.0) for f in flag_sets]
        for p in procs:
            stack.callback(p.close)
        for p in procs:
            p.start()
        yield procs


def body(room: dict[str, Any] | None = None, *, stream: bool = False) -> dict[str, Any]:
    return {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        "stream": stream,
        **(room or {}),
    }


def generate(url: str, b: dict[str, Any]) -> list[int]:
    """``output_ids`` of a ``/generate`` call (the last event's when streamed)."""
    if not b["stream"]:
        r = httpx.post(f"{url}/generate", json=b, timeout=120)
        assert r.status_code == 200, r.text
        return list(r.json()["output_ids"])
    last: dict[str, Any] = {}
    with httpx.stream("POST", f"{url}/generate", json=b, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
    return list(last["output_ids"])


def through_pair(
    prefill: ServerProcess, decode: ServerProcess, port: int, room: int, stream: bool
) -> list[int]:
    """Both halves of ``room``; the decode side's answer (the prefill's is one token)."""
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}
    with ThreadPoolExecutor(2) as ex:
        p = ex.submit(generate, prefill.url, body(fields, stream=False))
        d = ex.submit(generate, decode.url, body(fields, stream=stream))
        assert len(p.result()) == 1
        return d.result()


def open_rooms(server: ServerProcess) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("hicache_pd_open_rooms"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


CASES = [
    pytest.param("tiny-random-llama", 2, 2, "mooncake"),
    pytest.param("tiny-random-llama", 1, 2, "mooncake"),
    pytest.param("tiny-random-llama", 2, 1, "nixl"),
    pytest.param("tiny-random-llama", 4, 2, "mooncake", marks=pytest.mark.matrix),
    pytest.param("tiny-random-llama", 2, 2, "nixl", marks=pytest.mark.matrix),
    pytest.param("tiny-random-llama", 1, 2, "nixl", marks=pytest.mark.matrix),
    pytest.param("tiny-random-deepseek-v2", 2, 1, "mooncake"),
    pytest.param("tiny-random-deepseek-v2", 1, 2, "mooncake", marks=pytest.mark.matrix),
    pytest.param("tiny-random-deepseek-v2", 4, 2, "nixl", marks=pytest.mark.matrix),
    pytest.param("tiny-random-gemma3", 2, 2, "mooncake", marks=pytest.mark.matrix),
    pytest.param("tiny-random-gemma3", 1, 2, "nixl", marks=pytest.mark.matrix),
    pytest.param("tiny-random-gemma3", 2, 1, "mooncake", marks=pytest.mark.matrix),
    pytest.param("tiny-random-deepseek-v32", 2, 2, "mooncake", marks=pytest.mark.matrix),
    pytest.param("tiny-random-deepseek-v32", 1, 2, "nixl", marks=pytest.mark.matrix),
    pytest.param("tiny-random-deepseek-v32", 2, 1, "mooncake", marks=pytest.mark.matrix),
]


@pytest.mark.parametrize(("model", "prefill_tp", "decode_tp", "backend"), CASES)
def test_a_pair_at_two_tp_sizes_answers_as_a_plain_server(
    model: str, prefill_tp: int, decode_tp: int, backend: str
) -> None:
    port = free_port()
    pd = ["--model-path", model, "--disaggregation-transfer-backend", backend, *FAST]
    with servers(
        ["--model-path", model],
        [
            *pd,
            "--tp-size",
            str(prefill_tp),
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(port),
        ],
        [*pd, "--tp-size", str(decode_tp), "--disaggregation-mode", "decode"],
    ) as (plain, prefill, decode):
        want = generate(plain.url, body())
        assert len(want) == 8
        for room, stream in ((101, False), (102, True)):
            got = through_pair(prefill, decode, port, room, stream)
            assert got == want, (room, stream, got, want)
        assert open_rooms(prefill) == 0
