"""Prometheus metrics of a serving engine: cache occupancy and traffic per tier, requests
running and queued, TTFT and its queue time, aborted requests.

Cache and scheduler figures are read on the engine thread (:meth:`EngineMetrics.refresh`)
and exported by a collector at scrape time; request latencies and aborts are observed by
the server. Names follow SGLang's where SGLang has one (``sglang:num_running_reqs`` ->
``hicache_num_running_reqs``), with the ``hicache_`` prefix.

Every :class:`~hicache.metrics.CacheCounters` field ``x_total`` is exported as the counter
``hicache_x_total`` (:func:`counter_metric_name`), generically, so a new field needs no
change here. Each value has one name: no counter is exported again as a labelled view or
under a second name, and no gauge repeats another's source (what a dashboard sums must
not count twice).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hicache.engine.engine import Engine, EngineStats
from hicache.engine.request import FinishReason, RequestOutput

log = logging.getLogger(__name__)


def counter_metric_name(field: str) -> str:
    """The Prometheus family of the :class:`~hicache.metrics.CacheCounters` field
    ``field`` (``prefetch_component_records_total`` -> ``hicache_prefetch_component_records``;
    the exposition adds ``_total``)."""
    return "hicache_" + field.removesuffix("_total")


_COUNTER_HELP = {
    "query_tokens_total": "Prompt tokens looked up",
    "device_hit_tokens_total": "Prompt tokens served from L1",
    "host_hit_tokens_total": "Prompt tokens served from L2 (loaded back to L1)",
    "storage_hit_tokens_total": "Prompt tokens served from L3 (prefetched, loaded back)",
    "load_tokens_total": "Tokens loaded L2 -> L1",
    "load_bytes_total": "Bytes loaded L2 -> L1",
    "backup_tokens_total": "Tokens backed up L1 -> L2",
    "backup_bytes_total": "Bytes backed up L1 -> L2",
    "prefetch_tokens_total": "Tokens prefetched L3 -> L2",
    "l3_backup_tokens_total": "Tokens written L2 -> L3",
    "device_evicted_tokens_total": "Tokens evicted from L1 and dropped (not in L2)",
    "device_demoted_tokens_total": "Tokens evicted from L1 that stay in L2",
    "host_evicted_tokens_total": "Tokens evicted from L2",
}
"""Help text of the counters that have more to say than their name (CacheCounters)."""

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _CacheCollector(Collector):
    def __init__(self) -> None:
        self.snapshot: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        if self.snapshot is not None:
            yield from cache_families(self.snapshot)


def cache_families(snap: EngineStats) -> Iterator[Metric]:
    """The metric families of one engine snapshot: the queues, L1 and L2 occupancy, every
    cache counter, and the L3 backend's figures. Each value under one name."""
    s = snap.cache
    yield GaugeMetricFamily(
        "hicache_num_running_reqs", "Requests in the running batch", snap.running
    )
    yield GaugeMetricFamily(
        "hicache_num_queue_reqs", "Requests waiting to be admitted", snap.waiting
    )
    yield GaugeMetricFamily(
        "hicache_num_admitted_reqs",
        "Requests the cache has admitted (holding pages)",
        snap.admitted,
    )
    holders = GaugeMetricFamily(
        "hicache_device_tokens",
        "L1 token slots by holder: requests (not yet in the tree), cache (the tree), free",
        labels=["holder"],
    )
    holders.add_metric(["requests"], s.device_request_tokens)
    holders.add_metric(["cache"], s.device_cached_tokens)
    holders.add_metric(["free"], s.device_free_tokens)
    yield holders
    used = s.device_total_tokens - s.device_free_tokens
    yield GaugeMetricFamily("hicache_num_used_tokens", "L1 token slots in use", used)
    yield GaugeMetricFamily(
        "hicache_token_usage",
        "Fraction of L1 token slots in use",
        used / s.device_total_tokens if s.device_total_tokens else 0.0,
    )
    yield GaugeMetricFamily("hicache_device_total_tokens", "L1 capacity", s.device_total_tokens)
    yield GaugeMetricFamily(
        "hicache_cache_hit_rate", "Prompt tokens served from a cache tier over all", s.hit_rate
    )
    yield GaugeMetricFamily(
        "hicache_host_cached_tokens", "L2 tokens held by the tree", s.host_cached_tokens
    )
    yield GaugeMetricFamily(
        "hicache_host_used_tokens",
        "L2 tokens in use (the tree's and those L3 transfers hold)",
        s.host_total_tokens - s.host_free_tokens,
    )
    yield GaugeMetricFamily("hicache_host_total_tokens", "L2 capacity", s.host_total_tokens)
    for key, value in s.counters.items():
        yield CounterMetricFamily(
            counter_metric_name(key), _COUNTER_HELP.get(key, f"Cache counter {key}"), value
        )
    st = s.storage
    if st is not None:
        yield CounterMetricFamily(
            "hicache_l3_read_bytes", "Record bytes read from L3", st.bytes_read
        )
        yield CounterMetricFamily(
            "hicache_l3_written_bytes", "Record bytes written to L3", st.bytes_written
        )
        misses = CounterMetricFamily(
            "hicache_l3_misses", "L3 pages not used, by reason", labels=["reason"]
        )
        for reason, n in sorted(st.misses.items()):
            misses.add_metric([reason], n)
        yield misses
        yield CounterMetricFamily("hicache_l3_errors", "L3 backend errors", st.errors)
        yield CounterMetricFamily(
            "hicache_l3_records_repaired",
            "L3 records read corrupt or stale and overwritten by a later write",
            st.repaired,
        )


class EngineMetrics:
    """A registry of its own (so several engines in one process do not clash)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        self._cache = _CacheCollector()
        self.registry.register(self._cache)
        self.requests = Counter(
            "hicache_requests", "Finished requests", ["finish_reason"], registry=self.registry
        )
        self.ttft = Histogram(
            "hicache_ttft_seconds",
            "Time to first token",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.queue_time = Histogram(
            "hicache_queue_time_seconds",
            "Arrival to first admission (the part of TTFT a cache hit does not shorten)",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "hicache_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry
        )
        self.generation_tokens = Counter(
            "hicache_generation_tokens", "Generated tokens", registry=self.registry
        )
        self.aborted = Counter(
            "hicache_aborted_requests",
            "Requests aborted before finishing, by reason (client_disconnected, error,"
            " engine_stopped)",
            ["reason"],
            registry=self.registry,
        )
        for reason in ("client_disconnected", "error", "engine_stopped"):
            self.aborted.labels(reason=reason)
        self.healthy = Gauge(
            "hicache_engine_healthy",
            "1 while the engine loop runs and goes round, else 0",
            registry=self.registry,
        )

    def refresh(self, timeout_s: float = 30.0) -> None:
        """Read the cache's stats on the engine thread (blocking; call off the event loop).

        When the engine does not answer within ``timeout_s`` seconds (or is not running),
        the last stats read stay exported and ``hicache_engine_healthy`` says so.
        """
        self.healthy.set(1 if self.engine.health().healthy else 0)
        try:
            self._cache.snapshot = self.engine.stats(timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            log.warning("cache stats not refreshed: %s", exc or type(exc).__name__)

    def observe(self, out: RequestOutput) -> None:
        reason = out.finish_reason.value if out.finish_reason else "unknown"
        self.requests.labels(finish_reason=reason).inc()
        if out.finish_reason is FinishReason.ABORT:
            self.aborted.labels(reason="error" if out.error else "aborted").inc()
        if out.ttft_s is not None:
            self.ttft.observe(out.ttft_s)
        if out.queue_s is not None:
            self.queue_time.observe(out.queue_s)
        self.prompt_tokens.inc(out.prompt_tokens)
        self.generation_tokens.inc(out.completion_tokens)
