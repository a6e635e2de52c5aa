"""DeepSeek-V3.2 (MLA + DSA indexer) served through :class:`Engine` (tiny random model,
CPU, fp32).

* The cache is built from the model's spec: the MLA latent as the full KV and the
  ``"indexer"`` component (one key of ``index_head_dim`` per token and layer, on the full
  KV's page ids).
* Greedy generation equals transformers' greedy ``generate`` (a prompt of 33 tokens and
  ``index_topk = 6``: every layer attends sparsely).
* The same prompt again gives identical tokens from L1, from L2 after forced eviction and
  from a file L3 after ``flush_cache`` (the latent and the indexer keys went through the
  host pool and their L3 records, ``"indexer"`` ones counted); a second engine on the
  same L3 hits the first one's records.
* Every pool is back to idle afterwards.
"""

from __future__ import annotations

from pathlib import Path

from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.sampling import SamplingParams
from hicache.engine.step.scheduler import SchedulerConfig
from hicache.spec import AttentionKind, IndexerSpec
from tests.helpers.tier_walk import assert_hits_storage, assert_idle, walk_tiers
from tests.runner.models.deepseek_v32_fixtures import hf_greedy, prompt, v32_model

PAGE = 4
PROMPT_LEN = 33  # prompt[:-1] is matched: 8 whole pages
MATCHED = 32
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def make_engine(*, storage: Path | None = None) -> Engine:
    config = EngineConfig(
        model_path=str(v32_model().path),
        dtype="float32",
        device="cpu",
        cache=CacheConfig(
            page_size=PAGE, device_tokens=256, hicache_ratio=4.0, load_back_threshold=0
        ),
        scheduler=SchedulerConfig(max_running_requests=4, chunked_prefill_size=16),
        context_length=128,
        storage_backend="file" if storage is not None else None,
        storage_extra_config=(
            {"file_path": str(storage), "prefetch_threshold": 8} if storage is not None else {}
        ),
    )
    return Engine(config, loaded=v32_model()).start()


def test_greedy_through_engine_equals_transformers() -> None:
    ids = prompt(PROMPT_LEN)
    want = hf_greedy(ids, NEW_TOKENS)
    cfg = v32_model().model.config
    with make_engine() as engine:
        assert engine.core.cache.context.spec.attention is AttentionKind.MLA
        indexer = engine.core.cache.stores.get("indexer")
        assert indexer is not None and indexer.spec == IndexerSpec(
            num_layers=cfg.num_layers, index_head_dim=16, dtype="float32"
        )
        assert engine.core.cache.stores.names == ["indexer", "logprob"]  # + scoring entries
        out = engine.generate(ids, GREEDY, timeout=60)
        assert out.error is None and out.output_ids == want
        assert_idle(engine)


def test_hits_from_l1_l2_and_file_l3(tmp_path: Path) -> None:
    ids = prompt(PROMPT_LEN)
    want = hf_greedy(ids, NEW_TOKENS)
    with make_engine(storage=tmp_path) as engine:

        def indexer_keys_backed_up() -> None:
            written = engine.core.cache.full.pages.counters.l3_backup_indexer_pages_total
            assert written >= MATCHED // PAGE
            assert engine.core.cache.full.pages.counters.l3_backup_indexer_pages_failed_total == 0

        walk_tiers(engine, ids, GREEDY, want, MATCHED, after_l3_backup=indexer_keys_backed_up)
        assert (
            engine.core.cache.full.pages.counters.prefetch_component_records_total
            == MATCHED // PAGE
        )
    with make_engine(storage=tmp_path) as second:  # the first engine's records
        assert_hits_storage(second, ids, GREEDY, want, MATCHED)
