"""The decoder-only transformer shared by the Llama, Qwen2 and Qwen3 families.

Module names mirror Hugging Face checkpoints (``model.layers.N.self_attn.q_proj`` ...), so
a checkpoint's tensors load by name. The model never owns a KV cache: attention reads and
writes the pool given in :class:`AttentionContext`.

Tensor parallelism: over a group of ``size`` ranks (:class:`~hicache.runner.parallel.TPGroup`)
each rank holds ``1 / size`` of the query heads and the K/V heads they read (q/k/v
column-parallel by heads, ``o_proj`` row-parallel; K/V heads fewer than the ranks are
replicated, :class:`~hicache.heads.HeadSplit`), of the MLP's intermediate columns (gate/up column-, down row-parallel) and of
the vocabulary rows (embedding and LM head; a tied model projects with the embedding's
rows). One forward runs two all-reduces per layer (``o_proj``, ``down_proj``), one for the
embedding and one all-gather of the logits, so every rank ends with the same full logits.
:meth:`DecoderLM.load_weights` cuts each rank's slice out of the full checkpoint tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import ClassVar

import torch
from torch import nn

from hicache.heads import HeadSplit
from hicache.memory import DevicePool
from hicache.runner.models.attention import AttentionContext, PagedAttention
from hicache.runner.models.cached import (
    BoundPools,
    CachedModel,
    ModelOutput,
    check_kv_pool,
    refuse_unused_pools,
)
from hicache.runner.models.config import DecoderConfig
from hicache.runner.models.layers import GatedMLP, RMSNorm
from hicache.runner.models.recurrent import RecurrentState
from hicache.runner.models.rope import RotaryEmbedding
from hicache.runner.parallel import (
    Narrowable,
    ParallelLMHead,
    TPGroup,
    VocabParallelEmbedding,
    gather_logits,
    shard_dims,
)
from hicache.spec import AttentionKind, CacheSpec, KVSpec

__all__ = ["DecoderLM", "WeightLoadError", "build_model"]


class WeightLoadError(ValueError):
    """A checkpoint's tensors do not match the model (missing, unexpected or mis-shaped)."""


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x += attn(norm(x)); x += mlp(norm(x))``."""

    def __init__(self, cfg: DecoderConfig, layer_id: int, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = PagedAttention(cfg, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp=tp)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """``x (T, hidden)`` -> ``(T, hidden)``."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    """Embeddings, the layer stack and the final norm (``model.*`` in checkpoints)."""

    def __init__(self, cfg: DecoderConfig, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderLM(nn.Module, CachedModel):
    """A causal language model over a paged KV pool, on one rank of ``tp`` (default: the
    single rank; see the module docstring).

    ``lm_head`` exists only when embeddings are untied; tied models project with
    ``model.embed_tokens.weight`` (this rank's vocabulary rows of it). ``size`` must split
    the heads (:meth:`DecoderConfig.check_tensor_parallel`: divide the query heads, and
    divide the K/V heads or be a multiple of them) and divide the intermediate size
    (ValueError naming them, before any module is built). It caches the full KV of every layer and nothing else
    (:meth:`cache_spec`), and reads no component pool.
    """

    config: DecoderConfig
    supports_decode_graphs: ClassVar[bool] = True

    def __init__(self, cfg: DecoderConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp or TPGroup.single()
        cfg.check_tensor_parallel(tp.size)
        self.config = cfg
        self.tp = tp
        self.heads = HeadSplit(cfg.num_heads, cfg.num_kv_heads, tp.size, tp.rank)
        self.model = DecoderBody(cfg, tp)
        self.lm_head: ParallelLMHead | None = None
        if not cfg.tie_word_embeddings:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp=tp)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim)

    @property
    def num_kv_heads(self) -> int:
        """The K/V heads this rank computes and caches (``num_kv_heads / size``, or 1
        when they are replicated): the head count of its pools."""
        return self.heads.local_kv_heads

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

    def cache_spec(self, dtype: str) -> CacheSpec:
        """The full KV of every layer: this rank's :attr:`num_kv_heads` heads."""
        cfg = self.config
        kv = KVSpec(
            num_layers=cfg.num_layers,
            attention=AttentionKind.MHA,
            num_kv_heads=self.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=dtype,
        )
        return CacheSpec(kv=kv)

    def bind_pools(self, kv_pool: DevicePool, pools: Mapping[str, DevicePool]) -> BoundPools:
        """Every layer reads and writes ``kv_pool``; any component pool is refused."""
        refuse_unused_pools(type(self).__name__, pools, ())
        check_kv_pool(kv_pool, self.cache_spec(kv_pool.spec.dtype).kv, self.device)
        return BoundPools(kv_pool)

    def forward_batch(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        states: Mapping[int, RecurrentState] | None = None,
        marks: Sequence[int | None] = (),
    ) -> ModelOutput:
        """:meth:`forward`'s hidden states (the model has no recurrent layers: ``states``
        and ``marks`` are unused)."""
        return ModelOutput(hidden=self(input_ids, positions, ctx))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden (N, hidden)`` -> logits ``(N, vocab)`` in fp32."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return gather_logits(
            hidden, self.model.embed_tokens.weight, self.config.vocab_size, self.tp
        )

    def load_weights(self, tensors: Iterable[tuple[str, Narrowable]]) -> None:
        """Copy checkpoint tensors (Hugging Face names, full size) into the parameters,
        casting dtype; on a rank of a group of ``size > 1``, its slice of each split tensor
        (:func:`~hicache.runner.parallel.shard_dims`: heads, the K/V ones possibly held
        by several ranks alike, intermediate columns, vocabulary rows padded to a multiple
        of ``size``). A tensor may be given unread
        (a :class:`~hicache.runner.parallel.Narrowable`: only the rank's slice is read),
        consumed before the next one is taken.

        Every parameter must be covered exactly once; a tied model ignores ``lm_head.weight``
        and non-parameter tensors such as ``rotary_emb.inv_freq``. Raises
        :class:`WeightLoadError` naming the offending tensors (a shape mismatch names the
        full shape the checkpoint should have).
        """
        params = dict(self.named_parameters())
        dims = shard_dims(self) if self.tp.size > 1 else {}
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
            want = list(param.shape)
            split = dims.get(name)
            if split is not None and split.full is not None:  # the full tensor's shape
                want[split.dim] = split.full
            if list(tensor.shape) != want:
                raise WeightLoadError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(want)}"
                )
            if split is not None:
                value = self.tp.shard(tensor, *split)
            elif isinstance(tensor, torch.Tensor):
                value = tensor
            else:  # read it whole
                value = tensor.narrow(0, 0, tensor.shape[0])
            with torch.no_grad():
                param.copy_(value)
            seen.add(name)
        missing = sorted(set(params) - seen)
        if unexpected or missing:
            raise WeightLoadError(
                f"checkpoint does not match the {self.config.family} model: "
                f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
            )


def build_model(
    cfg: DecoderConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TPGroup | None = None,
) -> DecoderLM:
    """An eval-mode :class:`DecoderLM` (this rank's shard of it over ``tp``, default one
    rank) with *uninitialized* weights on ``device``.

    It is built on the meta device and materialized empty, so nothing is initialized twice;
    call :meth:`DecoderLM.load_weights` next.
    """
    with torch.device("meta"):
        model = DecoderLM(cfg, tp)
    model = model.to_empty(device=torch.device(device)).to(dtype)
    model.requires_grad_(False)
    return model.eval()
