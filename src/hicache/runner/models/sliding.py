"""Attention of the hybrid families over the paged pool: sliding window, sinks, gates.

:class:`WindowedAttention`, configured by :class:`AttentionSpec`, covers Gemma 3, GPT-OSS
(per-head sinks, biases), Qwen3-Next (sigmoid output gate, partial RoPE) and Nemotron-H (no
RoPE). K/V are addressed by slot as in :mod:`hicache.runner.models.attention`, at pool
layer ``kv_layer`` (rank among attention layers). Window: query position ``p`` attends to
keys ``p - window < q <= p``; a sliding layer reads only slots of positions ``>= prefix + 1
- window``. Placements: one pool (``ctx.swa`` None: every layer in ``ctx.pool``, ``seq_slots``
from position 0) or split (sliding layers in ``ctx.swa.pool``, whose ``seq_slots`` hold only
the window and the new tokens; global layers in ``ctx.pool``; each at ``split_layer``, its
rank among its kind; only global layers wait for a layer-wise load). Sinks: ``p_j =
exp(s_j) / (exp(sink) + sum_i exp(s_i))``, no value. Tensor parallelism: a rank holds its
query and K/V heads (:class:`~hicache.heads.HeadSplit`), ``o_proj`` row-parallel (one
all-reduce), its pool its own K/V heads (``docs/architecture.md``, "Hybrids under TP").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hicache.heads import HeadSplit
from hicache.runner.models.attention import AttentionContext
from hicache.runner.models.layers import RMSNorm
from hicache.runner.models.norms import OffsetRMSNorm
from hicache.runner.models.rope import apply_rotary
from hicache.runner.parallel import (
    ColumnParallelLinear,
    HeadParallelLinear,
    RowParallelLinear,
    TPGroup,
)

__all__ = ["AttentionSpec", "WindowedAttention", "window_start"]


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """Shape and switches of one attention layer.

    ``kv_layer``: pool layer with one pool for all attention layers; ``split_layer``: pool
    layer in the layer's own pool when sliding layers have their own (None: ``kv_layer``).
    ``window``: sliding window in tokens, None = global. ``sinks``: per-head sink logits.
    ``qk_norm``: None, ``"rms"`` (weight) or ``"offset"`` (1 + weight) per-head norm before
    RoPE. ``output_gate``: q_proj also emits a per-head gate (``[q | gate]`` per head) and
    the attention output is multiplied by ``sigmoid(gate)``. ``rotary_dim``: leading head
    dims rotated (0 = no RoPE). ``scale``: logit scale (default ``head_dim ** -0.5``).
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_layer: int
    rms_norm_eps: float
    split_layer: int | None = None
    rotary_dim: int
    window: int | None = None
    sinks: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None
    output_gate: bool = False
    scale: float | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.window is not None and self.window < 1:
            raise ValueError(f"window={self.window} is invalid; must be >= 1 or None")
        if self.qk_norm not in (None, "rms", "offset"):
            raise ValueError(f"qk_norm={self.qk_norm!r} is invalid; choose None, 'rms', 'offset'")
        if self.rotary_dim % 2 or not 0 <= self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even and <= head_dim")


def window_start(total: int, extend: int, window: int | None) -> int:
    """First key index a forward adding ``extend`` of ``total`` tokens must read."""
    if window is None:
        return 0
    return max(0, total - extend + 1 - window)


class WindowedAttention(nn.Module):
    """GQA attention of one layer over the paged pool (see the module doc), on one rank of
    ``tp`` (default: the single rank). :attr:`num_heads` and :attr:`num_kv_heads` are this
    rank's (``spec``'s are the model's)."""

    def __init__(self, spec: AttentionSpec, tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp or TPGroup.single()
        heads = HeadSplit(spec.num_heads, spec.num_kv_heads, tp.size, tp.rank)
        self.spec = spec
        self.num_heads = heads.local_heads
        self.num_kv_heads = heads.local_kv_heads
        self.scale = spec.scale if spec.scale is not None else spec.head_dim**-0.5
        q_width = spec.num_heads * spec.head_dim
        h, bias = spec.hidden_size, spec.qkv_bias
        self.q_proj = ColumnParallelLinear(
            h, q_width * (2 if spec.output_gate else 1), bias=bias, tp=tp
        )
        kv = spec.num_kv_heads, spec.head_dim, (heads.first_kv_head, heads.local_kv_heads)
        self.k_proj = HeadParallelLinear(h, *kv, bias=bias, tp=tp)  # replicated past Hkv ranks
        self.v_proj = HeadParallelLinear(h, *kv, bias=bias, tp=tp)
        self.o_proj = RowParallelLinear(q_width, h, bias=spec.o_bias, tp=tp)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if spec.qk_norm is not None:
            norm = OffsetRMSNorm if spec.qk_norm == "offset" else RMSNorm
            self.q_norm = norm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = norm(spec.head_dim, spec.rms_norm_eps)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if spec.sinks else None

    def tp_split_dims(self) -> dict[str, int]:
        """The parameter split besides the parallel linears: the sinks, one per query head
        (dim 0; see :meth:`~hicache.runner.models.hybrid.HybridLM.split_params`)."""
        return {"sinks": 0} if self.sinks is not None else {}

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.spec.rotary_dim
        if r == x.shape[-1]:
            return apply_rotary(x, cos, sin)
        return torch.cat((apply_rotary(x[..., :r], cos, sin), x[..., r:]), dim=-1)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        """``x (T, hidden)``, ``rope = (cos, sin) (T, rotary_dim)`` or None -> ``(T, hidden)``."""
        spec, t = self.spec, x.shape[0]
        h, d = self.num_heads, spec.head_dim
        gate: torch.Tensor | None = None
        if spec.output_gate:
            q, gate = self.q_proj(x).view(t, h, 2 * d).chunk(2, dim=-1)
            gate = gate.reshape(t, h * d)
        else:
            q = self.q_proj(x).view(t, h, d)
        k = self.k_proj(x).view(t, self.num_kv_heads, d)
        v = self.v_proj(x).view(t, self.num_kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None and spec.rotary_dim:
            q, k = self._rotate(q, *rope), self._rotate(k, *rope)

        pool, layer, seq_slots, write = ctx.pool, spec.kv_layer, ctx.seq_slots, ctx.write_slots
        wait = ctx.layer_wait
        if ctx.swa is not None:
            layer = spec.kv_layer if spec.split_layer is None else spec.split_layer
            if spec.window is not None:  # SWA pages were copied before the forward
                pool, seq_slots, write, wait = (
                    ctx.swa.pool,
                    ctx.swa.seq_slots,
                    ctx.swa.write_slots,
                    None,
                )
        k_cache = pool.k_buffer(layer)
        v_cache = pool.v_buffer(layer)
        k_cache[write] = k.to(k_cache.dtype)
        v_cache[write] = v.to(v_cache.dtype)
        if wait is not None:
            wait(layer)

        outs = []
        start = 0
        for i, n in enumerate(ctx.extend_lens):
            total = int(ctx.seq_slots[i].shape[0])  # every position: the full pool's table
            first = window_start(total, n, spec.window)
            slots = seq_slots[i]
            held = total - int(slots.shape[0])  # positions before the slots listed
            if first < held:
                raise ValueError(
                    f"sequence {i}: the sliding layer needs position {first} but its SWA"
                    f" slots start at {held}"
                )
            keys = slots[first - held :]
            q_i = q[start : start + n].transpose(0, 1)  # (H, n, D)
            k_i = k_cache[keys].to(q.dtype).transpose(0, 1)
            v_i = v_cache[keys].to(q.dtype).transpose(0, 1)
            outs.append(self._attend(q_i, k_i, v_i, total - n, first).transpose(0, 1))
            start += n
        out = torch.cat(outs).reshape(t, h * d)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, first: int
    ) -> torch.Tensor:
        """``q (H, n, D)`` at positions ``prefix ..``; ``k``/``v (Hkv, L, D)`` at ``first ..``
        (this rank's heads)."""
        n, length, device = q.shape[1], k.shape[1], q.device
        q_pos = torch.arange(prefix, prefix + n, device=device)[:, None]
        k_pos = torch.arange(first, first + length, device=device)[None, :]
        mask = k_pos <= q_pos
        if self.spec.window is not None:
            mask &= k_pos > q_pos - self.spec.window
        if self.sinks is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True
            )
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        logits = (q @ k.transpose(1, 2)).float() * self.scale
        logits = logits.masked_fill(~mask, float("-inf"))
        sink = self.sinks.float()[:, None, None].expand(-1, n, 1)
        probs = torch.cat((logits, sink), dim=-1).softmax(dim=-1)[..., :-1]
        return (probs.to(v.dtype) @ v).to(q.dtype)
