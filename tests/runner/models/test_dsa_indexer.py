"""The DSA indexer against transformers' ``DeepseekV32Indexer`` on tiny random weights.

Same weights (loaded by the checkpoint's parameter names), same inputs: the keys equal the
ones transformers caches (fp32, 1e-6), and the tokens each query attends to (the top-k
selection, causally masked) are the same sets, for a whole prompt at once and for a prompt
run in chunks whose earlier keys come back through a paged indexer pool (scattered pages),
as the engine runs it. Also: fewer earlier tokens than ``topk`` means all of them.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from hicache.memory import DevicePool
from hicache.runner.models.config import RopeConfig
from hicache.runner.models.dsa_indexer import (
    DsaIndexer,
    IndexerShape,
    read_keys,
    sparse_mask,
)
from hicache.runner.models.rope import RotaryEmbedding
from hicache.spec import IndexerSpec
from tests.helpers.numerics import order_bound

transformers = pytest.importorskip("transformers")
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.deepseek_v32.configuration_deepseek_v32 import (  # noqa: E402
    DeepseekV32Config,
)
from transformers.models.deepseek_v32.modeling_deepseek_v32 import (  # noqa: E402
    DeepseekV32Indexer,
    DeepseekV32RotaryEmbedding,
)

HIDDEN, Q_LORA, HEADS, DIM, ROPE, TOPK = 32, 24, 16, 16, 8, 5
# 16 heads: a score is exactly 0 (every head's relu 0) almost never, so no two tokens tie
# at the top-k boundary, where transformers' torch.topk would break the tie arbitrarily.
# The selections are compared exactly: on these inputs the k-th and (k+1)-th scores of a
# row are at least 0.015 apart (1.4e4 eps max|score|), while two orders of the 16-term
# dot products move a score by order_bound(16, 16 * |q||k|) ~ 1e-4 at most.
T = 13  # prompt length: more tokens than TOPK, so later queries really select
PAGE = 2


def hf_config() -> DeepseekV32Config:
    return DeepseekV32Config(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        kv_lora_rank=16, q_lora_rank=Q_LORA, qk_rope_head_dim=ROPE, qk_nope_head_dim=8,
        v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        index_topk=TOPK, index_head_dim=DIM, index_n_heads=HEADS,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pair() -> tuple[DeepseekV32Indexer, DsaIndexer, DeepseekV32Config]:
    torch.manual_seed(0)
    cfg = hf_config()
    ref = DeepseekV32Indexer(cfg, layer_idx=0).float().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.5)
    ours = DsaIndexer(
        IndexerShape(
            hidden_size=HIDDEN, q_lora_rank=Q_LORA, n_heads=HEADS, head_dim=DIM,
            rope_dim=ROPE, topk=TOPK,
        )
    )  # fmt: skip
    ours.load_state_dict(ref.state_dict())  # the checkpoint's parameter names
    return ref, ours.eval(), cfg


def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, HIDDEN, generator=g), torch.randn(T, Q_LORA, generator=g)


def hf_rope(cfg: DeepseekV32Config, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    rope = DeepseekV32RotaryEmbedding(cfg)
    x = torch.zeros(1, n, HIDDEN)
    cos, sin = rope(x, torch.arange(n)[None])
    return cos[0], sin[0]


def hf_select(
    ref: DeepseekV32Indexer, cfg: DeepseekV32Config, hidden: torch.Tensor, q_resid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' attention mask of the selection ``(T, T)`` and its cached keys."""
    cos, sin = hf_rope(cfg, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None]
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        top = ref(hidden[None], q_resid[None], (cos[None], sin[None]), causal, None, cache=cache)[0]
    chosen = torch.zeros(T, T, dtype=torch.bool).scatter(-1, top.long(), True)
    keys = cache.layers[0].indexer_keys[0]
    return chosen & causal[0], keys


def test_ropes_agree(pair: tuple[DeepseekV32Indexer, DsaIndexer, DeepseekV32Config]) -> None:
    _, _, cfg = pair
    cos, sin = RotaryEmbedding(RopeConfig(theta=cfg.rope_parameters["rope_theta"]), ROPE)(
        torch.arange(T), torch.float32
    )
    ref_cos, ref_sin = hf_rope(cfg, T)
    # cos and sin of the same fp32 angles (|x| <= 1): a few ulps, measured equal
    assert torch.allclose(cos, ref_cos, atol=1e-6) and torch.allclose(sin, ref_sin, atol=1e-6)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_whole_prompt_selects_what_transformers_selects(
    pair: tuple[DeepseekV32Indexer, DsaIndexer, DeepseekV32Config], seed: int
) -> None:
    ref, ours, cfg = pair
    hidden, q_resid = inputs(seed)
    want, ref_keys = hf_select(ref, cfg, hidden, q_resid)
    cos, sin = hf_rope(cfg, T)
    with torch.no_grad():
        keys = ours.keys(hidden, cos, sin)
        # the same Linear, LayerNorm and RoPE on the same inputs (measured equal); allclose
        # also allows rtol 1e-5 |k|, 84 eps, over the RoPE's 2-term sums (2 eps (|x|+|y|))
        assert torch.allclose(keys, ref_keys, atol=1e-6)
        scores = ours.scores(ours.queries(q_resid, cos, sin), ours.head_weights(hidden), keys)
        got = ours.select(scores, torch.arange(T))
    assert torch.equal(got, want)
    assert got.sum(-1).tolist() == [min(i + 1, TOPK) for i in range(T)]  # all, then top-k


@pytest.mark.parametrize("chunks", [(T,), (6, 7), (4, 1, 8), (1,) * T])
def test_chunks_through_the_paged_pool_select_the_same(
    pair: tuple[DeepseekV32Indexer, DsaIndexer, DeepseekV32Config], chunks: tuple[int, ...]
) -> None:
    ref, ours, cfg = pair
    hidden, q_resid = inputs(7)
    want, ref_keys = hf_select(ref, cfg, hidden, q_resid)
    spec = IndexerSpec(num_layers=2, index_head_dim=DIM)
    pool = DevicePool(spec.kv, num_pages=16, page_size=PAGE)
    pages = torch.tensor([9, 2, 14, 5, 0, 11, 7])  # the sequence's pages, scattered
    slots = (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:T]
    cos, sin = hf_rope(cfg, T)
    start = 0
    with torch.no_grad():
        for n in chunks:
            end = start + n
            got = sparse_mask(
                ours, pool, 1,
                hidden=hidden[start:end], q_resid=q_resid[start:end],
                cos=cos[start:end], sin=sin[start:end],
                new_slots=slots[start:end], context_slots=slots[:end],
                positions=torch.arange(start, end),
            )  # fmt: skip
            assert torch.equal(got, want[start:end, :end]), f"chunk [{start}, {end})"
            start = end
    # chunk by chunk the key GEMM runs on fewer rows, which MKL may sum in another order:
    # one 32-term reduction per value, then a LayerNorm, so the error is absolute at the
    # keys' scale K: order_bound(32, K) = 8e-6 at K = 2.1 (measured 4.8e-7 with SSE4.2
    # GEMMs, 3e-7 with AVX2 / AVX-512; 1e-6 + 1e-5 |k| held a key near 0 to 1e-6)
    bound = order_bound(32, ref_keys.abs().max().item())
    torch.testing.assert_close(read_keys(pool, 1, slots), ref_keys, rtol=0, atol=bound)
    assert not pool.latent_buffer(0).any()  # another layer's keys are untouched


def test_ties_go_to_the_earlier_token_whatever_the_rows_length(
    pair: tuple[DeepseekV32Indexer, DsaIndexer, DeepseekV32Config],
) -> None:
    _, ours, _ = pair
    scores = torch.tensor([[0.0, 3.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]] * 2)
    pos = torch.tensor([8, 10])
    got = ours.select(scores, pos)  # TOPK = 5: 3.0, 1.0, then the first three zeros
    assert got[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert got[1].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    short = ours.select(scores[:1, :9], pos[:1])  # the same query over a shorter context
    assert torch.equal(short[0], got[0, :9])


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="rope_dim"):
        IndexerShape(hidden_size=8, q_lora_rank=4, n_heads=2, head_dim=4, rope_dim=6, topk=1)
    with pytest.raises(ValueError, match="topk"):
        IndexerShape(hidden_size=8, q_lora_rank=4, n_heads=2, head_dim=4, rope_dim=2, topk=0)
