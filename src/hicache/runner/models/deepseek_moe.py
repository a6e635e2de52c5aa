"""DeepSeek-V2/V3 feed-forward blocks: the dense SwiGLU MLP and the MoE (routed experts,
shared experts, the routers), split over tensor-parallel ranks.

Routers score in fp32, and every rank computes the same choice from the same input.
DeepSeek-V2 (:class:`SoftmaxGroupRouter`): softmax over all experts, then ``greedy`` or
``group_limited_greedy`` (the ``topk_group`` of ``n_group`` groups with the best single
expert), weights the chosen scores times ``routed_scaling_factor``. DeepSeek-V3
(``noaux_tc``, :class:`~hicache.runner.models.moe.Router` in ``SIGMOID_GROUPED`` mode):
sigmoid scores, the choice adding ``e_score_correction_bias`` over the ``topk_group`` best
groups (each scored by its two best experts), weights the unbiased scores (renormalized
when ``norm_topk_prob``) times the scaling factor. Tensor parallelism splits every expert
and the dense MLP by intermediate columns (gate/up rows ``[rank * I / size, ...)``, down the
same input columns), with one all-reduce per MoE layer for routed and shared experts
together. Why columns rather than whole experts: ``docs/architecture.md``, "MLA".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hicache.runner.models.moe import GatedExperts, Router, Routing, RoutingConfig, RoutingMode
from hicache.runner.parallel import ColumnParallelLinear, RowParallelLinear, TPGroup

__all__ = [
    "DeepseekMLP",
    "DeepseekMoE",
    "MoEConfig",
    "RouterKind",
    "SoftmaxGroupRouter",
    "expert_shard_dims",
]


class RouterKind(enum.Enum):
    """How a DeepSeek MoE layer picks its experts (see the module doc)."""

    GREEDY = "greedy"
    """V2: top-k of the softmax over every expert."""
    GROUP_LIMITED_GREEDY = "group_limited_greedy"
    """V2: top-k inside the ``topk_group`` groups with the best single softmax score."""
    NOAUX_TC = "noaux_tc"
    """V3: sigmoid scores, bias-corrected group-limited choice."""


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """One DeepSeek MoE layer: ``num_experts`` routed experts of ``intermediate_size``
    columns, ``top_k`` per token, ``num_shared`` always-on experts (one MLP of
    ``num_shared * intermediate_size`` columns), routed by ``router`` over ``num_groups``
    groups keeping ``topk_groups``; ``norm_topk_prob`` renormalizes the chosen weights
    (V3), ``scaling`` multiplies them."""

    router: RouterKind
    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared: int
    num_groups: int = 1
    topk_groups: int = 1
    norm_topk_prob: bool = False
    scaling: float = 1.0

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size", "num_groups", "topk_groups"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"moe {name}={v!r} is invalid; must be an int >= 1")
        if not isinstance(self.num_shared, int) or self.num_shared < 0:
            raise ValueError(f"moe num_shared={self.num_shared!r} is invalid; must be >= 0")
        if not self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.num_experts % self.num_groups or self.topk_groups > self.num_groups:
            raise ValueError(
                f"n_group={self.num_groups} / topk_group={self.topk_groups} do not fit "
                f"{self.num_experts} experts (groups must divide them, topk_group <= n_group)"
            )
        if self.router is RouterKind.NOAUX_TC and self.num_experts // self.num_groups < 2:
            raise ValueError(
                f"noaux_tc routing scores a group by its two best experts; {self.num_experts}"
                f" experts in {self.num_groups} groups leave fewer than two per group"
            )
        if self.router is not RouterKind.NOAUX_TC and self.norm_topk_prob:
            raise ValueError(
                "norm_topk_prob is only supported with noaux_tc routing (DeepSeek-V3); the"
                " DeepSeek-V2 reference does not renormalize"
            )

    @property
    def limited(self) -> tuple[int, int]:
        """``(groups, kept groups)`` of the choice; ``(1, 1)`` for plain greedy."""
        if self.router is RouterKind.GREEDY:
            return 1, 1
        return self.num_groups, self.topk_groups


class SoftmaxGroupRouter(nn.Module):
    """DeepSeek-V2's router: ``weight (E, hidden)``; softmax scores, (group-limited) greedy."""

    def __init__(self, hidden_size: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> Routing:
        """``x (T, hidden)`` -> :class:`Routing` with ``k = top_k``, fp32 weights."""
        cfg = self.cfg
        scores = F.linear(x.float(), self.weight.float()).softmax(dim=-1)
        groups, kept = cfg.limited
        if groups > 1:
            grouped = scores.view(scores.shape[0], groups, -1)
            best = grouped.amax(dim=-1).topk(kept, dim=-1).indices
            keep = torch.zeros(best.shape[0], groups, dtype=torch.bool, device=x.device)
            keep.scatter_(1, best, True)
            scores = grouped.masked_fill(~keep[..., None], 0.0).view_as(scores)
        weight, index = scores.topk(cfg.top_k, dim=-1)
        return Routing(index=index, weight=weight * cfg.scaling)


class DeepseekMLP(nn.Module):
    """SwiGLU ``down(silu(gate x) * up x)`` split by intermediate columns over ``tp``:
    ``gate_proj``/``up_proj`` column-parallel, ``down_proj`` row-parallel."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=False, tp=tp)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=False, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, tp=tp)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, ``x (T, hidden)`` -> ``(T, hidden)``, before
        the sum over the ranks."""
        h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        return F.linear(h, self.down_proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (T, hidden)`` -> ``(T, hidden)`` (summed over the ranks)."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DeepseekMoE(nn.Module):
    """``mlp.gate`` (the router), ``mlp.experts`` (stacked, each expert's intermediate
    columns split over ``tp``) and ``mlp.shared_experts``; one all-reduce per forward."""

    def __init__(self, hidden_size: int, cfg: MoEConfig, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.gate: Router | SoftmaxGroupRouter
        if cfg.router is RouterKind.NOAUX_TC:
            routing = RoutingConfig(
                mode=RoutingMode.SIGMOID_GROUPED,
                num_experts=cfg.num_experts,
                top_k=cfg.top_k,
                renormalize=cfg.norm_topk_prob,
                num_groups=cfg.num_groups,
                topk_groups=cfg.topk_groups,
                scaling=cfg.scaling,
            )
            self.gate = Router(hidden_size, routing)
        else:
            self.gate = SoftmaxGroupRouter(hidden_size, cfg)
        local = tp.part(cfg.intermediate_size, "moe_intermediate_size columns")
        self.experts = GatedExperts(cfg.num_experts, hidden_size, local)
        self.shared_experts: DeepseekMLP | None = None
        if cfg.num_shared:
            self.shared_experts = DeepseekMLP(
                hidden_size, cfg.num_shared * cfg.intermediate_size, tp
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (T, hidden)`` -> ``(T, hidden)``."""
        y = self.experts(x, self.gate(x))
        if self.shared_experts is not None:
            y = y + self.shared_experts.partial(x)
        return self.tp.all_reduce(y)


def expert_shard_dims(model: nn.Module) -> dict[str, int]:
    """For every stacked expert parameter of ``model`` split by :class:`DeepseekMoE`: its
    name -> the dimension of ONE expert's checkpoint tensor that is split (gate/up: 0, the
    intermediate rows; down: 1, the intermediate columns)."""
    out: dict[str, int] = {}
    for prefix, m in model.named_modules():
        if isinstance(m, DeepseekMoE):
            base = f"{prefix}.experts." if prefix else "experts."
            out.update({base + "gate_proj": 0, base + "up_proj": 0, base + "down_proj": 1})
    return out
