"""Outputs off the critical path (``SchedulerConfig.overlap_outputs``), forced on on CPU.

A step's text work and reports run once the next forward is launched. The reports are
exactly those of the synchronous order; a stop string found one step late ends its request
with the token in flight discarded and the KV of the stopping token kept; every request
gets its final report last and once, whether it finishes, is aborted, retracted or the
engine closes. Scheduler tests use the fake runner (token ``t`` -> ``t + 1``) and a
tokenizer that spells ids with spaces; engine tests the tiny random Llama, greedy.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from hicache.cache import HiCache
from hicache.cache.report import check_integrity
from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.request import FinishReason, Request, RequestOutput
from hicache.engine.sampling import SamplingParams
from hicache.engine.step.scheduler import Scheduler, SchedulerConfig
from hicache.spec import KVSpec
from tests.helpers.engine_fixtures import engine_model, prompt_ids
from tests.helpers.fake_runner import (
    NextTokenRunner,
    client,
    make_scheduler,
    run_until_idle,
    step,
)

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
PAGE = 4


@pytest.fixture
def cache() -> Iterator[HiCache]:
    cfg = CacheConfig(page_size=PAGE, device_tokens=8 * PAGE, hicache_ratio=2.0)
    with HiCache(cfg, SPEC) as c:
        yield c


def make(cache: HiCache, overlap: bool, **cfg: int) -> tuple[Scheduler, NextTokenRunner]:
    return make_scheduler(cache, overlap_outputs=overlap, **cfg)


def run(sched: Scheduler) -> None:
    run_until_idle(sched, steps=200)


def shown(outs: list[RequestOutput]) -> list[tuple[object, ...]]:
    """What a client sees of each report."""
    return [(o.output_ids, o.delta_text, o.text, o.finished, o.finish_reason) for o in outs]


def assert_well_formed(outs: list[RequestOutput]) -> None:
    """One final report, the last; the deltas make up its text."""
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert "".join(o.delta_text for o in outs) == outs[-1].text


def test_the_default_overlaps_on_cuda_only(cache: HiCache) -> None:
    sched, _ = make(cache, overlap=True)
    assert sched.overlap
    assert not make_scheduler(cache)[0].overlap  # the runner is on the CPU
    with pytest.raises(ValueError, match="overlap_outputs"):
        SchedulerConfig(overlap_outputs="yes")  # type: ignore[arg-type]


def test_a_stop_string_found_one_step_late(cache: HiCache) -> None:
    """Outputs 4 5 6 7 8; stop "8". With overlap the stop is seen while the forward that
    computes token 8's position runs: that forward's token (9) is discarded, the text and
    the reports are those of the synchronous order, and the KV of position 7 is kept (two
    whole pages committed instead of one)."""
    results = {}
    for overlap in (False, True):
        cache.reset()
        sched, runner = make(cache, overlap)
        outs: list[RequestOutput] = []
        req = client(
            Request([1, 2, 3], SamplingParams(temperature=0, max_tokens=10, stop="8")),
            outs.append,
        )
        sched.add(req)
        run(sched)
        assert req.output_ids == [4, 5, 6, 7, 8] and req.kv_len == (8 if overlap else 7)
        assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].text == "4 5 6 7 "
        assert len(runner.batches) == (6 if overlap else 5)  # one forward more, discarded
        assert_well_formed(outs)
        results[overlap] = shown(outs)
        assert cache.full.pages.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 99]).device_tokens == (
            8 if overlap else 4
        )
        cache.sync(wait=True)
        check_integrity(cache)
        assert len(cache.admitted) == 0
    assert results[True] == results[False]


def test_reports_are_those_of_the_synchronous_order(cache: HiCache) -> None:
    """Requests that end by stop strings (found on time or late), stop ids, max_tokens,
    ``min_tokens``: every report of every request as without overlap."""

    def requests() -> list[tuple[Request, list[RequestOutput]]]:
        params = [
            SamplingParams(temperature=0, max_tokens=8, stop=["19 2"]),
            SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[45]),
            SamplingParams(temperature=0, max_tokens=5),
            SamplingParams(temperature=0, max_tokens=8, stop=["6", "7 8"], min_tokens=3),
        ]
        prompts = [list(range(1, 14)), list(range(30, 43)), [60, 61], [1, 2, 3]]
        made = []
        for prompt, p in zip(prompts, params, strict=True):
            outs: list[RequestOutput] = []
            made.append((client(Request(prompt, p), outs.append), outs))
        return made

    results = {}
    for overlap in (False, True):
        cache.reset()
        sched, _ = make(cache, overlap)
        made = requests()
        for req, _ in made:
            sched.add(req)
        run(sched)
        for _, outs in made:
            assert_well_formed(outs)
        results[overlap] = [shown(outs) for _, outs in made]
        cache.sync(wait=True)
        check_integrity(cache)
        assert len(cache.admitted) == 0
    assert results[True] == results[False]
    finals = [outs[-1] for outs in results[True]]
    assert [f[4] for f in finals] == [
        FinishReason.STOP,
        FinishReason.STOP,
        FinishReason.LENGTH,
        FinishReason.STOP,
    ]
    assert finals[0][2] == "14 15 16 17 18 " and finals[3][2] == "4 5 "


def test_outputs_wait_for_the_next_forward_or_an_idle_step(cache: HiCache) -> None:
    sched, runner = make(cache, overlap=True)
    outs: list[RequestOutput] = []
    req = client(Request([1, 2, 3], SamplingParams(temperature=0, max_tokens=1)), outs.append)
    sched.add(req)
    assert step(sched)  # prefill; token 4 read, the request ends (max_tokens) and is released
    assert req.finished and outs == [] and len(cache.admitted) == 0
    assert not sched.idle and sched.in_flight == [req]
    assert not step(sched)  # no forward: the pending final report goes out
    assert shown(outs) == [([4], "4", "4", True, FinishReason.LENGTH)]
    assert sched.idle and sched.in_flight == [] and len(runner.batches) == 1


def test_abort_while_an_output_is_pending(cache: HiCache) -> None:
    """The pending report goes first, then the final one; nothing is lost or doubled."""
    sched, _ = make(cache, overlap=True)
    outs: list[RequestOutput] = []
    req = client(Request([1, 2, 3], SamplingParams(temperature=0, max_tokens=10)), outs.append)
    sched.add(req)
    step(sched)
    step(sched)  # token 4 reported while token 5's forward ran; token 5 pending
    assert shown(outs) == [([4], "4", "4", False, None)]
    sched.abort(req.rid)
    assert not step(sched)
    assert shown(outs) == [
        ([4], "4", "4", False, None),
        ([4, 5], " 5", "4 5", False, None),
        ([4, 5], "", "4 5", True, FinishReason.ABORT),
    ]
    assert sched.idle and len(cache.admitted) == 0
    cache.sync(wait=True)
    check_integrity(cache)


def test_a_pending_stop_string_wins_over_a_later_abort(cache: HiCache) -> None:
    """Token 5 completes the stop string; the abort comes before its text was looked at.
    The request had stopped: it ends so, and is reported once."""
    sched, _ = make(cache, overlap=True)
    outs: list[RequestOutput] = []
    params = SamplingParams(temperature=0, max_tokens=10, stop="5")
    req = client(Request([1, 2, 3], params), outs.append)
    sched.add(req)
    step(sched)
    step(sched)
    sched.abort(req.rid)
    step(sched)
    assert shown(outs) == [
        ([4], "4", "4", False, None),
        ([4, 5], " ", "4 ", True, FinishReason.STOP),
    ]
    assert sum(o.finished for o in outs) == 1 and sched.idle and len(cache.admitted) == 0


def test_a_pending_stop_string_voids_the_reason_of_a_later_abort(cache: HiCache) -> None:
    """As above, with the abort the engine makes when it stops (reason set with it): the
    request had stopped, so its final report carries no error."""
    sched, _ = make(cache, overlap=True)
    outs: list[RequestOutput] = []
    params = SamplingParams(temperature=0, max_tokens=10, stop="5")
    req = client(Request([1, 2, 3], params), outs.append)
    sched.add(req)
    step(sched)
    step(sched)
    req.error, req.aborted = "the engine was closed", True  # what Engine._fail does
    step(sched)
    assert [(o.finished, o.finish_reason, o.error) for o in outs] == [
        (False, None, None),
        (True, FinishReason.STOP, None),
    ]
    assert sched.idle and len(cache.admitted) == 0


def test_a_retracted_request_stopped_by_its_pending_output(cache: HiCache) -> None:
    """A request retracted (L1 full) while its last token's text is pending, that text
    holding its stop string: it ends from the waiting queue, once, with nothing held."""

    def setup(stop: str | None) -> tuple[Scheduler, list[tuple[Request, list[RequestOutput]]]]:
        cache.reset()
        sched, _ = make(cache, overlap=True)
        made = []
        for prompt in (list(range(1, 14)), list(range(30, 43))):
            outs: list[RequestOutput] = []
            params = SamplingParams(temperature=0, max_tokens=8, stop=[stop] if stop else [])
            made.append((client(Request(prompt, params), outs.append), outs))
            sched.add(made[-1][0])
        return sched, made

    sched, made = setup(None)  # where is the first retraction, and what was pending then?
    pending_token = None
    for _ in range(100):
        before = [(r.retracted, r.output_ids[-1] if r.output_ids else None) for r, _ in made]
        step(sched)
        hit = [b[1] for (r, _), b in zip(made, before, strict=True) if r.retracted > b[0]]
        if hit:
            pending_token = hit[0]
            break
    assert pending_token is not None
    run(sched)
    sched, made = setup(str(pending_token))
    run(sched)
    stopped = [(r, outs) for r, outs in made if outs[-1].finish_reason is FinishReason.STOP]
    assert len(stopped) == 1
    req, outs = stopped[0]
    assert req.retracted == 1 and req.output_ids[-1] == pending_token
    assert_well_formed(outs)
    assert req not in sched.waiting and req not in sched.running
    for _, other in made:
        assert_well_formed(other)
    assert len(cache.admitted) == 0
    cache.sync(wait=True)
    check_integrity(cache)


# ---------------------------------------------------------------- engine


MODEL = "tiny-random-llama"


def make_engine(overlap: bool) -> Engine:
    config = EngineConfig(
        model_path=MODEL,
        dtype="float32",
        device="cpu",
        cache=CacheConfig(page_size=PAGE, device_tokens=512, load_back_threshold=0),
        scheduler=SchedulerConfig(max_running_requests=8, overlap_outputs=overlap),
        context_length=128,
    )
    return Engine(config, loaded=engine_model(MODEL)).start()


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    e = make_engine(overlap=True)
    yield e
    e.close()


def stream(engine: Engine, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    """Every report of one request, until its final one."""
    outs: list[RequestOutput] = []
    done = threading.Event()

    def on_output(out: RequestOutput) -> None:
        outs.append(out)
        if out.finished:
            done.set()

    engine.submit(prompt, params, on_output)
    assert done.wait(60)
    return outs


def test_engine_stop_string_found_late_keeps_the_right_kv(engine: Engine) -> None:
    """Greedy on the tiny model; the stop string is the text of an output token whose
    position ends a page, so the page computed by the discarded step is committed. A
    follow-up turn that reuses it continues exactly as one computed from scratch."""
    tok = engine.model.tokenizer
    prompt = prompt_ids(MODEL, 10).tolist()
    base = stream(engine, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    ids = base[-1].output_ids
    pieces = [tok.decode(ids[: k + 1]) for k in range(len(ids))]
    k = next(
        k
        for k in range(2, len(ids))
        if (len(prompt) + k + 1) % PAGE == 0
        and pieces[k].strip()
        and (stop := pieces[k][len(pieces[k - 1]) :].strip())
        and stop not in pieces[k - 1]
        and pieces[k] == pieces[k - 1] + pieces[k][len(pieces[k - 1]) :]
    )
    stop = pieces[k][len(pieces[k - 1]) :].strip()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop)
    outs = stream(engine, prompt, params)
    final = outs[-1]
    assert final.finish_reason is FinishReason.STOP and final.output_ids == ids[: k + 1]
    assert final.text == pieces[k][: pieces[k].index(stop)]
    assert_well_formed(outs)
    follow = [*prompt, *ids[: k + 1], *prompt_ids(MODEL, 3).tolist()]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    warm = stream(engine, follow, greedy)[-1]
    assert warm.cached.device == len(prompt) + k + 1  # the late step's page included
    assert engine.flush_cache()
    cold = stream(engine, follow, greedy)[-1]
    assert cold.cached.total == 0 and warm.output_ids == cold.output_ids


def test_engine_streams_match_without_overlap(engine: Engine) -> None:
    prompts = [prompt_ids(MODEL, n).tolist() for n in (7, 11, 13)]
    params = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=["e", "a"]),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=3, stop=[" "]),
    ]
    engine.flush_cache()
    with_overlap = [shown(stream(engine, p, s)) for p, s in zip(prompts, params, strict=True)]
    plain = make_engine(overlap=False)
    try:
        without = [shown(stream(plain, p, s)) for p, s in zip(prompts, params, strict=True)]
    finally:
        plain.close()
    assert with_overlap == without


def test_engine_close_with_outputs_pending() -> None:
    """Close while requests decode (their last token's output pending): each gets every
    token's report and then exactly one final report."""
    engine = make_engine(overlap=True)
    streams: list[list[RequestOutput]] = [[] for _ in range(3)]
    started = threading.Event()

    def collect(i: int) -> object:
        def on_output(out: RequestOutput) -> None:
            streams[i].append(out)
            if len(out.output_ids) >= 3:
                started.set()

        return on_output

    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    for i in range(3):
        engine.submit(prompt_ids(MODEL, 5 + i).tolist(), params, collect(i))  # type: ignore[arg-type]
    assert started.wait(60)
    engine.close()
    for outs in streams:
        assert_well_formed(outs)
        final = outs[-1]
        assert final.finish_reason is FinishReason.ABORT and final.error
        assert final.text == engine.model.tokenizer.decode(
            final.output_ids, skip_special_tokens=True
        )


def test_engine_failing_flush_fails_pending_finals_directly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When the scheduler cannot do its pending outputs (a bug), the engine fails those
    requests directly: a request that already ended still gets a final report, once."""
    engine = make_engine(overlap=True)
    try:
        sched = engine.core.scheduler
        streams: list[list[RequestOutput]] = [[], []]
        gate = threading.Event()

        def hold() -> None:
            gate.wait(30)

        engine.call(hold)  # the loop waits here while both requests are queued
        short = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        engine.submit(prompt_ids(MODEL, 5).tolist(), short, streams[0].append)
        engine.submit(prompt_ids(MODEL, 6).tolist(), long, streams[1].append)

        def broken() -> None:
            raise RuntimeError("flush broken")

        monkeypatch.setattr(sched.ends, "flush", broken)
        gate.set()
        for _ in range(600):
            if all(s and s[-1].finished for s in streams):
                break
            threading.Event().wait(0.05)
        for outs in streams:
            assert_well_formed(outs)
            assert outs[-1].finish_reason is FinishReason.ABORT
            assert "flush broken" in (outs[-1].error or "")
    finally:
        monkeypatch.undo()
        engine.close()
