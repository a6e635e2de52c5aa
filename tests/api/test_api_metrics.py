"""``GET /metrics``: every cache counter is exported, with the value the cache holds, and
every value under one name only (a counter exported twice, under a generic and an
SGLang-style name or as a labelled view, would be summed twice by a dashboard)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import fields

import httpx
from prometheus_client.parser import text_string_to_metric_families

from hicache.cache.report import cache_stats
from hicache.engine.front.engine import EngineStats
from hicache.metrics import CacheCounters, CacheStats, ComponentUsage
from hicache.rates import RateFit, RestoreRates
from hicache.server.metrics import cache_families, counter_metric_name
from hicache.storage.stats import LATENCY_BUCKETS_S, OPS, OpLatency, StorageStats
from tests.helpers.api_fixtures import make_engine, post, scrape, serve, wait_idle

PROMPT = list(range(300, 345))


def test_every_cache_counter_is_exported() -> None:
    engine = make_engine()
    with serve(engine) as url:
        assert post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200
        wait_idle(engine)
        stats = engine.call(lambda: cache_stats(engine.core.cache)).result(30)
        text = scrape(url, engine)
    engine.close()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    names = [f.name for f in fields(CacheCounters)]
    assert set(stats.counters) == set(names)
    for field in names:
        family = families.get(counter_metric_name(field))
        assert family is not None, field
        assert family.type == "counter", field
        samples = [s for s in family.samples if s.name == "hicache_" + field]
        assert len(samples) == 1, field
        assert samples[0].value == stats.counters[field], field
    assert stats.counters["query_tokens_total"] > 0  # the request was counted
    # each family once (a generic name never repeats a curated one)
    exposed = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(exposed) == len(set(exposed))


def _values(text: str) -> Counter[float]:
    """How many exported samples carry each value (``_created`` timestamps left out)."""
    return Counter(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if not s.name.endswith("_created")
    )


def test_each_cache_counter_is_exported_under_one_name() -> None:
    """Each counter of the live cache set to a value of its own: the scrape carries each
    value exactly once, under ``hicache_<field>``."""
    engine = make_engine()
    names = [f.name for f in fields(CacheCounters)]
    injected = {name: 10**9 + 1009 * i for i, name in enumerate(names)}

    def inject() -> None:
        for name, value in injected.items():
            setattr(engine.core.cache.full.pages.counters, name, value)

    with serve(engine) as url:
        assert post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200
        wait_idle(engine)
        engine.call(inject).result(30)
        text = scrape(url, engine)
    engine.close()
    carried = _values(text)
    twice = {name: carried[v] for name, v in injected.items() if carried[v] != 1}
    assert not twice, f"counters exported under more (or fewer) than one name: {twice}"
    by_value = {
        s.value: s.name
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if not s.name.endswith("_created")
    }
    for name, value in injected.items():
        assert by_value[value] == "hicache_" + name, name


def test_no_two_series_carry_the_same_value_source() -> None:
    """Every source the exporter reads (each stat, each counter, each L3 figure, the
    queues) set to its own power of 3 (so no difference, sum or ratio of two equals a
    third): no two exported series carry the same value. A histogram's buckets and count
    are sums of its own counts by definition (its +Inf bucket is its count): only its
    sum is compared."""
    powers = iter(3**k for k in range(1, 400))
    counters = {f.name: next(powers) for f in fields(CacheCounters)}
    nbuckets = len(LATENCY_BUCKETS_S) + 1
    storage = StorageStats(
        bytes_read=next(powers),
        bytes_written=next(powers),
        errors=next(powers),
        repaired=next(powers),
        previous=next(powers),
        misses={"absent": next(powers), "corrupt": next(powers)},
        backend="redis",
        stall_s=float(next(powers)),
        stalls={op: next(powers) for op in OPS},
        op_timeouts={op: next(powers) for op in OPS},
        latency={
            op: OpLatency(tuple(next(powers) for _ in range(nbuckets)), float(next(powers)))
            for op in OPS
        },
    )

    def usage(name: str) -> ComponentUsage:
        requests, cached, inflight, free = (next(powers) for _ in range(4))
        host_cached, host_inflight, host_free = (next(powers) for _ in range(3))
        return ComponentUsage(
            name=name,
            device_used=requests + cached + inflight,
            device_total=requests + cached + inflight + free,
            host_used=host_cached + host_inflight,
            host_total=host_cached + host_inflight + host_free,
            unit_bytes=next(powers),
            bytes_per_cached_token=0.5,
            device_requests=requests,
            device_cached=cached,
            host_cached=host_cached,
        )

    components = (usage("swa"), usage("mamba"))

    def fit() -> RateFit:
        return RateFit(
            observations=next(powers),
            per_second=float(next(powers)),
            mean_amount=float(next(powers)),
            overhead_s=0.0,
            seconds_per_unit=1.0,
        )

    # L1's total is what is free, evictable and held (its own power): used tokens (total
    # less free less evictable) is then that power, and usage a fraction of it
    free, evictable, held = next(powers), next(powers), next(powers)
    stats = CacheStats(
        page_size=4,
        device_total_tokens=free + evictable + held,
        device_cached_tokens=next(powers),
        device_free_tokens=free,
        device_request_tokens=next(powers),
        device_evictable_tokens=evictable,
        host_total_tokens=next(powers),
        host_cached_tokens=next(powers),
        host_free_tokens=next(powers),
        host_only_tokens=next(powers),
        nodes=next(powers),
        counters=counters,
        storage=storage,
        components=components,
        tree_tokens=next(powers),
        l3_stored_tokens=next(powers),
        restores=RestoreRates(token_bytes=next(powers), host=fit(), storage=fit()),
    )
    snapshot = EngineStats(
        cache=stats,
        running=next(powers),
        waiting=next(powers),
        admitted=next(powers),
        queued=next(powers),
        refused=next(powers),
        reclaimed=next(powers),
        parked=next(powers),
        open_rooms=next(powers),
        fenced_pages=next(powers),
        prefill=fit(),
    )
    seen: dict[float, list[str]] = {}
    for f in cache_families(snapshot):
        for s in f.samples:
            if f.type == "histogram" and not s.name.endswith("_sum"):
                continue
            seen.setdefault(s.value, []).append(f"{s.name}{s.labels or ''}")
    dupes = {v: names for v, names in seen.items() if len(names) > 1}
    assert not dupes, f"one value under several names: {list(dupes.values())}"
    for name, value in counters.items():
        assert value in seen, f"{name} is not exported"
    assert stats.device_cached_tokens in seen and stats.host_cached_tokens in seen
    assert held in seen and held / stats.device_total_tokens in seen  # used, usage
    assert snapshot.queued in seen and snapshot.refused in seen
    assert snapshot.reclaimed in seen
    assert snapshot.parked in seen and snapshot.open_rooms in seen
    assert storage.repaired in seen
    for op in OPS:
        assert storage.stalls[op] in seen and storage.op_timeouts[op] in seen
        assert storage.latency[op].sum_s in seen
    for u in components:
        assert u.device_requests in seen and u.device_cached in seen and u.host_cached in seen
    rates, prefill = stats.restores, snapshot.prefill
    assert rates is not None and prefill is not None
    assert rates.token_bytes in seen
    assert prefill.per_second in seen and prefill.observations in seen
    for tier, f in rates.tiers():
        assert f.per_second in seen and f.observations in seen
        assert f.per_second / rates.token_bytes / prefill.per_second in seen, tier


def test_a_scrape_never_waits_on_the_engine_thread() -> None:
    """The engine thread is held in a call: a scrape answers at once, from the stats the
    loop published before, and says how old they are (before, each scrape ran a call on
    the engine thread and waited for it, up to 30 s)."""
    engine = make_engine()
    release = threading.Event()
    with serve(engine) as url:
        assert post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200
        wait_idle(engine)
        scrape(url, engine)
        held = engine.call(lambda: release.wait(20))
        try:
            time.sleep(0.6)  # the loop is stuck in the call: nothing new is published
            t = time.monotonic()
            r = httpx.get(f"{url}/metrics", timeout=5)
            took = time.monotonic() - t
        finally:
            release.set()
        held.result(30)
    engine.close()
    assert r.status_code == 200 and took < 2.0, took
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    age = families["hicache_stats_age_seconds"].samples[0].value
    assert age >= 0.5, age
    assert families["hicache_query_tokens"].samples[0].value > 0  # the request's lookup
    assert families["hicache_num_running_reqs"].samples[0].value == 0
