"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over the paged MLA pool.

Per token and layer the cache keeps ONE latent of ``kv_lora_rank + qk_rope_head_dim``
values (:meth:`~hicache.memory.DevicePool.latent_buffer`, ``(slots, 1, D)``):
``[kv_a_layernorm(c_kv) | k_pe after RoPE]``, ``kv_a_proj_with_mqa(x) = [c_kv | k_pe]``. RoPE
is decoupled (only the ``qk_rope_head_dim`` part rotates, interleaved unless
``rope_interleave`` is off; the rotated key part is shared by every head). Attention is
absorbed: with ``kv_b_proj.weight`` viewed as ``(heads, qk_nope_head_dim + v_head_dim,
kv_lora_rank)`` = ``[W_UK | W_UV]``, ``q_h . k_h = [W_UK[h]^T q_nope_h | q_pe_h] . latent`` and
``out_h = W_UV[h] (P_h c)``, so one SDPA call per sequence treats the latent as one key head
shared by all query heads (its first ``kv_lora_rank`` values the value head); exact in fp32
up to the order of the sums. Tensor parallelism splits the heads; the latent projections
are replicated, so every rank stores the same latent. DeepSeek-V3.2's indexer passes
``key_masks``: per sequence a bool ``(extend, prefix + extend)`` mask ANDed with the causal
one. Why: ``docs/architecture.md``, "MLA (DeepSeek-V2/V3)".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hicache.runner.models.attention import AttentionContext, DecodeGather
from hicache.runner.models.layers import RMSNorm
from hicache.runner.models.rope import apply_interleaved_rotary, apply_rotary
from hicache.runner.parallel import ColumnParallelLinear, RowParallelLinear, TPGroup

__all__ = ["MlaAttention", "MlaSpec"]


@dataclass(frozen=True, kw_only=True)
class MlaSpec:
    """Sizes of one MLA layer: ``num_heads`` query heads (all ranks together), each with a
    ``qk_nope_head_dim + qk_rope_head_dim`` query/key and a ``v_head_dim`` value;
    ``q_lora_rank`` None projects queries directly (``q_proj``), else through a low-rank
    ``q_a_proj`` + norm + ``q_b_proj``; ``scale`` the softmax scale; ``kv_layer`` the
    layer's index in the pool."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    rope_interleave: bool
    scale: float
    kv_layer: int
    rms_norm_eps: float = 1e-6

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cache entry: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class MlaAttention(nn.Module):
    """One layer's MLA over the pool (see the module doc); parameter names are the Hugging
    Face ones (``self_attn.*``)."""

    def __init__(self, spec: MlaSpec, tp: TPGroup) -> None:
        super().__init__()
        self.spec = spec
        self.layer_id = spec.kv_layer
        self.num_heads = tp.part(spec.num_heads, "attention heads")
        hidden, bias = spec.hidden_size, spec.attention_bias
        q_width = spec.num_heads * spec.qk_head_dim
        self.q_proj: ColumnParallelLinear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: ColumnParallelLinear | None = None
        if spec.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_width, bias=False, tp=tp)
        else:
            self.q_a_proj = nn.Linear(hidden, spec.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, spec.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(spec.q_lora_rank, q_width, bias=False, tp=tp)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, spec.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(spec.kv_lora_rank, spec.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(
            spec.kv_lora_rank,
            spec.num_heads * (spec.qk_nope_head_dim + spec.v_head_dim),
            bias=False,
            tp=tp,
        )
        self.o_proj = RowParallelLinear(spec.num_heads * spec.v_head_dim, hidden, bias=bias, tp=tp)

    def latent(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x (T, hidden)`` -> ``(q, latent)``: the absorbed queries ``(T, heads,
        kv_lora_rank + qk_rope_head_dim)`` of this rank's heads and the cache entries
        ``(T, kv_lora_rank + qk_rope_head_dim)``."""
        spec, t = self.spec, x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            assert self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, spec.qk_head_dim)
        q_nope, q_pe = q.split([spec.qk_nope_head_dim, spec.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split(
            [spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1
        )
        rotate = apply_interleaved_rotary if spec.rope_interleave else apply_rotary
        q_pe = rotate(q_pe, cos, sin)
        k_pe = rotate(k_pe[:, None, :], cos, sin)[:, 0]
        w_uk = self._w_kv()[:, : spec.qk_nope_head_dim]  # (H, nope, kv_lora)
        q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)
        return torch.cat((q_lat, q_pe), dim=-1), torch.cat((self.kv_a_layernorm(c_kv), k_pe), -1)

    def _w_kv(self) -> torch.Tensor:
        """``kv_b_proj.weight`` as ``(heads, qk_nope_head_dim + v_head_dim, kv_lora_rank)``."""
        spec = self.spec
        return self.kv_b_proj.weight.view(
            self.num_heads, spec.qk_nope_head_dim + spec.v_head_dim, spec.kv_lora_rank
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: AttentionContext,
        key_masks: Sequence[torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """``x (T, hidden)``, ``rope`` the ``(cos, sin)`` tables ``(T, qk_rope_head_dim)``
        -> ``(T, hidden)``. ``key_masks[i]`` (optional, see the module doc) restricts the
        keys of sequence ``i``'s new tokens."""
        spec, t = self.spec, x.shape[0]
        q, latent = self.latent(x, *rope)
        cache = ctx.pool.latent_buffer(self.layer_id)  # (slots, 1, latent_dim)
        cache[ctx.write_slots] = latent[:, None, :].to(cache.dtype)
        if ctx.layer_wait is not None:
            ctx.layer_wait(self.layer_id)
        decode = ctx.decode if key_masks is None else None
        out = torch.empty(t, self.num_heads, spec.kv_lora_rank, dtype=q.dtype, device=q.device)
        if decode is not None:
            out[decode.rows] = self._attend_decode(q[decode.rows], cache, decode)
        skip = decode.seqs if decode is not None else frozenset()
        start = 0
        for i, (slots, n, mask) in enumerate(
            zip(ctx.seq_slots, ctx.extend_lens, ctx.masks, strict=True)
        ):
            if i not in skip:
                extra = None if key_masks is None else key_masks[i]
                out[start : start + n] = self._attend(
                    q[start : start + n], cache[slots], mask, extra
                )
            start += n
        v = torch.einsum("thc,hvc->thv", out, self._w_kv()[:, spec.qk_nope_head_dim :])
        return self.o_proj(v.reshape(t, self.num_heads * spec.v_head_dim))

    def _sdpa(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """``q (..., H, n, D)``, ``keys (..., 1, L, D)`` latents -> ``(..., H, n, kv_lora)``."""
        keys = keys.to(q.dtype)
        return F.scaled_dot_product_attention(
            q,
            keys,
            keys[..., : self.spec.kv_lora_rank],
            attn_mask=mask,
            is_causal=is_causal,
            scale=self.spec.scale,
            enable_gqa=True,
        )

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        mask: torch.Tensor | None,
        extra: torch.Tensor | None,
    ) -> torch.Tensor:
        """One sequence: ``q (n, H, D)``, ``keys (L, 1, D)`` -> ``(n, H, kv_lora)``."""
        n, length = q.shape[0], keys.shape[0]
        if extra is not None:
            if tuple(extra.shape) != (n, length):
                raise ValueError(f"key mask shape {tuple(extra.shape)} != ({n}, {length})")
            causal = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
            mask = causal & extra.to(q.device)
        is_causal = mask is None and n > 1  # a prefill without prefix: L == n
        out = self._sdpa(q.transpose(0, 1)[None], keys.transpose(0, 1)[None], mask, is_causal)
        return out[0].transpose(0, 1)

    def _attend_decode(
        self, q: torch.Tensor, cache: torch.Tensor, gather: DecodeGather
    ) -> torch.Tensor:
        """One padded SDPA call for B single-token queries: ``q (B, H, D)`` -> ``(B, H,
        kv_lora)`` (with the Triton backend too: there is no MLA kernel here)."""
        if gather.by_page:
            b, ps, tail = gather.index.shape[0], gather.page_size, cache.shape[1:]
            keys = cache.view(-1, ps, *tail)[gather.index].view(b, -1, *tail).transpose(1, 2)
        else:
            keys = cache[gather.index].transpose(1, 2)  # (B, 1, Lmax, D)
        return self._sdpa(q[:, :, None, :], keys, gather.mask)[:, :, 0, :]
