"""Mamba2 selective state-space mixer (Nemotron-H), chunked, carrying its state.

Per head ``h`` the state ``S (P, N)`` evolves as ``S <- exp(dt_t A_h) S + dt_t x_t B_t^T``,
output ``y_t = S C_t + D_h x_t`` (``x_t (P,)``, ``B_t`` / ``C_t (N,)`` shared by a group's heads,
``dt_t = clamp(softplus(dt_raw + dt_bias), *time_step_limit)``, default ``(0, inf)`` as
``mamba_ssm``; ``time_step_min`` bounds nothing at run time). :func:`ssd_scan` computes it a
chunk at a time: ``y_t = e^{G_t} S_0 C_t + sum_{s<=t} e^{G_t - G_s} (C_t . B_s) dt_s x_s + D
x_t`` and ``S_C = e^{G_C} S_0 + sum_s e^{G_C - G_s} dt_s x_s B_s^T`` (``G_t`` the cumulative
log decay in the chunk); chunk boundaries do not change the result. Output:
``out_proj(group_rms(y * silu(z)) * weight)``. Tensor parallelism: a rank holds
``num_heads / size`` heads and their groups (:meth:`Mamba2Spec.head_split`, the split of
K/V heads): ``n_groups / size`` whole groups, or with more ranks than groups one group
replicated on ``size / n_groups`` ranks (its B/C rows on each, its heads split), the gated
norm's sum of squares then all-reduced over the group's ranks; its state is its own; it
gathers its rows of ``in_proj = [z | x | B | C | dt]`` and the conv's ``[x | B | C]``
(:meth:`Mamba2Mixer.tp_pieces`). Why: ``docs/architecture.md``, "Tensor-parallel models".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hicache.heads import HeadSplit
from hicache.runner.models.norms import GroupGatedRMSNorm
from hicache.runner.models.recurrent import RecurrentContext, RecurrentState, StateSpec, causal_conv
from hicache.runner.parallel import RowParallelLinear, RowPieces, TPGroup

__all__ = ["Mamba2Mixer", "Mamba2Spec", "ssd_scan"]

CHUNK = 64


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x (B, T, H, P)``, ``dt (B, T, H)``, ``a (H,)`` (negative), ``b``/``c (B, T, H, N)``,
    ``state (B, H, P, N)`` -> ``(y (B, T, H, P)`` without the D term``, state')``, fp32."""
    x, b, c = (t.float().transpose(1, 2) for t in (x, b, c))  # (B, H, T, .)
    dt = dt.float().transpose(1, 2)  # (B, H, T)
    log_decay = dt * a.float()[:, None]
    s = state.float()
    outs = []
    for c0 in range(0, x.shape[2], chunk):
        xc = x[:, :, c0 : c0 + chunk] * dt[:, :, c0 : c0 + chunk, None]
        bc, cc = b[:, :, c0 : c0 + chunk], c[:, :, c0 : c0 + chunk]
        cum = log_decay[:, :, c0 : c0 + chunk].cumsum(-1)
        n = xc.shape[2]
        lower = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
        y = ((cc @ bc.transpose(-1, -2)) * decay) @ xc + cum.exp()[..., None] * (
            cc @ s.transpose(-1, -2)
        )
        outs.append(y)
        last = cum[..., -1:]
        s = last.exp()[..., None] * s + (xc * (last - cum).exp()[..., None]).transpose(-1, -2) @ bc
    return torch.cat(outs, dim=2).transpose(1, 2), s


class Mamba2Spec:
    """Sizes of a Mamba2 mixer: ``num_heads`` x ``head_dim`` (intermediate width),
    ``n_groups`` groups of B/C of ``state_size``, conv ``conv_kernel``, biases, and
    ``time_step_limit = (low, high)``, the bounds of every step size ``dt``
    (``0 <= low <= high``, ``high`` may be ``inf``)."""

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        n_groups: int,
        state_size: int,
        conv_kernel: int,
        conv_bias: bool,
        proj_bias: bool,
        time_step_limit: tuple[float, float],
        eps: float,
    ) -> None:
        if num_heads % n_groups:
            raise ValueError(
                f"mamba num_heads={num_heads} is not a multiple of n_groups={n_groups}"
            )
        limit = tuple(float(v) for v in time_step_limit)
        if len(limit) != 2 or not 0.0 <= limit[0] <= limit[1]:  # also refuses NaN
            raise ValueError(
                f"mamba time_step_limit={tuple(time_step_limit)} must be (low, high) with"
                " 0 <= low <= high"
            )
        self.hidden_size = hidden_size
        self.num_heads, self.head_dim = num_heads, head_dim
        self.n_groups, self.state_size = n_groups, state_size
        self.conv_kernel, self.conv_bias, self.proj_bias = conv_kernel, conv_bias, proj_bias
        self.time_step_limit = (limit[0], limit[1])
        self.eps = eps

    def head_split(self, tp: TPGroup) -> HeadSplit:
        """Which heads and groups rank ``tp.rank`` of ``tp.size`` holds: ``num_heads / size``
        heads, and ``n_groups / size`` groups or, when the ranks outnumber the groups, the
        one group its heads read (ValueError naming the numbers unless ``size`` divides
        ``num_heads``, and divides ``n_groups`` or is a multiple of it)."""
        return HeadSplit(
            self.num_heads, self.n_groups, tp.size, tp.rank, names=("mamba_num_heads", "n_groups")
        )

    def split(self, tp: TPGroup) -> Mamba2Spec:
        """The sizes one rank of ``tp`` holds (:meth:`head_split`): its heads and groups
        (one group, part of whose heads other ranks hold, when the groups are replicated)."""
        heads = self.head_split(tp)
        return Mamba2Spec(
            hidden_size=self.hidden_size,
            num_heads=heads.local_heads,
            head_dim=self.head_dim,
            n_groups=heads.local_kv_heads,
            state_size=self.state_size,
            conv_kernel=self.conv_kernel,
            conv_bias=self.conv_bias,
            proj_bias=self.proj_bias,
            time_step_limit=self.time_step_limit,
            eps=self.eps,
        )

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the conv: x, B and C concatenated."""
        return self.inner + 2 * self.n_groups * self.state_size

    @property
    def state(self) -> StateSpec:
        return StateSpec(
            conv=(self.conv_dim, self.conv_kernel - 1),
            ssm=(self.num_heads, self.head_dim, self.state_size),
        )


class Mamba2Mixer(nn.Module):
    """Nemotron-H's Mamba2 mixer (checkpoint names ``mixer.*``).

    ``in_proj`` emits ``[z (inner) | xBC (conv_dim) | dt (heads)]``.
    """

    def __init__(self, full: Mamba2Spec, layer_id: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp or TPGroup.single()
        spec = full.split(tp)
        self.full, self.spec, self.tp = full, spec, tp
        self.heads = full.head_split(tp)
        self.layer_id = layer_id
        self.in_proj = nn.Linear(
            spec.hidden_size, spec.inner + spec.conv_dim + spec.num_heads, bias=spec.proj_bias
        )
        self.conv1d = nn.Conv1d(
            spec.conv_dim,
            spec.conv_dim,
            spec.conv_kernel,
            groups=spec.conv_dim,
            bias=spec.conv_bias,
        )
        self.dt_bias = nn.Parameter(torch.empty(spec.num_heads))
        self.A_log = nn.Parameter(torch.empty(spec.num_heads))
        self.D = nn.Parameter(torch.empty(spec.num_heads))
        self.norm = GroupGatedRMSNorm(
            spec.inner, spec.inner // spec.n_groups, spec.eps, tp=tp, replicas=self.heads.replicas
        )
        self.out_proj = RowParallelLinear(full.inner, spec.hidden_size, bias=spec.proj_bias, tp=tp)

    def tp_pieces(self) -> dict[str, RowPieces]:
        """This rank's rows: its heads' share of ``z``, ``x`` and ``dt`` in ``in_proj``
        (``[z | x | B | C | dt]``) and of ``x`` in the conv (``[x | B | C]``), its groups'
        ``B``/``C`` rows (the same on every rank sharing a group), weights and biases; its
        heads of ``dt_bias``/``A_log``/``D`` and of the norm's weight; ``out_proj``
        row-parallel."""
        f, s = self.full, self.heads
        gs = f.n_groups * f.state_size
        inner = (s.first_head * f.head_dim, s.local_heads * f.head_dim)
        groups = (s.first_kv_head * f.state_size, s.local_kv_heads * f.state_size)
        heads = (s.first_head, s.local_heads)
        in_proj = RowPieces.within(
            [f.inner, f.inner, gs, gs, f.num_heads], [inner, inner, groups, groups, heads]
        )
        conv = RowPieces.within([f.inner, gs, gs], [inner, groups, groups])
        per_head = RowPieces.within([f.num_heads], [heads])
        out = {
            "in_proj.weight": in_proj,
            "conv1d.weight": conv,
            "dt_bias": per_head,
            "A_log": per_head,
            "D": per_head,
            "norm.weight": RowPieces.within([f.inner], [inner]),
        }
        if f.proj_bias:
            out["in_proj.bias"] = in_proj
        if f.conv_bias:
            out["conv1d.bias"] = conv
        return out

    def forward(self, x: torch.Tensor, rctx: RecurrentContext) -> torch.Tensor:
        """``x (T, hidden)`` -> ``(T, hidden)``; reads and records this layer's state."""
        return rctx.run(self.layer_id, self.spec.state, x, self._step)

    def _step(self, x: torch.Tensor, state: RecurrentState) -> tuple[torch.Tensor, RecurrentState]:
        """``x (B, n, hidden)`` from ``state`` -> ``(B, n, hidden)`` and the new state."""
        sp = self.spec
        bsz, n, _ = x.shape
        z, xbc, dt = self.in_proj(x).split([sp.inner, sp.conv_dim, sp.num_heads], dim=-1)
        conv_out, conv_state = causal_conv(
            xbc.transpose(1, 2), state.conv, self.conv1d.weight, self.conv1d.bias
        )
        gs = sp.n_groups * sp.state_size
        xs, b, c = conv_out.transpose(1, 2).split([sp.inner, gs, gs], dim=-1)
        per_group = sp.num_heads // sp.n_groups
        b = b.reshape(bsz, n, sp.n_groups, sp.state_size).repeat_interleave(per_group, dim=2)
        c = c.reshape(bsz, n, sp.n_groups, sp.state_size).repeat_interleave(per_group, dim=2)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*sp.time_step_limit)
        xs = xs.reshape(bsz, n, sp.num_heads, sp.head_dim)
        y, ssm = ssd_scan(xs, dt, -self.A_log.float().exp(), b, c, state.ssm)
        y = y + self.D.float()[:, None] * xs.float()
        y = self.norm(y.reshape(bsz, n, sp.inner).to(x.dtype), z)
        return self.out_proj(y), RecurrentState(conv=conv_state, ssm=ssm)
