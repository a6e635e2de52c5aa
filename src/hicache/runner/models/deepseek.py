"""DeepSeek-V2 and V3 (``model_type: deepseek_v2 / deepseek_v3``): the MLA decoder.

A :class:`~hicache.runner.models.hybrid.HybridLM` whose layers are all ``full_attention``
and whose pool is the MLA pool (:meth:`DeepseekConfig.kv_spec`): each layer is latent
attention (:mod:`.deepseek_mla`; queries with or without a ``q_lora_rank`` projection),
then a dense SwiGLU MLP for the first ``first_k_dense_replace`` layers and a mixture of
experts after them (:mod:`.deepseek_moe`). RoPE may be YaRN with DeepSeek's ``mscale`` /
``mscale_all_dim``, the latter also scaling the softmax
(:func:`~hicache.runner.models.rope.softmax_scale_factor`). Under a
:class:`~hicache.runner.parallel.TPGroup` heads, expert and MLP columns split, the latent
projections are replicated and embedding and LM head are vocab-parallel; full-size
checkpoint tensors load by Hugging Face names, cut to the rank by
:meth:`DeepseekLM.load_weights`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hicache.runner.models.attention import AttentionContext
from hicache.runner.models.config import HybridRopeConfig, UnsupportedModelError, check_split
from hicache.runner.models.deepseek_mla import MlaAttention, MlaSpec
from hicache.runner.models.deepseek_moe import (
    DeepseekMLP,
    DeepseekMoE,
    MoEConfig,
    RouterKind,
    expert_shard_dims,
)
from hicache.runner.models.hybrid import HybridBody, HybridConfig, HybridLM
from hicache.runner.models.layers import RMSNorm
from hicache.runner.models.recurrent import RecurrentContext
from hicache.runner.models.rope import RotaryEmbedding, softmax_scale_factor
from hicache.runner.parallel import TPGroup
from hicache.spec import AttentionKind, KVSpec

__all__ = ["DEEPSEEK_FAMILIES", "DeepseekConfig", "DeepseekLM"]

DEEPSEEK_FAMILIES: tuple[str, ...] = ("deepseek_v2", "deepseek_v3")
"""``model_type`` values served by :class:`DeepseekLM`."""


@dataclass(frozen=True, kw_only=True)
class DeepseekConfig(HybridConfig):
    """DeepSeek-V2/V3 sizes (see the module doc). ``num_heads`` query heads, each with a
    ``qk_nope_head_dim + qk_rope_head_dim`` (= ``head_dim``) query/key; ``num_kv_heads``
    equals ``num_heads`` (the latent decompresses into one K/V per head) but the pool keeps
    the latent only (:meth:`kv_spec`)."""

    intermediate_size: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    first_k_dense_replace: int
    moe: MoEConfig | None
    rope: HybridRopeConfig
    rope_interleave: bool = True
    attention_bias: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("intermediate_size", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} is invalid; must be an int >= 1")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank={self.q_lora_rank!r} is invalid; None or >= 1")
        if self.qk_nope_head_dim < 0 or self.qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_nope_head_dim={self.qk_nope_head_dim} must be >= 0 and qk_rope_head_dim="
                f"{self.qk_rope_head_dim} even (RoPE rotates pairs)"
            )
        if (self.moe is None) != (self.first_k_dense_replace >= self.num_layers):
            raise ValueError(
                f"moe must be given exactly when some layer has it (first_k_dense_replace="
                f"{self.first_k_dense_replace} < num_layers={self.num_layers})"
            )
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise ValueError(
                f"head_dim={self.head_dim} must be qk_nope_head_dim + qk_rope_head_dim ="
                f" {self.qk_nope_head_dim + self.qk_rope_head_dim}"
            )

    def is_moe(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` has the MoE (else the dense MLP)."""
        return layer_id >= self.first_k_dense_replace

    def moe_of(self, layer_id: int) -> MoEConfig | None:
        """Layer ``layer_id``'s MoE config; None for a dense layer."""
        return self.moe if self.is_moe(layer_id) else None

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times the YaRN ``mscale_all_dim`` correction."""
        return float(self.head_dim**-0.5 * softmax_scale_factor(self.rope))

    def kv_spec(self, dtype: str) -> KVSpec:
        """The MLA pool: one latent of ``kv_lora_rank + qk_rope_head_dim`` per layer."""
        return KVSpec(
            num_layers=self.num_layers,
            attention=AttentionKind.MLA,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            dtype=dtype,
        )

    def full_kv_spec(self, dtype: str) -> KVSpec:
        return self.kv_spec(dtype)

    def check_tensor_parallel(self, size: int) -> None:
        """ValueError naming the numbers unless ``size`` divides the query heads (each rank
        decompresses the latent into its own heads), the dense MLP's and the experts'
        intermediate sizes. The latent itself is whole on every rank."""
        sizes = [
            ("num_attention_heads", self.num_heads),
            ("intermediate_size", self.intermediate_size),
        ]
        if self.moe is not None:
            sizes.append(("moe_intermediate_size", self.moe.intermediate_size))
        check_split(size, sizes, self.family)

    @classmethod
    def from_hf(cls, hf: Any) -> DeepseekConfig:
        """Build from a transformers ``DeepseekV2Config`` / ``DeepseekV3Config``;
        UnsupportedModelError names a feature this engine does not implement."""
        family = str(getattr(hf, "model_type", ""))
        if family not in DEEPSEEK_FAMILIES:
            raise UnsupportedModelError(
                f"model_type={family!r} is not a DeepSeek MLA family; choose one of"
                f" {DEEPSEEK_FAMILIES}"
            )
        if getattr(hf, "quantization_config", None):
            raise UnsupportedModelError(f"{family} quantized (FP8) checkpoints are not supported")
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(
                f"{family} hidden_act={act!r} is not supported; only 'silu'"
            )
        if int(getattr(hf, "moe_layer_freq", 1) or 1) != 1:
            raise UnsupportedModelError(
                f"{family} moe_layer_freq={hf.moe_layer_freq} is not supported; only 1"
            )
        if bool(getattr(hf, "mlp_bias", False)):
            raise UnsupportedModelError(f"{family} mlp_bias=True is not supported")
        heads = int(hf.num_attention_heads)
        kv_heads = int(getattr(hf, "num_key_value_heads", None) or heads)
        if kv_heads != heads:
            raise UnsupportedModelError(
                f"{family} num_key_value_heads={kv_heads} != num_attention_heads={heads} is"
                " not supported (MLA decompresses one K/V per query head)"
            )
        v3 = family == "deepseek_v3"
        if v3:
            router = RouterKind.NOAUX_TC
        else:
            method = str(getattr(hf, "topk_method", None) or "greedy")
            kinds = {k.value: k for k in (RouterKind.GREEDY, RouterKind.GROUP_LIMITED_GREEDY)}
            if method not in kinds:
                raise UnsupportedModelError(
                    f"deepseek_v2 topk_method={method!r} is not supported; choose one of"
                    f" {sorted(kinds)}"
                )
            router = kinds[method]
        layers = int(hf.num_hidden_layers)
        first_dense = int(getattr(hf, "first_k_dense_replace", 0) or 0)
        moe = None
        if layers > first_dense:  # some layers have the MoE: every field it needs is set
            missing = [
                name
                for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
                if getattr(hf, name, None) is None
            ]
            if missing:
                raise UnsupportedModelError(
                    f"{family} has MoE layers (num_hidden_layers={layers} >"
                    f" first_k_dense_replace={first_dense}) but no {', '.join(missing)}"
                )
            moe = MoEConfig(
                router=router,
                num_experts=int(hf.n_routed_experts),
                top_k=int(hf.num_experts_per_tok),
                intermediate_size=int(hf.moe_intermediate_size),
                num_shared=int(getattr(hf, "n_shared_experts", None) or 0),
                num_groups=int(getattr(hf, "n_group", None) or 1),
                topk_groups=int(getattr(hf, "topk_group", None) or 1),
                norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)) if v3 else False,
                scaling=float(getattr(hf, "routed_scaling_factor", None) or 1.0),
            )
        if not v3 and bool(getattr(hf, "norm_topk_prob", False)):
            raise UnsupportedModelError(
                "deepseek_v2 norm_topk_prob=True is not supported (the reference ignores it)"
            )
        nope, rope_dim = int(hf.qk_nope_head_dim), int(hf.qk_rope_head_dim)
        q_lora = getattr(hf, "q_lora_rank", None)
        return cls(
            family=family,
            vocab_size=int(hf.vocab_size),
            hidden_size=int(hf.hidden_size),
            layer_kinds=("full_attention",) * layers,
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=nope + rope_dim,
            rms_norm_eps=float(hf.rms_norm_eps),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            intermediate_size=int(hf.intermediate_size),
            kv_lora_rank=int(hf.kv_lora_rank),
            q_lora_rank=None if q_lora is None else int(q_lora),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope_dim,
            v_head_dim=int(hf.v_head_dim),
            first_k_dense_replace=first_dense,
            moe=moe,
            rope=HybridRopeConfig.from_hf(hf),
            # V2's reference always rotates interleaved pairs; V3 follows its flag
            rope_interleave=bool(getattr(hf, "rope_interleave", True)) if v3 else True,
            attention_bias=bool(getattr(hf, "attention_bias", False)),
        )


class DeepseekLayer(nn.Module):
    """Pre-norm block: MLA, then the dense MLP or the MoE."""

    def __init__(self, cfg: DeepseekConfig, layer_id: int, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MlaAttention(
            MlaSpec(
                hidden_size=cfg.hidden_size,
                num_heads=cfg.num_heads,
                q_lora_rank=cfg.q_lora_rank,
                kv_lora_rank=cfg.kv_lora_rank,
                qk_nope_head_dim=cfg.qk_nope_head_dim,
                qk_rope_head_dim=cfg.qk_rope_head_dim,
                v_head_dim=cfg.v_head_dim,
                attention_bias=cfg.attention_bias,
                rope_interleave=cfg.rope_interleave,
                scale=cfg.softmax_scale,
                kv_layer=cfg.kv_index(layer_id),
                rms_norm_eps=1e-6,  # the reference's q_a/kv_a norms keep their default eps
            ),
            tp,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        moe = cfg.moe_of(layer_id)
        self.mlp: DeepseekMLP | DeepseekMoE = (
            DeepseekMLP(cfg.hidden_size, cfg.intermediate_size, tp)
            if moe is None
            else DeepseekMoE(cfg.hidden_size, moe, tp)
        )

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


class DeepseekLM(HybridLM):
    """DeepSeek-V2/V3 causal LM over the MLA pool (no recurrent state), on ``tp``."""

    config: DeepseekConfig

    def __init__(self, cfg: DeepseekConfig, tp: TPGroup | None = None) -> None:
        super().__init__(cfg, tp)
        self.model = HybridBody(  # the vocab-parallel embedding, the layers, the final norm
            cfg,
            (DeepseekLayer(cfg, i, self.tp) for i in range(cfg.num_layers)),
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            tp=self.tp,
        )
        self._build_head()
        self.rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim)

    def after_cast(self) -> None:
        """Turn the routers' parameters (weights, V3's score-correction bias) back to fp32
        after the model was cast to a lower dtype: the reference keeps them in fp32, and a
        bf16 bias would round away the small differences that decide the experts."""
        for m in self.modules():
            if isinstance(m, DeepseekMoE):
                m.gate.float()

    def skip_tensor(self, name: str) -> bool:
        """Also the multi-token-prediction layers DeepSeek-V3 stores past the last layer."""
        if super().skip_tensor(name):
            return True
        parts = name.split(".")
        return (
            len(parts) > 2
            and parts[:2] == ["model", "layers"]
            and parts[2].isdigit()
            and int(parts[2]) >= self.config.num_layers
        )

    def split_params(self) -> dict[str, int]:
        """Also the routed experts' stacked parameters: their intermediate rows (gate/up,
        dim 1) and columns (down, dim 2)
        (:func:`~hicache.runner.models.deepseek_moe.expert_shard_dims`, one expert's dims)."""
        if self.tp.size == 1:
            return {}
        experts = {name: dim + 1 for name, dim in expert_shard_dims(self).items()}
        return {**super().split_params(), **experts}
