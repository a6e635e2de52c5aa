"""Admission: priority, the per-group cap and fair share, ``lpm``, and the queue places.

A real cache and a :class:`~tests.helpers.fake_runner.NextTokenRunner` (outputs known in
advance); every assertion is on the scheduler's exact state after a step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from hicache.cache import HiCache
from hicache.config import CacheConfig, KVSpec
from hicache.engine.admission import QueueFull, QueueGate
from hicache.engine.request import Request
from hicache.engine.sampling import SamplingParams
from hicache.engine.scheduler import SchedulerConfig
from tests.helpers.fake_runner import make_scheduler as make
from tests.helpers.fake_runner import run_until_idle as run

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
PAGE = 4
SHORT = SamplingParams(temperature=0.0, max_tokens=2)
LONG = SamplingParams(temperature=0.0, max_tokens=20)


@pytest.fixture
def cache() -> Iterator[HiCache]:
    cfg = CacheConfig(page_size=PAGE, device_tokens=64 * PAGE, hicache_ratio=2.0)
    with HiCache(cfg, SPEC) as c:
        yield c


def req(first: int, group: str = "", params: SamplingParams = SHORT, **kw: Any) -> Request:
    """A two-token prompt ``[first, first + 1]``."""
    return Request([first, first + 1], params, None, group=group, **kw)


def rids(reqs: Any) -> list[str]:
    return [r.rid for r in reqs]


def test_a_group_holds_at_most_its_cap_and_a_later_small_request_runs_at_once(
    cache: HiCache,
) -> None:
    sched, runner = make(cache, max_running_requests=4)  # cap: half, 2
    assert sched.config.group_cap == 2
    wide = [req(10 + 2 * i, "wide", LONG) for i in range(6)]
    for r in wide:
        sched.add(r)
    sched.step()
    assert rids(sched.running) == rids(wide[:2])  # 2 free slots stay free for others
    small = req(80)
    sched.add(small)
    sched.step()
    assert rids(sched.running) == rids([*wide[:2], small])
    assert runner.batches[-1] == [1, 1, 2]  # two decodes and the small one's prefill
    sched.step()  # its second and last token
    assert small.finished and small.output_ids == [82, 83]
    assert rids(sched.running) == rids(wide[:2])
    assert rids(sched.waiting) == rids(wide[2:])
    run(sched, 200)
    assert all(len(r.output_ids) == 20 for r in wide)
    assert cache.requests == 0
    cache.check_integrity()


def test_without_a_group_rule_the_wide_request_takes_every_slot(cache: HiCache) -> None:
    sched, _ = make(cache, max_running_requests=4, max_running_requests_per_group=0)
    assert sched.config.group_cap is None
    wide = [req(10 + 2 * i, "wide", LONG) for i in range(6)]
    for r in wide:
        sched.add(r)
    sched.step()
    small = req(80)
    sched.add(small)
    for _ in range(19):  # the small one waits until a wide copy has finished
        sched.step()
        assert small.admitted_at is None
    sched.step()
    assert small.admitted_at is not None
    run(sched, 200)


def test_fair_share_picks_the_new_group_and_fcfs_without_a_rule(cache: HiCache) -> None:
    for cap, expected in ((3, "b"), (0, "a")):
        sched, _ = make(cache, max_running_requests=3, max_running_requests_per_group=cap)
        for first in (10, 12):
            sched.add(req(first, "a", LONG))
        sched.step()
        sched.add(req(14, "a", LONG))
        sched.add(req(16, "b", LONG))
        sched.step()
        assert [r.group for r in sched.running] == ["a", "a", expected], cap
        assert [r.group for r in sched.waiting] == ["b" if expected == "a" else "a"]
        run(sched, 200)
    cache.check_integrity()


def test_higher_priority_is_admitted_first(cache: HiCache) -> None:
    sched, _ = make(cache, max_running_requests=1)
    low, high = req(10, priority=0), req(20, priority=5)
    sched.add(low)
    sched.add(high)
    assert rids(sched.admission_order()) == rids([high, low])
    sched.step()
    assert rids(sched.running) == rids([high])
    run(sched)
    assert low.output_ids == [12, 13] and high.output_ids == [22, 23]


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_lpm_admits_the_longest_cached_prefix_first(cache: HiCache, policy: str) -> None:
    sched, _ = make(cache, max_running_requests=1, schedule_policy=policy)
    warm_prefix = list(range(40, 52))  # 3 pages
    sched.add(Request(warm_prefix, SHORT, None))
    run(sched)  # its 3 pages are now in the tree
    cold = Request(list(range(60, 73)), SHORT, None)
    half = Request([*warm_prefix[:4], *range(90, 99)], SHORT, None)  # 1 page cached
    warm = Request([*warm_prefix, 7], SHORT, None)  # 3 pages cached
    for r in (cold, half, warm):
        sched.add(r)
    order = sched.admission_order()
    if policy == "lpm":
        assert rids(order) == rids([warm, half, cold])
    else:
        assert rids(order) == rids([cold, half, warm])
    sched.step()
    assert rids(sched.running) == rids(order[:1])
    run(sched)
    assert (warm.cached.device, half.cached.device, cold.cached.device) == (12, 4, 0)
    cache.check_integrity()


def test_queue_places_are_given_back_at_admission_and_on_abort(cache: HiCache) -> None:
    gate = QueueGate(3)
    sched, _ = make(cache, max_running_requests=1)
    ticket = gate.reserve(3)
    with pytest.raises(QueueFull) as refused:
        gate.reserve(1)
    assert (refused.value.queued, refused.value.limit, refused.value.requested) == (3, 3, 1)
    assert refused.value.retry_after_s == 1
    a, b = req(10, "g", queue_slot=ticket.take()), req(20, "g", queue_slot=ticket.take())
    sched.add(a)
    sched.add(b)
    assert gate.counts().queued == 3  # two waiting, one reserved for a later copy
    sched.step()  # a admitted: its place is free
    assert rids(sched.running) == rids([a]) and gate.counts().queued == 2
    sched.abort(b.rid)
    sched.step()  # b ends unadmitted: its place is free too
    assert gate.counts().queued == 1
    ticket.close()  # the copy never submitted
    assert gate.counts().queued == 0 and gate.counts().refused == 1
    ticket.close()  # idempotent
    a.leave_queue()
    assert gate.counts().queued == 0
    with pytest.raises(RuntimeError, match="used up"):
        ticket.take()
    run(sched)


def test_a_request_larger_than_the_queue_bound_is_a_client_error() -> None:
    gate = QueueGate(4)
    with pytest.raises(ValueError, match=r"5 sequences .* at most 4"):
        gate.reserve(5)
    assert gate.counts().queued == 0
    assert QueueGate(None).reserve(10**6).size == 10**6


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"schedule_policy": "dfs-weight"}, "'dfs-weight' is not supported; supported: fcfs, lpm"),
        ({"schedule_policy": "lof"}, "not supported; supported: fcfs, lpm"),
        ({"schedule_policy": "fifo"}, "schedule_policy='fifo' is invalid; choose one of fcfs"),
        ({"schedule_policy": ["lpm"]}, r"schedule_policy=\['lpm'\] is invalid"),
        ({"max_running_requests_per_group": -1}, "max_running_requests_per_group=-1"),
        ({"max_running_requests_per_group": 33}, r"\[1, max_running_requests=32\]"),
        ({"max_running_requests_per_group": True}, "max_running_requests_per_group=True"),
        ({"max_running_requests_per_group": 2.0}, "max_running_requests_per_group=2.0"),
    ],
)
def test_scheduler_config_is_validated(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**fields)


def test_group_cap_defaults_to_half_the_slots() -> None:
    assert SchedulerConfig().group_cap == 16
    assert SchedulerConfig(max_running_requests=1).group_cap == 1
    assert SchedulerConfig(max_running_requests=5).group_cap == 2
    assert SchedulerConfig(max_running_requests_per_group=32).group_cap == 32
    assert SchedulerConfig(max_running_requests_per_group=0).group_cap is None
