"""The decoder-only transformer shared by the Llama, Qwen2 and Qwen3 families.

Module names mirror Hugging Face checkpoints (``model.layers.N.self_attn.q_proj`` ...), so
a checkpoint's tensors load by name. The model never owns a KV cache: attention reads and
writes the pool given in :class:`AttentionContext`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from hicache.runner.models.attention import AttentionContext, PagedAttention
from hicache.runner.models.config import DecoderConfig
from hicache.runner.models.layers import GatedMLP, RMSNorm
from hicache.runner.models.rope import RotaryEmbedding

__all__ = ["DecoderLM", "WeightLoadError", "build_model"]


class WeightLoadError(ValueError):
    """A checkpoint's tensors do not match the model (missing, unexpected or mis-shaped)."""


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x += attn(norm(x)); x += mlp(norm(x))``."""

    def __init__(self, cfg: DecoderConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = PagedAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """``x (T, hidden)`` -> ``(T, hidden)``."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    """Embeddings, the layer stack and the final norm (``model.*`` in checkpoints)."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderLM(nn.Module):
    """A causal language model over a paged KV pool.

    ``lm_head`` exists only when embeddings are untied; tied models project with
    ``model.embed_tokens.weight``.
    """

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderBody(cfg)
        self.lm_head: nn.Linear | None = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """``input_ids``/``positions (T,)`` int64 -> final hidden states ``(T, hidden)``."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden (N, hidden)`` -> logits ``(N, vocab)`` in fp32."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters, casting dtype.

        Every parameter must be covered exactly once; a tied model ignores ``lm_head.weight``
        and non-parameter tensors such as ``rotary_emb.inv_freq``. Raises
        :class:`WeightLoadError` naming the offending tensors.
        """
        params = dict(self.named_parameters())
        seen: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in tensors:
            if name.endswith("rotary_emb.inv_freq") or (
                name == "lm_head.weight" and self.lm_head is None
            ):
                continue
            param = params.get(name)
            if param is None:
                unexpected.append(name)
                continue
            if tuple(tensor.shape) != tuple(param.shape):
                raise WeightLoadError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape "
                    f"{tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor)
            seen.add(name)
        missing = sorted(set(params) - seen)
        if unexpected or missing:
            raise WeightLoadError(
                f"checkpoint does not match the {self.config.family} model: "
                f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
            )


def build_model(cfg: DecoderConfig, *, dtype: torch.dtype, device: torch.device | str) -> DecoderLM:
    """An eval-mode :class:`DecoderLM` with *uninitialized* weights on ``device``.

    It is built on the meta device and materialized empty, so nothing is initialized twice;
    call :meth:`DecoderLM.load_weights` next.
    """
    with torch.device("meta"):
        model = DecoderLM(cfg)
    model = model.to_empty(device=torch.device(device)).to(dtype)
    model.requires_grad_(False)
    return model.eval()
