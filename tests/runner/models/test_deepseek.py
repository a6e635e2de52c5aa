"""DeepSeek-V2/V3 (MLA) against transformers on tiny random checkpoints, fp32 CPU.

* Logits of a mixed paged batch equal transformers' within 1e-4 for every variant: two
  cold prefills over scattered pages, then an extend on a cached prefix next to a decode
  token, then a decode batch (the padded by-page gather).
* The pool holds exactly the latent per token and layer: ``[kv_a_layernorm(c_kv) | k_pe
  after RoPE]`` as transformers computes it.
* YaRN with ``mscale``/``mscale_all_dim``: frequencies, cos/sin factor and the softmax
  scale equal transformers'.
* A key mask that keeps every key changes nothing; one that drops keys changes the
  output (the hook DeepSeek-V3.2's sparse attention uses); a wrong shape is refused.
* Bad configs and tensor-parallel sizes are refused naming what is wrong.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hicache.memory import DevicePool
from hicache.runner.model_runner import (
    ForwardBatch,
    ModelRunner,
    cache_spec_of,
    kv_spec_from_hf_config,
)
from hicache.runner.models.attention import AttentionContext
from hicache.runner.models.config import UnsupportedModelError
from hicache.runner.models.deepseek import DeepseekConfig, DeepseekLM
from hicache.runner.models.deepseek_moe import MoEConfig, RouterKind
from hicache.runner.models.registry import build_hybrid_model, hybrid_config_from_hf
from hicache.runner.models.rope import (
    attention_scaling,
    inverse_frequencies,
    softmax_scale_factor,
)
from hicache.runner.parallel import TPGroup
from hicache.spec import AttentionKind
from tests.helpers.engine_fixtures import paged_batch, slots_for
from tests.helpers.numerics import order_bound
from tests.runner.models.deepseek_fixtures import (
    VARIANTS,
    deepseek_model,
    hf_logits,
    hf_twin,
    prompt,
)

PAGE = 4
TOL = dict(rtol=0.0, atol=order_bound(64, 3.6))
"""fp32 logits against transformers': an absolute bound at the logits' scale (|z| <= 3.6
on these prompts), from the longest fp32 reduction of the tiny DeepSeeks (the dense MLP's
64 terms): ``order_bound(64, 3.6)`` = 2.7e-5 (tests/helpers/numerics.py). Measured at most
3.2e-6 under default, AVX2 and AVX-512 (MKL and oneDNN pinned alike); the former
``rtol=atol=1e-4`` allowed up to 4.6e-4, looser than the argument."""
A_PAGES, B_PAGES = [5, 2, 7, 0, 9], [1, 3, 4, 6, 8, 10]


def new_runner(variant: str) -> ModelRunner:
    model = deepseek_model(variant).model
    return ModelRunner(model, DevicePool(cache_spec_of(model, "float32").kv, 16, PAGE))


def batch(ids: list[list[int]], starts: list[int], pages: list[list[int]]) -> ForwardBatch:
    return paged_batch(ids, starts, pages, PAGE)


@pytest.mark.parametrize("variant", VARIANTS)
def test_paged_logits_equal_transformers(variant: str) -> None:
    runner = new_runner(variant)
    a, b = prompt(variant, 15), prompt(variant, 19, offset=3)
    ref_a, ref_b = hf_logits(variant, a), hf_logits(variant, b)
    # two cold prefills: A's 13 first tokens, B's 12
    got = runner.forward(batch([a[:13], b[:12]], [0, 0], [A_PAGES, B_PAGES]), all_logits=True)
    torch.testing.assert_close(got[:13], ref_a[:13], **TOL)
    torch.testing.assert_close(got[13:], ref_b[:12], **TOL)
    # B extends 6 tokens on its cached 12, next to one decode token of A
    got = runner.forward(batch([b[12:18], a[13:14]], [12, 13], [B_PAGES, A_PAGES]), all_logits=True)
    torch.testing.assert_close(got[:6], ref_b[12:18], **TOL)
    torch.testing.assert_close(got[6:], ref_a[13:14], **TOL)
    # a decode batch: one token each, the padded gather over their pages
    got = runner.forward(batch([a[14:15], b[18:19]], [14, 18], [A_PAGES, B_PAGES]))
    torch.testing.assert_close(got[0], ref_a[14], **TOL)
    torch.testing.assert_close(got[1], ref_b[18], **TOL)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_pool_holds_the_latent(variant: str) -> None:
    """Layer 0's pool entries equal ``[kv_a_layernorm(c_kv) | rotated k_pe]`` computed by
    transformers' own modules (V2's complex rotation interleaves its output: compared
    de-interleaved, the layout the engine stores)."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    runner = new_runner(variant)
    cfg = deepseek_model(variant).model.config
    spec = cache_spec_of(runner.model, "float32").kv
    assert spec.attention is AttentionKind.MLA and spec.dim == cfg.kv_lora_rank + 8
    hf_config = hf_twin(variant).config  # the same latent whatever the TP size
    assert kv_spec_from_hf_config(hf_config, "float32") == spec
    assert kv_spec_from_hf_config(hf_config, "float32", tp_size=2) == spec
    ids = prompt(variant, 10)
    runner.forward(batch([ids], [0], [A_PAGES]))
    stored = runner.pool.latent_buffer(0)[slots_for(A_PAGES, PAGE, 10), 0]
    hf = hf_twin(variant)
    layer = hf.model.layers[0]
    with torch.no_grad():
        h = layer.input_layernorm(hf.model.embed_tokens(torch.tensor([ids])))
        c_kv, k_pe = layer.self_attn.kv_a_proj_with_mqa(h).split([cfg.kv_lora_rank, 8], -1)
        c_kv = layer.self_attn.kv_a_layernorm(c_kv)[0]
        k = k_pe[:, None]  # (1, 1, T, r)
        emb = hf.model.rotary_emb(h, torch.arange(10)[None])
        if cfg.family == "deepseek_v2":
            _, k = v2.apply_rotary_emb(k, k, emb)
            k = torch.cat((k[..., 0::2], k[..., 1::2]), dim=-1)
        elif cfg.rope_interleave:
            _, k = v3.apply_rotary_pos_emb_interleave(k, k, *emb)
        else:
            _, k = v3.apply_rotary_pos_emb(k, k, *emb)
    # layer 0 from the same embeddings through the same Linear and norm: c_kv is equal;
    # k_pe's RoPE is a 2-term sum x cos - y sin per value (V2's as a complex product),
    # which two dispatches may round or contract differently: 2 eps (|x| + |y|) <= 1e-6 at
    # |x|, |y| <= 2 (measured one ulp, 1.2e-7)
    torch.testing.assert_close(stored[:, : cfg.kv_lora_rank], c_kv, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stored[:, cfg.kv_lora_rank :], k[0, 0], rtol=1e-6, atol=1e-6)


def test_yarn_mscale_matches_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_twin("v3-yarn")
    cfg = deepseek_model("v3-yarn").model.config
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf.config, "cpu")
    # closed-form values from the same config on both sides (measured equal): fp32 at
    # assert_close's default (rtol 1.3e-6 = 11 eps), float64 scalars at 1e-12
    torch.testing.assert_close(inverse_frequencies(cfg.rope, 8), want_freq.float())
    assert attention_scaling(cfg.rope) == pytest.approx(want_factor, rel=1e-12)
    assert want_factor != pytest.approx(1.0)  # mscale 0.9 over mscale_all_dim 0.8
    assert softmax_scale_factor(cfg.rope) > 1
    assert cfg.softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    assert softmax_scale_factor(deepseek_model("v3").model.config.rope) == 1.0  # no yarn


def test_a_deepseek_v2_lite_rope_config_matches_transformers() -> None:
    """DeepSeek-V2-Lite's legacy ``rope_scaling`` (YaRN, factor 40, mscale = mscale_all_dim
    = 0.707, a 4k original context) and a dense-only stack (no MoE fields needed)."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2

    hf = DeepseekV2Config.from_dict(
        dict(
            hidden_size=32,
            num_attention_heads=4,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            num_hidden_layers=2,
            first_k_dense_replace=2,
            max_position_embeddings=163840,
            rope_theta=10000,
            rope_scaling={
                "type": "yarn",
                "factor": 40,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        )
    )
    cfg = hybrid_config_from_hf(hf)
    assert isinstance(cfg, DeepseekConfig) and cfg.moe is None
    rotary = v2.DeepseekV2RotaryEmbedding(hf)
    torch.testing.assert_close(inverse_frequencies(cfg.rope, 8), rotary.inv_freq.float())
    assert attention_scaling(cfg.rope) == pytest.approx(rotary.attention_scaling, rel=1e-12)
    assert cfg.softmax_scale == pytest.approx(v2.DeepseekV2Attention(hf, 0).scaling, rel=1e-12)
    assert cfg.softmax_scale != pytest.approx(16**-0.5)
    moe_layers = DeepseekV2Config.from_dict({**hf.to_dict(), "first_k_dense_replace": 1})
    with pytest.raises(
        UnsupportedModelError, match=r"has MoE layers .* but no num_experts_per_tok"
    ):
        hybrid_config_from_hf(moe_layers)


def test_key_masks_restrict_the_keys() -> None:
    variant = "v3"
    runner = new_runner(variant)
    model = runner.model
    assert isinstance(model, DeepseekLM)
    ids = torch.tensor(prompt(variant, 8))
    slots = slots_for(A_PAGES, PAGE, 8)
    attn = model.model.layers[0].self_attn
    x = model.model.embed_tokens(ids)
    rope = model.rotary(torch.arange(8), x.dtype)
    ctx = AttentionContext.build(runner.pool, [slots], [8])
    with torch.no_grad():
        dense = attn(x, rope, ctx)
        every = attn(x, rope, ctx, key_masks=[torch.ones(8, 8, dtype=torch.bool)])
        only_self = attn(x, rope, ctx, key_masks=[torch.eye(8, dtype=torch.bool)])
    torch.testing.assert_close(every, dense, rtol=0, atol=0)
    # token 0 sees itself either way: the same ops on the same values (measured equal)
    torch.testing.assert_close(only_self[0], dense[0])
    assert not torch.allclose(only_self[1:], dense[1:], atol=1e-3)
    with pytest.raises(ValueError, match=r"key mask shape \(8, 7\) != \(8, 8\)"):
        attn(x, rope, ctx, key_masks=[torch.ones(8, 7, dtype=torch.bool)])


def test_bad_configs_are_refused() -> None:
    base = hf_twin("v2-lite").config
    for change, message in [
        ({"norm_topk_prob": True}, "deepseek_v2 norm_topk_prob=True is not supported"),
        ({"topk_method": "noaux_tc"}, "deepseek_v2 topk_method='noaux_tc' is not supported"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2 != num_attention_heads=4"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ]:
        hf = base.__class__.from_dict({**base.to_dict(), **change})
        with pytest.raises(UnsupportedModelError, match=message):
            hybrid_config_from_hf(hf)
    cfg = deepseek_model("v3").model.config
    with pytest.raises(ValueError, match="n_group=3 / topk_group=2 do not fit 8 experts"):
        dataclasses.replace(cfg.moe, num_groups=3)
    with pytest.raises(ValueError, match="norm_topk_prob is only supported with noaux_tc"):
        MoEConfig(
            router=RouterKind.GREEDY,
            num_experts=4,
            top_k=2,
            intermediate_size=8,
            num_shared=0,
            norm_topk_prob=True,
        )


def test_tensor_parallel_sizes_are_checked() -> None:
    cfg = deepseek_model("v3").model.config
    assert isinstance(cfg, DeepseekConfig)
    with torch.device("meta"):
        with pytest.raises(ValueError, match="size 3 does not divide the 4 attention heads"):
            DeepseekLM(cfg, TPGroup(rank=0, size=3))
        moe = dataclasses.replace(cfg.moe, intermediate_size=12)
        wide = dataclasses.replace(cfg, num_heads=8, num_kv_heads=8, moe=moe)
        with pytest.raises(ValueError, match="size 8 does not divide the 12 moe_intermediate"):
            DeepseekLM(wide, TPGroup(rank=0, size=8))
    other = hybrid_config_from_hf(
        __import__("transformers").AutoConfig.for_model("gpt_oss", num_hidden_layers=2)
    )
    with pytest.raises(ValueError, match="size 3 cannot split num_attention_heads=64"):
        build_hybrid_model(other, dtype=torch.float32, device="cpu", tp=TPGroup(rank=0, size=3))


def test_bfloat16_keeps_the_routers_in_fp32() -> None:
    """As transformers does (``_keep_in_fp32_modules_strict``): a bf16 score-correction
    bias would round away the differences that pick the experts."""
    from hicache.runner.loader import load_model
    from tests.runner.models.deepseek_fixtures import checkpoint

    model = load_model(str(checkpoint("v3")), dtype="bfloat16").model
    gates = {n: p.dtype for n, p in model.named_parameters() if ".mlp.gate." in n}
    assert len(gates) == 4  # layers 1 and 2: weight and bias
    assert set(gates.values()) == {torch.float32}
    assert model.dtype == torch.bfloat16
    runner = ModelRunner(model, DevicePool(cache_spec_of(model, "bfloat16").kv, 16, PAGE))
    ids = prompt("v3", 15)
    got = runner.forward(batch([ids], [0], [A_PAGES]), all_logits=True)
    ref = hf_logits("v3", ids)
    # bf16 rounds every activation to 8 significant bits (u = 2**-8 = 3.9e-3): the logits
    # move by a few u times their scale |z| <= 3.5 (measured 0.071 = 5 u |z|, on every
    # dispatch); the bound is 11 u |z|
    bound = 0.15
    torch.testing.assert_close(got, ref, rtol=0, atol=bound)
    # greedy tokens: equal wherever the reference's top two are more than 2 * bound apart,
    # the positions any result within the bound decides the same; elsewhere a near tie
    # (position 6's top two are 4e-4 apart) may go either way on another bf16 kernel
    top2 = ref.topk(2, dim=-1).values
    decided = top2[:, 0] - top2[:, 1] > 2 * bound
    assert decided.any()
    assert torch.equal(got.argmax(-1)[decided], ref.argmax(-1)[decided])
