"""Admission: priority, the per-group cap and fair share, lending idle slots and taking
them back, ``lpm``, and the queue places.

A real cache and a :class:`~tests.helpers.fake_runner.NextTokenRunner` (outputs known in
advance); every assertion is on the scheduler's exact state after a step. The lending tests
on real tiny models (plain, sliding-window and recurrent) drive the engine's scheduler step
by step on its own thread and compare every token with a run whose cap does not lend.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from hicache.cache import HiCache
from hicache.cache.report import cache_stats, check_integrity
from hicache.config import CacheConfig, PrefetchConfig
from hicache.engine.admission import QueueFull, QueueGate
from hicache.engine.request import Request
from hicache.engine.sampling import SamplingParams
from hicache.engine.step.scheduler import Scheduler, SchedulerConfig
from hicache.keys import Namespace, PageKey
from hicache.spec import KVSpec
from hicache.storage.backends.memory import MemoryStorage, MemoryStore
from hicache.storage.base import Deadline
from hicache.storage.pageio import Payloads
from hicache.storage.stats import MissReason
from tests.helpers.fake_runner import make_scheduler as make
from tests.helpers.fake_runner import run_until_idle as run
from tests.helpers.fake_runner import step
from tests.helpers.kvdata import serve

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
    return Request([first, first + 1], params, group=group, **kw)


def add_wide(sched: Scheduler, n: int = 6) -> list[Request]:
    """``n`` greedy 20-token requests of group ``"wide"`` (prompts ``[10 + 2i, 11 + 2i]``),
    added to ``sched`` and stepped once."""
    wide = [req(10 + 2 * i, "wide", LONG) for i in range(n)]
    for r in wide:
        sched.add(r)
    step(sched)
    return wide


def rids(reqs: Any) -> list[str]:
    return [r.rid for r in reqs]


def test_a_strict_cap_holds_a_group_to_its_cap_and_a_later_small_request_runs_at_once(
    cache: HiCache,
) -> None:
    sched, runner = make(cache, max_running_requests=4, lend_idle_slots=False)  # cap: half, 2
    assert sched.config.group_cap == 2
    wide = add_wide(sched)
    assert rids(sched.running) == rids(wide[:2])  # 2 free slots stay free for others
    small = req(80)
    sched.add(small)
    step(sched)
    assert rids(sched.running) == rids([*wide[:2], small])
    assert runner.batches[-1] == [1, 1, 2]  # two decodes and the small one's prefill
    step(sched)  # its second and last token
    assert small.finished and small.output_ids == [82, 83]
    assert rids(sched.running) == rids(wide[:2])
    assert rids(sched.waiting) == rids(wide[2:])
    run(sched, 200)
    assert all(len(r.output_ids) == 20 for r in wide)
    assert len(cache.admitted) == 0
    check_integrity(cache)


def test_without_a_group_rule_the_wide_request_takes_every_slot(cache: HiCache) -> None:
    sched, _ = make(cache, max_running_requests=4, max_running_requests_per_group=0)
    assert sched.config.group_cap is None
    add_wide(sched)
    small = req(80)
    sched.add(small)
    for _ in range(19):  # the small one waits until a wide copy has finished
        step(sched)
        assert small.admitted_at is None
    step(sched)
    assert small.admitted_at is not None
    run(sched, 200)


def test_fair_share_picks_the_new_group_and_fcfs_without_a_rule(cache: HiCache) -> None:
    for cap, expected in ((3, "b"), (0, "a")):
        sched, _ = make(cache, max_running_requests=3, max_running_requests_per_group=cap)
        for first in (10, 12):
            sched.add(req(first, "a", LONG))
        step(sched)
        sched.add(req(14, "a", LONG))
        sched.add(req(16, "b", LONG))
        step(sched)
        assert [r.group for r in sched.running] == ["a", "a", expected], cap
        assert [r.group for r in sched.waiting] == ["b" if expected == "a" else "a"]
        run(sched, 200)
    check_integrity(cache)


def test_higher_priority_is_admitted_first(cache: HiCache) -> None:
    sched, _ = make(cache, max_running_requests=1)
    low, high = req(10, priority=0), req(20, priority=5)
    sched.add(low)
    sched.add(high)
    assert rids(sched.admission_order()) == rids([high, low])
    step(sched)
    assert rids(sched.running) == rids([high])
    run(sched)
    assert low.output_ids == [12, 13] and high.output_ids == [22, 23]


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_lpm_admits_the_longest_cached_prefix_first(cache: HiCache, policy: str) -> None:
    sched, _ = make(cache, max_running_requests=1, schedule_policy=policy)
    warm_prefix = list(range(40, 52))  # 3 pages
    sched.add(Request(warm_prefix, SHORT))
    run(sched)  # its 3 pages are now in the tree
    cold = Request(list(range(60, 73)), SHORT)
    half = Request([*warm_prefix[:4], *range(90, 99)], SHORT)  # 1 page cached
    warm = Request([*warm_prefix, 7], SHORT)  # 3 pages cached
    for r in (cold, half, warm):
        sched.add(r)
    order = sched.admission_order()
    if policy == "lpm":
        assert rids(order) == rids([warm, half, cold])
    else:
        assert rids(order) == rids([cold, half, warm])
    step(sched)
    assert rids(sched.running) == rids(order[:1])
    run(sched)
    assert (warm.cached.device, half.cached.device, cold.cached.device) == (12, 4, 0)
    check_integrity(cache)


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
    step(sched)  # a admitted: its place is free
    assert rids(sched.running) == rids([a]) and gate.counts().queued == 2
    sched.abort(b.rid)
    step(sched)  # b ends unadmitted: its place is free too
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


# ---------------------------------------------------------------- lending idle slots


def test_a_lone_wide_group_borrows_every_slot_and_gives_one_back_per_small_request(
    cache: HiCache,
) -> None:
    sched, runner = make(cache, max_running_requests=4)  # cap 2, lending
    wide = add_wide(sched)
    assert rids(sched.running) == rids(wide[:4])  # nothing else waits: 2 slots lent
    step(sched)
    small = req(80)
    sched.add(small)
    step(sched)  # one lent slot back: the most recently admitted of equally advanced copies
    assert rids(sched.running) == rids([*wide[:3], small])
    assert rids(sched.waiting) == rids([wide[3], *wide[4:]])
    assert (wide[3].retracted, sched.reclaimed) == (1, 1)
    assert runner.batches[-1] == [1, 1, 1, 2]  # the small one's prefill at once
    step(sched)
    assert small.finished and small.output_ids == [82, 83]
    assert rids(sched.running) == rids(wide[:3])
    step(sched)  # the slot is lent again: the retracted copy comes back first
    assert rids(sched.running) == rids(wide[:4])
    assert runner.batches[-1] == [1, 1, 1, 4]  # its prompt and 2 tokens: no whole page kept
    run(sched, 200)
    for i, r in enumerate(wide):
        assert r.output_ids == list(range(12 + 2 * i, 32 + 2 * i))
    assert sched.reclaimed == 1 and sum(r.retracted for r in wide) == 1
    assert len(cache.admitted) == 0
    check_integrity(cache)


def test_small_requests_cut_the_wide_group_to_its_cap_and_no_further(cache: HiCache) -> None:
    sched, _ = make(cache, max_running_requests=4)
    wide = add_wide(sched)
    small = [req(70 + 2 * i) for i in range(3)]
    for r in small:
        sched.add(r)
    step(sched)  # two lent slots back, then the third small one finds the wide one at its cap
    assert rids(sched.running) == rids([*wide[:2], *small[:2]])
    assert rids(sched.waiting) == rids([wide[2], wide[3], *wide[4:], small[2]])
    assert sched.reclaimed == 2 and [r.retracted for r in wide] == [0, 0, 1, 1, 0, 0]
    step(sched)  # the first two small ones end; a claimant waits, so nothing is lent
    assert rids(sched.running) == rids(wide[:2])
    assert small[2].admitted_at is None
    step(sched)  # the claimant first, then one lent slot for the first retracted copy
    assert rids(sched.running) == rids([*wide[:2], small[2], wide[2]])
    run(sched, 200)
    assert sched.reclaimed == 2
    assert [r.output_ids for r in small] == [[72, 73], [74, 75], [76, 77]]
    for i, r in enumerate(wide):
        assert r.output_ids == list(range(12 + 2 * i, 32 + 2 * i))
    check_integrity(cache)


def test_a_claimant_short_of_l1_takes_back_one_lent_slot_and_the_prefix_is_found_again() -> None:
    # L1: 13 pages. Six wide copies of 7-token prompts hold 2 pages each (12); a small
    # 7-token prompt needs 2 pages with 1 free: one lent copy (of 8 slots, cap 4) goes.
    cfg = CacheConfig(page_size=PAGE, device_tokens=13 * PAGE, hicache_ratio=2.0)
    with HiCache(cfg, SPEC) as cache:
        sched, runner = make(cache, max_running_requests=8)
        two = SamplingParams(temperature=0.0, max_tokens=2)
        wide = [Request(list(range(10 * i + 1, 10 * i + 8)), two, group="w") for i in range(6)]
        for r in wide:
            sched.add(r)
        step(sched)
        assert rids(sched.running) == rids(wide)
        assert cache_stats(cache).device_free_tokens == PAGE  # one page free
        small = Request(list(range(80, 87)), two)
        sched.add(small)
        step(sched)  # a free slot but no L1: one lent copy's pages, no more
        assert sched.reclaimed == 1 and [r.retracted for r in wide] == [0] * 5 + [1]
        assert runner.batches[-1] == [1, 1, 1, 1, 1, 7]
        assert all(r.finished for r in wide[:5]) and rids(sched.waiting) == rids(wide[5:])
        step(sched)  # re-admitted from its committed page: 4 of its 8 tokens recomputed
        assert runner.batches[-1] == [1, 4]
        assert small.output_ids == [87, 88] and wide[5].output_ids == [58, 59]
        assert sched.idle and len(cache.admitted) == 0
        check_integrity(cache)


def test_priority_first_among_claimants_for_a_lent_slot(cache: HiCache) -> None:
    sched, _ = make(cache, max_running_requests=4)
    other = req(90, "x", LONG)
    wide = [req(10 + 2 * i, "wide", LONG) for i in range(6)]
    for r in (other, *wide):
        sched.add(r)
    step(sched)  # x, two wide copies at the cap, then the one idle slot lent to a third
    assert rids(sched.running) == rids([other, *wide[:3]])
    low, high = req(70, priority=0), req(80, priority=5)
    sched.add(low)
    sched.add(high)
    # claimants by priority, then the borrowers (their group at its cap) in queue order
    assert rids(sched.admission_order()) == rids([high, low, *wide[3:]])
    step(sched)  # one lent slot: the higher priority takes it, the lower one waits
    assert rids(sched.running) == rids([other, *wide[:2], high])
    assert rids(sched.waiting) == rids([wide[2], *wide[3:], low])
    assert sched.reclaimed == 1
    run(sched, 300)
    assert low.output_ids == [72, 73] and high.output_ids == [82, 83]
    check_integrity(cache)


def test_a_strict_cap_lists_no_borrower(cache: HiCache) -> None:
    sched, _ = make(cache, max_running_requests=4, lend_idle_slots=False)
    wide = add_wide(sched, 4)
    assert rids(sched.running) == rids(wide[:2])
    assert sched.admission_order() == []
    run(sched, 200)
    assert sched.reclaimed == 0


class GatedStorage(MemoryStorage):
    """``MemoryStorage`` whose reads wait for ``gate``: an L3 prefetch that stays running."""

    def __init__(self, namespace: Namespace, store: MemoryStore) -> None:
        super().__init__(namespace, store=store)
        self.gate = threading.Event()

    def _get(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline
    ) -> list[MissReason | None]:
        assert self.gate.wait(30)
        return super()._get(keys, pages, deadline)


def test_a_claimant_whose_prefetch_runs_leaves_the_lent_slots_until_it_is_ready() -> None:
    prompt = list(range(40, 49))  # 9 tokens: its first 8 (2 pages) in L3
    store = MemoryStore()
    prefetch = PrefetchConfig(policy="wait_complete", prefetch_threshold=0)
    cfg = CacheConfig(
        page_size=PAGE, device_tokens=64 * PAGE, hicache_ratio=2.0, load_back_threshold=0
    )

    def namespace(cache: HiCache) -> Namespace:
        layout = cache.context.config.mem_layout
        return Namespace.for_spec(SPEC, model="m", weights_fingerprint="w", layout=layout,
                                  page_size=PAGE)  # fmt: skip

    with HiCache(cfg, SPEC).start() as writer:
        ns = namespace(writer)
        writer.l3.attach(MemoryStorage(ns, store=store), ns, prefetch)
        serve(writer, prompt)
        writer.sync(wait=True)
    with HiCache(cfg, SPEC).start() as cache:
        ns = namespace(cache)
        storage = GatedStorage(ns, store)
        cache.l3.attach(storage, ns, prefetch)
        sched, _ = make(cache, max_running_requests=4)
        wide = [req(10 + 2 * i, "wide", LONG) for i in range(6)]
        for r in wide:
            sched.add(r)
        for _ in range(100):  # their lookups (nothing in L3) come back
            if len(sched.running) == 4:
                break
            step(sched)
            time.sleep(0.001)
        assert rids(sched.running) == rids(wide[:4])
        claimant = Request(prompt, SHORT)
        sched.add(claimant)
        for _ in range(3):  # its read waits: the lent slots stay lent
            step(sched)
            assert rids(sched.running) == rids(wide[:4]) and sched.reclaimed == 0
        storage.gate.set()
        assert claimant.cache is not None
        for _ in range(1000):
            cache.sync()  # as the engine's steps do: the read's records are applied here
            if cache.ready(claimant.cache):
                break
            time.sleep(0.001)
        step(sched)  # ready: it takes one lent slot back at once
        assert rids(sched.running) == rids([*wide[:3], claimant])
        assert sched.reclaimed == 1 and claimant.cached.storage == 8
        run(sched, 200)
        assert claimant.output_ids == [49, 50]
        cache.sync(wait=True)
        check_integrity(cache)


LENDING_MODELS = ("tiny-random-llama", "tiny-random-gemma3", "tiny-random-qwen3-next")


def lending_run(name: str, lend: bool) -> dict[str, Any]:
    """Six 10-token prompts of one group (8 greedy tokens each) on a real tiny model, 4
    running slots (cap 2); after 3 steps two small requests arrive. The scheduler is
    stepped on the engine's thread (the loop waits meanwhile): every output, the groups
    running just after the small ones arrived, and what was retracted."""
    from hicache.engine.front.engine import Engine, EngineConfig
    from tests.helpers.engine_fixtures import TINY, engine_model
    from tests.runner.models.hybrid_fixtures import hybrid_model

    loaded = engine_model(name) if name in TINY else hybrid_model(name)
    config = EngineConfig(
        model_path=name,
        dtype="float32",
        device="cpu",
        cache=CacheConfig(
            page_size=PAGE, device_tokens=256, hicache_ratio=2.0, max_mamba_cache_size=16
        ),
        scheduler=SchedulerConfig(
            max_running_requests=4, chunked_prefill_size=64, lend_idle_slots=lend
        ),
        context_length=128,
    )
    wide_params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    small_params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    with Engine(config, loaded=loaded).start() as engine:

        def drive() -> dict[str, Any]:
            sched = engine.core.scheduler
            wide = [
                Request(list(range(11 + 13 * i, 21 + 13 * i)), wide_params, group="wide")
                for i in range(6)
            ]
            small = [Request(list(range(200 + 5 * i, 205 + 5 * i)), small_params) for i in (0, 1)]
            for r in wide:
                sched.add(r)
            for _ in range(3):
                step(sched)
            for r in small:
                sched.add(r)
            step(sched)
            groups = [r.group for r in sched.running]
            prefixes: dict[int, int] = {}
            for _ in range(200):
                if sched.idle:
                    break
                step(sched)
                for i, r in enumerate(wide):  # what a retracted copy's re-admission found
                    if r.retracted and i not in prefixes and r in sched.running:
                        assert r.cache is not None
                        prefixes[i] = r.cache.prefix_tokens
            assert sched.idle and len(engine.core.cache.admitted) == 0
            states = sched.runner.states
            assert states is None or len(states) == 0
            return {
                "wide": [r.output_ids for r in wide],
                "small": [r.output_ids for r in small],
                "errors": [r.error for r in (*wide, *small) if r.error],
                "groups": groups,
                "retracted": [r.retracted for r in wide],
                "prefixes": prefixes,
            }

        got: dict[str, Any] = engine.call(drive).result(timeout=120)
        engine.call(lambda: check_integrity(engine.core.cache)).result(timeout=30)
        return got


@pytest.mark.parametrize("name", LENDING_MODELS)
def test_retracted_lent_copies_generate_the_same_tokens_as_a_strict_cap(name: str) -> None:
    lent, strict = lending_run(name, True), lending_run(name, False)
    assert lent["errors"] == strict["errors"] == []
    # lending: every slot was the wide group's; the two small ones took two back at once
    assert lent["groups"].count("wide") == 2 and len(lent["groups"]) == 4
    assert lent["retracted"] == [0, 0, 1, 1, 0, 0] and strict["retracted"] == [0] * 6
    assert lent["wide"] == strict["wide"] and lent["small"] == strict["small"]
    assert all(len(o) == 8 for o in lent["wide"])
    # retracted with 12 of 13 tokens computed: 3 whole pages kept (and the state after
    # them, for the sliding-window and recurrent layers), found again at re-admission
    assert lent["prefixes"] == {2: 12, 3: 12}


def test_each_retraction_falls_on_a_copy_retracted_fewest_times(cache: HiCache) -> None:
    sched, _ = make(cache, max_running_requests=4)
    wide = add_wide(sched)
    victims = []
    for k in range(3):  # a small request, its two tokens, its lent slot back to the wide one
        before = [r.retracted for r in wide]
        sched.add(req(70 + 2 * k))
        step(sched)
        victims += [i for i, r in enumerate(wide) if r.retracted > before[i]]
        step(sched)
        step(sched)
        assert [r.group for r in sched.running] == ["wide"] * 4
    # least progressed alone would pick wide[3] every time (its retraction set it back)
    assert victims == [3, 2, 1]
    run(sched, 300)
    for i, r in enumerate(wide):
        assert r.output_ids == list(range(12 + 2 * i, 32 + 2 * i))
    check_integrity(cache)
