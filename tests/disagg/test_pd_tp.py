"""Prefill/decode pairs at tensor-parallel sizes, equal or not: a prefill and a decode
``hicache serve`` (each a process tree of its ranks) paired over a real transport on
127.0.0.1, each request sent to both with the same room (as the router does). Greedy
answers equal a plain TP-1 server's, streamed and not, and so do logprobs, prompt
logprobs, ``n`` = 2 and seeded sampling; both sides end idle.

Every rank of each side writes or receives its own share (:mod:`hicache.disagg.shares`):
K/V heads split at 2 ranks and replicated at 4 for the tiny Llama (2 K/V heads), an MLA
latent whole on every rank. ``make test`` runs a representative subset; ``make
test-matrix`` the rest (marked ``matrix``).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from hicache.bench.serverproc import ServerProcess
from hicache.config import CacheConfig
from hicache.disagg.config import Bootstrap, DisaggConfig
from hicache.disagg.layout import prompt_hash
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.request import RequestOutput
from hicache.engine.sampling import SamplingParams
from hicache.services.process import free_port
from tests.api.test_serve_tp import rank_pids
from tests.disagg.test_pd_logprobs import CASES as LOGPROB_CASES
from tests.disagg.test_pd_logprobs import assert_close, for_model, merged, post
from tests.disagg.test_pd_logprobs import through_pair as pair_answer
from tests.helpers.metrics import metric as server_metric

PROMPT = list(range(300, 345))  # 45 tokens: 11 whole pages of 4, and 1
GREEDY = SamplingParams(temperature=0, max_tokens=8)
COMMON = ("--device", "cpu", "--page-size", "4", "--context-length", "256")
FAST: tuple[str, ...] = ()


@contextmanager
def servers(*flag_sets: list[str]) -> Iterator[list[ServerProcess]]:
    """One ``hicache serve`` per flag set, started one after the other (on two cores no
    slower than together), all stopped on exit."""
    with ExitStack() as stack:
        procs = [ServerProcess([*COMMON, *f], startup_timeout_s=180.0) for f in flag_sets]
        for p in procs:
            stack.callback(p.close)
        for p in procs:
            p.start()
        yield procs


def body(
    room: dict[str, Any] | None = None, *, stream: bool = False, prompt: list[int] = PROMPT
) -> dict[str, Any]:
    return {
        "input_ids": prompt,
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
    prefill: ServerProcess,
    decode: ServerProcess,
    port: int,
    room: int,
    stream: bool,
    prompt: list[int] = PROMPT,
) -> list[int]:
    """Both halves of ``room``; the decode side's answer (the prefill's is one token)."""
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}
    with ThreadPoolExecutor(2) as ex:
        p = ex.submit(generate, prefill.url, body(fields, prompt=prompt))
        d = ex.submit(generate, decode.url, body(fields, stream=stream, prompt=prompt))
        assert len(p.result()) == 1
        return d.result()


def open_rooms(server: ServerProcess) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("hicache_pd_open_rooms"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


MODELS = (
    "tiny-random-llama",
    "tiny-random-deepseek-v2",
    "tiny-random-gemma3",
    "tiny-random-deepseek-v32",
)
SIZES = ((2, 2), (1, 2), (2, 1), (4, 2))
CORE = {("tiny-random-deepseek-v2", 1, 2, "mooncake")}
"""The subset ``make test`` runs here: an MLA latent spread over two ranks. Split heads
gathered on one rank (``tiny-random-llama``, 2 -> 1, ``nixl``), the other transport, is
checked by :func:`test_a_prefill_rank_killed_or_paused_fails_the_decode_room_within_the_bound`
on its pair (:func:`assert_answers_as_a_plain_server`) before it pauses a rank."""
CASES = [
    pytest.param(m, p, d, b, marks=() if (m, p, d, b) in CORE else pytest.mark.matrix)
    for m in MODELS
    for p, d in SIZES
    for b in ("mooncake", "nixl")
]
_PLAIN: dict[str, list[int]] = {}


def plain_answer(model: str, prompt: list[int] = PROMPT) -> list[int]:
    """A plain TP-1 engine's greedy answer to ``prompt`` (computed once per model and
    prompt)."""
    key = f"{model}:{prompt_hash(prompt)}"
    if key not in _PLAIN:
        with Engine(
            EngineConfig(
                model_path=model, device="cpu", context_length=256, cache=CacheConfig(page_size=4)
            )
        ).start() as plain:
            _PLAIN[key] = plain.generate(prompt, GREEDY, timeout=120).output_ids
    return _PLAIN[key]


@pytest.mark.parametrize(("model", "prefill_tp", "decode_tp", "backend"), CASES)
def test_a_pair_at_two_tp_sizes_answers_as_a_plain_server(
    model: str, prefill_tp: int, decode_tp: int, backend: str
) -> None:
    port = free_port()
    pd = ["--model-path", model, "--disaggregation-transfer-backend", backend, *FAST]
    with servers(
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
    ) as (prefill, decode):
        assert_answers_as_a_plain_server(prefill, decode, port, model)


def assert_answers_as_a_plain_server(
    prefill: ServerProcess, decode: ServerProcess, port: int, model: str
) -> None:
    """The pair's greedy answers (rooms 101 and 102), streamed and not, are a plain TP-1
    engine's, and the prefill instance has no room open after them."""
    want = plain_answer(model)
    assert len(want) == 8
    for room, stream in ((101, False), (102, True)):
        got = through_pair(prefill, decode, port, room, stream)
        assert got == want, (room, stream, got, want)
    assert open_rooms(prefill) == 0


@pytest.mark.matrix
def test_logprobs_and_n_through_a_tp_2_pair_answer_as_a_plain_server() -> None:
    """Output and prompt logprobs, ``n`` = 2 and seeded sampling
    (:data:`tests.disagg.test_pd_logprobs.CASES`) through a pair at TP 2 on both sides,
    streamed and not, as a plain TP-1 server answers them: rank 0 samples, so rank 0's
    share carries the room's logprobs and generator state."""
    port = free_port()
    model = "tiny-random-llama"
    pd = ["--model-path", model, "--disaggregation-transfer-backend", "mooncake", *FAST]
    prefill_flags = [*pd, "--tp-size", "2", "--disaggregation-mode", "prefill"]
    prefill_flags += ["--disaggregation-bootstrap-port", str(port)]
    decode_flags = [*pd, "--tp-size", "2", "--disaggregation-mode", "decode"]
    with servers(["--model-path", model], prefill_flags, decode_flags) as (plain, p, d):
        for case, (path, case_body, rooms) in sorted(LOGPROB_CASES.items()):
            for stream in (False, True):
                b = for_model(case_body, model, stream)
                want = merged(path, post(plain.url, path, b), stream)
                got = merged(path, pair_answer(p.url, d.url, port, path, b, rooms), stream)
                assert_close(got, want, f"{case}, stream={stream}")
        assert open_rooms(p) == 0


RECURRENT = (
    pytest.param("tiny-random-qwen3-next", "mooncake", marks=pytest.mark.matrix),  # DeltaNet
    pytest.param("tiny-random-nemotron-h", "nixl", marks=pytest.mark.matrix),  # Mamba2
)


@pytest.mark.parametrize(("model", "backend"), RECURRENT)
def test_a_recurrent_pair_at_tp_2_answers_as_a_plain_server(model: str, backend: str) -> None:
    """Each prefill rank sends its own shard of the state after the prompt to the decode
    rank of its number; also when the decode side's own cache holds part of a prompt
    (the first answer's conversation): it skips those pages and resumes from the state
    sent after the whole prompt."""
    port = free_port()
    pd = ["--model-path", model, "--disaggregation-transfer-backend", backend, "--tp-size", "2"]
    want = plain_answer(model)
    longer = PROMPT + want[:7] + list(range(500, 509))
    with servers(
        [*pd, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port)],
        [*pd, "--disaggregation-mode", "decode"],
    ) as (prefill, decode):
        for room, stream in ((111, False), (112, True)):
            got = through_pair(prefill, decode, port, room, stream)
            assert got == want, (room, stream, got, want)
        got = through_pair(prefill, decode, port, 113, True, prompt=longer)
        assert got == plain_answer(model, longer)
        assert open_rooms(prefill) == 0
        assert_idle(prefill)
        assert_idle(decode)


@pytest.mark.matrix
def test_a_recurrent_pair_of_two_tp_sizes_is_refused_naming_both() -> None:
    """A recurrent model's state is each rank's own heads: it moves only rank to rank."""
    port = free_port()
    pd = ["--model-path", "tiny-random-nemotron-h", "--disaggregation-transfer-backend", "nixl"]
    with servers(
        [*pd, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port)],
        [*pd, "--tp-size", "2", "--disaggregation-mode", "decode"],
    ) as (prefill, decode):
        fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 121}
        with ThreadPoolExecutor(2) as ex:
            futs = [
                ex.submit(httpx.post, f"{s.url}/generate", json=body(fields), timeout=120)
                for s in (prefill, decode)
            ]
            for f in futs:
                r = f.result()
                assert r.status_code == 400, r.text
                assert "tp_size differs" in r.text, r.text
                assert "has 1" in r.text and "instance 2" in r.text, r.text
        assert_idle(prefill)
        assert_idle(decode)


def l3_written(server: ServerProcess) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("hicache_l3_written_bytes_total"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_decode_offload_at_tp_2_writes_head_records_a_tp_1_prefill_hits(tmp_path: Path) -> None:
    """A decode instance at TP 2 writes the finished conversation to the shared L3, each
    rank the records of its K/V head; the next turn's prefill, at TP 1 and under
    ``write_back`` (it writes nothing there), takes the first prompt from its L1 and the
    first turn's output from those records, and the pair answers as a plain server."""
    model, page = "tiny-random-llama", 4
    extra = json.dumps({"file_path": str(tmp_path), "prefetch_threshold": 0})
    l3 = ["--enable-hierarchical-cache", "--hicache-storage-backend", "file"]
    l3 += ["--hicache-storage-backend-extra-config", extra, "--hicache-load-back-threshold", "0"]
    l3 += ["--hicache-storage-tp-lcm", "2"]  # TP 1 and TP 2 share it: a record per K/V head
    port = free_port()
    pd = ["--model-path", model, "--disaggregation-transfer-backend", "mooncake", *l3]
    prefill_flags = [*pd, "--disaggregation-mode", "prefill"]
    prefill_flags += [
        "--disaggregation-bootstrap-port",
        str(port),
        "--hicache-write-policy",
        "write_back",
    ]
    decode_flags = [*pd, "--disaggregation-mode", "decode", "--tp-size", "2"]
    decode_flags += ["--disaggregation-decode-enable-offload-kvcache"]
    with servers(prefill_flags, decode_flags) as (prefill, decode):
        first_ids = list(range(300, 342))  # 42 tokens: 10 whole pages
        first = through_pair(prefill, decode, port, 201, False, first_ids)
        conversation = first_ids + first
        written = (len(conversation) - 1) // page * page  # every position but the last token
        deadline = time.monotonic() + 30
        while l3_written(decode) == 0:
            assert time.monotonic() < deadline, "the decode instance wrote nothing to L3"
            time.sleep(0.2)
        time.sleep(1.0)  # its last pages' writes land
        second_ids = conversation + list(range(500, 520))
        fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 202}
        with ThreadPoolExecutor(2) as ex:
            url = f"{prefill.url}/generate"
            p = ex.submit(httpx.post, url, json=body(fields, prompt=second_ids), timeout=120)
            d = ex.submit(generate, decode.url, body(fields, prompt=second_ids))
            meta = p.result().json()["meta_info"]["cached_tokens_details"]
            got = d.result()
        assert (meta["device"], meta["storage"]) == (40, written - 40), (meta, written)
    with Engine(
        EngineConfig(
            model_path=model, device="cpu", context_length=256, cache=CacheConfig(page_size=4)
        )
    ).start() as plain:
        assert got == plain.generate(second_ids, GREEDY, timeout=120).output_ids


def metric(server: ServerProcess, name: str, labels: str = "") -> float:
    return server_metric(server.url, name, labels)


def assert_idle(server: ServerProcess, timeout_s: float = 20.0) -> None:
    """No request admitted, parked or holding an L1 page, no page fenced (read until so)."""
    deadline = time.monotonic() + timeout_s
    names = [
        ("hicache_num_admitted_reqs", ""),
        ("hicache_num_parked_reqs", ""),
        ("hicache_pd_fenced_pages", ""),
        ("hicache_device_tokens", '{holder="requests"}'),
    ]
    while sum(metric(server, n, lab) for n, lab in names) != 0:
        assert time.monotonic() < deadline, f"{server.url} still holds requests or pages"
        time.sleep(0.2)


def decode_alone(decode: ServerProcess, port: int, room: int) -> Future[httpx.Response]:
    """The decode half of ``room`` alone (it registers and waits for the prefill)."""
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}
    ex = ThreadPoolExecutor(1)
    fut = ex.submit(httpx.post, f"{decode.url}/generate", json=body(fields), timeout=120)
    ex.shutdown(wait=False)
    return fut


@pytest.mark.parametrize(
    "signum",
    [
        pytest.param(signal.SIGKILL, id="killed", marks=pytest.mark.matrix),
        pytest.param(signal.SIGSTOP, id="paused"),
    ],
)
def test_a_prefill_rank_killed_or_paused_fails_the_decode_room_within_the_bound(
    signum: int,
) -> None:
    """A prefill instance at TP 2 whose rank 1 is killed, or paused, while a decode
    request waits on its room: rank 0's bootstrap server answers 503 from the moment the
    rank is named gone or silent (or is gone itself), so the decode side fails the room
    within its health bound after that; a paused rank that runs again leaves the prefill
    serving, and both sides end idle.

    The pair is ``make test``'s TP 2 -> 1 case of
    :func:`test_a_pair_at_two_tp_sizes_answers_as_a_plain_server` (split heads gathered
    on one rank, ``nixl``), whose answers are checked first: one pair started, not two."""
    port = free_port()
    pd = ["--model-path", "tiny-random-llama", "--disaggregation-transfer-backend", "nixl"]
    with servers(
        [
            *pd,
            "--tp-size",
            "2",
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(port),
        ],
        [*pd, "--disaggregation-mode", "decode"],
    ) as (prefill, decode):
        assert_answers_as_a_plain_server(prefill, decode, port, "tiny-random-llama")
        assert prefill.proc is not None
        rank1 = rank_pids(prefill.proc.pid)
        assert len(rank1) == 1, rank1
        waiting = decode_alone(decode, port, 301)
        time.sleep(1.0)  # registered: the decode polls the room
        assert not waiting.done(), waiting.result().text
        os.kill(rank1[0], signum)
        t0 = time.monotonic()
        try:
            r = waiting.result(timeout=60)
            took = time.monotonic() - t0
            # a silent rank is named after SILENT_AFTER_S (5 s); then the health bound (3 s)
            assert took < 5.0 + 3.0 + 4.0, took
            assert r.status_code in (502, 503, 504), r.text
            assert "did not answer" in r.text or "unhealthy" in r.text, r.text
        finally:
            if signum == signal.SIGSTOP:
                os.kill(rank1[0], signal.SIGCONT)
        assert_idle(decode)
        if signum == signal.SIGSTOP:  # it runs again: the pair serves
            deadline = time.monotonic() + 30
            while httpx.get(f"{prefill.url}/health", timeout=5).status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.2)
            assert through_pair(prefill, decode, port, 302, False) == plain_answer(
                "tiny-random-llama"
            )
            assert_idle(prefill)
            assert_idle(decode)


@pytest.mark.matrix
def test_a_decode_rank_killed_fails_the_prefill_room_without_a_hang() -> None:
    """A decode instance at TP 2 whose rank 1 is killed with a room registered: the
    prefill's writes to it fail (or the decode instance is gone), the prefill request
    ends with an error within the transfer bound, and the prefill instance is idle."""
    port = free_port()
    pd = ["--model-path", "tiny-random-llama", "--disaggregation-transfer-backend", "mooncake"]
    with servers(
        [*pd, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port)],
        [*pd, "--tp-size", "2", "--disaggregation-mode", "decode"],
    ) as (prefill, decode):
        assert decode.proc is not None
        rank1 = rank_pids(decode.proc.pid)
        assert len(rank1) == 1, rank1
        waiting = decode_alone(decode, port, 311)
        time.sleep(1.0)  # registered
        os.kill(rank1[0], signal.SIGKILL)
        time.sleep(0.5)
        fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 311}
        t0 = time.monotonic()
        r = httpx.post(f"{prefill.url}/generate", json=body(fields), timeout=120)
        assert time.monotonic() - t0 < 60
        assert r.status_code != 200 or r.json().get("error"), r.text
        assert waiting.result(timeout=60).status_code != 200
        assert_idle(prefill)


@pytest.mark.matrix
def test_a_prefill_engine_at_tp_2_stops_promptly_with_rooms_live() -> None:
    """A TP-2 prefill engine closed while a request waits for its decode side (its room
    live on both ranks): the request ends with an error and the close takes well under
    the collectives' bound."""
    port = free_port()
    config = EngineConfig(
        model_path="tiny-random-llama",
        device="cpu",
        tp_size=2,
        context_length=256,
        cache=CacheConfig(page_size=4),
        disagg=DisaggConfig(mode="prefill", bootstrap_port=port),  # type: ignore[arg-type]
    )
    ends: list[RequestOutput] = []
    with Engine(config).start() as prefill:
        b = Bootstrap("127.0.0.1", port, 401)
        prefill.submit(
            PROMPT, GREEDY, lambda o: ends.append(o) if o.finished else None, bootstrap=b
        )
        time.sleep(1.0)  # queued, waiting for its room's registration: the room is live
        t0 = time.monotonic()
        prefill.close()
        took = time.monotonic() - t0
    assert took < 15.0, took
    assert len(ends) == 1 and ends[0].error is not None, ends
