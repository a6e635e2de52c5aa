"""DeepSeek-V2/V3 (MLA) served through :class:`Engine` (tiny random models, CPU, fp32).

* The cache is built from the model's MLA spec: one latent of ``kv_lora_rank +
  qk_rope_head_dim`` per token and layer, no other component.
* Greedy generation equals transformers' greedy ``generate`` for every variant (V2
  with/without q LoRA, greedy and group-limited routers; V3 with the sigmoid router, and
  with YaRN + mscale).
* The same prompt again gives identical tokens from L1, from L2 after forced eviction
  and from a file L3 after ``flush_cache`` (the latent pages went through the host pool
  and the L3 records, in each host layout); a second engine on the same L3 hits the first
  one's records.
* Six concurrent requests on a small L1 (evictions, retractions, decode batches) each
  give transformers' tokens.
* Every pool is back to idle afterwards (no request held, integrity clean).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.config import CacheConfig, MemLayout
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.sampling import SamplingParams
from hicache.engine.step.scheduler import SchedulerConfig
from hicache.spec import AttentionKind
from tests.helpers.tier_walk import (
    assert_hits_storage,
    assert_idle,
    count_retractions,
    run_all,
    walk_tiers,
)
from tests.runner.models.deepseek_fixtures import VARIANTS, deepseek_model, hf_greedy, prompt

PAGE = 4
PROMPT_LEN = 33  # prompt[:-1] is matched: 8 whole pages
MATCHED = 32
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def make_engine(
    variant: str,
    *,
    storage: Path | None = None,
    layout: MemLayout = MemLayout.PAGE_FIRST,
    device_tokens: int = 256,
) -> Engine:
    config = EngineConfig(
        model_path=str(deepseek_model(variant).path),
        dtype="float32",
        device="cpu",
        cache=CacheConfig(
            page_size=PAGE,
            device_tokens=device_tokens,
            hicache_ratio=4.0,
            load_back_threshold=0,
            mem_layout=layout,
        ),
        scheduler=SchedulerConfig(max_running_requests=4, chunked_prefill_size=16),
        context_length=128,
        storage_backend="file" if storage is not None else None,
        storage_extra_config=(
            {"file_path": str(storage), "prefetch_threshold": 8} if storage is not None else {}
        ),
    )
    return Engine(config, loaded=deepseek_model(variant)).start()


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_through_engine_equals_transformers(variant: str) -> None:
    ids = prompt(variant, PROMPT_LEN)
    want = hf_greedy(variant, ids, NEW_TOKENS)
    cfg = deepseek_model(variant).model.config
    with make_engine(variant) as engine:
        spec = engine.core.cache.context.spec
        assert spec.attention is AttentionKind.MLA and spec.num_layers == cfg.num_layers
        assert (spec.heads, spec.dim) == (1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        assert engine.core.cache.stores.names == ["logprob"]  # the engine's scoring entries
        out = engine.generate(ids, GREEDY, timeout=60)
        assert out.error is None and out.output_ids == want
        assert_idle(engine)


@pytest.mark.parametrize(
    ("variant", "layout"),
    [
        ("v2-qlora-grouped", MemLayout.PAGE_FIRST),
        ("v3", MemLayout.LAYER_FIRST),
        ("v3", MemLayout.PAGE_FIRST_DIRECT),
    ],
)
def test_mla_hits_l1_l2_and_file_l3(variant: str, layout: MemLayout, tmp_path: Path) -> None:
    """The latent pages go L1 -> L2 -> L3 and back through every host layout."""
    ids = prompt(variant, PROMPT_LEN)
    want = hf_greedy(variant, ids, NEW_TOKENS)
    with make_engine(variant, storage=tmp_path, layout=layout) as engine:
        walk_tiers(engine, ids, GREEDY, want, MATCHED)
    with make_engine(variant, storage=tmp_path, layout=layout) as second:  # the first's records
        assert_hits_storage(second, ids, GREEDY, want, MATCHED)


def test_concurrent_requests_on_a_small_l1_stay_exact() -> None:
    """Six requests sharing a 12-token prefix on an L1 of 14 pages (each needs 6 for its
    prompt, 8 at the end): decode batches over the padded latent gather, evictions and
    retractions, and every output equals transformers'."""
    variant = "v3"
    shared = prompt(variant, 12)
    prompts = [shared + prompt(variant, 10, offset=20 + 7 * i) for i in range(6)]
    want = [hf_greedy(variant, p, NEW_TOKENS) for p in prompts]
    with make_engine(variant, device_tokens=14 * PAGE) as engine:
        retracted = count_retractions(engine)
        assert run_all(engine, prompts, GREEDY) == want
        assert retracted, "the small L1 should have forced a retraction"
        assert_idle(engine)
