"""A frozen Redis behind a serving engine shows on ``/metrics``.

The probe that found it: with Redis frozen (SIGSTOP) every request waited the prefetch
policy's deadline (2.1-2.2 s), yet ``hicache_l3_misses_total{reason="timeout"}`` and
``hicache_l3_errors_total`` stayed 0: the wait was the lookup's ``EXISTS`` hanging, which
is no get (no miss) and whose timeout was never exported. Now each such request counts in
``hicache_prefetch_timeouts_total``, and the hung lookups in
``hicache_l3_stalls_total{backend="redis",op="exists"}`` and
``hicache_l3_timeouts_total{...}``.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.api_fixtures import make_engine, scrape, serve

PROMPT = list(range(300, 345))


def value(text: str, name: str, **labels: str) -> float:
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if s.name == name and s.labels == labels:
                return s.value
    raise AssertionError(f"no sample {name} {labels}")


def test_a_frozen_redis_shows_on_metrics(redis_private: Any) -> None:
    engine = make_engine(
        storage_backend="redis",
        storage_extra_config={
            "url": redis_private.url,
            "timeout_s": 1.0,
            "stall_s": 0.2,
            "prefetch_threshold": 8,
            "prefetch_timeout_base": 0.4,
            "prefetch_timeout_per_ki_token": 0.0,
        },
    )
    try:
        with serve(engine) as url:
            body = {"prompt": PROMPT, "max_tokens": 2}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
            before = scrape(url, engine)
            assert value(before, "hicache_prefetch_timeouts_total") == 0
            assert value(before, "hicache_l3_timeouts_total", backend="redis", op="exists") == 0
            os.kill(redis_private.pid, signal.SIGSTOP)
            for i in range(2):
                prompt = [(i + 1) * 1000 + j for j in range(40)]
                t = time.monotonic()
                r = httpx.post(
                    f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60
                )
                assert r.status_code == 200
                assert 0.35 <= time.monotonic() - t < 5.0  # the policy's 0.4 s wait
            end = time.monotonic() + 15  # the hung EXISTS return at their 1 s deadline
            while True:
                text = scrape(url, engine)
                stalls = value(text, "hicache_l3_stalls_total", backend="redis", op="exists")
                timeouts = value(text, "hicache_l3_timeouts_total", backend="redis", op="exists")
                waited = value(text, "hicache_prefetch_timeouts_total")  # published a round late
                if (stalls >= 1 and timeouts >= 1 and waited >= 2) or time.monotonic() > end:
                    break
                time.sleep(0.1)
            assert value(text, "hicache_prefetch_timeouts_total") == 2
            assert stalls >= 1 and timeouts >= 1, (stalls, timeouts)
            count = value(text, "hicache_l3_op_seconds_count", backend="redis", op="exists")
            slow = count - value(
                text, "hicache_l3_op_seconds_bucket", backend="redis", op="exists", le="0.5"
            )
            assert slow >= 1  # the latency histogram shows the hung lookups too
            assert value(text, "hicache_l3_stall_threshold_seconds", backend="redis") == 0.2
            os.kill(redis_private.pid, signal.SIGCONT)
    finally:
        os.kill(redis_private.pid, signal.SIGCONT)
        engine.close()
