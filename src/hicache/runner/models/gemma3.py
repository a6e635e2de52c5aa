"""Gemma 3 text (``model_type: gemma3_text``): interleaved sliding-window and global layers.

Differences from Llama: embeddings scaled by ``sqrt(hidden)``; every norm is
``rms(x) * (1 + w)``; four norms per layer (``x += post_attn(attn(in(x)))``,
``x += post_ff(mlp(pre_ff(x)))``); per-head q/k norms; logit scale
``query_pre_attn_scalar ** -0.5``; GeLU-tanh gated MLP; separate RoPE for sliding
(``rope_local``) and global layers; optional final logit soft-capping.

Tensor parallelism (:meth:`Gemma3Config.check_tensor_parallel`): attention heads split
(:class:`~hicache.runner.models.sliding.WindowedAttention`; the q/k norms, one weight for
every head, whole), MLP columns split, the (tied) embedding vocab-parallel; the logits are
gathered before the soft-capping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hicache.runner.models.attention import AttentionContext
from hicache.runner.models.config import HybridRopeConfig, UnsupportedModelError
from hicache.runner.models.hybrid import HybridBody, HybridConfig, HybridLM
from hicache.runner.models.layers import GatedMLP
from hicache.runner.models.norms import OffsetRMSNorm
from hicache.runner.models.recurrent import RecurrentContext
from hicache.runner.models.rope import RotaryEmbedding
from hicache.runner.models.sliding import AttentionSpec, WindowedAttention
from hicache.runner.parallel import TPGroup

__all__ = ["Gemma3Config", "Gemma3LM"]


@dataclass(frozen=True, kw_only=True)
class Gemma3Config(HybridConfig):
    """Gemma 3 text sizes (see the module doc)."""

    intermediate_size: int
    sliding_window: int
    query_pre_attn_scalar: float
    rope_global: HybridRopeConfig
    rope_local: HybridRopeConfig
    final_logit_softcapping: float | None = None

    @property
    def window(self) -> int | None:
        return self.sliding_window

    def check_tensor_parallel(self, size: int) -> None:
        """The heads split (:meth:`HybridConfig.check_attention_split`) and ``size`` divides
        the MLP's ``intermediate_size``; ValueError naming the numbers otherwise."""
        self.check_attention_split(size, [("intermediate_size", self.intermediate_size)])

    @classmethod
    def from_hf(cls, hf: Any) -> Gemma3Config:
        """Build from a transformers ``Gemma3TextConfig``."""
        if getattr(hf, "attn_logit_softcapping", None) is not None:
            raise UnsupportedModelError("gemma3 attn_logit_softcapping is not supported")
        if getattr(hf, "use_bidirectional_attention", False):
            raise UnsupportedModelError("gemma3 use_bidirectional_attention is not supported")
        act = getattr(hf, "hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise UnsupportedModelError(f"gemma3 hidden_activation={act!r} is not supported")
        params = hf.rope_parameters
        max_pos = int(hf.max_position_embeddings)
        return cls(
            family="gemma3_text",
            vocab_size=int(hf.vocab_size),
            hidden_size=int(hf.hidden_size),
            layer_kinds=tuple(hf.layer_types),
            num_heads=int(hf.num_attention_heads),
            num_kv_heads=int(hf.num_key_value_heads),
            head_dim=int(hf.head_dim),
            rms_norm_eps=float(hf.rms_norm_eps),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
            intermediate_size=int(hf.intermediate_size),
            sliding_window=int(hf.sliding_window),
            query_pre_attn_scalar=float(hf.query_pre_attn_scalar),
            rope_global=HybridRopeConfig.from_params(params["full_attention"], max_pos),
            rope_local=HybridRopeConfig.from_params(params["sliding_attention"], max_pos),
            final_logit_softcapping=getattr(hf, "final_logit_softcapping", None),
        )


class Gemma3Layer(nn.Module):
    """One Gemma 3 block (sliding or global attention + GeLU MLP, four norms)."""

    def __init__(self, cfg: Gemma3Config, layer_id: int, tp: TPGroup) -> None:
        super().__init__()
        self.sliding = cfg.layer_kinds[layer_id] == "sliding_attention"
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = WindowedAttention(
            AttentionSpec(
                hidden_size=h,
                num_heads=cfg.num_heads,
                num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim,
                kv_layer=cfg.kv_index(layer_id),
                split_layer=cfg.split_index(layer_id),
                rms_norm_eps=eps,
                rotary_dim=cfg.head_dim,
                window=cfg.sliding_window if self.sliding else None,
                qk_norm="offset",
                scale=cfg.query_pre_attn_scalar**-0.5,
            ),
            tp,
        )
        self.mlp = GatedMLP(h, cfg.intermediate_size, False, act="gelu_pytorch_tanh", tp=tp)
        self.input_layernorm = OffsetRMSNorm(h, eps)
        self.post_attention_layernorm = OffsetRMSNorm(h, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(h, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(h, eps)

    def forward(
        self,
        x: torch.Tensor,
        ropes: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        ctx: AttentionContext,
        rctx: RecurrentContext,
    ) -> torch.Tensor:
        """``x (T, hidden)`` -> ``(T, hidden)``; ``ropes``: the global layers' and the
        sliding layers' ``(cos, sin)``."""
        rope = ropes[1] if self.sliding else ropes[0]
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3LM(HybridLM):
    """Gemma 3 text causal LM over the paged pool (no recurrent state), on ``tp``."""

    config: Gemma3Config

    def __init__(self, cfg: Gemma3Config, tp: TPGroup | None = None) -> None:
        super().__init__(cfg, tp)
        self.model = HybridBody(
            cfg,
            (Gemma3Layer(cfg, i, self.tp) for i in range(cfg.num_layers)),
            OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            tp=self.tp,
        )
        self._build_head()
        self.rope_global = RotaryEmbedding(cfg.rope_global, cfg.head_dim)
        self.rope_local = RotaryEmbedding(cfg.rope_local, cfg.head_dim)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings scaled by ``sqrt(hidden)`` (in the model dtype)."""
        x = super().embed(input_ids)
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)

    def rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """The global and the local (sliding) RoPE; each layer takes its own."""
        return self.rope_global(positions, dtype), self.rope_local(positions, dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
