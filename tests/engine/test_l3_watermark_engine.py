"""The ``watermark`` write policy through the engine: prompts that overflow L2 are written
to L3 ahead of eviction, a prompt L2 let go comes back from L3 with the output of a run
with no cache tier, and less is written to L3 than under ``write_through``."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.cache.report import cache_stats, check_integrity
from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.sampling import SamplingParams
from hicache.engine.step.scheduler import SchedulerConfig
from hicache.metrics import CacheStats
from tests.helpers.engine_fixtures import engine_model

MODEL = "tiny-random-llama"
PAGE = 4
GREEDY = SamplingParams(temperature=0, max_tokens=4)
PROMPTS = [[(13 * i + 7 * k + 5) % 4000 + 100 for i in range(81)] for k in range(8)]
"""8 prompts of 20 whole pages (and one token): 160 pages, L2 holds 128."""


def make_engine(root: Path | None, policy: str) -> Engine:
    config = EngineConfig(
        model_path=MODEL,
        dtype="float32",
        device="cpu",
        cache=CacheConfig(
            page_size=PAGE,
            device_tokens=128,
            hicache_ratio=4.0,
            load_back_threshold=0,
            write_policy=policy,
            write_back_threshold=0.5,
        ),
        scheduler=SchedulerConfig(max_running_requests=2, chunked_prefill_size=64),
        context_length=128,
        storage_backend=None if root is None else "file",
        storage_prefetch_policy="wait_complete",
        storage_extra_config={}
        if root is None
        else {"file_path": str(root), "prefetch_threshold": 8},
    )
    return Engine(config, loaded=engine_model(MODEL)).start()


def stats(engine: Engine) -> CacheStats:
    def get() -> CacheStats:
        cache = engine.core.cache
        cache.sync(wait=True)
        cache.l3.tier.flush(30.0)  # and what that sync wrote ahead
        check_integrity(cache)
        return cache_stats(cache)

    return engine.call(get).result(timeout=60)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with make_engine(None, "write_through") as engine:
        return [engine.generate(p, GREEDY, timeout=60).output_ids for p in PROMPTS]


def test_watermark_serves_what_l2_let_go_from_l3(
    tmp_path: Path, reference: list[list[int]]
) -> None:
    written = {}
    for policy in ("write_through", "watermark"):
        with make_engine(tmp_path / policy, policy) as engine:
            for p, ref in zip(PROMPTS, reference, strict=True):
                assert engine.generate(p, GREEDY, timeout=60).output_ids == ref
            s = stats(engine)
            assert s.counters["l3_unstored_evicted_tokens_total"] == 0
            again = engine.generate(PROMPTS[0], GREEDY, timeout=60)  # L2 let it go
            assert again.output_ids == reference[0]
            if policy == "watermark":
                assert again.cached.storage > 0
                assert s.counters["l3_ahead_writes_total"] > 0
            written[policy] = stats(engine).storage.bytes_written
    assert 0 < written["watermark"] < written["write_through"]
