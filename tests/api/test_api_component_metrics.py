"""``/metrics`` exports each extra component's pools (sliding-window K/V pages of SWA
models, state-snapshot slots of recurrent ones) like the full KV pool's: used, free,
total and the used ones by holder, in L1 and L2. They add up while requests run, and come
back to idle values (nothing held by requests or in flight; all free after a flush).

Before, hybrid models exported no gauge for these pools, so a leak there could not be
seen.
"""

from __future__ import annotations

import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicache.cache.report import cache_stats
from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.step.scheduler import SchedulerConfig
from hicache.metrics import ComponentUsage
from tests.helpers.api_fixtures import scrape, serve, wait_idle
from tests.runner.models.hybrid_fixtures import hybrid_model

PAGE = 4
ADMIN = {"authorization": "Bearer sk-admin"}
MODELS = {"tiny-random-gemma3": "swa", "tiny-random-qwen3-next": "mamba"}


def make_engine(name: str) -> Engine:
    config = EngineConfig(
        model_path=name,
        dtype="float32",
        device="cpu",
        cache=CacheConfig(
            page_size=PAGE,
            device_tokens=256,
            hicache_ratio=4.0,
            load_back_threshold=0,
            max_mamba_cache_size=16,
        ),
        scheduler=SchedulerConfig(max_running_requests=8, chunked_prefill_size=16),
        context_length=128,
        stats_interval_s=0.01,  # many snapshots while the requests run
    )
    engine = Engine(config, loaded=hybrid_model(name)).start()
    return engine


Pools = dict[tuple[str, str], dict[str, float]]


def pools(text: str, component: str) -> Pools:
    """``(tier, what) -> value`` of one component: ``what`` is a holder, ``used`` or
    ``total``."""
    out: Pools = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if s.labels.get("component") != component:
                continue
            tier = s.labels.get("tier", "")
            if f.name == "hicache_component_units":
                out.setdefault((tier, "holders"), {})[s.labels["holder"]] = s.value
            elif f.name == "hicache_component_used_units":
                out.setdefault((tier, "used"), {})["n"] = s.value
            elif f.name == "hicache_component_total_units":
                out.setdefault((tier, "total"), {})["n"] = s.value
    return out


def check_adds_up(p: Pools) -> None:
    for tier in ("device", "host"):
        holders = p[(tier, "holders")]
        used, total = p[(tier, "used")]["n"], p[(tier, "total")]["n"]
        assert used + holders["free"] == total, (tier, p)
        assert sum(v for k, v in holders.items() if k != "free") == used, (tier, p)
        assert all(v >= 0 for v in holders.values()), p
    assert set(p[("device", "holders")]) == {"requests", "cache", "inflight", "free"}
    assert set(p[("host", "holders")]) == {"cache", "inflight", "free"}


def usage(engine: Engine, component: str) -> ComponentUsage:
    stats = engine.call(lambda: cache_stats(engine.core.cache)).result(30)
    return next(u for u in stats.components if u.name == component)


@pytest.mark.parametrize("name", list(MODELS))
def test_component_pools_add_up_and_return_to_idle(name: str) -> None:
    component = MODELS[name]
    engine = make_engine(name)
    with serve(engine, admin_api_key="sk-admin") as url:
        prompts = [[(7 * i + 31 * j) % 500 + 10 for j in range(33)] for i in range(6)]
        body = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
        errors: list[str] = []

        def run(p: list[int]) -> None:
            r = httpx.post(f"{url}/v1/completions", json={**body, "prompt": p}, timeout=120)
            if r.status_code != 200:
                errors.append(r.text)

        threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        busy: list[Pools] = []
        while any(t.is_alive() for t in threads):
            text = httpx.get(f"{url}/metrics", timeout=30).text
            p = pools(text, component)
            assert p, f"no {component} gauges exported"
            check_adds_up(p)
            if p[("device", "holders")]["requests"] or p[("device", "holders")]["inflight"]:
                busy.append(p)
        for t in threads:
            t.join(120)
        assert not errors, errors
        if component == "swa":  # running requests hold their windows' pages
            assert any(b[("device", "holders")]["requests"] > 0 for b in busy), busy

        wait_idle(engine)
        engine.call(lambda: engine.core.cache.sync(wait=True)).result(30)  # backups landed
        idle = pools(scrape(url, engine), component)
        check_adds_up(idle)
        u = usage(engine, component)
        assert idle[("device", "holders")] == {
            "requests": 0,
            "cache": u.device_cached,
            "inflight": 0,
            "free": u.device_total - u.device_used,
        }
        assert idle[("host", "holders")] == {
            "cache": u.host_cached,
            "inflight": 0,
            "free": u.host_total - u.host_used,
        }
        assert u.device_cached > 0 and u.device_used == u.device_cached  # the tree's only

        assert httpx.post(f"{url}/flush_cache", headers=ADMIN, timeout=60).status_code == 200
        flushed = pools(scrape(url, engine), component)
        for tier in ("device", "host"):
            total = flushed[(tier, "total")]["n"]
            assert flushed[(tier, "used")]["n"] == 0, flushed
            assert flushed[(tier, "holders")]["free"] == total > 0, flushed
    engine.close()
