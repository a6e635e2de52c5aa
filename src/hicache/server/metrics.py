"""Prometheus metrics of a serving engine: cache occupancy and traffic per tier, the pools
of each extra component, L3 waits, requests running and queued, TTFT and its queue time,
aborted requests, requests by agent-session kind and outcome (never by session id).

Cache and scheduler figures are the engine's last published
:class:`~hicache.engine.front.engine.EngineStats` (:attr:`Engine.published_stats`): a scrape
never calls into the engine thread nor waits on it, and ``hicache_stats_age_seconds`` says
how old the figures are; request latencies and aborts are observed by the server. Names
follow SGLang's with the ``hicache_`` prefix; every ``CacheCounters`` field ``x_total`` is
the counter ``hicache_x_total`` (:func:`counter_metric_name`). Invariant: under ``hicache_``
each value has one name (no labelled re-export, no gauge repeating another's source);
:func:`sglang_families` is the one deliberate exception, a second view of six gauges under
SGLang's names for routers and dashboards. Every metric: ``docs/api.md``, "Metrics".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from hicache.engine.front.engine import Engine, EngineStats
from hicache.engine.request import FinishReason, RequestOutput
from hicache.engine.session import SessionKind
from hicache.metrics import ComponentUsage
from hicache.rates import break_even
from hicache.storage.stats import OPS, StorageStats

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
    "session_demotions_total": "Idle sessions unpinned from L2 past their share of it",
    "session_yields_total": "Idle sessions unpinned from L2 for an allocation",
    "session_expired_total": "Sessions ended by their TTL",
    "restores_total": "Restores started (POST /hicache/prefetch)",
    "restore_failures_total": "Restores that ended without a hold (no L3, or a failed lookup)",
    "restore_tokens_total": "Tokens restores read L3 -> L2",
    "restore_l1_tokens_total": "Tokens of held restores copied L2 -> L1 ahead of their request",
}
"""Help text of the counters that have more to say than their name (CacheCounters)."""

SESSION_OUTCOMES = ("finished", "aborted", "failed")
"""How an engine request ended, for ``hicache_session_requests_total``: ``finished``
(stop or length), ``aborted`` (its client went away, or aborted without an error),
``failed`` (an error, or the engine stopped first)."""


def session_outcome(out: RequestOutput) -> str:
    """The :data:`SESSION_OUTCOMES` entry of a final output."""
    if out.error:
        return "failed"
    return "aborted" if out.finish_reason is FinishReason.ABORT else "finished"


_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _CacheCollector(Collector):
    def __init__(self, model_name: str) -> None:
        self.snapshot: EngineStats | None = None
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        if snap is not None:
            yield GaugeMetricFamily(
                "hicache_stats_age_seconds",
                "Seconds since the engine thread read the cache figures exported here",
                max(0.0, time.monotonic() - snap.at),
            )
            yield from cache_families(snap)
            yield from sglang_families(snap, self.model_name)


class _AgreementCollector(Collector):
    """The engine's tensor-parallel agreement counters, read at each scrape (two numbers
    the engine thread adds to; a scrape may see one step's figures half added)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        totals = self.engine.agreement
        yield CounterMetricFamily(
            "hicache_tp_agreement_seconds",
            "Seconds rank 0 spent in the step's agreement collectives (step-input broadcast,"
            " cache sync, sampled-token broadcast); 0 with one rank",
            float(totals.seconds),
        )
        yield CounterMetricFamily(
            "hicache_tp_steps",
            "Engine steps under tensor parallelism (the agreement's steps); 0 with one rank",
            int(totals.steps),
        )


class _KvEventsCollector(Collector):
    """The KV event hub's and its ZMQ publisher's counters, read at each scrape (nothing
    without KV events)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        hub = self.engine.kv_events
        if hub is None:
            return
        st = hub.stats()
        counters = (
            ("published_batches", "KV event batches published", st.published_batches),
            ("published_events", "KV events published", st.published_events),
            (
                "dropped_batches",
                "KV event batches a subscriber that fell behind did not get (per subscriber)",
                st.dropped_batches,
            ),
            (
                "dropped_events",
                "KV events a subscriber that fell behind did not get (per subscriber)",
                st.dropped_events,
            ),
            (
                "lagged_subscriptions",
                "KV event subscriptions that fell behind (ended, to resync)",
                st.lagged_subscriptions,
            ),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(f"hicache_kv_events_{name}", doc, value)
        yield GaugeMetricFamily(
            "hicache_kv_events_subscribers", "KV event subscriptions open", st.subscribers
        )
        yield GaugeMetricFamily(
            "hicache_kv_events_resident_pages",
            "Pages reported resident (L1 or L2) to KV event subscribers",
            st.resident_blocks,
        )
        zmq = self.engine.kv_zmq
        if zmq is not None:
            z = zmq.stats()
            yield CounterMetricFamily(
                "hicache_kv_events_zmq_sent", "KV event messages sent over ZMQ", z.sent
            )
            yield CounterMetricFamily(
                "hicache_kv_events_zmq_resyncs",
                "Times the ZMQ publisher fell behind the hub and resynced",
                z.resyncs,
            )


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
        "hicache_num_parked_reqs",
        "Requests a prefill/decode instance holds while the other instance of their room"
        " does its half (pages being sent, or awaited)",
        snap.parked,
    )
    yield GaugeMetricFamily(
        "hicache_num_open_rooms",
        "Bootstrap rooms of a prefill instance not closed yet (0 on other instances)",
        snap.open_rooms,
    )
    yield GaugeMetricFamily(
        "hicache_pd_fenced_pages",
        "L1 pages of failed requests a decode instance keeps out of use until the prefill"
        " instance has acknowledged that none of their bytes can land any more",
        snap.fenced_pages,
    )
    yield GaugeMetricFamily(
        "hicache_num_admitted_reqs",
        "Requests the cache has admitted (holding pages)",
        snap.admitted,
    )
    yield GaugeMetricFamily(
        "hicache_num_queued_seqs",
        "Sequences queued against --max-queued-requests (never yet admitted)",
        snap.queued,
    )
    yield CounterMetricFamily(
        "hicache_refused_requests",
        "HTTP requests refused by the bounded waiting queue (429, or 503 when unhealthy)",
        snap.refused,
    )
    yield CounterMetricFamily(
        "hicache_reclaimed_slots",
        "Running sequences retracted to give a lent slot back to a waiting request",
        snap.reclaimed,
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
    used = s.device_held_tokens
    yield GaugeMetricFamily(
        "hicache_num_used_tokens", "L1 token slots held (not free, not evictable cache)", used
    )
    yield GaugeMetricFamily(
        "hicache_token_usage",
        "Fraction of L1 token slots held (not free, not evictable cache)",
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
    yield GaugeMetricFamily(
        "hicache_l3_stored_tokens",
        "Tokens of tree nodes (L1 or L2) marked in L3: a write of them landed or a prefetch"
        " read them",
        s.l3_stored_tokens,
    )
    yield GaugeMetricFamily(
        "hicache_distinct_tokens",
        "Distinct tokens L1, L2 and L3 hold together, each page once: the tree's plus the"
        " L3 records this instance wrote that are not in the tree (exact for an L3 it alone"
        " writes and that evicts nothing)",
        s.distinct_tokens,
    )
    for key, value in s.counters.items():
        yield CounterMetricFamily(
            counter_metric_name(key), _COUNTER_HELP.get(key, f"Cache counter {key}"), value
        )
    yield from component_families(s.components)
    yield from rate_families(snap)
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
        yield CounterMetricFamily(
            "hicache_l3_previous_version_records",
            "L3 lookups that missed and found a record of the previous key spec version",
            st.previous,
        )
        yield from l3_wait_families(st)


def rate_families(snap: EngineStats) -> Iterator[Metric]:
    """What a token costs to restore per tier and to recompute, as measured by rank 0
    (:mod:`hicache.rates`): restore bytes/s per tier (``host``: L2 -> L1 loads,
    ``storage``: L3 -> L2 reads) and the observations behind them, prefill tokens/s and
    its observations, the bytes of one token, and per tier the break-even (restore
    tokens/s over prefill tokens/s). A tier or the prefill appears once measured."""
    restores, prefill = snap.cache.restores, snap.prefill
    if restores is not None:
        yield GaugeMetricFamily(
            "hicache_kv_token_bytes",
            "Bytes of one token's full KV on this rank, all layers",
            restores.token_bytes,
        )
        tiers = restores.tiers()
        if tiers:
            rate = GaugeMetricFamily(
                "hicache_restore_bytes_per_second",
                "Bytes per second per rank a restore moves, per tier (host: L2 -> L1 loads,"
                " storage: L3 -> L2 reads), over recent observations",
                labels=["tier"],
            )
            seen = CounterMetricFamily(
                "hicache_restore_observations",
                "Restore operations timed, per tier",
                labels=["tier"],
            )
            for tier, fit in tiers:
                rate.add_metric([tier], fit.per_second)
                seen.add_metric([tier], fit.observations)
            yield rate
            yield seen
    if prefill is None:
        return
    yield GaugeMetricFamily(
        "hicache_prefill_tokens_per_second",
        "Tokens per second of recent forwards that prefilled (not waiting on a load)",
        prefill.per_second,
    )
    yield CounterMetricFamily(
        "hicache_prefill_observations", "Forwards timed for the prefill rate", prefill.observations
    )
    if restores is not None and restores.tiers():
        family = GaugeMetricFamily(
            "hicache_restore_break_even",
            "Restore tokens/s over prefill tokens/s, per tier: above 1, loading a hit beats"
            " recomputing it",
            labels=["tier"],
        )
        for b in break_even(restores, prefill):
            family.add_metric([b.tier], b.ratio)
        yield family


def sglang_families(snap: EngineStats, model_name: str) -> Iterator[Metric]:
    """SGLang's names for the scheduler and L1 gauges of one snapshot (the same values as
    ``hicache_num_running_reqs``, ``hicache_num_queue_reqs``, ``hicache_num_used_tokens``,
    ``hicache_token_usage``, ``hicache_device_total_tokens`` and
    ``hicache_cache_hit_rate``), each labelled ``model_name``."""
    s = snap.cache
    used = s.device_held_tokens
    values = (
        ("num_running_reqs", "Requests in the running batch", snap.running),
        ("num_queue_reqs", "Requests waiting to be admitted", snap.waiting),
        ("num_used_tokens", "L1 token slots held (not free, not evictable cache)", used),
        ("max_total_num_tokens", "L1 capacity in tokens", s.device_total_tokens),
        (
            "token_usage",
            "Fraction of L1 token slots held (not free, not evictable cache)",
            used / s.device_total_tokens if s.device_total_tokens else 0.0,
        ),
        ("cache_hit_rate", "Prompt tokens served from a cache tier over all", s.hit_rate),
    )
    for name, help_text, value in values:
        family = GaugeMetricFamily(f"sglang:{name}", help_text, labels=["model_name"])
        family.add_metric([model_name], value)
        yield family


def l3_wait_families(st: StorageStats) -> Iterator[Metric]:
    """What callers waited on L3, per backend and operation (``exists``, ``get``,
    ``set``): stalls (batch calls of at least the stall threshold), timeouts (batch
    calls a deadline ended) and the latency histogram."""
    labels = ["backend", "op"]
    stalls = CounterMetricFamily(
        "hicache_l3_stalls",
        "L3 batch operations that took at least the stall threshold (stall_s)",
        labels=labels,
    )
    timeouts = CounterMetricFamily(
        "hicache_l3_timeouts",
        "L3 batch operations that overran their deadline (or were refused: server stuck)",
        labels=labels,
    )
    latency = HistogramMetricFamily(
        "hicache_l3_op_seconds", "Latency of L3 batch operations", labels=labels
    )
    for op in OPS:
        key = [st.backend, op]
        stalls.add_metric(key, st.stalls[op])
        timeouts.add_metric(key, st.op_timeouts[op])
        h = st.latency[op]
        latency.add_metric(key, h.cumulative(), sum_value=h.sum_s)
    yield stalls
    yield timeouts
    yield latency
    threshold = GaugeMetricFamily(
        "hicache_l3_stall_threshold_seconds",
        "An L3 batch operation at least this long counts as a stall",
        labels=["backend"],
    )
    threshold.add_metric([st.backend], st.stall_s)
    yield threshold


def component_families(usages: tuple[ComponentUsage, ...]) -> Iterator[Metric]:
    """The pools of each extra component (``swa``: sliding-window K/V pages; ``mamba``:
    state-snapshot slots), per tier (``device`` = L1, ``host`` = L2), with the same
    figures as the full KV pool's: used, free and total, and the used ones by holder
    (``requests``: admitted requests, L1 only; ``cache``: the tree; ``inflight``: copies
    and L3 operations in flight, 0 when idle). ``free`` plus every holder equals the
    total.
    The full KV pool (``full``) is exported by the ``hicache_device_*`` / ``host_*``
    gauges (in tokens), not again here."""
    units = GaugeMetricFamily(
        "hicache_component_units",
        "Component pool units (pages or slots) by tier and holder: requests, cache, inflight, free",
        labels=["component", "tier", "holder"],
    )
    used = GaugeMetricFamily(
        "hicache_component_used_units",
        "Component pool units in use",
        labels=["component", "tier"],
    )
    total = GaugeMetricFamily(
        "hicache_component_total_units",
        "Component pool capacity (pages or slots)",
        labels=["component", "tier"],
    )
    unit_bytes = GaugeMetricFamily(
        "hicache_component_unit_bytes",
        "Bytes of one unit (page or slot) of a component pool, per tier",
        labels=["component"],
    )
    extra = [u for u in usages if u.name != "full"]
    for u in extra:
        tiers = [("device", u.device_used, u.device_total, u.device_requests, u.device_cached)]
        if u.host_total:
            tiers.append(("host", u.host_used, u.host_total, 0, u.host_cached))
        for tier, n_used, n_total, requests, cached in tiers:
            if tier == "device":  # requests hold no L2 ids
                units.add_metric([u.name, tier, "requests"], requests)
            units.add_metric([u.name, tier, "cache"], cached)
            units.add_metric([u.name, tier, "inflight"], max(0, n_used - requests - cached))
            units.add_metric([u.name, tier, "free"], n_total - n_used)
            used.add_metric([u.name, tier], n_used)
            total.add_metric([u.name, tier], n_total)
        unit_bytes.add_metric([u.name], u.unit_bytes)
    if extra:
        yield units
        yield used
        yield total
        yield unit_bytes


class EngineMetrics:
    """A registry of its own (so several engines in one process do not clash);
    ``model_name``: the ``model_name`` label of the ``sglang:`` gauges (default: the
    model's name)."""

    def __init__(self, engine: Engine, model_name: str | None = None) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        self._cache = _CacheCollector(model_name or engine.model.name)
        self.registry.register(self._cache)
        self.registry.register(_AgreementCollector(engine))
        self.registry.register(_KvEventsCollector(engine))
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
        self.sessions = Counter(
            "hicache_session_requests",
            "Engine requests by agent-session kind (none, session, subagent) and outcome"
            " (finished, aborted, failed)",
            ["kind", "outcome"],
            registry=self.registry,
        )
        for kind in SessionKind:
            for outcome in SESSION_OUTCOMES:
                self.sessions.labels(kind=kind.value, outcome=outcome)
        self.healthy = Gauge(
            "hicache_engine_healthy",
            "1 while the engine loop runs and goes round, else 0",
            registry=self.registry,
        )

    def count_abort(self, reason: str, kind: SessionKind = SessionKind.NONE) -> None:
        """Account an engine request the server aborted (its final output is not
        observed): ``reason`` as :class:`~hicache.server.fanout.Ending` names it; a client
        gone is ``aborted``, anything else ``failed``."""
        self.aborted.labels(reason=reason).inc()
        outcome = "aborted" if reason == "client_disconnected" else "failed"
        self.sessions.labels(kind=kind.value, outcome=outcome).inc()

    def refresh(self) -> None:
        """Take the engine's health and its last published stats (cheap, lock-free, never
        waits on the engine thread: callable on the event loop). While the loop is stuck
        or has ended, the last stats published stay exported, ``hicache_stats_age_seconds``
        grows and ``hicache_engine_healthy`` says so."""
        self.healthy.set(1 if self.engine.health().healthy else 0)
        published = self.engine.published_stats
        if published is not None:
            self._cache.snapshot = published

    def observe(self, out: RequestOutput, kind: SessionKind = SessionKind.NONE) -> None:
        """Account the final output ``out`` of a request of session ``kind``."""
        reason = out.finish_reason.value if out.finish_reason else "unknown"
        self.requests.labels(finish_reason=reason).inc()
        self.sessions.labels(kind=kind.value, outcome=session_outcome(out)).inc()
        if out.finish_reason is FinishReason.ABORT:
            self.aborted.labels(reason="error" if out.error else "aborted").inc()
        if out.ttft_s is not None:
            self.ttft.observe(out.ttft_s)
        if out.queue_s is not None:
            self.queue_time.observe(out.queue_s)
        self.prompt_tokens.inc(out.prompt_tokens)
        self.generation_tokens.inc(out.completion_tokens)
