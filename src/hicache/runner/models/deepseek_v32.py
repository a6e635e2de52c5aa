"""DeepSeek-V3.2 (``model_type: deepseek_v32``): DeepSeek-V3 with DSA sparse attention.

The decoder is DeepSeek-V3's (:mod:`.deepseek`: MLA over the MLA pool, the dense MLP
then the MoE with the sigmoid router, interleaved RoPE on the MLA), and every attention
layer also has a DSA indexer (:mod:`.dsa_indexer`): it writes one key per new token into
the indexer's pool (the cache's ``"indexer"`` component, on the full KV's slots, so a
sequence's indexer slots are its :attr:`AttentionContext.seq_slots`), scores each new
token against the keys of its whole context read back through that pool, and restricts
the MLA to the ``index_topk`` tokens it selects (``MlaAttention``'s ``key_masks``).

The indexer is replicated on every tensor-parallel rank (its projections are small and
its keys must be the same everywhere, like the latent), so each rank selects the same
tokens for its heads. Its cache spec (:meth:`DeepseekV32LM.cache_spec`) adds the
indexer's :class:`~hicache.spec.IndexerSpec`; the model needs the indexer's L1 pool
among those it is bound to (:meth:`DeepseekV32LM.bind_pools`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hicache.memory import DevicePool
from hicache.runner.models.attention import AttentionContext
from hicache.runner.models.cached import BoundPools
from hicache.runner.models.config import UnsupportedModelError
from hicache.runner.models.deepseek import DeepseekConfig, DeepseekLayer, DeepseekLM
from hicache.runner.models.deepseek_mla import MlaAttention, MlaSpec
from hicache.runner.models.dsa_indexer import DsaIndexer, IndexerShape, read_keys, write_keys
from hicache.runner.parallel import TPGroup
from hicache.spec import CacheSpec, IndexerSpec

__all__ = ["DSA_FAMILY", "DeepseekV32Config", "DeepseekV32LM", "DsaAttention"]

DSA_FAMILY = "deepseek_v32"
"""The ``model_type`` served by :class:`DeepseekV32LM`."""

INDEXER = IndexerSpec.name
"""The component of the indexer's keys (``"indexer"``)."""


@dataclass(frozen=True, kw_only=True)
class DeepseekV32Config(DeepseekConfig):
    """DeepSeek-V3's sizes plus the indexer's: ``index_n_heads`` heads of
    ``index_head_dim`` values, ``index_topk`` tokens kept per query. V3.2 always has a
    ``q_lora_rank`` (the indexer reads the MLA's low-rank query)."""

    index_n_heads: int
    index_head_dim: int
    index_topk: int

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("index_n_heads", "index_head_dim", "index_topk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} is invalid; must be an int >= 1")
        if self.q_lora_rank is None:
            raise ValueError("deepseek_v32 needs q_lora_rank (the indexer reads the q LoRA)")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(
                f"index_head_dim={self.index_head_dim} must be at least qk_rope_head_dim="
                f"{self.qk_rope_head_dim} (the indexer rotates that many values)"
            )

    def indexer_shape(self) -> IndexerShape:
        assert self.q_lora_rank is not None
        return IndexerShape(
            hidden_size=self.hidden_size,
            q_lora_rank=self.q_lora_rank,
            n_heads=self.index_n_heads,
            head_dim=self.index_head_dim,
            rope_dim=self.qk_rope_head_dim,
            topk=self.index_topk,
        )

    def indexer_spec(self, dtype: str) -> IndexerSpec:
        """The cache component of the indexer's keys: one per token and layer."""
        return IndexerSpec(
            num_layers=self.num_layers, index_head_dim=self.index_head_dim, dtype=dtype
        )

    @classmethod
    def from_hf(cls, hf: Any) -> DeepseekV32Config:
        """Build from a transformers ``DeepseekV32Config``: its V3 part as DeepSeek-V3's
        (the MLP pattern ``mlp_layer_types`` must be dense layers then MoE ones), plus the
        indexer's sizes."""
        family = str(getattr(hf, "model_type", ""))
        if family != DSA_FAMILY:
            raise UnsupportedModelError(f"model_type={family!r} is not {DSA_FAMILY!r}")
        kinds = list(getattr(hf, "mlp_layer_types", None) or [])
        dense = kinds.count("dense")
        if kinds != ["dense"] * dense + ["sparse"] * (len(kinds) - dense):
            raise UnsupportedModelError(
                f"deepseek_v32 mlp_layer_types={kinds} is not supported; only dense layers"
                " then sparse (MoE) ones"
            )
        base = DeepseekConfig.from_hf(_AsV3(hf, first_k_dense_replace=dense))
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        fields["family"] = DSA_FAMILY
        return cls(
            **fields,
            index_n_heads=int(hf.index_n_heads),
            index_head_dim=int(hf.index_head_dim),
            index_topk=int(hf.index_topk),
        )


class _AsV3:
    """A V3.2 config read as the V3 config it extends (its model type, its dense layers
    as ``first_k_dense_replace``); every other attribute is the V3.2 config's."""

    def __init__(self, hf: Any, *, first_k_dense_replace: int) -> None:
        self._hf = hf
        self.model_type = "deepseek_v3"
        self.first_k_dense_replace = first_k_dense_replace

    def __getattr__(self, name: str) -> Any:
        return getattr(self._hf, name)


class DsaAttention(MlaAttention):
    """MLA restricted to the tokens the layer's DSA indexer selects (``indexer.*``
    parameters, as in the checkpoint)."""

    def __init__(self, spec: MlaSpec, shape: IndexerShape, tp: TPGroup) -> None:
        super().__init__(spec, tp)
        self.indexer = DsaIndexer(shape)
        self.indexer_pool: DevicePool | None = None
        """The indexer's L1 pool (set by :meth:`DeepseekV32LM.use_indexer_pool`)."""

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: AttentionContext,
        key_masks: Sequence[torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        return super().forward(x, rope, ctx, self.select(x, rope, ctx))

    def select(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext
    ) -> list[torch.Tensor | None]:
        """Write the new tokens' indexer keys, then per sequence the bool mask ``(extend,
        prefix + extend)`` of the context tokens each new token attends to."""
        pool = self.indexer_pool
        if pool is None:
            raise RuntimeError("a DeepSeek-V3.2 layer needs its indexer pool (use_indexer_pool)")
        assert self.q_a_proj is not None and self.q_a_layernorm is not None
        cos, sin = rope
        idx = self.indexer
        write_keys(pool, self.layer_id, ctx.write_slots, idx.keys(x, cos, sin))
        queries = idx.queries(self.q_a_layernorm(self.q_a_proj(x)), cos, sin)
        weights = idx.head_weights(x)
        masks: list[torch.Tensor | None] = []
        start = 0
        for slots, n in zip(ctx.seq_slots, ctx.extend_lens, strict=True):
            keys = read_keys(pool, self.layer_id, slots)
            length = keys.shape[0]
            scores = idx.scores(queries[start : start + n], weights[start : start + n], keys)
            positions = torch.arange(length - n, length, device=scores.device)
            masks.append(idx.select(scores, positions))
            start += n
        return masks


class DeepseekV32LM(DeepseekLM):
    """DeepSeek-V3.2: :class:`DeepseekLM` whose attention layers are :class:`DsaAttention`."""

    config: DeepseekV32Config

    def __init__(self, cfg: DeepseekV32Config, tp: TPGroup | None = None) -> None:
        super().__init__(cfg, tp)
        shape = cfg.indexer_shape()
        for layer in self.model.layers:
            assert isinstance(layer, DeepseekLayer)
            old = layer.self_attn
            layer.self_attn = DsaAttention(old.spec, shape, self.tp)

    def cache_spec(self, dtype: str) -> CacheSpec:
        """DeepSeek-V3's (the MLA pool), plus the indexer's keys."""
        spec = super().cache_spec(dtype)
        return CacheSpec(kv=spec.kv, components=(*spec.components, self.config.indexer_spec(dtype)))

    def pool_components(self) -> tuple[str, ...]:
        return (*super().pool_components(), INDEXER)

    def bind_pools(self, kv_pool: DevicePool, pools: Mapping[str, DevicePool]) -> BoundPools:
        """DeepSeek-V3's MLA pool, and the indexer's (``pools["indexer"]``, required; the
        model reads and writes its keys there from now on, :meth:`use_indexer_pool`)."""
        bound = super().bind_pools(kv_pool, pools)
        indexer = pools.get(INDEXER)
        if indexer is None:
            raise ValueError(f"a DeepSeek-V3.2 runner needs the indexer pool (pools[{INDEXER!r}])")
        self.use_indexer_pool(indexer)
        return BoundPools(kv_pool, {**bound.components, INDEXER: indexer}, bound.window)

    def use_indexer_pool(self, pool: DevicePool) -> None:
        """Read and write the indexer's keys in ``pool`` (the cache's ``"indexer"`` L1
        pool); ValueError when its shape is not this model's."""
        want = self.config.indexer_spec(pool.spec.dtype).kv
        if pool.spec != want:
            raise ValueError(f"indexer pool {pool.spec} does not fit the model's {want}")
        for layer in self.model.layers:
            attn = layer.self_attn
            assert isinstance(attn, DsaAttention)
            attn.indexer_pool = pool
