"""Nemotron-H (``model_type: nemotron_h``): a stack of single-mixer blocks chosen by pattern
(``M`` Mamba2, ``*`` attention without RoPE, ``-`` ReLU² MLP, ``E`` MoE), each
``x += mixer(rms(x))``. The MoE routes with grouped sigmoid scores (DeepSeek-V3 style) over
non-gated ReLU² experts and always adds a shared expert. Checkpoint prefix ``backbone.``.

Tensor parallelism (:meth:`NemotronHLM.build` on a ``tp`` group): attention split by heads,
Mamba2 by heads with their groups (:mod:`.mamba2`: groups fewer than the ranks replicated,
the gated norm's sums then all-reduced over a group's ranks), the MLP's, every expert's and the shared expert's intermediate columns split
(router replicated; one all-reduce per MoE), embedding and LM head vocab-parallel. Sizes
that must divide: :meth:`NemotronHConfig.check_tensor_parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hicache.runner.models.attention import AttentionContext
from hicache.runner.models.config import UnsupportedModelError, check_split
from hicache.runner.models.hybrid import HybridConfig, HybridLM
from hicache.runner.models.layers import PlainMLP, RMSNorm
from hicache.runner.models.mamba2 import Mamba2Mixer, Mamba2Spec
from hicache.runner.models.moe import PlainExperts, Router, RoutingConfig, RoutingMode
from hicache.runner.models.recurrent import RecurrentContext, StateSpec
from hicache.runner.models.sliding import AttentionSpec, WindowedAttention
from hicache.runner.parallel import TPGroup, VocabParallelEmbedding

__all__ = ["NemotronHConfig", "NemotronHLM"]


@dataclass(frozen=True, kw_only=True)
class NemotronHConfig(HybridConfig):
    """Nemotron-H sizes (see the module doc)."""

    intermediate_size: int
    mlp_bias: bool
    mlp_act: str
    mamba: Mamba2Spec
    routing: RoutingConfig | None
    moe_intermediate_size: int
    shared_expert_intermediate_size: int

    def check_tensor_parallel(self, size: int) -> None:
        """ValueError naming the numbers unless ``size`` ranks split the attention heads
        (:meth:`HybridConfig.check_attention_split`), the Mamba2 heads and groups (the size
        divides ``mamba_num_heads``, and divides ``n_groups`` or is a multiple of it:
        :meth:`Mamba2Spec.head_split`) and the intermediate sizes of the layers the model
        has."""
        self.check_attention_split(size)
        if "linear_attention" in self.layer_kinds:
            self.mamba.head_split(TPGroup(size=size))
        sizes: list[tuple[str, int]] = []
        if "mlp" in self.layer_kinds:
            sizes.append(("intermediate_size", self.intermediate_size))
        if "moe" in self.layer_kinds:
            sizes += [
                ("moe_intermediate_size", self.moe_intermediate_size),
                ("moe_shared_expert_intermediate_size", self.shared_expert_intermediate_size),
            ]
        check_split(size, sizes, self.family)

    @classmethod
    def from_hf(cls, hf: Any) -> NemotronHConfig:
        """Build from a transformers ``NemotronHConfig``."""
        if getattr(hf, "sliding_window", None) is not None:
            raise UnsupportedModelError("nemotron_h sliding_window is not supported")
        if getattr(hf, "moe_latent_size", None) is not None:
            raise UnsupportedModelError("nemotron_h moe_latent_size is not supported")
        if getattr(hf, "mamba_hidden_act", "silu") != "silu":
            raise UnsupportedModelError("nemotron_h mamba_hidden_act must be 'silu'")
        act = str(getattr(hf, "mlp_hidden_act", "relu2"))
        if act != "relu2":
            raise UnsupportedModelError(f"nemotron_h mlp_hidden_act={act!r} is not supported")
        kinds = tuple(hf.layers_block_type)
        h = int(hf.hidden_size)
        routing = None
        if "moe" in kinds:
            routing = RoutingConfig(
                mode=RoutingMode.SIGMOID_GROUPED,
                num_experts=int(hf.n_routed_experts),
                top_k=int(hf.num_experts_per_tok),
                renormalize=bool(hf.norm_topk_prob),
                num_groups=int(hf.n_group),
                topk_groups=int(hf.topk_group),
                scaling=float(hf.routed_scaling_factor),
            )
        return cls(
            family="nemotron_h",
            vocab_size=int(hf.vocab_size),
            hidden_size=h,
            layer_kinds=kinds,
            num_heads=int(hf.num_attention_heads),
            num_kv_heads=int(hf.num_key_value_heads),
            head_dim=int(hf.head_dim),
            rms_norm_eps=float(hf.layer_norm_epsilon),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            intermediate_size=int(hf.intermediate_size),
            mlp_bias=bool(hf.mlp_bias),
            mlp_act=act,
            mamba=Mamba2Spec(
                hidden_size=h,
                num_heads=int(hf.mamba_num_heads),
                head_dim=int(hf.mamba_head_dim),
                n_groups=int(hf.n_groups),
                state_size=int(hf.ssm_state_size),
                conv_kernel=int(hf.conv_kernel),
                conv_bias=bool(hf.use_conv_bias),
                proj_bias=bool(hf.use_bias),
                time_step_limit=tuple(hf.time_step_limit),
                eps=float(hf.layer_norm_epsilon),
            ),
            routing=routing,
            moe_intermediate_size=int(hf.moe_intermediate_size),
            shared_expert_intermediate_size=int(hf.moe_shared_expert_intermediate_size),
        )


class NemotronHMoE(nn.Module):
    """``mixer.gate`` router, ``mixer.experts`` and ``mixer.shared_experts``."""

    def __init__(self, cfg: NemotronHConfig, tp: TPGroup) -> None:
        super().__init__()
        assert cfg.routing is not None
        self.tp = tp
        self.gate = Router(cfg.hidden_size, cfg.routing)
        self.experts = PlainExperts(
            cfg.routing.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, tp=tp
        )
        self.shared_experts = PlainMLP(
            cfg.hidden_size,
            cfg.shared_expert_intermediate_size,
            cfg.mlp_bias,
            cfg.mlp_act,
            tp=tp,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (T, hidden)`` -> ``(T, hidden)``; over ``tp`` the routed and shared partial
        sums are all-reduced once (the shared expert's bias added after)."""
        if self.tp.size == 1:
            return self.experts(x, self.gate(x)) + self.shared_experts(x)
        y = self.tp.all_reduce(self.experts(x, self.gate(x)) + self.shared_experts.partial(x))
        bias = self.shared_experts.down_proj.bias
        return y if bias is None else y + bias


class NemotronHBlock(nn.Module):
    """``x += mixer(norm(x))`` with the mixer of this layer's kind."""

    def __init__(self, cfg: NemotronHConfig, layer_id: int, tp: TPGroup) -> None:
        super().__init__()
        self.kind = cfg.layer_kinds[layer_id]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer: nn.Module
        if self.kind == "linear_attention":
            self.mixer = Mamba2Mixer(cfg.mamba, layer_id, tp)
        elif self.kind == "full_attention":
            self.mixer = WindowedAttention(
                AttentionSpec(
                    hidden_size=cfg.hidden_size,
                    num_heads=cfg.num_heads,
                    num_kv_heads=cfg.num_kv_heads,
                    head_dim=cfg.head_dim,
                    kv_layer=cfg.kv_index(layer_id),
                    rms_norm_eps=cfg.rms_norm_eps,
                    rotary_dim=0,
                ),
                tp,
            )
        elif self.kind == "moe":
            self.mixer = NemotronHMoE(cfg, tp)
        else:
            self.mixer = PlainMLP(
                cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.mlp_act, tp=tp
            )

    def forward(
        self, x: torch.Tensor, rope: None, ctx: AttentionContext, rctx: RecurrentContext
    ) -> torch.Tensor:
        """``x (T, hidden)`` -> ``(T, hidden)`` (no position encoding: ``rope`` is None)."""
        normed = self.norm(x)
        out: torch.Tensor
        if self.kind == "linear_attention":
            out = self.mixer(normed, rctx)
        elif self.kind == "full_attention":
            out = self.mixer(normed, None, ctx)
        else:
            out = self.mixer(normed)
        return x + out


class NemotronHBody(nn.Module):
    """``backbone.*`` in checkpoints: ``embeddings``, ``layers``, ``norm_f`` (also read as
    the frame's ``embed_tokens`` and ``norm``)."""

    def __init__(self, cfg: NemotronHConfig, tp: TPGroup) -> None:
        super().__init__()
        self.embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=tp)
        self.layers = nn.ModuleList(NemotronHBlock(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def embed_tokens(self) -> VocabParallelEmbedding:
        return self.embeddings

    @property
    def norm(self) -> RMSNorm:
        return self.norm_f


class NemotronHLM(HybridLM):
    """Nemotron-H causal LM: attention K/V in the pool, Mamba2 state carried; on ``tp``, this
    rank's shard (see the module doc) and its heads' state."""

    config: NemotronHConfig

    def __init__(self, cfg: NemotronHConfig, tp: TPGroup | None = None) -> None:
        super().__init__(cfg, tp)
        self.backbone = NemotronHBody(cfg, self.tp)
        self._build_head()

    def body(self) -> NemotronHBody:
        return self.backbone

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> None:
        """None: Nemotron-H's attention has no position encoding."""
        return None

    def recurrent_state(self) -> StateSpec:
        """This rank's Mamba2 state: its heads' x and its groups' B/C conv channels (a
        replicated group's too), its heads."""
        return self.config.mamba.split(self.tp).state
