"""Scheduler unit tests: a real cache, a fake model runner, exact state.

The fake runner answers each sequence's last token ``t`` with ``t + 1`` (mod the vocab),
so every output is known in advance; it records each forward's ``extend_lens``. The cache
is real (L1 + L2), so pages, pins and retraction are the real ones.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hicache.cache import HiCache
from hicache.cache.report import cache_stats, check_integrity
from hicache.config import CacheConfig
from hicache.engine.request import FinishReason, Request, RequestOutput
from hicache.engine.sampling import SamplingParams
from hicache.spec import KVSpec
from tests.helpers.fake_runner import client, step
from tests.helpers.fake_runner import make_scheduler as make
from tests.helpers.fake_runner import run_until_idle as run
from tests.helpers.kvdata import FailingLoads, LoadGates

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
PAGE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


@pytest.fixture
def cache() -> Iterator[HiCache]:
    cfg = CacheConfig(page_size=PAGE, device_tokens=8 * PAGE, hicache_ratio=2.0)
    with HiCache(cfg, SPEC) as c:
        yield c


def request(
    prompt: list[int], params: SamplingParams = GREEDY
) -> tuple[Request, list[RequestOutput]]:
    outs: list[RequestOutput] = []
    return client(Request(prompt, params), outs.append), outs


def test_admission_is_fifo_and_bounded_by_max_running(cache: HiCache) -> None:
    sched, runner = make(cache, max_running_requests=2)
    reqs = [request([10 * i + 1, 10 * i + 2, 10 * i + 3]) for i in range(3)]
    for r, _ in reqs:
        sched.add(r)
    step(sched)
    assert [r.rid for r in sched.running] == [reqs[0][0].rid, reqs[1][0].rid]
    assert [r.rid for r in sched.waiting] == [reqs[2][0].rid]
    assert runner.batches[0] == [3, 3]  # both prompts in one prefill
    assert [len(r.cache.pages) for r in sched.running if r.cache] == [1, 1]
    run(sched)
    for (r, outs), first in zip(reqs, (4, 14, 24), strict=True):
        assert outs[-1].finished and r.output_ids == [first, first + 1, first + 2]
    assert len(cache.admitted) == 0
    check_integrity(cache)


def test_queue_time_ends_at_the_first_admission_and_stays_within_ttft(cache: HiCache) -> None:
    sched, _ = make(cache, max_running_requests=1)
    (first, first_outs), (second, second_outs) = request([1, 2, 3]), request([11, 12, 13])
    sched.add(first)
    sched.add(second)
    step(sched)  # admits only the first: the second waits for room in the batch
    assert first.admitted_at is not None and second.admitted_at is None
    assert first_outs[0].queue_s == first.admitted_at - first.arrival
    run(sched)
    assert second.admitted_at is not None and second.admitted_at > first.admitted_at
    for outs in (first_outs, second_outs):
        queue, ttft = outs[-1].queue_s, outs[-1].ttft_s
        assert queue is not None and ttft is not None and 0 <= queue <= ttft
    # the second waited for the whole first request (3 steps): its queue is most of its TTFT
    assert second_outs[-1].queue_s > first_outs[-1].ttft_s - first_outs[-1].queue_s


def test_pages_grow_one_page_at_a_boundary(cache: HiCache) -> None:
    sched, _ = make(cache)
    r, _ = request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=6))
    sched.add(r)
    step(sched)  # prefill: 3 tokens in 1 page, first output token sampled
    assert r.cache is not None and len(r.cache.pages) == 1 and r.kv_len == 3
    step(sched)  # decode position 3: still page 0
    assert len(r.cache.pages) == 1
    step(sched)  # decode position 4: a second page
    assert len(r.cache.pages) == 2 and r.kv_len == 5
    run(sched)
    assert r.output_ids == [4, 5, 6, 7, 8, 9]


def test_abort_frees_everything_of_waiting_and_running_requests(cache: HiCache) -> None:
    sched, _ = make(cache, max_running_requests=1)
    a, a_outs = request([1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=20))
    b, b_outs = request([7, 8, 9])
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.running == [a] and list(sched.waiting) == [b]
    sched.abort(a.rid)
    sched.abort(b.rid)
    step(sched)
    assert sched.idle
    assert a_outs[-1].finish_reason is FinishReason.ABORT
    assert b_outs[-1].finish_reason is FinishReason.ABORT
    assert len(cache.admitted) == 0 and cache.full.pages.request_pages(cache.admitted) == []
    cache.sync(wait=True)
    check_integrity(cache)
    st = cache_stats(cache)
    assert st.device_cached_tokens + st.device_free_tokens == st.device_total_tokens


def test_retraction_keeps_kv_and_readmission_finds_it(cache: HiCache) -> None:
    # L1: 8 pages. Two requests of 13 prompt tokens (4 pages each with the first output
    # token) fill it; the next decode page of either forces a retraction.
    sched, _ = make(cache)
    long = SamplingParams(temperature=0.0, max_tokens=8)
    a, a_outs = request(list(range(1, 14)), long)
    b, b_outs = request(list(range(30, 43)), long)
    sched.add(a)
    sched.add(b)
    run(sched, 200)
    assert a.output_ids == list(range(14, 22)) and b.output_ids == list(range(43, 51))
    assert a.retracted + b.retracted >= 1
    retracted = a if a.retracted else b
    assert retracted.cached.total == 0  # counted once, at the first admission
    assert cache_stats(cache).counters["prefix_queries_total"] == 2
    assert a_outs[-1].finished and b_outs[-1].finished
    cache.sync(wait=True)
    check_integrity(cache)


def test_a_request_too_large_for_l1_fails_alone(cache: HiCache) -> None:
    sched, _ = make(cache)
    big, big_outs = request(list(range(1, 40)))  # 10 pages > 8
    small, small_outs = request([1, 2, 3])
    sched.add(big)
    sched.add(small)
    run(sched)
    assert big_outs[-1].finish_reason is FinishReason.ABORT
    assert "KV pages" in (big_outs[-1].error or "")
    assert small_outs[-1].finished and small.output_ids == [4, 5, 6]
    check_integrity(cache)


def test_a_load_failing_mid_forward_falls_back_to_recompute_and_pins_nothing() -> None:
    """Every L2 -> L1 load fails after its layer 0, while the forward waits for layer 1.
    That forward's result for the request is discarded and the request is requeued; its
    re-admission loads nothing and recomputes the prompt: same output as cold, no error
    (it used to end with finish_reason abort, "loading the cached prefix failed")."""
    hook = FailingLoads()
    cfg = CacheConfig(page_size=PAGE, device_tokens=8 * PAGE, hicache_ratio=2.0)
    with HiCache(cfg, SPEC, layer_hook=hook) as cache:
        sched, runner = make(cache, max_running_requests=4)
        prompt = list(range(1, 14))
        first, _ = request(prompt)
        sched.add(first)
        run(sched)
        cache.sync(wait=True)
        cache.full.pages.evict_device(8)  # the prompt's KV is in L2 only now
        hook.on = True
        again, again_outs = request(prompt)
        other, other_outs = request([50, 51, 52])
        sched.add(again)
        sched.add(other)
        done = len(runner.batches)
        run(sched)
        assert hook.fired.is_set()
        assert again_outs[-1].finish_reason is FinishReason.LENGTH
        assert again_outs[-1].error is None and again.output_ids == first.output_ids
        assert other_outs[-1].finished and other.output_ids == [53, 54, 55]
        # the forward over the loaded prefix (12 tokens matched: 1 new), discarded; then
        # the recompute of the whole prompt, with the other's decode
        assert runner.batches[done][:2] == [1, 3] and runner.batches[done + 1][-1] == 13
        assert again.cache is not None and again.cache.cached.host == 0
        stats = cache_stats(cache).counters
        assert stats["load_fallbacks_total"] == 1 and stats["load_failures_total"] == 1
        cache.sync(wait=True)
        check_integrity(cache)
        assert all(n.lock_ref == 0 and n.host_ref == 0 for n in cache.full.pages.tree.iter_nodes())
        hook.on = False
        third, _ = request(prompt)  # the recomputed prefix is cached again: from L1
        sched.add(third)
        run(sched)
        assert third.output_ids == first.output_ids
        assert third.cache is not None and third.cache.cached.device == 12


def test_a_load_failure_seen_at_the_step_poll_recomputes_before_any_forward() -> None:
    """The load fails before the step's forward (its completion is applied by the step's
    poll): the request is requeued and re-admitted in the same step with nothing loaded,
    so no forward ever runs over the unloaded prefix."""
    gates = LoadGates()
    gates.park(0, fail=True)  # the first load: the request's own, below
    cfg = CacheConfig(page_size=PAGE, device_tokens=8 * PAGE, hicache_ratio=2.0)
    with HiCache(cfg, SPEC, layer_hook=gates) as cache:
        sched, runner = make(cache)
        prompt = list(range(1, 14))
        first, _ = request(prompt)
        sched.add(first)
        run(sched)
        cache.sync(wait=True)
        cache.full.pages.evict_device(8)
        again, outs = request(prompt)
        sched.add(again)
        sched._admit()  # admitted over its L2 prefix: the load starts, and fails
        assert again in sched.running and again.kv_len == 12
        assert gates.parked(0)
        gates.release(0)
        assert cache.full.pages.host_pool is not None
        cache.full.pages.host.controller.wait_idle(10)  # its failed completion is posted
        done = len(runner.batches)
        step(sched)
        assert runner.batches[done:] == [[13]]  # only the recompute, from position 0
        run(sched)
        assert outs[-1].error is None and again.output_ids == first.output_ids
        assert cache_stats(cache).counters["load_fallbacks_total"] == 1
        cache.sync(wait=True)
        check_integrity(cache)


def test_a_new_prompt_is_prefilled_alongside_running_decodes(cache: HiCache) -> None:
    sched, runner = make(cache, chunked_prefill_size=6)
    a, _ = request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5))
    sched.add(a)
    step(sched)  # a's prefill
    b, _ = request(list(range(10, 20)))  # 10 tokens
    sched.add(b)
    step(sched)
    step(sched)
    # a decodes every step; b's prompt goes in chunks of the 5 tokens left of the budget
    assert runner.batches[:3] == [[3], [1, 5], [1, 5]]
    run(sched)
    assert a.output_ids == [4, 5, 6, 7, 8] and b.output_ids == [20, 21, 22]


def test_the_first_prefill_advances_even_when_decodes_fill_the_budget(cache: HiCache) -> None:
    sched, runner = make(cache, chunked_prefill_size=2)
    reqs = [request([i, i + 1], SamplingParams(temperature=0.0, max_tokens=4))[0] for i in (1, 11)]
    for r in reqs:
        sched.add(r)
    step(sched)  # both prompts: 2 tokens each, budget 2 -> one, then the other
    step(sched)
    late, _ = request([40, 41, 42, 43, 44, 45, 46, 47, 48])
    sched.add(late)
    step(sched)
    assert runner.batches[2][-1] == PAGE  # two decodes took the budget; a page anyway
    run(sched)
    assert late.output_ids == [49, 50, 51]
