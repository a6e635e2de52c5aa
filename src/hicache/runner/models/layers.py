"""Small building blocks of the decoders: RMSNorm, activations and the dense MLPs."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hicache.runner.parallel import ColumnParallelLinear, RowParallelLinear, TPGroup

__all__ = ["ACTIVATIONS", "GatedMLP", "PlainMLP", "RMSNorm"]


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last dim.

    The normalization runs in fp32; the result is cast back to the input dtype before the
    weight is applied (the Hugging Face order, which matters for bf16).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (..., dim)`` -> same shape and dtype."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu2": lambda x: F.relu(x).square(),
}
"""Activations by their Hugging Face ``hidden_act`` names."""


class GatedMLP(nn.Module):
    """Gated feed-forward: ``down(act(gate(x)) * up(x))`` (SwiGLU with the default ``silu``).

    Over a tensor-parallel group ``tp`` (default: one rank) each rank holds
    ``intermediate_size / size`` columns: ``gate``/``up`` are column-parallel (their rows of
    the weight), ``down`` row-parallel (its columns), so the one all-reduce is ``down``'s.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        act: str = "silu",
        *,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        tp = tp or TPGroup.single()
        self.act = ACTIVATIONS[act]
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, tp=tp)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (T, hidden)`` -> ``(T, hidden)``."""
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of :meth:`forward`, before the sum over the ranks and without
        ``down``'s bias: ``x (T, hidden)`` -> ``(T, hidden)`` (a caller adding it to other
        partial sums runs one all-reduce for all of them)."""
        return F.linear(self.act(self.gate_proj(x)) * self.up_proj(x), self.down_proj.weight)


class PlainMLP(nn.Module):
    """Non-gated feed-forward (Nemotron-H): ``down(act(up(x)))``, split over ``tp`` by
    intermediate columns as :class:`GatedMLP`."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        act: str,
        *,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        tp = tp or TPGroup.single()
        self.act = ACTIVATIONS[act]
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (T, hidden)`` -> ``(T, hidden)``."""
        return self.down_proj(self.act(self.up_proj(x)))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of :meth:`forward` (see :meth:`GatedMLP.partial`)."""
        return F.linear(self.act(self.up_proj(x)), self.down_proj.weight)
