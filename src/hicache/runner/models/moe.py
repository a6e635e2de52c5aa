"""Routed mixture of experts: routers, expert banks and the token dispatch.

A router turns ``x (T, hidden)`` into :class:`Routing` (``index (T, k)`` expert ids,
``weight (T, k)`` mixing weights); an expert bank stacks all experts' weights on a leading
expert dim. :func:`dispatch` groups the ``T*k`` (token, expert) pairs by expert with one
sort and loops over the experts that received tokens (never over tokens): gather, run,
scale by the weight, scatter-add. Modes (:class:`RoutingMode`): ``SOFTMAX_TOPK``
(Qwen3-Next: softmax, top-k, optionally renormalized), ``TOPK_SOFTMAX`` (GPT-OSS: top-k of
the biased logits, softmax over the k), ``SIGMOID_GROUPED`` (Nemotron-H, DeepSeek-V3:
sigmoid scores; the choice adds a correction bias over the ``topk_group`` best groups, each
scored by its two best experts; weights the unbiased scores, optionally renormalized,
times ``scaling``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hicache.runner.parallel import RowPieces, TPGroup

__all__ = [
    "ClampedSwigluExperts",
    "GatedExperts",
    "PlainExperts",
    "Router",
    "Routing",
    "RoutingConfig",
    "RoutingMode",
    "dispatch",
]


class RoutingMode(enum.Enum):
    SOFTMAX_TOPK = "softmax_topk"
    TOPK_SOFTMAX = "topk_softmax"
    SIGMOID_GROUPED = "sigmoid_grouped"


@dataclass(frozen=True, kw_only=True)
class RoutingConfig:
    """How a router picks ``top_k`` of ``num_experts`` (see the module doc)."""

    mode: RoutingMode
    num_experts: int
    top_k: int
    renormalize: bool = False
    bias: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    scaling: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} is invalid; must be in [1, num_experts={self.num_experts}]"
            )
        if self.num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(
                f"num_groups={self.num_groups} / topk_groups={self.topk_groups} do not fit "
                f"num_experts={self.num_experts}"
            )


@dataclass(frozen=True)
class Routing:
    """``index (T, k)`` int64 expert ids and ``weight (T, k)`` fp32 mixing weights."""

    index: torch.Tensor
    weight: torch.Tensor


class Router(nn.Module):
    """Linear scores ``weight (E, hidden)`` (+ ``bias (E,)``) and the top-k choice.

    ``SIGMOID_GROUPED`` also has the buffer-like parameter ``e_score_correction_bias (E,)``.
    Scores are computed in fp32.
    """

    def __init__(self, hidden_size: int, cfg: RoutingConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(cfg.num_experts)) if cfg.bias else None
        self.e_score_correction_bias: nn.Parameter | None = None
        if cfg.mode is RoutingMode.SIGMOID_GROUPED:
            self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> Routing:
        """``x (T, hidden)`` -> :class:`Routing` with ``k = top_k``."""
        cfg = self.cfg
        bias = None if self.bias is None else self.bias.float()
        logits = F.linear(x.float(), self.weight.float(), bias)
        if cfg.mode is RoutingMode.TOPK_SOFTMAX:
            top, index = logits.topk(cfg.top_k, dim=-1)
            return Routing(index=index, weight=top.softmax(dim=-1))
        if cfg.mode is RoutingMode.SOFTMAX_TOPK:
            weight, index = logits.softmax(dim=-1).topk(cfg.top_k, dim=-1)
            if cfg.renormalize:
                weight = weight / weight.sum(dim=-1, keepdim=True)
            return Routing(index=index, weight=weight)
        scores = logits.sigmoid()
        assert self.e_score_correction_bias is not None
        choice = scores + self.e_score_correction_bias.float()
        if cfg.num_groups > 1:
            grouped = choice.view(choice.shape[0], cfg.num_groups, -1)
            group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(cfg.topk_groups, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
        index = choice.topk(cfg.top_k, dim=-1).indices
        weight = scores.gather(1, index)
        if cfg.renormalize:
            weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(index=index, weight=weight * cfg.scaling)


ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


def dispatch(x: torch.Tensor, routing: Routing, num_experts: int, expert: ExpertFn) -> torch.Tensor:
    """``sum_j routing.weight[t, j] * expert(routing.index[t, j], x[t])`` for every token.

    ``x (T, hidden)``; ``expert(e, rows (n, hidden)) -> (n, hidden)``. One stable sort
    groups the pairs by expert; the loop runs over experts that got tokens. Accumulates in
    fp32 and returns ``x``'s dtype.
    """
    k = routing.index.shape[1]
    flat = routing.index.reshape(-1)
    order = flat.argsort(stable=True)
    tokens = order // k
    weights = routing.weight.reshape(-1)[order]
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # one host sync
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start : start + n]
        y = expert(e, x.index_select(0, rows))
        out.index_add_(0, rows, y.float() * weights[start : start + n, None])
        start += n
    return out.to(x.dtype)


class _StackedExperts(nn.Module):
    """What the stacked experts share: ``num_experts`` experts, each with input projections
    ``INPUTS`` ``(E, I, hidden)`` and ``down_proj (E, hidden, I)`` (nn.Linear layout per
    expert, so checkpoints' ``experts.{e}.{proj}.weight`` load into row ``e``). With ``tp``,
    ``intermediate_size`` is the full one and each rank holds its ``1 / size`` of every
    expert's columns (:meth:`tp_pieces`); the output is then this rank's partial sum (the
    caller all-reduces). Without it, the sizes are taken as given."""

    INPUTS: tuple[str, ...] = ()

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.tp = tp
        self.intermediate_size = intermediate_size
        local = intermediate_size if tp is None else tp.part(intermediate_size, "expert columns")
        for name in self.INPUTS:
            self.register_parameter(
                name, nn.Parameter(torch.empty(num_experts, local, hidden_size))
            )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, local))

    def tp_pieces(self) -> dict[str, RowPieces]:
        """A rank's slice of one expert's checkpoint tensors (none without ``tp``): rows of
        the input projections ``(I, hidden)``, columns of ``down_proj (hidden, I)``."""
        if self.tp is None:
            return {}
        rows = RowPieces.split([self.intermediate_size], self.tp, "expert columns")
        return {**{name: rows for name in self.INPUTS}, "down_proj": RowPieces(1, rows.pieces)}

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on ``x (n, hidden)`` -> ``(n, hidden)``."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """``x (T, hidden)`` -> routed mixture ``(T, hidden)``."""
        return dispatch(x, routing, self.num_experts, self.expert)


class GatedExperts(_StackedExperts):
    """SwiGLU experts: ``down_e(silu(gate_e x) * up_e x)``; ``gate_proj``/``up_proj``
    ``(E, I, hidden)`` (see :class:`_StackedExperts`)."""

    INPUTS = ("gate_proj", "up_proj")
    gate_proj: nn.Parameter
    up_proj: nn.Parameter

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(F.linear(x, self.gate_proj[e])) * F.linear(x, self.up_proj[e])
        return F.linear(h, self.down_proj[e])


class PlainExperts(_StackedExperts):
    """Non-gated experts (Nemotron-H): ``down_e(relu(up_e x) ** 2)``; ``up_proj (E, I,
    hidden)`` (see :class:`_StackedExperts`)."""

    INPUTS = ("up_proj",)
    up_proj: nn.Parameter

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.relu(F.linear(x, self.up_proj[e])).square(), self.down_proj[e])


class ClampedSwigluExperts(nn.Module):
    """GPT-OSS experts, in the checkpoint's ``x @ W`` layout with biases.

    ``gate_up_proj (E, hidden, 2I)`` interleaves gate (even columns) and up (odd);
    ``down_proj (E, I, hidden)``. ``h = (clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)``
    with ``g = min(gate, limit)``.

    Over a tensor-parallel group ``tp`` (default: one rank) each rank holds ``I / size`` of
    every expert's intermediate columns: the contiguous ``2I / size`` columns of
    ``gate_up_proj`` (and its bias), whole (gate, up) pairs since the slice starts on an
    even column, and the matching ``I / size`` rows of ``down_proj``
    (:meth:`tp_split_dims`). The output is then this rank's partial sum, which the caller
    all-reduces; ``down_proj_bias`` (whole) is added by rank 0 alone, so once in the sum.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        alpha: float,
        limit: float,
        *,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        tp = tp or TPGroup.single()
        local = tp.part(intermediate_size, "expert intermediate columns")
        self.num_experts = num_experts
        self.alpha = alpha
        self.limit = limit
        self.split = tp.size > 1
        self.add_down_bias = tp.rank == 0
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * local))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * local))
        self.down_proj = nn.Parameter(torch.empty(num_experts, local, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))

    def tp_split_dims(self) -> dict[str, int]:
        """The stacked parameters this rank holds a slice of: name -> dim (see the class
        doc); none with one rank."""
        if not self.split:
            return {}
        return {"gate_up_proj": 2, "gate_up_proj_bias": 1, "down_proj": 1}

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on ``x (n, hidden)`` -> ``(n, hidden)`` (this rank's part of it)."""
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
        gate = gate_up[:, 0::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(-self.limit, self.limit)
        h = (up + 1) * gate * torch.sigmoid(gate * self.alpha)
        out = h @ self.down_proj[e]
        return out + self.down_proj_bias[e] if self.add_down_bias else out

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """``x (T, hidden)`` -> routed mixture ``(T, hidden)`` (this rank's partial sum
        under tensor parallelism)."""
        return dispatch(x, routing, self.num_experts, self.expert)
