"""RMSNorm variants of the hybrid families (the plain one is :class:`layers.RMSNorm`).

All normalize in fp32 over the last dim (or over groups of it) and return the input dtype.
A group spread over several tensor-parallel ranks (Mamba2 with fewer groups than ranks) has
its sum of squares added over them by one all-reduce (:class:`GroupGatedRMSNorm`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hicache.runner.parallel import TPGroup

__all__ = ["GatedRMSNorm", "GroupGatedRMSNorm", "OffsetRMSNorm"]


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2) + eps)`` over the last dim, in fp32."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class OffsetRMSNorm(nn.Module):
    """Gemma / Qwen3-Next style: ``rms(x) * (1 + weight)``, weight stored around 0, all fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (..., dim)`` -> same shape and dtype."""
        return (_rms(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Qwen3-Next's output norm of Gated DeltaNet: ``weight * rms(x) * silu(gate)``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``x``, ``gate (..., dim)`` -> ``(..., dim)`` in ``x``'s dtype."""
        normed = self.weight * _rms(x, self.eps).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)


class GroupGatedRMSNorm(nn.Module):
    """Mamba2's output norm (gate first): ``weight * group_rms(x * silu(gate))``.

    The last dim (``dim``) is split into groups of ``group_size``, each normalized alone.
    ``replicas`` > 1: this rank's ``dim`` is one share of a single group whose other
    ``replicas - 1`` shares the neighbouring ranks of ``tp`` hold (ranks ``[g * replicas,
    (g + 1) * replicas)`` share group ``g``): the group's mean square is the sum of the
    shares' sums of squares over ``dim * replicas``, added by one all-reduce over ``tp``
    (each rank's sum in its group's column, zeros elsewhere).
    """

    def __init__(
        self,
        dim: int,
        group_size: int,
        eps: float,
        *,
        tp: TPGroup | None = None,
        replicas: int = 1,
    ) -> None:
        super().__init__()
        if dim % group_size:
            raise ValueError(f"group_size={group_size} must divide dim={dim}")
        tp = tp or TPGroup.single()
        if replicas < 1 or tp.size % replicas or (replicas > 1 and group_size != dim):
            raise ValueError(
                f"replicas={replicas} must divide the tensor-parallel size {tp.size}, and a"
                f" group shared by ranks must be the rank's whole dim={dim}"
                f" (group_size={group_size})"
            )
        self.eps = eps
        self.group_size = group_size
        self.tp, self.replicas = tp, replicas
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``x``, ``gate (..., dim)`` -> ``(..., dim)`` in ``x``'s dtype."""
        gated = x.float() * F.silu(gate.float())
        if self.replicas > 1:
            group = self.tp.rank // self.replicas
            squares = gated.new_zeros(*gated.shape[:-1], self.tp.size // self.replicas)
            squares[..., group] = gated.pow(2).sum(-1)
            total = self.tp.all_reduce(squares)[..., group : group + 1]
            mean = total / (gated.shape[-1] * self.replicas)
            return self.weight * (gated * torch.rsqrt(mean + self.eps)).to(x.dtype)
        shape = gated.shape
        grouped = _rms(gated.view(*shape[:-1], -1, self.group_size), self.eps).view(shape)
        return self.weight * grouped.to(x.dtype)
