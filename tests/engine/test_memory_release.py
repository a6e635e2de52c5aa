"""Memory back after peaks: finished requests and their buffers are freed at once (by
reference counting alone), nothing keyed by a request id outlives it, and freed heap
memory is handed back to the OS once the engine goes idle after being busy, rate-limited
(:mod:`hicache.engine.memory_trim`)."""

from __future__ import annotations

import argparse
import gc
import threading
import time
import tracemalloc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.logits import TokenLogprob, token_logprobs
from hicache.engine.memory_trim import IdleTrimmer, TrimRecord, malloc_trim, trim_supported
from hicache.engine.request import Request, RequestOutput
from hicache.engine.sampling import SamplingParams
from hicache.server.args import add_engine_args, engine_config_from_args, flag_message
from tests.helpers.api_fixtures import make_engine, wait_idle


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Trims:
    """A trim function that records its calls (answers ``released``)."""

    def __init__(self, released: bool | None = True) -> None:
        self.calls: list[float] = []
        self.released = released
        self.clock: FakeClock | None = None

    def __call__(self) -> bool | None:
        assert self.clock is not None
        self.calls.append(self.clock.now)
        return self.released


def trimmer(interval_s: float, idle_s: float = 1.0) -> tuple[IdleTrimmer, FakeClock, Trims]:
    clock, trims = FakeClock(), Trims()
    trims.clock = clock
    return IdleTrimmer(interval_s, idle_s=idle_s, trim=trims, clock=clock), clock, trims


def rounds(t: IdleTrimmer, clock: FakeClock, pattern: str, step_s: float = 0.5) -> str:
    """Feed ``pattern`` (``b`` busy round, ``.`` idle round), ``step_s`` apart; returns
    where a trim happened (``T``) or not (``-``)."""
    out = ""
    for c in pattern:
        clock.now += step_s
        out += "-" if t.after_round(c == "b") is None else "T"
    return out


def test_trims_after_settling_idle_past_busy_then_once_more_an_interval_later() -> None:
    t, clock, trims = trimmer(interval_s=10.0, idle_s=1.0)
    assert rounds(t, clock, "....") == "----"  # idle since start: nothing was freed
    # busy at 102.5 and 103.0; idle rounds at 103.5 (0.5 s), 104.0 (1.0 s: trims), then none
    assert rounds(t, clock, "bb......") == "---T----"
    assert trims.calls == [104.0]
    assert t.trims == 1
    assert t.last == TrimRecord(at=104.0, released=True, took_s=0.0)
    # the follow-up, 10 s after (what the server freed late), then nothing while idle
    assert rounds(t, clock, "." * 16) == "-" * 15 + "T"
    assert rounds(t, clock, "." * 40) == "-" * 40
    assert trims.calls == [104.0, 114.0]


def test_rate_limited_trim_waits_for_the_interval_then_runs_if_still_idle() -> None:
    t, clock, trims = trimmer(interval_s=3.0, idle_s=0.5)
    assert rounds(t, clock, "b.") == "-T"  # trims at 101.0
    # busy again at 101.5; settled at 102.0 but the interval ends at 104.0
    assert rounds(t, clock, "b.....") == "-----T"
    assert trims.calls == [101.0, 104.0]
    # busy rounds in between do not start the interval again, nor trim
    assert rounds(t, clock, "b.b.b.b.") == "-----T--"  # settled 0.5 s at 107.0
    assert trims.calls == [101.0, 104.0, 107.0]


def test_busy_again_before_settling_postpones_the_trim() -> None:
    t, clock, trims = trimmer(interval_s=1.0, idle_s=1.0)
    assert rounds(t, clock, "b.b.b.b...") == "--------T-"  # 1 s after the last busy
    assert rounds(t, clock, "...") == "T--"  # the follow-up, 1 s after it
    assert trims.calls == [104.5, 105.5]


def test_interval_zero_never_trims() -> None:
    t, clock, trims = trimmer(interval_s=0.0)
    assert not t.enabled
    assert rounds(t, clock, "b....b........") == "-" * 14
    assert trims.calls == []


def test_a_failing_trim_is_recorded_and_the_loop_goes_on() -> None:
    clock = FakeClock()

    def broken() -> bool | None:
        raise OSError("no")

    t = IdleTrimmer(5.0, idle_s=0.0, trim=broken, clock=clock)
    assert rounds(t, clock, "b.") == "-T"
    assert t.last is not None and t.last.released is None
    assert rounds(t, clock, "b.........") == "-" * 9 + "T"  # next one 5 s later


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "5"])
def test_bad_trim_interval_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(ValueError, match="memory_trim_interval_s"):
        EngineConfig(model_path="tiny-random-llama", memory_trim_interval_s=bad)  # type: ignore[arg-type]


def test_trim_interval_flag() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cpu = ["--device", "cpu"]
    assert engine_config_from_args(p.parse_args(cpu)).memory_trim_interval_s == 10.0
    got = engine_config_from_args(p.parse_args([*cpu, "--memory-trim-interval", "2.5"]))
    assert got.memory_trim_interval_s == 2.5
    off = engine_config_from_args(p.parse_args([*cpu, "--memory-trim-interval", "0"]))
    assert off.memory_trim_interval_s == 0
    with pytest.raises(ValueError) as err:
        engine_config_from_args(p.parse_args([*cpu, "--memory-trim-interval", "-1"]))
    assert flag_message(err.value) == (
        "--memory-trim-interval -1.0 is invalid; must be a finite number of seconds >= 0 (0: off)"
    )


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not trim_supported(), reason="needs Linux with glibc")
def test_malloc_trim_gives_back_free_pages_glibc_keeps() -> None:
    """1280 blocks of 100 kB (under glibc's mmap threshold, so on a heap), every other one
    freed: 64 MiB of holes between live blocks, which glibc cannot trim from a heap's top;
    their pages stay resident until ``malloc_trim`` gives them back."""
    blocks = [bytearray(b"\x01") * 100_000 for _ in range(1280)]  # written: resident
    loaded = _rss_mib()
    del blocks[::2]
    freed = _rss_mib()
    assert loaded - freed < 16, "glibc gave the pages back by itself: nothing to test"
    assert malloc_trim() is True
    assert freed - _rss_mib() > 40
    assert len(blocks) == 640


# ---------------------------------------------------------------- the engine


@pytest.fixture
def engine() -> Iterator[Engine]:
    eng = make_engine()
    try:
        yield eng
    finally:
        eng.close()


def _submit_and_watch(
    engine: Engine, params: SamplingParams, count: int
) -> tuple[list[weakref.ref[Request]], list[RequestOutput], threading.Event]:
    """Submit ``count`` requests; weak references to their :class:`Request` objects (read
    on the engine thread right after they were queued), their final outputs, and an event
    set once all are in."""
    finals: list[RequestOutput] = []
    done = threading.Event()

    def on_output(out: RequestOutput) -> None:
        if out.finished:
            finals.append(out)
            if len(finals) == count:
                done.set()

    rids = [engine.submit([5, 6, 7, 8, 9, 10, 11], params, on_output) for _ in range(count)]

    def refs() -> list[weakref.ref[Request]]:
        held = [*engine.core.scheduler.waiting, *engine.core.scheduler.running]
        return [weakref.ref(r) for r in held if r.rid in rids]

    found = engine.call(refs).result(10)  # runs after the requests' _add tasks
    assert len(found) == count
    return found, finals, done


def test_finished_requests_and_their_buffers_are_freed_without_the_gc(engine: Engine) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, logprobs=20, prompt_logprobs=5)
    gc.collect()
    gc.disable()  # only reference counting frees below: no cycle may keep a request
    try:
        refs, finals, done = _submit_and_watch(engine, params, 6)
        assert done.wait(60)
        wait_idle(engine)
        engine.call(lambda: None).result(10)  # one more loop round after the last report
        alive = [r() for r in refs if r() is not None]
        assert alive == []
        # what the clients got is intact: one logprob record per token, 20 alternatives
        assert all(len(f.logprobs or ()) == 12 for f in finals)
        assert all(len(lp.top) == 20 for f in finals for lp in f.logprobs or ())

        def held() -> tuple[int, int, int, int, int]:
            s = engine.core.scheduler
            return (
                len(s.waiting),
                len(s.running),
                len(s.ends.pending),
                len(s.runner._extras),
                len(engine.core.cache.admitted),
            )

        assert engine.call(held).result(10) == (0, 0, 0, 0, 0)
    finally:
        gc.enable()


def test_aborted_requests_are_freed_without_the_gc(engine: Engine) -> None:
    params = SamplingParams(max_tokens=100, temperature=1.0, seed=1, logprobs=5)
    gc.collect()
    gc.disable()
    try:
        refs, finals, done = _submit_and_watch(engine, params, 3)
        for f in [r() for r in refs]:
            assert f is not None
            engine.abort(f.rid)
        del f
        assert done.wait(60)
        assert len(finals) == 3
        wait_idle(engine)
        engine.call(lambda: None).result(10)
        assert [r() for r in refs if r() is not None] == []
    finally:
        gc.enable()


def test_engine_trims_once_after_a_busy_period(engine: Engine) -> None:
    """The loop feeds its trimmer: no trim while idle since the start, one about a second
    after a request's last step (the settle time), none again until there is work."""
    trimmer = engine.core.memory_trimmer
    assert trimmer.interval_s == 10.0  # the default
    start = engine.call(lambda: trimmer.trims).result(10)
    time.sleep(1.3)
    assert engine.call(lambda: trimmer.trims).result(10) == start  # nothing was busy since
    engine.generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
    finished = time.monotonic()
    deadline = finished + 10
    while engine.call(lambda: trimmer.trims).result(10) == start and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.call(lambda: trimmer.trims).result(10) == start + 1
    record = trimmer.last
    assert record is not None
    assert record.released is (None if not trim_supported() else record.released)
    time.sleep(1.3)
    assert engine.call(lambda: trimmer.trims).result(10) == start + 1


# ---------------------------------------------------------------- logprob records


def test_logprob_records_are_packed() -> None:
    """A ``logprobs: 20`` record holds its alternatives packed: about 330 bytes each
    (2.5 kB as a tuple of 20 (int, float) pairs), exactly the fp32 values."""
    logits = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0))
    tracemalloc.start()
    try:
        records = token_logprobs(logits, list(range(64)), [20] * 64)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held / len(records) < 500
    values, ids = torch.log_softmax(logits, dim=-1).topk(20, dim=-1)
    for r, v, i in zip(records, values.tolist(), ids.tolist(), strict=True):
        assert r.k == 20
        assert r.top == tuple(zip(i, v, strict=True))  # fp32 values, bit for bit


def test_logprob_record_from_pairs_and_bad_packing() -> None:
    rec = TokenLogprob.of(5, -0.5, ((1, -0.25), (2, -1.5)))
    assert (rec.token_id, rec.logprob, rec.k, rec.top) == (5, -0.5, 2, ((1, -0.25), (2, -1.5)))
    assert TokenLogprob(7, -1.0).top == ()
    with pytest.raises(ValueError, match="top_id_bytes"):
        TokenLogprob(7, -1.0, b"\x00" * 8, b"\x00" * 4)


def test_nothing_of_a_wide_http_request_is_left_once_it_was_answered(engine: Engine) -> None:
    """An ``n: 8``, ``logprobs: 5`` completion, streamed and not: once answered, no engine
    request, fan-out or engine output of it is alive."""
    import httpx

    from hicache.server.fanout import Fanout
    from tests.helpers.api_fixtures import serve

    kinds = {Request, Fanout, RequestOutput}
    gc.collect()
    # objects of earlier tests in this process (say, an engine a robustness test left
    # dead) are not this request's: held here so that their ids stay theirs
    earlier = [o for o in gc.get_objects() if type(o) in kinds]
    earlier_ids = {id(o) for o in earlier}
    body = {"prompt": [5, 6, 7, 8], "n": 8, "logprobs": 5, "max_tokens": 6, "temperature": 1.0}
    with serve(engine) as url:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 8
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60
        ) as s:
            assert s.status_code == 200
            assert "data: [DONE]" in "".join(s.iter_text())
        wait_idle(engine)
        engine.call(lambda: None).result(10)
        gc.collect()
        left = [o for o in gc.get_objects() if type(o) in kinds and id(o) not in earlier_ids]
        assert left == []
