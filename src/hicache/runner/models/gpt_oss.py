"""GPT-OSS (``model_type: gpt_oss``): alternating sliding-window (with sinks) and global
attention, every layer a routed MoE (top-k of the biased router logits, softmax over the
chosen; clamped SwiGLU experts with biases), YaRN RoPE, biased attention projections.

Tensor parallelism (:meth:`GptOssConfig.check_tensor_parallel`): attention heads and their
sinks split (:class:`~hicache.runner.models.sliding.WindowedAttention`), every expert's
intermediate columns split (:class:`~hicache.runner.models.moe.ClampedSwigluExperts`; the
router replicated, the ranks' partial mixtures all-reduced once per layer), the embedding
and LM head vocab-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hicache.runner.models.attention import AttentionContext
from hicache.runner.models.config import HybridRopeConfig, UnsupportedModelError
from hicache.runner.models.hybrid import HybridBody, HybridConfig, HybridLM
from hicache.runner.models.layers import RMSNorm
from hicache.runner.models.moe import ClampedSwigluExperts, Router, RoutingConfig, RoutingMode
from hicache.runner.models.recurrent import RecurrentContext
from hicache.runner.models.rope import RotaryEmbedding
from hicache.runner.models.sliding import AttentionSpec, WindowedAttention
from hicache.runner.parallel import TPGroup

__all__ = ["GptOssConfig", "GptOssLM"]


@dataclass(frozen=True, kw_only=True)
class GptOssConfig(HybridConfig):
    """GPT-OSS sizes (see the module doc)."""

    intermediate_size: int
    num_experts: int
    top_k: int
    sliding_window: int
    rope: HybridRopeConfig
    swiglu_alpha: float
    swiglu_limit: float
    attention_bias: bool = True

    @property
    def window(self) -> int | None:
        return self.sliding_window

    def check_tensor_parallel(self, size: int) -> None:
        """The heads split (:meth:`HybridConfig.check_attention_split`) and ``size`` divides
        the experts' ``intermediate_size``; ValueError naming the numbers otherwise."""
        self.check_attention_split(size, [("intermediate_size", self.intermediate_size)])

    @classmethod
    def from_hf(cls, hf: Any) -> GptOssConfig:
        """Build from a transformers ``GptOssConfig`` (unquantized weights only)."""
        if getattr(hf, "quantization_config", None):
            raise UnsupportedModelError("gpt_oss quantized (MXFP4) checkpoints are not supported")
        return cls(
            family="gpt_oss",
            vocab_size=int(hf.vocab_size),
            hidden_size=int(hf.hidden_size),
            layer_kinds=tuple(hf.layer_types),
            num_heads=int(hf.num_attention_heads),
            num_kv_heads=int(hf.num_key_value_heads),
            head_dim=int(hf.head_dim),
            rms_norm_eps=float(hf.rms_norm_eps),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            intermediate_size=int(hf.intermediate_size),
            num_experts=int(hf.num_local_experts),
            top_k=int(hf.num_experts_per_tok),
            sliding_window=int(hf.sliding_window),
            rope=HybridRopeConfig.from_hf(hf),
            swiglu_alpha=float(hf.swiglu_alpha),
            swiglu_limit=float(hf.swiglu_limit),
            attention_bias=bool(getattr(hf, "attention_bias", True)),
        )


class GptOssMoE(nn.Module):
    """``mlp.router`` (whole on every rank) + ``mlp.experts`` (this rank's columns; their
    partial mixtures summed over the ranks)."""

    def __init__(self, cfg: GptOssConfig, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        routing = RoutingConfig(
            mode=RoutingMode.TOPK_SOFTMAX, num_experts=cfg.num_experts, top_k=cfg.top_k, bias=True
        )
        self.router = Router(cfg.hidden_size, routing)
        self.experts = ClampedSwigluExperts(
            cfg.num_experts,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.swiglu_alpha,
            cfg.swiglu_limit,
            tp=tp,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (T, hidden)`` -> ``(T, hidden)``."""
        return self.tp.all_reduce(self.experts(x, self.router(x)))


class GptOssLayer(nn.Module):
    """Pre-norm block: attention (sliding with sinks, or global with sinks) then MoE."""

    def __init__(self, cfg: GptOssConfig, layer_id: int, tp: TPGroup) -> None:
        super().__init__()
        sliding = cfg.layer_kinds[layer_id] == "sliding_attention"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = WindowedAttention(
            AttentionSpec(
                hidden_size=cfg.hidden_size,
                num_heads=cfg.num_heads,
                num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim,
                kv_layer=cfg.kv_index(layer_id),
                split_layer=cfg.split_index(layer_id),
                rms_norm_eps=cfg.rms_norm_eps,
                rotary_dim=cfg.head_dim,
                window=cfg.sliding_window if sliding else None,
                sinks=True,
                qkv_bias=cfg.attention_bias,
                o_bias=cfg.attention_bias,
            ),
            tp,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GptOssMoE(cfg, tp)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: AttentionContext,
        rctx: RecurrentContext,
    ) -> torch.Tensor:
        """``x (T, hidden)`` -> ``(T, hidden)``."""
        x = x + self.self_attn(self.input_layernorm(x), rope, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssLM(HybridLM):
    """GPT-OSS causal LM over the paged pool (no recurrent state), on ``tp``."""

    config: GptOssConfig

    def __init__(self, cfg: GptOssConfig, tp: TPGroup | None = None) -> None:
        super().__init__(cfg, tp)
        self.model = HybridBody(
            cfg,
            (GptOssLayer(cfg, i, self.tp) for i in range(cfg.num_layers)),
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            tp=self.tp,
        )
        self._build_head()
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim)
