"""Gated DeltaNet linear attention (Qwen3-Next), chunked, carrying its state.

Per value head the state ``S (Dk, Dv)`` evolves token by token as ``S <- exp(g_t) S``;
``u_t = beta_t (v_t - S^T k_t)``; ``S <- S + k_t u_t^T``; output ``o_t = S^T q_t`` (``q``,
``k`` L2-normalized, ``q`` scaled by ``Dk ** -0.5``). :func:`gated_delta_rule` computes it a
chunk at a time: with cumulative log decay ``G_t`` from the chunk start, the deltas solve
the unit lower triangular ``(I + A) U = beta V - (beta e^G K) S_0``, ``A[s, r] = beta_s
e^{G_s - G_r} k_s . k_r`` (r < s); then ``o_t = e^{G_t} S_0^T q_t + sum_{s<=t} e^{G_t - G_s}
(q_t . k_s) u_s`` and ``S_C = e^{G_C} S_0 + sum_s e^{G_C - G_s} k_s u_s^T``. Invariant: chunk
boundaries do not change the result, so a prefill can be split anywhere and resumed from
the returned state. Tensor parallelism: a rank holds ``num_v_heads / size`` value heads and
their key heads (:meth:`GatedDeltaNetSpec.head_split`, the split of K/V heads):
``num_k_heads / size`` key heads with all their value heads, or with more ranks than key
heads one key head replicated on ``size / num_k_heads`` ranks, each with its share of the
value heads; its state is its value heads', and it gathers its rows of each fused part
(:meth:`GatedDeltaNet.tp_pieces`); why this split is exact: ``docs/architecture.md``,
"Tensor-parallel models".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hicache.heads import HeadSplit
from hicache.runner.models.norms import GatedRMSNorm
from hicache.runner.models.recurrent import RecurrentContext, RecurrentState, StateSpec, causal_conv
from hicache.runner.parallel import RowParallelLinear, RowPieces, TPGroup

__all__ = ["GatedDeltaNet", "GatedDeltaNetSpec", "gated_delta_rule"]

CHUNK = 64


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q``/``k (B, T, H, Dk)`` (normalized, scaled), ``v (B, T, H, Dv)``, ``g``/``beta
    (B, T, H)``, ``state (B, H, Dk, Dv)`` -> ``(o (B, T, H, Dv), state')``, all fp32."""
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))  # (B, H, T, .)
    g, beta = g.float().transpose(1, 2), beta.float().transpose(1, 2)  # (B, H, T)
    s = state.float()
    outs = []
    for c0 in range(0, q.shape[2], chunk):
        qc, kc, vc = q[:, :, c0 : c0 + chunk], k[:, :, c0 : c0 + chunk], v[:, :, c0 : c0 + chunk]
        gc, bc = g[:, :, c0 : c0 + chunk], beta[:, :, c0 : c0 + chunk]
        n = qc.shape[2]
        cum = gc.cumsum(-1)  # (B, H, n)
        diff = cum[..., :, None] - cum[..., None, :]  # [t, s] = G_t - G_s
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = diff.masked_fill(~lower, float("-inf")).exp()  # inclusive lower, else 0
        a = (kc @ kc.transpose(-1, -2)) * decay * bc[..., None]
        a = a.tril(-1) + torch.eye(n, dtype=a.dtype, device=a.device)
        rhs = torch.cat((vc * bc[..., None], kc * (bc * cum.exp())[..., None]), dim=-1)
        solved = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
        u = solved[..., : vc.shape[-1]] - solved[..., vc.shape[-1] :] @ s
        intra = ((qc @ kc.transpose(-1, -2)) * decay) @ u
        outs.append((qc * cum.exp()[..., None]) @ s + intra)
        last = cum[..., -1:]
        s = last.exp()[..., None] * s + (kc * (last - cum).exp()[..., None]).transpose(-1, -2) @ u
    return torch.cat(outs, dim=2).transpose(1, 2), s


class GatedDeltaNetSpec:
    """Sizes of a Gated DeltaNet layer (Qwen3-Next names in parentheses).

    ``num_k_heads`` (linear_num_key_heads) of ``k_dim`` (linear_key_head_dim),
    ``num_v_heads`` (linear_num_value_heads, a multiple of num_k_heads) of ``v_dim``, conv
    kernel ``conv_kernel`` (linear_conv_kernel_dim).
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        k_dim: int,
        v_dim: int,
        conv_kernel: int,
        eps: float,
    ) -> None:
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads={num_v_heads} is not a multiple of {num_k_heads}")
        self.hidden_size = hidden_size
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.k_dim, self.v_dim = k_dim, v_dim
        self.conv_kernel = conv_kernel
        self.eps = eps

    def head_split(self, tp: TPGroup) -> HeadSplit:
        """Which value and key heads rank ``tp.rank`` of ``tp.size`` holds:
        ``num_v_heads / size`` value heads, and ``num_k_heads / size`` key heads or, when the
        ranks outnumber the key heads, the one key head its value heads read (ValueError
        naming the numbers unless ``size`` divides ``num_v_heads``, and divides
        ``num_k_heads`` or is a multiple of it)."""
        return HeadSplit(
            self.num_v_heads,
            self.num_k_heads,
            tp.size,
            tp.rank,
            names=("linear_num_value_heads", "linear_num_key_heads"),
        )

    def split(self, tp: TPGroup) -> GatedDeltaNetSpec:
        """The sizes one rank of ``tp`` holds (:meth:`head_split`): its key heads and value
        heads (one key head and part of its value heads when the key heads are
        replicated)."""
        heads = self.head_split(tp)
        return GatedDeltaNetSpec(
            hidden_size=self.hidden_size,
            num_k_heads=heads.local_kv_heads,
            num_v_heads=heads.local_heads,
            k_dim=self.k_dim,
            v_dim=self.v_dim,
            conv_kernel=self.conv_kernel,
            eps=self.eps,
        )

    @property
    def conv_dim(self) -> int:
        """Channels through the conv: q, k and v concatenated."""
        return 2 * self.num_k_heads * self.k_dim + self.num_v_heads * self.v_dim

    @property
    def state(self) -> StateSpec:
        return StateSpec(
            conv=(self.conv_dim, self.conv_kernel - 1),
            ssm=(self.num_v_heads, self.k_dim, self.v_dim),
        )


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear-attention mixer (checkpoint names ``linear_attn.*``).

    ``in_proj_qkvz`` emits, per key head, ``[q (Dk) | k (Dk) | v (r*Dv) | z (r*Dv)]`` with
    ``r = num_v_heads / num_k_heads``; ``in_proj_ba`` emits ``[b (r) | a (r)]`` per key head.
    ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``.
    """

    def __init__(self, full: GatedDeltaNetSpec, layer_id: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp or TPGroup.single()
        spec = full.split(tp)
        self.full, self.spec, self.tp = full, spec, tp
        self.heads = full.head_split(tp)
        self.layer_id = layer_id
        hk, hv = spec.num_k_heads, spec.num_v_heads
        self.in_proj_qkvz = nn.Linear(
            spec.hidden_size, 2 * hk * spec.k_dim + 2 * hv * spec.v_dim, bias=False
        )
        self.in_proj_ba = nn.Linear(spec.hidden_size, 2 * hv, bias=False)
        self.conv1d = nn.Conv1d(
            spec.conv_dim, spec.conv_dim, spec.conv_kernel, groups=spec.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.empty(hv))
        self.A_log = nn.Parameter(torch.empty(hv))
        self.norm = GatedRMSNorm(spec.v_dim, spec.eps)
        self.out_proj = RowParallelLinear(
            full.num_v_heads * spec.v_dim, spec.hidden_size, bias=False, tp=tp
        )

    def tp_pieces(self) -> dict[str, RowPieces]:
        """This rank's rows: of ``in_proj_qkvz``/``in_proj_ba``, per key head it holds, the
        key head's ``q``/``k`` (the same on every rank sharing it) and its value heads'
        share of ``v``/``z`` (``b``/``a``); of the conv its key heads' q and k channels and
        its value heads' v channels; of ``dt_bias``/``A_log`` its value heads; ``norm``
        (per head dim) is whole, ``out_proj`` row-parallel."""
        f, s = self.full, self.heads
        r = f.num_v_heads // f.num_k_heads
        first = s.first_head - s.first_kv_head * r  # within each key head: its value heads
        count = s.local_heads // s.local_kv_heads
        kd, vd = f.k_dim, f.v_dim
        block = 2 * kd + 2 * r * vd
        qkvz: list[tuple[int, int]] = []
        ba: list[tuple[int, int]] = []
        for kh in s.kv_heads:
            at = kh * block
            qkvz += [
                (at, 2 * kd),
                (at + 2 * kd + first * vd, count * vd),
                (at + 2 * kd + (r + first) * vd, count * vd),
            ]
            ba += [(kh * 2 * r + first, count), (kh * 2 * r + r + first, count)]
        keys = (s.first_kv_head * kd, s.local_kv_heads * kd)
        values = (s.first_head, s.local_heads)
        per_value = RowPieces.within([f.num_v_heads], [values])
        return {
            "in_proj_qkvz.weight": RowPieces.merged(qkvz),
            "in_proj_ba.weight": RowPieces.merged(ba),
            "conv1d.weight": RowPieces.within(
                [f.num_k_heads * kd, f.num_k_heads * kd, f.num_v_heads * vd],
                [keys, keys, (s.first_head * vd, s.local_heads * vd)],
            ),
            "dt_bias": per_value,
            "A_log": per_value,
        }

    def forward(self, x: torch.Tensor, rctx: RecurrentContext) -> torch.Tensor:
        """``x (T, hidden)`` -> ``(T, hidden)``; reads and records this layer's state."""
        return rctx.run(self.layer_id, self.spec.state, x, self._step)

    def _step(self, x: torch.Tensor, state: RecurrentState) -> tuple[torch.Tensor, RecurrentState]:
        """``x (B, n, hidden)`` from ``state`` -> ``(B, n, hidden)`` and the new state."""
        sp = self.spec
        b, n, _ = x.shape
        hk, hv, r = sp.num_k_heads, sp.num_v_heads, sp.num_v_heads // sp.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(b, n, hk, 2 * sp.k_dim + 2 * r * sp.v_dim)
        q, k, v, z = qkvz.split([sp.k_dim, sp.k_dim, r * sp.v_dim, r * sp.v_dim], dim=-1)
        ba = self.in_proj_ba(x).view(b, n, hk, 2 * r)
        beta = ba[..., :r].reshape(b, n, hv).sigmoid()
        a = ba[..., r:].reshape(b, n, hv)
        mixed = torch.cat((q.reshape(b, n, -1), k.reshape(b, n, -1), v.reshape(b, n, -1)), -1)
        conv_out, conv_state = causal_conv(
            mixed.transpose(1, 2), state.conv, self.conv1d.weight, None
        )
        q, k, v = conv_out.transpose(1, 2).split([hk * sp.k_dim, hk * sp.k_dim, hv * sp.v_dim], -1)
        q = q.reshape(b, n, hk, sp.k_dim).repeat_interleave(r, dim=2).float()
        k = k.reshape(b, n, hk, sp.k_dim).repeat_interleave(r, dim=2).float()
        q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + 1e-6) * sp.k_dim**-0.5
        k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + 1e-6)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        o, ssm = gated_delta_rule(q, k, v.reshape(b, n, hv, sp.v_dim), g, beta, state.ssm)
        o = self.norm(o.to(x.dtype), z.reshape(b, n, hv, sp.v_dim))
        return self.out_proj(o.reshape(b, n, -1)), RecurrentState(conv=conv_state, ssm=ssm)
