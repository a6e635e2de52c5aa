"""Qwen3-Next (``model_type: qwen3_next``): Gated DeltaNet linear-attention layers and
gated full-attention layers (sigmoid output gate, partial RoPE, q/k norms), with a routed
MoE (softmax top-k) plus a sigmoid-gated shared expert, or a dense MLP on ``mlp_only_layers``.
All norms are ``rms(x) * (1 + w)`` except DeltaNet's gated output norm.

Tensor parallelism (:meth:`Qwen3NextLM.build` on a ``tp`` group): attention split by heads
(the output gate with its head), DeltaNet by value heads with their key heads and conv
channels (:mod:`.gated_deltanet`: key heads fewer than the ranks replicated), the dense
MLP's, every expert's and the shared expert's intermediate columns split (router and
shared-expert gate replicated; one all-reduce per MoE), embedding and LM head
vocab-parallel. Sizes that must divide: :meth:`Qwen3NextConfig.check_tensor_parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hicache.runner.models.attention import AttentionContext
from hicache.runner.models.config import HybridRopeConfig, UnsupportedModelError, check_split
from hicache.runner.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetSpec
from hicache.runner.models.hybrid import HybridBody, HybridConfig, HybridLM
from hicache.runner.models.layers import GatedMLP
from hicache.runner.models.moe import GatedExperts, Router, RoutingConfig, RoutingMode
from hicache.runner.models.norms import OffsetRMSNorm
from hicache.runner.models.recurrent import RecurrentContext, StateSpec
from hicache.runner.models.rope import RotaryEmbedding
from hicache.runner.models.sliding import AttentionSpec, WindowedAttention
from hicache.runner.parallel import TPGroup, VocabParallelEmbedding

__all__ = ["Qwen3NextConfig", "Qwen3NextLM"]


@dataclass(frozen=True, kw_only=True)
class Qwen3NextConfig(HybridConfig):
    """Qwen3-Next sizes (see the module doc); ``moe_layers`` lists the MoE layer ids."""

    intermediate_size: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    moe_layers: tuple[int, ...]
    rope: HybridRopeConfig
    rotary_dim: int
    linear: GatedDeltaNetSpec
    attention_bias: bool = False

    def check_tensor_parallel(self, size: int) -> None:
        """ValueError naming the numbers unless ``size`` ranks split the attention heads
        (:meth:`HybridConfig.check_attention_split`), the DeltaNet value and key heads (the
        size divides ``linear_num_value_heads``, and divides ``linear_num_key_heads`` or is
        a multiple of it: :meth:`GatedDeltaNetSpec.head_split`) and the MLP, expert and
        shared-expert intermediate sizes."""
        self.check_attention_split(size)
        self.linear.head_split(TPGroup(size=size))
        check_split(
            size,
            [
                ("intermediate_size", self.intermediate_size),
                ("moe_intermediate_size", self.moe_intermediate_size),
                ("shared_expert_intermediate_size", self.shared_expert_intermediate_size),
            ],
            self.family,
        )

    @classmethod
    def from_hf(cls, hf: Any) -> Qwen3NextConfig:
        """Build from a transformers ``Qwen3NextConfig``."""
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"qwen3_next hidden_act={hf.hidden_act!r} is not supported")
        n = int(hf.num_hidden_layers)
        num_experts = int(getattr(hf, "num_experts", 0) or 0)
        step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(hf, "mlp_only_layers", None) or ())
        moe = tuple(
            i for i in range(n) if num_experts > 0 and (i + 1) % step == 0 and i not in dense
        )
        head_dim = int(hf.head_dim)
        params = dict(getattr(hf, "rope_parameters", None) or {})
        partial = float(
            params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
        )
        return cls(
            family="qwen3_next",
            vocab_size=int(hf.vocab_size),
            hidden_size=int(hf.hidden_size),
            layer_kinds=tuple(hf.layer_types),
            num_heads=int(hf.num_attention_heads),
            num_kv_heads=int(hf.num_key_value_heads),
            head_dim=head_dim,
            rms_norm_eps=float(hf.rms_norm_eps),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            intermediate_size=int(hf.intermediate_size),
            moe_intermediate_size=int(hf.moe_intermediate_size),
            shared_expert_intermediate_size=int(hf.shared_expert_intermediate_size),
            num_experts=max(num_experts, 1),
            top_k=int(hf.num_experts_per_tok) if num_experts else 1,
            norm_topk_prob=bool(hf.norm_topk_prob),
            moe_layers=moe,
            rope=HybridRopeConfig.from_hf(hf),
            rotary_dim=int(head_dim * partial),
            linear=GatedDeltaNetSpec(
                hidden_size=int(hf.hidden_size),
                num_k_heads=int(hf.linear_num_key_heads),
                num_v_heads=int(hf.linear_num_value_heads),
                k_dim=int(hf.linear_key_head_dim),
                v_dim=int(hf.linear_value_head_dim),
                conv_kernel=int(hf.linear_conv_kernel_dim),
                eps=float(hf.rms_norm_eps),
            ),
            attention_bias=bool(getattr(hf, "attention_bias", False)),
        )


class Qwen3NextMoE(nn.Module):
    """``mlp.gate`` router, ``mlp.experts``, ``mlp.shared_expert`` and its sigmoid gate;
    over ``tp`` the experts' and the shared expert's columns split, their partial sums
    all-reduced once (the gate is a per-token scalar: it scales each rank's share)."""

    def __init__(self, cfg: Qwen3NextConfig, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        routing = RoutingConfig(
            mode=RoutingMode.SOFTMAX_TOPK,
            num_experts=cfg.num_experts,
            top_k=cfg.top_k,
            renormalize=cfg.norm_topk_prob,
        )
        self.gate = Router(cfg.hidden_size, routing)
        self.experts = GatedExperts(
            cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, tp=tp
        )
        self.shared_expert = GatedMLP(
            cfg.hidden_size, cfg.shared_expert_intermediate_size, False, tp=tp
        )
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (T, hidden)`` -> ``(T, hidden)``."""
        if self.tp.size == 1:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            return self.experts(x, self.gate(x)) + shared
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.partial(x)
        return self.tp.all_reduce(self.experts(x, self.gate(x)) + shared)


class Qwen3NextLayer(nn.Module):
    """Pre-norm block: DeltaNet or gated attention, then MoE or dense MLP."""

    def __init__(self, cfg: Qwen3NextConfig, layer_id: int, tp: TPGroup) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(h, eps)
        self.post_attention_layernorm = OffsetRMSNorm(h, eps)
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: WindowedAttention | None = None
        if cfg.layer_kinds[layer_id] == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg.linear, layer_id, tp)
        else:
            self.self_attn = WindowedAttention(
                AttentionSpec(
                    hidden_size=h,
                    num_heads=cfg.num_heads,
                    num_kv_heads=cfg.num_kv_heads,
                    head_dim=cfg.head_dim,
                    kv_layer=cfg.kv_index(layer_id),
                    rms_norm_eps=eps,
                    rotary_dim=cfg.rotary_dim,
                    qk_norm="offset",
                    output_gate=True,
                    qkv_bias=cfg.attention_bias,
                    o_bias=cfg.attention_bias,
                ),
                tp,
            )
        self.mlp: nn.Module = (
            Qwen3NextMoE(cfg, tp)
            if layer_id in cfg.moe_layers
            else GatedMLP(h, cfg.intermediate_size, False, tp=tp)
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: AttentionContext,
        rctx: RecurrentContext,
    ) -> torch.Tensor:
        """``x (T, hidden)`` -> ``(T, hidden)``."""
        normed = self.input_layernorm(x)
        if self.linear_attn is not None:
            x = x + self.linear_attn(normed, rctx)
        else:
            assert self.self_attn is not None
            x = x + self.self_attn(normed, rope, ctx)
        out: torch.Tensor = self.mlp(self.post_attention_layernorm(x))
        return x + out


class Qwen3NextLM(HybridLM):
    """Qwen3-Next causal LM: K/V of the attention layers in the pool, DeltaNet state carried;
    on ``tp``, this rank's shard (see the module doc) and its heads' state."""

    config: Qwen3NextConfig

    def __init__(self, cfg: Qwen3NextConfig, tp: TPGroup | None = None) -> None:
        super().__init__(cfg, tp)
        self.model = HybridBody(
            cfg,
            (Qwen3NextLayer(cfg, i, self.tp) for i in range(cfg.num_layers)),
            OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=self.tp),
        )
        self._build_head()
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_dim)

    def recurrent_state(self) -> StateSpec:
        """This rank's DeltaNet state: its key heads' conv channels, its value heads."""
        return self.config.linear.split(self.tp).state
