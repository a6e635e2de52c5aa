"""``GET /metrics`` exports every cache counter: each :class:`CacheCounters` field
``x_total`` as the counter ``hicache_x_total``, with the value the cache holds."""

from __future__ import annotations

from dataclasses import fields

import httpx
from prometheus_client.parser import text_string_to_metric_families

from hicache.metrics import CacheCounters
from hicache.server.metrics import counter_metric_name
from tests.helpers.api_fixtures import make_engine, post, serve, wait_idle

PROMPT = list(range(300, 345))


def test_every_cache_counter_is_exported() -> None:
    engine = make_engine()
    with serve(engine) as url:
        assert post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200
        wait_idle(engine)
        stats = engine.call(engine.cache.stats).result(30)
        text = httpx.get(f"{url}/metrics", timeout=30).text
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
