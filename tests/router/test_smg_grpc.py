"""hicache as an smg gRPC worker: the real ``smg launch`` in gRPC mode in front of one
``hicache serve --grpc-mode`` worker (the tiny random Llama on CPU).

smg registers ``grpc://host:port`` as an SGLang gRPC worker; the path to the model it is
told does not exist where it runs (a link removed once the worker has loaded, as on
another host), so it tokenizes with the bundle ``GetTokenizer`` streams; greedy answers
through it (``/generate``, ``/v1/completions``, ``/v1/chat/completions``, streamed and
not) equal the worker's own HTTP answers. A malformed ``Generate`` sent straight to the
worker gets ``INVALID_ARGUMENT`` naming the field (the worker stays up); a wrong key is
refused; a call that goes away aborts its request; smg routes the worker by the KV events
it streams. A prefill/decode pair of gRPC workers behind smg in PD mode answers as the
plain worker does. One worker and one smg for the module (and the pair for its test).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from hicache.bench.serverproc import ServerProcess
from hicache.runner.checkpoints import resolve_checkpoint
from hicache.services.process import free_port
from tests.helpers.smg import Smg
from tests.router.conftest import ROUTER_KEY, WORKER_FLAGS, StartWorker
from tests.router.test_smg_pd import assert_idle, pd_flags

MODEL = "tiny-random-llama"
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to"
MESSAGES = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "Where does the fox run?"},
]


@pytest.fixture(scope="module")
def worker(start_worker: StartWorker, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    """The gRPC worker, started from a link to the model that is removed once it has
    loaded: the tokenizer path it reports then does not exist for smg."""
    link = tmp_path_factory.mktemp("model") / MODEL
    link.symlink_to(resolve_checkpoint(MODEL).path, target_is_directory=True)
    server = start_worker("--model-path", str(link), grpc=True)
    link.unlink()
    return server


@pytest.fixture(scope="module")
def smg(worker: ServerProcess) -> Iterator[Smg]:
    with Smg(
        worker_urls=[worker.grpc_url],
        policy="cache_aware",
        extra_args=["--health-check-timeout-secs", "1"],  # a frozen worker is out in ~3 s
    ) as router:
        router.wait_log(f"Successfully loaded tokenizer '{MODEL}'")  # listed ready before
        yield router


@pytest.fixture(scope="module")
def stub(worker: ServerProcess) -> Iterator[pb_grpc.SglangSchedulerStub]:
    with grpc.insecure_channel(worker.grpc_url.removeprefix("grpc://")) as channel:
        yield pb_grpc.SglangSchedulerStub(channel)


def _post(url: str, path: str, body: dict[str, Any]) -> Any:
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _events(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of a streamed answer (``[DONE]`` left out)."""
    out: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line.removeprefix("data: ")))
    return out


def test_smg_registers_the_grpc_worker_and_takes_its_tokenizer(
    smg: Smg, worker: ServerProcess
) -> None:
    (entry,) = smg.wait_workers(
        lambda ws: all("engine_load" in w for w in ws), 10.0, "a load poll (GetLoads)"
    )
    assert entry["url"] == worker.grpc_url
    assert entry["connection_mode"] == "grpc"
    assert entry["runtime_type"] == "sglang"
    labels = entry["labels"]
    assert labels["served_model_name"] == MODEL
    assert labels["page_size"] == "16"  # GetServerInfo's server_args
    assert labels["eos_token_ids"] == "[2]"  # GetModelInfo
    assert entry["engine_load"]["loads"][0]["max_total_num_tokens"] > 0  # GetLoads
    log = smg.log_text()
    assert f"Fetching tokenizer from worker: {worker.grpc_url}" in log  # GetTokenizer
    assert f"Tokenizer bundle validation passed for worker {worker.grpc_url}" in log


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_generate_equals_http(smg: Smg, worker: ServerProcess, stream: bool) -> None:
    body = {
        "model": MODEL,
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0},
    }
    want = _post(worker.url, "/generate", body)
    if stream:
        events = _events(smg.url, "/generate", body)
        ids = [
            t for e in events if e["meta_info"]["finish_reason"] is None for t in e["output_ids"]
        ]
        got = {"text": events[-1]["text"], "output_ids": ids}
        finish = events[-1]["meta_info"]["finish_reason"]
    else:
        (answer,) = _post(smg.url, "/generate", body)  # smg answers a list of one
        got = {"text": answer["text"], "output_ids": answer["output_ids"]}
        finish = answer["meta_info"]["finish_reason"]["type"]
    assert got == {"text": want["text"], "output_ids": want["output_ids"]}
    assert len(want["output_ids"]) == 12
    assert finish == want["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_equal_http(smg: Smg, worker: ServerProcess, stream: bool) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "n": 2}
    want = _post(worker.url, "/v1/completions", body)
    expected = {c["index"]: (c["text"], c["finish_reason"]) for c in want["choices"]}
    if stream:
        texts: dict[int, str] = {}
        finish: dict[int, str] = {}
        for event in _events(smg.url, "/v1/completions", body):
            for c in event["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                if c.get("finish_reason"):
                    finish[c["index"]] = c["finish_reason"]
        got = {i: (texts[i], finish[i]) for i in texts}
    else:
        answer = _post(smg.url, "/v1/completions", body)
        got = {c["index"]: (c["text"], c["finish_reason"]) for c in answer["choices"]}
    assert got == expected
    assert set(got) == {0, 1} and expected[0][0]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_equals_http(smg: Smg, worker: ServerProcess, stream: bool) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 10, "temperature": 0}
    want = _post(worker.url, "/v1/chat/completions", body)["choices"][0]
    if stream:
        text, finish = "", None
        for event in _events(smg.url, "/v1/chat/completions", body):
            for c in event["choices"]:
                text += c["delta"].get("content") or ""
                finish = c.get("finish_reason") or finish
    else:
        got = _post(smg.url, "/v1/chat/completions", body)["choices"][0]
        text, finish = got["message"]["content"], got["finish_reason"]
    assert (text, finish) == (want["message"]["content"], want["finish_reason"])
    assert text


def _generate(**fields: Any) -> pb.GenerateRequest:
    sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0}
    sampling.update(fields.pop("sampling", {}))
    return pb.GenerateRequest(
        request_id=fields.pop("request_id", "direct"),
        tokenized=fields.pop("tokenized", pb.TokenizedInput(input_ids=[1, 2, 3, 4])),
        sampling_params=pb.SamplingParams(**sampling),
        **fields,
    )


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (pb.GenerateRequest(request_id="no-prompt"), "tokenized"),
        (_generate(tokenized=pb.TokenizedInput(input_ids=[])), "tokenized.input_ids"),
        (_generate(tokenized=pb.TokenizedInput(input_ids=[1, 10**9])), "tokenized.input_ids"),
        (_generate(sampling={"top_p": 0.0}), "sampling_params.top_p"),
        (_generate(sampling={"temperature": -1.0}), "sampling_params.temperature"),
        (_generate(sampling={"max_new_tokens": 10**6}), "sampling_params.max_new_tokens"),
        (_generate(sampling={"regex": "a+"}), "sampling_params.regex"),
        (_generate(top_logprobs_num=1000, return_logprob=True), "top_logprobs_num"),
        (_generate(lora_id="adapter"), "lora_id"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_malformed_generate_is_invalid_argument_naming_the_field(
    stub: pb_grpc.SglangSchedulerStub, request_: pb.GenerateRequest, field: str
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request_, timeout=30))
    err = caught.value
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details().startswith(f"{field}: "), err.details()
    health = stub.HealthCheck(pb.HealthCheckRequest(), timeout=10)
    assert health.healthy, health.message


@pytest.mark.parametrize("rpc", ["Generate", "GetLoads"])
def test_bytes_that_are_no_message_are_invalid_argument(worker: ServerProcess, rpc: str) -> None:
    with grpc.insecure_channel(worker.grpc_url.removeprefix("grpc://")) as channel:
        path = f"/sglang.grpc.scheduler.SglangScheduler/{rpc}"
        call = (channel.unary_stream if rpc == "Generate" else channel.unary_unary)(path)
        with pytest.raises(grpc.RpcError) as caught:
            answer = call(b"\xff\xff\xff", timeout=10)
            list(answer) if rpc == "Generate" else answer
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details().startswith("request: not a valid sglang.grpc.scheduler.")
        embed = channel.unary_unary("/sglang.grpc.scheduler.SglangScheduler/Embed")
        with pytest.raises(grpc.RpcError) as caught:
            embed(b"", timeout=10)
        assert caught.value.code() is grpc.StatusCode.UNIMPLEMENTED


def test_direct_generate_streams_chunks_then_the_complete(
    stub: pb_grpc.SglangSchedulerStub,
) -> None:
    req = _generate(
        sampling={"max_new_tokens": 5, "n": 2},
        stream=True,
        return_logprob=True,
        top_logprobs_num=2,
        logprob_start_len=-1,
    )
    chunks: dict[int, list[int]] = {0: [], 1: []}
    completes: dict[int, pb.GenerateComplete] = {}
    for msg in stub.Generate(req, timeout=60):
        if msg.HasField("chunk"):
            assert msg.chunk.index not in completes
            chunks[msg.chunk.index] += list(msg.chunk.token_ids)
            assert len(msg.chunk.output_logprobs.token_ids) == len(msg.chunk.token_ids)
        else:
            completes[msg.complete.index] = msg.complete
    assert set(completes) == {0, 1}
    for i, done in completes.items():
        assert list(done.output_ids) == chunks[i] and len(chunks[i]) == 5
        assert done.finish_reason == "length"
        assert (done.prompt_tokens, done.completion_tokens) == (4, 5)
        assert list(done.output_logprobs.token_ids) == chunks[i]
        assert all(len(top.values) == 2 for top in done.output_logprobs.top_logprobs)
    assert chunks[0] == chunks[1]  # greedy copies


def test_keys_are_checked_as_over_http(stub: pb_grpc.SglangSchedulerStub, smg: Smg) -> None:
    """The worker has ``--admin-api-key`` (no ``--api-key``): FlushCache wants it, and
    smg 1.13 sends no key over gRPC, so its flush fan-out is refused (206)."""
    r = httpx.post(f"{smg.url}/flush_cache", timeout=30)
    assert r.status_code == 206, r.text
    assert "FlushCache: admin API key missing or wrong" in r.json()["failed"][0]["error"]
    flush = common_pb2.FlushCacheRequest(timeout_s=5.0)
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        with pytest.raises(grpc.RpcError) as caught:
            stub.FlushCache(flush, metadata=metadata, timeout=10)
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert "admin API key" in caught.value.details()
    ok = stub.FlushCache(flush, metadata=(("authorization", f"Bearer {ROUTER_KEY}"),), timeout=30)
    assert ok.success, ok.message
    assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy  # open
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)  # open without --api-key
    assert (info.served_model_name, info.max_context_length) == (MODEL, 2048)


def _aborts(worker: ServerProcess, reason: str) -> float:
    """The worker's count of requests it aborted for ``reason`` (its ``/metrics``)."""
    text = httpx.get(f"{worker.url}/metrics", timeout=10).text
    line = f'hicache_aborted_requests_total{{reason="{reason}"}} '
    return sum(float(x.removeprefix(line)) for x in text.splitlines() if x.startswith(line))


def _wait_aborts(worker: ServerProcess, reason: str, count: float) -> float:
    end = time.monotonic() + 20
    while _aborts(worker, reason) < count and time.monotonic() < end:
        time.sleep(0.05)
    return _aborts(worker, reason)


def test_a_call_that_goes_away_aborts_its_request(
    stub: pb_grpc.SglangSchedulerStub, worker: ServerProcess
) -> None:
    req = _generate(
        request_id="goes-away",
        sampling={"max_new_tokens": 1500, "ignore_eos": True},
        stream=True,
    )
    before = _aborts(worker, "client_disconnected")
    call = stub.Generate(req, timeout=120)
    first = next(call)
    assert first.HasField("chunk")
    call.cancel()
    assert _wait_aborts(worker, "client_disconnected", before + 1) == before + 1


def test_abort_ends_the_call(stub: pb_grpc.SglangSchedulerStub, worker: ServerProcess) -> None:
    req = _generate(
        request_id="aborted",
        sampling={"max_new_tokens": 1500, "ignore_eos": True},
        stream=True,
    )
    before = _aborts(worker, "abort")
    call = stub.Generate(req, timeout=120)
    assert next(call).HasField("chunk")
    answer = stub.Abort(pb.AbortRequest(request_id="aborted", reason="test"), timeout=10)
    assert answer.success, answer.message
    with pytest.raises(grpc.RpcError) as caught:
        for _ in call:
            pass
    assert caught.value.code() is grpc.StatusCode.CANCELLED
    assert not stub.Abort(pb.AbortRequest(request_id="aborted"), timeout=10).success
    assert _wait_aborts(worker, "abort", before + 1) == before + 1


def test_the_grpc_port_obeys_host(worker: ServerProcess) -> None:
    """Bound on --host (127.0.0.1) alone: the port is not open on another address."""
    port = worker.grpc_port
    listening = Path("/proc/net/tcp").read_text().splitlines()[1:]
    listening += Path("/proc/net/tcp6").read_text().splitlines()[1:]
    local = [line.split()[1] for line in listening if line.split()[3] == "0A"]  # LISTEN
    mine = [a for a in local if int(a.rsplit(":", 1)[1], 16) == port]
    assert mine, f"nothing listens on {port}"
    loopback = ("0100007F", "0000000000000000FFFF00000100007F")  # 127.0.0.1, ::ffff:127.0.0.1
    assert all(a.rsplit(":", 1)[0] in loopback for a in mine), mine


def test_smg_subscribes_to_the_workers_kv_events(smg: Smg, worker: ServerProcess) -> None:
    """``--grpc-mode`` turns the KV event hub on: smg's subscription stays connected, and
    it routes a prompt whose first page the worker reported by those events (smg's
    ``event_hit``)."""
    smg.wait_log("KV event stream connected")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    hit = f'Event-driven routing worker="{worker.grpc_url}" branch="event_hit"'
    for _ in range(20):  # the first request's pages reach smg as events, then one hits
        _post(smg.url, "/v1/chat/completions", body)
        if hit in smg.log_text():
            break
        time.sleep(0.1)
    log = smg.log_text()
    assert hit in log
    assert "disabling KV event subscription" not in log


def test_a_subscription_reports_a_served_prompts_pages(
    stub: pb_grpc.SglangSchedulerStub, worker: ServerProcess
) -> None:
    """From 0: a resync first (``AllBlocksCleared``), then the pages a new prompt left,
    each block its page's token ids (16 a page)."""
    prompt = list(range(1000, 1040))  # 2 whole pages and a part, in no other test
    events = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=60)
    try:
        first = next(events)
        assert first.events[0].WhichOneof("data") == "cleared"
        done = stub.Generate(
            _generate(
                tokenized=pb.TokenizedInput(input_ids=prompt), sampling={"max_new_tokens": 2}
            ),
            timeout=60,
        )
        assert [m.complete.finish_reason for m in done] == ["length"]
        stored: list[list[int]] = []
        for batch in events:
            for event in batch.events:
                if event.WhichOneof("data") == "stored":
                    stored += [list(b.token_ids) for b in event.stored.blocks]
            if prompt[16:32] in stored:
                break
        assert prompt[:16] in stored and prompt[16:32] in stored
    finally:
        events.cancel()


def test_a_cursor_from_before_a_restart_is_out_of_range_then_a_resync(
    stub: pb_grpc.SglangSchedulerStub,
) -> None:
    """A subscriber that followed an earlier run of this worker resumes from a sequence
    number past everything this run published: ``OUT_OF_RANGE`` naming the field, never
    a replay of what this run's numbers meant (smg then clears the worker's pages and
    subscribes from 0); from 0 it gets the resync first."""
    with pytest.raises(grpc.RpcError) as err:
        next(
            stub.SubscribeKvEvents(
                common_pb2.SubscribeKvEventsRequest(start_sequence_number=10**12), timeout=30
            )
        )
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "start_sequence_number" in (err.value.details() or "")
    events = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=30)
    try:
        assert next(events).events[0].WhichOneof("data") == "cleared"
    finally:
        events.cancel()


LOGPROBS = {
    "model": MODEL,
    "text": PROMPT,
    "sampling_params": {"max_new_tokens": 4, "temperature": 0},
    "return_logprob": True,
    "logprob_start_len": 0,
}
"""A greedy ``/generate`` asking every prompt token's logprob and the output's."""


def _assert_logprobs(got: list[list[Any]], want: list[list[Any]]) -> None:
    """smg's ``[logprob, id]`` entries against the worker's ``[logprob, id, text]``: the
    same ids, the logprobs within 1e-4 (the first prompt token's is null in both)."""
    assert [int(g[1]) for g in got] == [int(w[1]) for w in want]
    for g, w in zip(got, want, strict=True):
        assert (g[0] is None) == (w[0] is None)
        assert g[0] is None or abs(g[0] - w[0]) < 1e-4, (g, w)


def _pd_answers(url: str) -> dict[str, object]:
    """Greedy answers on the three routes (``/generate`` not streamed: smg's PD answer
    streams the decode side's chunks only), ``n`` = 2 on completions."""
    gen = {
        "model": MODEL,
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
    }
    comp = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "n": 2}
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    generated = _post(url, "/generate", gen)
    generated = generated[0] if isinstance(generated, list) else generated  # smg's: a list
    chat_stream = "".join(
        c["delta"].get("content") or ""
        for e in _events(url, "/v1/chat/completions", chat)
        for c in e["choices"]
    )
    return {
        "generate": generated["output_ids"],
        "completions": sorted(
            (c["index"], c["text"]) for c in _post(url, "/v1/completions", comp)["choices"]
        ),
        "chat": _post(url, "/v1/chat/completions", chat)["choices"][0]["message"]["content"],
        "chat stream": chat_stream,
    }


def test_a_pd_pair_of_grpc_workers_answers_as_the_plain_worker(worker: ServerProcess) -> None:
    bootstrap = free_port()
    prefill_flags, decode_flags = pd_flags(MODEL, "mooncake", bootstrap)
    pair = [
        ServerProcess([*WORKER_FLAGS, *f], startup_timeout_s=120.0, grpc=True)
        for f in (prefill_flags, decode_flags)
    ]
    try:
        prefill, decode = (p.start() for p in pair)
        router = Smg(
            prefill=[(prefill.grpc_url, bootstrap)], decode=[decode.grpc_url], policy="round_robin"
        )
        with router:
            router.wait_log(f"Successfully loaded tokenizer '{MODEL}'")
            got = _pd_answers(router.url)
            (scored,) = _post(router.url, "/generate", LOGPROBS)
        assert got == _pd_answers(worker.url)
        want = _post(worker.url, "/generate", LOGPROBS)["meta_info"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            _assert_logprobs(scored["meta_info"][key], want[key])
        assert_idle(prefill, decode)
    finally:
        for p in pair:
            p.close()


def _healthy(smg: Smg, url: str, want: bool, what: str) -> None:
    smg.wait_workers(
        lambda ws: any(w["url"] == url and w["is_healthy"] is want for w in ws), 20.0, what
    )


def test_stalls_either_side_of_the_grpc_link(smg: Smg, worker: ServerProcess) -> None:
    """smg frozen (SIGSTOP) while subscribed to the worker's KV events: the worker still
    answers at once (its events wait in the subscriber's bounded buffer). The worker
    frozen: smg's HealthCheck times out and takes it out; resumed, it is back and answers.
    Last in the module: it stops the module's worker for a while."""
    assert smg.proc is not None and worker.proc is not None
    os.kill(smg.proc.pid, signal.SIGSTOP)
    try:
        for i in range(4):
            body = {"model": MODEL, "prompt": f"{PROMPT} {i}", "max_tokens": 4, "temperature": 0}
            start = time.monotonic()
            _post(worker.url, "/v1/completions", body)
            assert time.monotonic() - start < 5
    finally:
        os.kill(smg.proc.pid, signal.SIGCONT)
    os.kill(worker.proc.pid, signal.SIGSTOP)
    try:
        _healthy(smg, worker.grpc_url, False, "the frozen worker taken out")
    finally:
        os.kill(worker.proc.pid, signal.SIGCONT)
    _healthy(smg, worker.grpc_url, True, "the resumed worker back")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    assert _post(smg.url, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
