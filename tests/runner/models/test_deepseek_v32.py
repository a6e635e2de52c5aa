"""DeepSeek-V3.2 (MLA + DSA indexer + top-k sparse attention) against transformers, fp32 CPU.

* The checkpoint loads by its names, the indexer's included (equal to transformers').
* Logits of a mixed paged batch equal transformers' within 1e-4: two cold prefills over
  scattered pages, an extend on a cached prefix next to a decode token, a decode batch;
  with prompts longer than ``index_topk``, so the selection matters (checked: the
  same batch with every key allowed gives other logits).
* The indexer pool holds the keys transformers caches (to fp32 rounding), on the full
  KV's slots.
* The cache spec has the indexer component; a runner without the indexer pool is refused.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hicache.memory import DevicePool
from hicache.runner.model_runner import ForwardBatch, ModelRunner, cache_spec_of
from hicache.runner.models.deepseek_v32 import DeepseekV32Config, DeepseekV32LM, DsaAttention
from hicache.spec import IndexerSpec
from tests.helpers.engine_fixtures import paged_batch, slots_for
from tests.helpers.numerics import order_bound
from tests.runner.models.deepseek_v32_fixtures import TOPK, hf_logits, hf_twin, prompt, v32_model

PAGE = 4
TOL = dict(rtol=0.0, atol=order_bound(64, 3.6))
"""fp32 logits against transformers': as test_deepseek's, an absolute bound at the logits'
scale (|z| <= 3.6) from the longest fp32 reduction (the dense MLP's 64 terms):
``order_bound(64, 3.6)`` = 2.7e-5; measured at most 3.2e-6 under default, AVX2 and AVX-512.
The former ``rtol=atol=1e-4`` allowed up to 4.6e-4, looser than the argument."""
A_PAGES, B_PAGES = [5, 2, 7, 0, 9, 12, 14], [1, 3, 4, 6, 8, 10, 11, 13]


def new_runner() -> ModelRunner:
    model = v32_model().model
    spec = cache_spec_of(model, "float32")
    indexer = spec.component("indexer")
    assert isinstance(indexer, IndexerSpec)
    pools = {"indexer": DevicePool(indexer.kv, 16, PAGE)}
    return ModelRunner(model, DevicePool(spec.kv, 16, PAGE), pools)


def batch(ids: list[list[int]], starts: list[int], pages: list[list[int]]) -> ForwardBatch:
    return paged_batch(ids, starts, pages, PAGE)


def test_the_checkpoint_loads_with_its_indexer() -> None:
    model = v32_model().model
    assert isinstance(model, DeepseekV32LM) and isinstance(model.config, DeepseekV32Config)
    assert model.config.index_topk == TOPK
    ours = dict(model.named_parameters())
    for name, p in hf_twin().named_parameters():
        if ".indexer." in name:
            torch.testing.assert_close(ours[name], p, rtol=0, atol=0)


def test_paged_logits_equal_transformers() -> None:
    runner = new_runner()
    a, b = prompt(20), prompt(27, offset=3)
    ref_a, ref_b = hf_logits(a), hf_logits(b)
    got = runner.forward(batch([a[:17], b[:12]], [0, 0], [A_PAGES, B_PAGES]), all_logits=True)
    torch.testing.assert_close(got[:17], ref_a[:17], **TOL)
    torch.testing.assert_close(got[17:], ref_b[:12], **TOL)
    # B extends 13 tokens on its cached 12, next to one decode token of A
    got = runner.forward(batch([b[12:25], a[17:18]], [12, 17], [B_PAGES, A_PAGES]), all_logits=True)
    torch.testing.assert_close(got[:13], ref_b[12:25], **TOL)
    torch.testing.assert_close(got[13:], ref_a[17:18], **TOL)
    # a decode batch: one token each
    got = runner.forward(batch([a[18:19], b[25:26]], [18, 25], [A_PAGES, B_PAGES]))
    torch.testing.assert_close(got[0], ref_a[18], **TOL)
    torch.testing.assert_close(got[1], ref_b[25], **TOL)


def test_the_selection_matters() -> None:
    """Allowing every key (the dense V3 attention) changes the logits of late tokens."""
    runner = new_runner()
    a = prompt(20)
    sparse = runner.forward(batch([a], [0], [A_PAGES]), all_logits=True)
    model = runner.model
    assert isinstance(model, DeepseekV32LM)
    layers = [layer.self_attn for layer in model.model.layers]
    assert all(isinstance(x, DsaAttention) for x in layers)
    topk = [x.indexer.shape for x in layers]
    try:
        for x in layers:
            x.indexer.shape = dataclasses.replace(x.indexer.shape, topk=10**6)
        dense = runner.forward(batch([a], [0], [A_PAGES]), all_logits=True)
    finally:
        for x, shape in zip(layers, topk, strict=True):
            x.indexer.shape = shape
    # <= topk keys: all, through the same ops bar the mask (measured 9.5e-7)
    torch.testing.assert_close(dense[:TOPK], sparse[:TOPK], **TOL)
    assert not torch.allclose(dense[TOPK + 2 :], sparse[TOPK + 2 :], atol=1e-3)


def test_the_indexer_pool_holds_transformers_keys() -> None:
    from transformers.cache_utils import DynamicCache

    runner = new_runner()
    ids = prompt(10)
    runner.forward(batch([ids], [0], [A_PAGES]))
    pool = runner.pools["indexer"]
    hf = hf_twin()
    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(torch.tensor([ids]), cache=cache, use_cache=True)
    for layer in range(3):
        stored = pool.latent_buffer(layer)[slots_for(A_PAGES, PAGE, 10), 0]
        want = cache.layers[layer].indexer_keys[0]
        # The keys are LayerNorm outputs (|k| <= K ~ 3.4): the error of an element is
        # absolute at the vector's scale K, not relative to the element (one near 0 can
        # differ by 2e-4 of itself). Layer 0's keys come through the same ops and are
        # equal; from layer 1 on, the hidden state carries the order difference of the
        # paged MLA and the MLPs against transformers', whose longest fp32 reduction is
        # the dense MLP's 64 terms: within order_bound(64, K) = 64 eps K (2.6e-5; measured
        # 1.4e-6 = 4 eps K under default, AVX2 and AVX-512). A key from the wrong slot or
        # without RoPE is O(1) off.
        bound = order_bound(64, want.abs().max().item())
        torch.testing.assert_close(stored, want, rtol=0, atol=bound)


def test_the_cache_spec_and_the_pools_are_checked() -> None:
    model = v32_model().model
    spec = cache_spec_of(model, "float32")
    assert spec.component("indexer") == IndexerSpec(num_layers=3, index_head_dim=16)
    with pytest.raises(ValueError, match="needs the indexer pool"):
        ModelRunner(model, DevicePool(spec.kv, 16, PAGE))
    wrong = IndexerSpec(num_layers=3, index_head_dim=8).kv
    with pytest.raises(ValueError, match="does not fit the model's"):
        ModelRunner(model, DevicePool(spec.kv, 16, PAGE), {"indexer": DevicePool(wrong, 16, PAGE)})
