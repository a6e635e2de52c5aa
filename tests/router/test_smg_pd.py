"""Prefill/decode disaggregation behind SGLang's real router: ``smg launch
--pd-disaggregation`` in front of one ``hicache serve --disaggregation-mode prefill`` and
one ``--disaggregation-mode decode``, real server processes on 127.0.0.1 moving pages
over Mooncake's transfer engine or NIXL.

- greedy answers through smg equal one plain server's, streamed and not, on ``/generate``
  and the OpenAI routes, for full attention, MLA and a sliding-window hybrid; so do
  output and prompt logprobs, ``n`` = 2 and seeded sampling;
- with decode offload, the next turn's prefill finds the first turn's prompt **and
  output** in the shared L3 (the decode instance wrote them), also when the prefill
  instance writes nothing itself (``write_back``), and also when each turn is sent the
  moment the previous answer ends (the decode instance announced its pages);
- under memory pressure (both instances with room for two prompts) 64 concurrent
  requests through smg with its default retries are all answered as a plain server
  answers them, and both instances end idle;
- failures end both sides with an error and leave every pool idle in ``/metrics``: the
  decode instance killed mid-transfer, the prefill instance killed while a decode waits.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from hicache.bench.pd_load import PdLoadSpec, idle, send_all
from hicache.bench.serverproc import ServerProcess
from hicache.services.process import free_port
from tests.disagg.test_pd_logprobs import CASES, assert_close, for_model, merged
from tests.helpers.metrics import metric as server_metric
from tests.helpers.smg import Smg
from tests.router.conftest import ROUTER_KEY, WORKER_FLAGS

ADMIN = {"Authorization": f"Bearer {ROUTER_KEY}"}
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to find"


@contextmanager
def servers(*flag_sets: list[str]) -> Iterator[list[ServerProcess]]:
    """One ``hicache serve`` per flag set, started one after the other (on two cores no
    slower than together), all stopped on exit."""
    with ExitStack() as stack:
        procs = [ServerProcess([*WORKER_FLAGS, *f], startup_timeout_s=120.0) for f in flag_sets]
        for p in procs:
            stack.callback(p.close)
        for p in procs:
            p.start()
        yield procs


def pd_flags(
    model: str, transport: str, bootstrap: int, *extra: str
) -> tuple[list[str], list[str]]:
    common = ["--model-path", model, "--disaggregation-transfer-backend", transport, *extra]
    prefill = [*common, "--disaggregation-mode", "prefill"]
    prefill += ["--disaggregation-bootstrap-port", str(bootstrap)]
    decode = [*common, "--disaggregation-mode", "decode"]
    return prefill, decode


def pd_router(prefill: ServerProcess, decode: ServerProcess, bootstrap: int) -> Smg:
    """smg in PD mode (``round_robin``) over one prefill and one decode instance."""
    return Smg(
        prefill=[(prefill.url, bootstrap)],
        decode=[decode.url],
        policy="round_robin",
        api_key=ROUTER_KEY,
    )


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}{path}", json=body, headers=ADMIN, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def streamed(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with httpx.stream(
        "POST", f"{url}{path}", json={**body, "stream": True}, headers=ADMIN, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def answers(url: str, model: str) -> dict[str, object]:
    """Greedy answers of ``url`` on each route, streamed and not."""
    gen = {"text": TEXT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": TEXT}],
        "max_tokens": 12,
        "temperature": 0,
    }
    comp = {"model": model, "prompt": TEXT, "max_tokens": 12, "temperature": 0}
    return {
        "generate": post(url, "/generate", gen)["output_ids"],
        "generate stream": streamed(url, "/generate", gen)[-1]["output_ids"],
        "chat": post(url, "/v1/chat/completions", chat)["choices"][0]["message"]["content"],
        "chat stream": "".join(
            e["choices"][0]["delta"].get("content", "")
            for e in streamed(url, "/v1/chat/completions", chat)
            if e.get("choices")
        ),
        "completion": post(url, "/v1/completions", comp)["choices"][0]["text"],
        "completion stream": "".join(
            e["choices"][0]["text"]
            for e in streamed(url, "/v1/completions", comp)
            if e.get("choices")
        ),
    }


def metric(server: ServerProcess, name: str, labels: str = "") -> float:
    return server_metric(server.url, name, labels)


def assert_idle(*procs: ServerProcess, timeout_s: float = 15.0) -> None:
    """Every instance has no admitted request and no L1 page held by one (its published
    stats, read until they say so)."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        while True:
            held = metric(p, "hicache_num_admitted_reqs") + metric(
                p, "hicache_device_tokens", '{holder="requests"}'
            )
            if held == 0:
                break
            assert time.monotonic() < deadline, f"{p.url} still holds requests or pages"
            time.sleep(0.2)


def smg_over(prefill: str, decode: str, bootstrap: int) -> Smg:
    """An smg (round robin, keyed) over one prefill/decode pair."""
    return Smg(
        prefill=[(prefill, bootstrap)], decode=[decode], policy="round_robin", api_key=ROUTER_KEY
    )


def answers_through_smg(prefill: str, decode: str, bootstrap: int, model: str) -> dict[str, object]:
    """:func:`answers` through :func:`smg_over` the pair."""
    with smg_over(prefill, decode, bootstrap) as smg:
        return answers(smg.url, model)


@pytest.mark.parametrize(
    ("model", "transport"),
    [
        ("tiny-random-llama", "mooncake"),
        pytest.param("tiny-random-llama", "nixl", marks=pytest.mark.matrix),
        pytest.param("tiny-random-deepseek-v2", "nixl", marks=pytest.mark.matrix),  # MLA
        # sliding-window layers
        pytest.param("tiny-random-gemma3", "mooncake", marks=pytest.mark.matrix),
    ],
)
def test_pd_behind_smg_answers_as_one_plain_server(model: str, transport: str) -> None:
    bootstrap = free_port()
    prefill_flags, decode_flags = pd_flags(model, transport, bootstrap)
    with servers(["--model-path", model], prefill_flags, decode_flags) as (plain, prefill, decode):
        want = answers(plain.url, model)
        assert answers_through_smg(prefill.url, decode.url, bootstrap, model) == want
        assert_idle(prefill, decode)


@pytest.mark.matrix
def test_a_keyed_pair_behind_smg_answers_as_one_plain_server() -> None:
    """deployment.md's one-machine example: both instances with smg's key as their
    ``--api-key``, which keys the prefill's bootstrap server (the decode sends it) and
    lets the decode contact the bootstrap address smg names; a registration without the
    key is refused (401) and changes nothing."""
    model, bootstrap = "tiny-random-llama", free_port()
    prefill_flags, decode_flags = pd_flags(model, "mooncake", bootstrap, "--api-key", ROUTER_KEY)
    with servers(["--model-path", model], prefill_flags, decode_flags) as (plain, prefill, decode):
        want = answers(plain.url, model)
        assert answers_through_smg(prefill.url, decode.url, bootstrap, model) == want
        r = httpx.post(
            f"http://127.0.0.1:{bootstrap}/abort", json={"room": 1, "why": "x"}, timeout=10
        )
        assert r.status_code == 401
        assert_idle(prefill, decode)


def ask(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    """``url``'s answer to ``body``: its JSON, or each event of a stream."""
    if body.get("stream"):
        return streamed(url, path, body)
    r = httpx.post(f"{url}{path}", json=body, headers=ADMIN, timeout=120)
    assert r.status_code == 200, r.text
    return [r.json()]


@pytest.mark.matrix  # 20 s; PD's logprobs and n: tests/disagg/test_pd_logprobs.py, test_pd_tp.py
def test_logprobs_and_n_behind_smg_answer_as_one_plain_server() -> None:
    """Output logprobs, prompt logprobs from ``logprob_start_len``, ``n`` = 2 and seeded
    sampling (:data:`tests.disagg.test_pd_logprobs.CASES`), streamed and not, through
    smg as one plain server answers them: smg's chat route sends a room per sequence, the
    others one per prompt; on ``/generate`` smg prepends the prefill's
    ``input_token_logprobs`` to the decode's, and a prefill instance sends none."""
    model, bootstrap = "tiny-random-llama", free_port()
    prefill_flags, decode_flags = pd_flags(model, "mooncake", bootstrap)
    with (
        servers(["--model-path", model], prefill_flags, decode_flags) as (plain, prefill, decode),
        smg_over(prefill.url, decode.url, bootstrap) as smg,
    ):
        for case, (path, body, _) in sorted(CASES.items()):
            for stream in (False, True):
                b = for_model(body, model, stream)
                want = merged(path, ask(plain.url, path, b), stream)
                got = merged(path, ask(smg.url, path, b), stream)
                assert_close(got, want, f"{case}, stream={stream}")
        assert_idle(prefill, decode)


@pytest.mark.matrix
def test_the_next_turn_hits_l3_for_the_first_turns_prompt_and_output(tmp_path: Path) -> None:
    """Decode offload: the decode instance writes the finished conversation to the shared
    L3, while the prefill instance, under ``write_back``, writes nothing there and holds
    the first prompt in L1 alone. The second turn's prefill takes the first prompt from
    its L1 and the first turn's output (and the prompt's last page) from L3, the decode
    instance's write; with its L1 and L2 flushed, all of it from L3."""
    model, page = "tiny-random-llama", 4
    l3 = ["--enable-hierarchical-cache", "--hicache-storage-backend", "file"]
    # every lookup prefetches (the default threshold, 256 tokens, is past these prompts)
    extra = {"file_path": str(tmp_path), "prefetch_threshold": 0}
    l3 += ["--hicache-storage-backend-extra-config", json.dumps(extra)]
    bootstrap = free_port()
    # ... and every L2 hit is loaded back (the default threshold, 10 tokens, is past the
    # two pages the first turn's output adds)
    prefill_flags, decode_flags = pd_flags(
        model,
        "mooncake",
        bootstrap,
        "--page-size",
        str(page),
        "--hicache-load-back-threshold",
        "0",
        *l3,
    )
    prefill_flags += ["--hicache-write-policy", "write_back"]
    decode_flags += ["--disaggregation-decode-enable-offload-kvcache"]
    with (
        servers(prefill_flags, decode_flags) as (prefill, decode),
        smg_over(prefill.url, decode.url, bootstrap) as smg,
    ):
        first_ids = list(range(300, 342))  # 42 tokens: 10 whole pages
        gen = {"sampling_params": {"max_new_tokens": 10, "temperature": 0}}
        first = post(smg.url, "/generate", {"input_ids": first_ids, **gen})
        conversation = first_ids + first["output_ids"]
        # the decode instance computed KV for every position but the last output token
        written = (len(conversation) - 1) // page * page
        deadline = time.monotonic() + 30
        while metric(decode, "hicache_l3_written_bytes_total") == 0:
            assert time.monotonic() < deadline, "the decode instance wrote nothing to L3"
            time.sleep(0.2)
        time.sleep(1.0)  # its last pages' writes land
        second_ids = conversation + list(range(500, 520))
        second = post(smg.url, "/generate", {"input_ids": second_ids, **gen})
        meta = second["meta_info"]["cached_tokens_details"]
        assert (meta["device"], meta["storage"]) == (40, written - 40), (meta, written)
        # on a prefill instance that holds nothing of it: all of it from L3
        r = httpx.post(f"{prefill.url}/flush_cache", headers=ADMIN, timeout=30)
        assert r.status_code == 200, r.text
        third_ids = conversation + list(range(600, 620))
        third = post(smg.url, "/generate", {"input_ids": third_ids, **gen})
        meta = third["meta_info"]["cached_tokens_details"]
        # (the second turn's conversation, written by the decode instance too, holds
        # the first conversation's last page whole)
        whole = len(conversation) // page * page
        assert (meta["device"], meta["host"], meta["storage"]) == (0, 0, whole), meta
        assert_idle(prefill, decode)


def test_the_next_turn_sent_at_once_finds_the_previous_answer(tmp_path: Path) -> None:
    """Decode offload, turns sent the moment the previous answer ends (no pause): the
    decode instance's L3 write of an answer lands after the answer went out, but it
    announced those pages first, so every next turn's prefill waits for them and takes
    the whole previous conversation but its last token from its own cache and L3: the
    previous prompt and the answer's pages, every turn."""
    model, page = "tiny-random-llama", 4
    extra = {"file_path": str(tmp_path), "prefetch_threshold": 0}
    l3 = ["--enable-hierarchical-cache", "--hicache-storage-backend", "file",
          "--hicache-storage-backend-extra-config", json.dumps(extra)]  # fmt: skip
    bootstrap = free_port()
    prefill_flags, decode_flags = pd_flags(
        model, "mooncake", bootstrap, "--page-size", str(page),
        "--hicache-load-back-threshold", "0", *l3,
    )  # fmt: skip
    prefill_flags += ["--hicache-write-policy", "write_through"]
    decode_flags += ["--disaggregation-decode-enable-offload-kvcache"]
    with (
        servers(prefill_flags, decode_flags) as (prefill, decode),
        pd_router(prefill, decode, bootstrap) as smg,
    ):
        gen = {"sampling_params": {"max_new_tokens": 10, "temperature": 0}}
        conversation: list[int] = []
        for turn in range(5):
            ids = conversation + list(range(300 + 20 * turn, 318 + 20 * turn))
            got = post(smg.url, "/generate", {"input_ids": ids, **gen})
            meta = got["meta_info"]["cached_tokens_details"]
            if turn:  # the previous answer's pages: its KV ends before its last token
                answer_end = (len(conversation) - 1) // page * page
                assert sum(meta.values()) >= answer_end, (turn, meta, answer_end)
                assert meta["storage"] > 0, (turn, meta)
            conversation = ids + got["output_ids"]
        assert metric(decode, "hicache_l3_announced_pages_total") > 0
        assert metric(prefill, "hicache_l3_announced_waits_expired_total") == 0
        assert_idle(prefill, decode)


@pytest.mark.matrix
def test_pd_under_memory_pressure_answers_every_request_as_a_plain_server() -> None:
    """Both instances at ``--max-total-tokens 2048`` (two 870-token prompts at a time),
    64 such prompts at once through smg with its default retries and circuit breaker:
    every request is answered 200 with a plain server's (same memory) greedy tokens, and
    both instances are idle afterwards (nothing queued, admitted or parked, no open room,
    no L1 page held by a request). Before, the prefill computed requests whose decode half
    was not admitted and parked them while the decode's parked requests waited for it,
    and requests were refused for memory parked ones would free: smg opened its circuit
    and 60 of 64 got 503."""
    spec = PdLoadSpec()  # 64 requests of 870 tokens, 16 generated, 2048 tokens per instance
    memory = ["--max-total-tokens", str(spec.max_total_tokens)]
    bootstrap = free_port()
    prefill_flags, decode_flags = pd_flags("tiny-random-llama", "mooncake", bootstrap, *memory)
    headers = {"authorization": f"Bearer {ROUTER_KEY}"}
    with servers(memory, prefill_flags, decode_flags) as (plain, prefill, decode):
        want = asyncio.run(send_all(plain.url, spec, "plain", headers))
        assert want.status == ["200"] * spec.requests, want.errors
        with Smg(
            prefill=[(prefill.url, bootstrap)],
            decode=[decode.url],
            policy="round_robin",
            api_key=ROUTER_KEY,
        ) as smg:
            got = asyncio.run(send_all(smg.url, spec, "pd", headers))
        assert got.status == ["200"] * spec.requests, got.errors
        assert got.output_ids == want.output_ids
        assert idle([prefill.url, decode.url], 30.0)


@pytest.mark.matrix
def test_a_paused_decode_instance_delays_its_prefills_and_then_serves_them() -> None:
    """The decode instance is paused (SIGSTOP) while requests arrive: their prefills wait,
    queued, for the decode side's registrations instead of computing; resumed 3 s later
    (within the room timeout), every request is answered as a plain server answers it
    and both instances end idle."""
    bootstrap = free_port()
    prefill_flags, decode_flags = pd_flags("tiny-random-llama", "mooncake", bootstrap)
    gen = {"sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    prompts = [list(range(300 + 40 * i, 340 + 40 * i)) for i in range(4)]
    with servers([], prefill_flags, decode_flags) as (plain, prefill, decode):
        want = [
            post(plain.url, "/generate", {"input_ids": p, **gen})["output_ids"] for p in prompts
        ]
        assert decode.proc is not None
        with (
            Smg(
                prefill=[(prefill.url, bootstrap)],
                decode=[decode.url],
                policy="round_robin",
                api_key=ROUTER_KEY,
            ) as smg,
            ThreadPoolExecutor(len(prompts)) as ex,
        ):
            os.kill(decode.proc.pid, signal.SIGSTOP)
            try:
                futs = [
                    ex.submit(post, smg.url, "/generate", {"input_ids": p, **gen}) for p in prompts
                ]
                time.sleep(3.0)
                assert metric(prefill, "hicache_num_queue_reqs") == len(prompts)
                assert metric(prefill, "hicache_num_admitted_reqs") == 0
            finally:
                os.kill(decode.proc.pid, signal.SIGCONT)
            got = [f.result(timeout=120)["output_ids"] for f in futs]
        assert got == want
        assert_idle(prefill, decode)
        assert metric(prefill, "hicache_num_open_rooms") == 0


def room_body(bootstrap: int, room: int) -> dict[str, Any]:
    """A ``/generate`` body with its bootstrap fields, as smg sends each half of a room."""
    return {
        "text": TEXT,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap,
        "bootstrap_room": room,
    }


def kill(server: ServerProcess) -> None:
    """SIGKILL ``server`` (no word to anyone) and reap it."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)


@pytest.mark.matrix
def test_decode_killed_mid_transfer_fails_the_prefill_without_a_hang() -> None:
    """The decode instance registers its pages, then dies (SIGKILL): the prefill's write
    fails, its request answers with an error, and it holds nothing afterwards."""
    bootstrap = free_port()
    prefill_flags, decode_flags = pd_flags("tiny-random-llama", "mooncake", bootstrap)
    with servers(prefill_flags, decode_flags) as (prefill, decode):
        body = room_body(bootstrap, 4242)
        with httpx.Client(timeout=120) as c:
            # streamed: the answer's head comes at once, the tokens once the pages land
            waiting = c.build_request(
                "POST", f"{decode.url}/generate", json={**body, "stream": True}
            )
            stream = c.send(waiting, stream=True)  # registered, waiting for the prefill
            time.sleep(1.0)
            kill(decode)
            stream.close()
        t0 = time.monotonic()
        r = httpx.post(f"{prefill.url}/generate", json=body, timeout=120)
        assert time.monotonic() - t0 < 35  # the transfer's bound at most
        assert r.status_code == 500, r.text
        assert "room 4242" in r.text and "peer" in r.text, r.text
        assert_idle(prefill)


@pytest.mark.matrix
def test_prefill_killed_fails_the_decode_rooms_within_the_health_bound() -> None:
    bootstrap = free_port()
    prefill_flags, decode_flags = pd_flags("tiny-random-llama", "nixl", bootstrap)
    with servers(prefill_flags, decode_flags) as (prefill, decode):
        body = room_body(bootstrap, 4343)
        with httpx.Client(timeout=120) as c:
            req = c.build_request("POST", f"{decode.url}/generate", json={**body, "stream": True})
            pending = c.send(req, stream=True)
            time.sleep(1.0)  # registered at the prefill instance, which then dies
            kill(prefill)
            t0 = time.monotonic()
            answer = pending.read().decode()
            took = time.monotonic() - t0
        assert took < 10, took  # the health bound (3 s by default) and a poll
        assert "did not answer" in answer, answer
        assert_idle(decode)
