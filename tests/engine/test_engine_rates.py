"""The measured rates of a serving engine (:mod:`hicache.rates`): after a prefill and an
L2 hit, ``/metrics`` carries the L2 -> L1 restore rate, the prefill rate and their
break-even, each the engine's own measurement; which forwards the prefill rate times."""

from __future__ import annotations

import time

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from hicache.cache.report import cache_stats
from hicache.engine.request import Request
from hicache.engine.step.batch import Chunk
from hicache.engine.step.prefill_timer import PrefillTimer, prefill_tokens
from tests.engine.test_engine_serving import GREEDY, PROMPT, make_engine
from tests.helpers.api_fixtures import scrape, serve
from tests.helpers.tier_walk import demote_all


def test_an_l2_hit_and_a_prefill_are_measured_and_exported() -> None:
    with make_engine() as engine, serve(engine) as url:
        assert engine.generate(PROMPT, GREEDY, timeout=60).cached.total == 0
        assert demote_all(engine) > 0
        from_l2 = engine.generate(PROMPT, GREEDY, timeout=60)
        assert from_l2.cached.host == 44
        engine.call(lambda: engine.core.cache.sync(wait=True)).result(timeout=60)
        stats = engine.call(lambda: cache_stats(engine.core.cache)).result(timeout=60)
        text = scrape(url, engine)
        prefill = engine.stats().prefill
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def value(name: str, **labels: str) -> float:
        (got,) = [s.value for s in families[name].samples if s.labels == labels]
        return got

    restores = stats.restores
    assert restores is not None and restores.storage is None  # no L3
    host = restores.host
    c = stats.counters
    # one load back, measured once: its bytes are the bytes loaded, its seconds its copy's
    assert host is not None and host.observations == c["load_ops_total"] == 1
    assert host.mean_amount == c["load_bytes_total"] == 44 * restores.token_bytes
    assert 0 < host.seconds(host.mean_amount) < 10
    assert value("hicache_restore_bytes_per_second", tier="host") == host.per_second
    assert value("hicache_restore_observations", tier="host") == 1
    assert value("hicache_kv_token_bytes") == restores.token_bytes
    # the cold prompt's two prefill chunks at least (45 tokens, 32-token chunks)
    assert prefill is not None and prefill.observations >= 2 and prefill.per_second > 0
    assert value("hicache_prefill_tokens_per_second") > 0
    restore_tokens = host.per_second / restores.token_bytes
    assert value("hicache_restore_break_even", tier="host") == (
        restore_tokens / value("hicache_prefill_tokens_per_second")
    )
    assert "hicache_restore_break_even" in text and 'tier="storage"' not in text


def test_only_forwards_that_prefill_are_timed_and_a_failed_one_is_not() -> None:
    prefill = Request([1, 2, 3], GREEDY)
    decoding = Request([1, 2], GREEDY, output_ids=[7])
    decoding.kv_len = 2
    assert prefill_tokens([Chunk(decoding, 1)]) is None  # decode only
    assert prefill_tokens([Chunk(decoding, 1), Chunk(prefill, 3)]) == 4  # all its tokens
    assert prefill_tokens([Chunk(prefill, 1)]) == 1  # a first token is a prefill
    timer = PrefillTimer(torch.device("cpu"))
    with timer.forward(None):
        pass
    with pytest.raises(RuntimeError), timer.forward(5):
        raise RuntimeError("the forward failed")
    assert timer.rate() is None and timer.meter.observations == 0
    with timer.forward(4):
        time.sleep(0.002)
    fit = timer.rate()
    assert fit is not None and fit.observations == 1 and fit.mean_amount == 4
    assert 0 < fit.per_second < 4 / 0.002
