"""A prefill engine and a decode engine in one process, paired by rooms over a real
transport (Mooncake's transfer engine over TCP, NIXL over UCX) on 127.0.0.1: greedy
outputs equal a plain engine's, for full attention, MLA (with and without the DSA
indexer) and sliding-window hybrids; room matching in either order; bad rooms and
mismatched pairs refused; every failure ends both sides with an error and leaves every
pool idle.

Each engine loads its own copy of the model (a model object is not shared between two
engines that run forwards at once)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from hicache.cache.report import check_integrity
from hicache.config import CacheConfig
from hicache.disagg.config import Bootstrap, DisaggConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.request import RequestOutput
from hicache.engine.roles.decode import DecodeRole
from hicache.engine.roles.prefill import PrefillRole
from hicache.engine.sampling import InvalidRequest, SamplingParams
from hicache.engine.step.scheduler import SchedulerConfig

PROMPT = list(range(300, 345))  # 45 tokens: 11 whole pages of 4, and 1
GREEDY = SamplingParams(temperature=0, max_tokens=8)
FAST = dict(room_timeout_s=2.0, health_interval_s=0.2, health_failures=3, drain_timeout_s=2.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_engine(
    model: str,
    mode: str = "null",
    *,
    port: int = 8998,
    page_size: int = 4,
    max_queued_requests: int = 1024,
    **disagg: object,
) -> Engine:
    config = EngineConfig(
        max_queued_requests=max_queued_requests,
        model_path=model,
        dtype="float32",
        device="cpu",
        cache=CacheConfig(
            page_size=page_size, device_tokens=256, hicache_ratio=4.0, load_back_threshold=0
        ),
        scheduler=SchedulerConfig(max_running_requests=8, chunked_prefill_size=32),
        context_length=128,
        disagg=DisaggConfig(mode=mode, bootstrap_port=port, **disagg),  # type: ignore[arg-type]
    )
    return Engine(config).start()


@contextmanager
def pair(
    model: str, backend: str = "mooncake", **disagg: object
) -> Iterator[tuple[Engine, Engine]]:
    port = free_port()
    opts = {"transfer_backend": backend, **FAST, **disagg}
    prefill = make_engine(model, "prefill", port=port, **opts)
    decode = None
    try:
        decode = make_engine(model, "decode", port=port, **opts)
        yield prefill, decode
    finally:
        if decode is not None:
            decode.close()
        prefill.close()


def reference(model: str, prompt: list[int] = PROMPT) -> list[int]:
    with make_engine(model) as plain:
        return plain.generate(prompt, GREEDY, timeout=60).output_ids


def run_room(
    prefill: Engine,
    decode: Engine,
    room: int,
    *,
    prompt: list[int] = PROMPT,
    delay: float = 0.0,
    decode_first: bool = False,
) -> tuple[RequestOutput, RequestOutput]:
    """Both halves of one room, the second side ``delay`` s after the first."""
    port = prefill.config.disagg.bootstrap_port
    b = Bootstrap("127.0.0.1", port, room)
    order = [decode, prefill] if decode_first else [prefill, decode]
    with ThreadPoolExecutor(2) as ex:
        futs: dict[int, Future[RequestOutput]] = {}
        for i, e in enumerate(order):
            if i:
                time.sleep(delay)
            futs[id(e)] = ex.submit(e.generate, prompt, GREEDY, 60, bootstrap=b)
        return futs[id(prefill)].result(), futs[id(decode)].result()


def assert_idle(*engines: Engine) -> None:
    """Nothing parked or running; every L1 page is the tree's (check_integrity)."""
    for e in engines:

        def check(e: Engine = e) -> None:
            assert e.core.scheduler.idle, (e.core.scheduler.ends.parked, e.core.scheduler.running)
            assert not e.core.cache.admitted
            check_integrity(e.core.cache)

        deadline = time.monotonic() + 10
        while True:
            try:
                e.call(check).result(timeout=30)
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


@pytest.mark.parametrize(
    ("model", "backend"),
    [
        ("tiny-random-llama", "mooncake"),
        ("tiny-random-llama", "nixl"),
        ("tiny-random-deepseek-v2", "mooncake"),  # MLA: one latent per token
        ("tiny-random-deepseek-v32", "nixl"),  # MLA and the DSA indexer's keys
        ("tiny-random-gemma3", "mooncake"),  # sliding-window layers in their own pool
        ("tiny-random-gpt-oss", "nixl"),
    ],
)
def test_pair_greedy_equals_a_plain_engine(model: str, backend: str) -> None:
    want = reference(model)
    with pair(model, backend) as (prefill, decode):
        first_p, first_d = run_room(prefill, decode, 1)
        assert first_p.error is None and first_d.error is None, (first_p.error, first_d.error)
        assert first_p.output_ids == want[:1]  # the prefill instance generates one token
        assert first_d.output_ids == want
        # again: both sides hit their own L1 now; the decode side promises its hit and the
        # prefill side sends only the page past it (44 of 45 tokens are whole pages)
        again_p, again_d = run_room(prefill, decode, 2, decode_first=True, delay=0.2)
        assert again_d.output_ids == want
        assert again_p.cached.device == 44 and again_d.cached.device == 44
        assert_idle(prefill, decode)


def test_a_prefill_waits_for_its_decode_side_before_it_computes() -> None:
    """A prefill request is admitted only once the decode side has registered its room's
    pages: computed before, it would hold its pages while the decode side may wait for
    memory that its own parked requests hold, each waiting for a prefill."""
    want = reference("tiny-random-llama")
    with pair("tiny-random-llama", room_timeout_s=30.0) as (prefill, decode):
        port = prefill.config.disagg.bootstrap_port
        b = Bootstrap("127.0.0.1", port, 71)
        with ThreadPoolExecutor(1) as ex:
            p_fut = ex.submit(prefill.generate, PROMPT, GREEDY, 60, bootstrap=b)
            time.sleep(0.5)

            def held() -> tuple[int, int, int]:
                s = prefill.core.scheduler
                return (
                    len(s.waiting),
                    len(s.running) + len(s.ends.parked),
                    len(prefill.core.cache.admitted),
                )

            assert prefill.call(held).result(timeout=30) == (1, 0, 0)
            d = decode.generate(PROMPT, GREEDY, 60, bootstrap=b)
            p = p_fut.result(timeout=60)
        assert p.error is None and d.error is None, (p.error, d.error)
        assert d.output_ids == want
        assert_idle(prefill, decode)


def test_rooms_match_whichever_side_comes_first() -> None:
    model = "tiny-random-llama"
    want = reference(model)
    with pair(model) as (prefill, decode):
        p, d = run_room(prefill, decode, 11, decode_first=True, delay=0.5)
        assert d.output_ids == want and p.error is None
        p, d = run_room(prefill, decode, 12, decode_first=False, delay=0.5)
        assert d.output_ids == want and p.error is None
        assert_idle(prefill, decode)


def test_bad_rooms_are_refused_naming_the_field() -> None:
    with pair("tiny-random-llama") as (prefill, decode):
        for e in (prefill, decode):
            with pytest.raises(InvalidRequest, match="bootstrap_room") as err:
                e.submit(PROMPT, GREEDY)
            assert err.value.param == "bootstrap_room"
        port = prefill.config.disagg.bootstrap_port
        run_room(prefill, decode, 21)
        # a room is single-use: one just closed is refused
        with pytest.raises(InvalidRequest, match="room 21 was used"):
            prefill.submit(PROMPT, GREEDY, bootstrap=Bootstrap("127.0.0.1", port, 21))
        # ... and one in use (its decode side never comes: it times out)
        b = Bootstrap("127.0.0.1", port, 22)
        first = prefill.submit(PROMPT, GREEDY, bootstrap=b)
        with pytest.raises(InvalidRequest, match="room 22 is in use"):
            prefill.submit(PROMPT, GREEDY, bootstrap=b)
        prefill.abort(first)
        assert_idle(prefill, decode)


def test_the_router_no_transfer_host_serves_alone() -> None:
    """Health checks and warm-ups send bootstrap_host 2.2.2.2: no transfer, no room."""
    want = reference("tiny-random-llama")
    with pair("tiny-random-llama") as (prefill, decode):
        b = Bootstrap("2.2.2.2", 8998, 5)
        assert decode.generate(PROMPT, GREEDY, bootstrap=b).output_ids == want
        assert prefill.generate(PROMPT, GREEDY, bootstrap=b).output_ids == want
        assert_idle(prefill, decode)


def test_mismatched_pair_is_refused_naming_both_values() -> None:
    port = free_port()
    model = "tiny-random-llama"
    with (
        make_engine(model, "prefill", port=port, page_size=4, **FAST) as prefill,
        make_engine(model, "decode", port=port, page_size=8, **FAST) as decode,
    ):
        p, d = run_room(prefill, decode, 31)
        for out in (p, d):
            assert out.finish_reason is not None and out.finish_reason.value == "abort"
            assert out.error is not None and "page_size differs" in out.error, out.error
            assert "4" in out.error and "8" in out.error
        assert_idle(prefill, decode)


def test_a_side_that_never_comes_times_out_on_both() -> None:
    with pair("tiny-random-llama", room_timeout_s=0.5) as (prefill, decode):
        port = prefill.config.disagg.bootstrap_port
        t0 = time.monotonic()
        lonely_d = decode.generate(PROMPT, GREEDY, bootstrap=Bootstrap("127.0.0.1", port, 41))
        assert lonely_d.error is not None and "did not come" in lonely_d.error
        lonely_p = prefill.generate(PROMPT, GREEDY, bootstrap=Bootstrap("127.0.0.1", port, 42))
        assert lonely_p.error is not None and "did not come" in lonely_p.error
        assert time.monotonic() - t0 < 10
        assert_idle(prefill, decode)


def test_decode_abort_drains_both_sides() -> None:
    """A client gone on the decode side: the prefill side is told, stops, and both free
    everything (the prefill's request reports why)."""
    with pair("tiny-random-llama") as (prefill, decode):
        port = prefill.config.disagg.bootstrap_port
        b = Bootstrap("127.0.0.1", port, 51)
        ends: list[RequestOutput] = []
        rid = decode.submit(
            PROMPT, GREEDY, lambda o: ends.append(o) if o.finished else None, bootstrap=b
        )
        time.sleep(0.3)  # registered, waiting for the prefill
        decode.abort(rid)
        deadline = time.monotonic() + 10
        while not ends and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ends and ends[0].finish_reason is not None and ends[0].finish_reason.value == "abort"
        # the prefill side was told: the room is closed for its request
        with pytest.raises(InvalidRequest, match="room 51 was aborted by the decode side"):
            prefill.submit(PROMPT, GREEDY, bootstrap=b)
        assert_idle(prefill, decode)


def test_prefill_abort_fails_the_decode_side() -> None:
    """The prefill side's client goes away before its prefill is done: the room fails
    and the decode side reports why."""
    with pair("tiny-random-llama") as (prefill, decode):
        port = prefill.config.disagg.bootstrap_port
        b = Bootstrap("127.0.0.1", port, 52)
        rid = prefill.submit(list(range(300, 400)), GREEDY, bootstrap=b)
        prefill.abort(rid)
        d = decode.generate(list(range(300, 400)), GREEDY, bootstrap=b)
        assert d.error is not None and "the prefill side failed" in d.error, d.error
        assert_idle(prefill, decode)


def test_prefill_gone_fails_the_decode_rooms_within_the_health_bound() -> None:
    port = free_port()
    model = "tiny-random-llama"
    with make_engine(model, "decode", port=port, **FAST) as decode:
        prefill = make_engine(model, "prefill", port=port, **{**FAST, "room_timeout_s": 30.0})
        b = Bootstrap("127.0.0.1", port, 61)
        ends: list[RequestOutput] = []
        decode.submit(PROMPT, GREEDY, lambda o: ends.append(o) if o.finished else None, bootstrap=b)
        time.sleep(0.3)  # registered; the prefill instance then goes away
        prefill.close()
        t0 = time.monotonic()
        while not ends and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert ends, "the decode side did not fail its room"
        assert time.monotonic() - t0 < 0.6 * 3 + 2  # the health bound, and a poll
        assert ends[0].error is not None and "did not answer" in ends[0].error
        # a prefill instance that is not there at all: refused at once
        gone = decode.generate(PROMPT, GREEDY, bootstrap=Bootstrap("127.0.0.1", port, 62))
        assert gone.error is not None and "did not answer" in gone.error
        assert_idle(decode)


def test_decode_gone_mid_transfer_fails_the_prefill_without_a_hang() -> None:
    port = free_port()
    model = "tiny-random-llama"
    with make_engine(model, "prefill", port=port, **FAST) as prefill:
        decode = make_engine(model, "decode", port=port, **FAST)
        try:
            b = Bootstrap("127.0.0.1", port, 71)
            decode.submit(PROMPT, GREEDY, bootstrap=b)
            time.sleep(0.3)  # its pages are registered at the prefill side
            role = decode.role
            assert isinstance(role, DecodeRole)
            role.transport.close()  # then its transfer engine is gone, without a word
            t0 = time.monotonic()
            p = prefill.generate(PROMPT, GREEDY, bootstrap=b)
            # the prefill's write fails, or the decode gives the room up first (its polls
            # go unanswered while the prefill's engine probes the dead peer) and aborts it
            assert p.error is not None, p
            assert any(
                why in p.error
                for why in ("room 71: sending the pages", "its rooms failed", "decode side aborted")
            ), p
            assert time.monotonic() - t0 < 35
            assert_idle(prefill)
        finally:
            decode.close()


@pytest.mark.parametrize("model", ["tiny-random-llama", "tiny-random-gemma3"])
def test_pages_go_chunk_by_chunk_as_the_prefill_computes(model: str) -> None:
    """A prompt of several prefill chunks: the full KV's pages are written after each
    chunk (partial jobs), a sliding window's with the last; the answer is the same."""
    prompt = list(range(300, 400))  # 100 tokens: 4 chunks of 32 at most
    want = reference(model, prompt)
    with pair(model) as (prefill, decode):
        p, d = run_room(prefill, decode, 81, prompt=prompt, decode_first=True, delay=0.2)
        assert p.error is None and d.output_ids == want
        role = prefill.role
        assert isinstance(role, PrefillRole)
        assert role.sender.partial_writes >= 2  # after chunks 1, 2 (and 3)
        assert_idle(prefill, decode)
