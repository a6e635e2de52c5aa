"""The DSA indexer of DeepSeek sparse attention (DeepSeek-V3.2), over the paged key cache.

For every query the indexer scores every earlier token and keeps the ``topk`` best; the
layer's MLA attends to those only. With ``n`` new tokens and ``H`` heads of ``D =
index_head_dim``: keys ``k = rope(LayerNorm(wk(x)))`` ``(n, D)``, cached in the ``"indexer"``
L1 pool on the full KV's slots; queries ``q = rope(wq_b(q_resid))`` ``(n, H, D)``; weights
``w = weights_proj(x) / sqrt(H)`` ``(n, H)``; the score of query ``s`` against token ``t`` is
``sum_h w[s, h] * relu(q[s, h] . k[t] / sqrt(D))`` in fp32. Invariants: the selection takes
the ``min(topk, context)`` best of each row, causally masked before the top-k; equal scores
go to the earlier token, so the selection does not depend on the row's length (only there
may it differ from the reference's ``torch.topk``). RoPE is the half-split kind on the
first ``rope_dim`` values of each head. Parameter names follow the checkpoint (``wq_b``,
``wk``, ``k_norm``, ``weights_proj``), all in the model's dtype. Why fp32 and no Hadamard
rotation: ``docs/architecture.md``, "Hybrid models" (the indexer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hicache.memory import DevicePool
from hicache.runner.models.rope import apply_rotary
from hicache.validate import int_at_least

__all__ = ["DsaIndexer", "IndexerShape", "read_keys", "sparse_mask", "write_keys"]


@dataclass(frozen=True, kw_only=True)
class IndexerShape:
    """One layer's indexer: ``hidden_size``, the MLA query rank ``q_lora_rank``,
    ``n_heads`` heads of ``head_dim`` values (``index_n_heads``, ``index_head_dim``), of
    which the first ``rope_dim`` (``qk_rope_head_dim``) are rotated, and ``topk``
    (``index_topk``) tokens kept per query."""

    hidden_size: int
    q_lora_rank: int
    n_heads: int
    head_dim: int
    rope_dim: int
    topk: int

    def __post_init__(self) -> None:
        for name in ("hidden_size", "q_lora_rank", "n_heads", "head_dim", "topk"):
            int_at_least(name, getattr(self, name), 1)
        int_at_least("rope_dim", self.rope_dim, 0)
        if self.rope_dim > self.head_dim or self.rope_dim % 2:
            raise ValueError(
                f"rope_dim={self.rope_dim} must be even and at most head_dim={self.head_dim}"
            )


class DsaIndexer(nn.Module):
    """The indexer's weights and its three steps (keys, scores, selection)."""

    def __init__(self, shape: IndexerShape) -> None:
        super().__init__()
        self.shape = shape
        h, d = shape.n_heads, shape.head_dim
        self.wq_b = nn.Linear(shape.q_lora_rank, h * d, bias=False)
        self.wk = nn.Linear(shape.hidden_size, d, bias=False)
        self.k_norm = nn.LayerNorm(d, eps=1e-6)
        self.weights_proj = nn.Linear(shape.hidden_size, h, bias=False)
        self.softmax_scale = d**-0.5

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first ``rope_dim`` values of ``x (n, heads, D)``."""
        r = self.shape.rope_dim
        if r == 0:
            return x
        return torch.cat((apply_rotary(x[..., :r], cos, sin), x[..., r:]), dim=-1)

    def keys(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``hidden (n, hidden_size)``, ``cos``/``sin (n, rope_dim)`` -> keys ``(n, D)``."""
        k = self.k_norm(self.wk(hidden)).unsqueeze(1)
        return self._rotate(k, cos, sin).squeeze(1)

    def queries(self, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``q_resid (n, q_lora_rank)`` -> queries ``(n, H, D)``."""
        q = self.wq_b(q_resid).view(q_resid.shape[0], self.shape.n_heads, self.shape.head_dim)
        return self._rotate(q, cos, sin)

    def head_weights(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden (n, hidden_size)`` -> fp32 ``(n, H)``, scaled by ``H ** -0.5``."""
        w = self.weights_proj(hidden.to(self.weights_proj.weight.dtype)).float()
        return w * self.shape.n_heads**-0.5

    def scores(
        self, queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        """fp32 scores ``(n, T)`` of ``queries (n, H, D)`` with ``weights (n, H)`` against
        the context's ``keys (T, D)``."""
        per_head = torch.matmul(queries.float(), keys.float().transpose(0, 1)) * self.softmax_scale
        per_head = F.relu(per_head)  # (n, H, T)
        return torch.matmul(weights.unsqueeze(-2), per_head).squeeze(-2)

    def select(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The attention mask of the selection: bool ``(n, T)``, True where query ``i`` (at
        ``positions[i]``, int64 ``(n,)``) attends to context token ``t``: among the
        ``min(topk, T)`` best of its causally masked row (of equal scores, the earlier
        tokens), and ``t <= positions[i]``."""
        n, t = scores.shape
        causal = torch.arange(t, device=scores.device)[None, :] <= positions[:, None]
        masked = scores.masked_fill(~causal, float("-inf"))
        # a stable sort: equal scores (relu makes exact zeros common) go to the earlier
        # token, whatever the row's length; torch.topk breaks such ties arbitrarily
        order = masked.sort(dim=-1, descending=True, stable=True).indices
        top = order[:, : min(self.shape.topk, t)]
        chosen = torch.zeros((n, t), dtype=torch.bool, device=scores.device)
        chosen.scatter_(-1, top, True)
        return chosen & causal


def write_keys(pool: DevicePool, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
    """Store ``keys (n, D)`` at ``slots (n,)`` of ``layer`` in the indexer's L1 ``pool``
    (cast to its dtype)."""
    buf = pool.latent_buffer(layer)  # (S, 1, D)
    buf[slots.to(buf.device), 0] = keys.to(buf.dtype)


def read_keys(pool: DevicePool, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """The keys ``(len(slots), D)`` at ``slots`` of ``layer`` in ``pool``."""
    buf = pool.latent_buffer(layer)
    return buf[slots.to(buf.device), 0]


def sparse_mask(
    indexer: DsaIndexer,
    pool: DevicePool,
    layer: int,
    *,
    hidden: torch.Tensor,
    q_resid: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    new_slots: torch.Tensor,
    context_slots: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """One sequence's step of a DSA layer: write the keys of its ``n`` new tokens
    (``hidden``, ``q_resid``, ``cos``/``sin`` of their positions) at ``new_slots``, read the
    keys of its whole context (``context_slots``: the slots of positions ``0 .. T - 1``, the
    new ones last) back through ``pool``, and return the bool attention mask ``(n, T)``
    of :meth:`DsaIndexer.select` for the new tokens at ``positions``."""
    if len(new_slots) != hidden.shape[0] or len(positions) != hidden.shape[0]:
        raise ValueError(
            f"{hidden.shape[0]} new tokens with {len(new_slots)} slots and"
            f" {len(positions)} positions"
        )
    write_keys(pool, layer, new_slots, indexer.keys(hidden, cos, sin))
    keys = read_keys(pool, layer, context_slots)
    scores = indexer.scores(indexer.queries(q_resid, cos, sin), indexer.head_weights(hidden), keys)
    return indexer.select(scores, positions.to(scores.device))
