"""The building blocks on their own: chunked scans vs token-by-token recurrences, the MoE
dispatch vs a per-token loop, and the architecture check of the loader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.runner.loader import load_hybrid_model, load_model
from hicache.runner.models import UnsupportedModelError
from hicache.runner.models.gated_deltanet import gated_delta_rule
from hicache.runner.models.hybrid import HybridLM
from hicache.runner.models.mamba2 import ssd_scan
from hicache.runner.models.moe import (
    ClampedSwigluExperts,
    GatedExperts,
    PlainExperts,
    Router,
    RoutingConfig,
    RoutingMode,
)
from hicache.runner.models.registry import SUPPORTED_MODEL_TYPES
from hicache.runner.models.sliding import window_start

gen = torch.Generator().manual_seed(7)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64).float()


def test_gated_delta_rule_chunks_equal_the_recurrence() -> None:
    b, t, h, dk, dv = 2, 11, 3, 4, 5
    q, k = rand(b, t, h, dk), rand(b, t, h, dk)
    k = k / k.norm(dim=-1, keepdim=True)
    v, s0 = rand(b, t, h, dv), rand(b, h, dk, dv)
    g, beta = -rand(b, t, h).abs(), rand(b, t, h).sigmoid()
    s, outs = s0.clone(), []
    for i in range(t):  # the definition, one token at a time
        s = s * g[:, i].exp()[..., None, None]
        u = beta[:, i, :, None] * (v[:, i] - (s * k[:, i, :, :, None]).sum(-2))
        s = s + k[:, i, :, :, None] * u[:, :, None, :]
        outs.append((s * q[:, i, :, :, None]).sum(-2))
    ref = torch.stack(outs, dim=1)
    # fp32 chunks reassociate the recurrence's sums: up to t * dk = 44 products of N(0, 1)
    # values (sum|terms| of a few tens): order_bound(44, 20) = 1e-4 at worst; measured
    # 4.8e-7 on every dispatch
    for chunk in (1, 3, 64):
        out, state = gated_delta_rule(q, k, v, g, beta, s0, chunk=chunk)
        assert (out - ref).abs().max() < 1e-4 and (state - s).abs().max() < 1e-4
    first, mid = gated_delta_rule(q[:, :6], k[:, :6], v[:, :6], g[:, :6], beta[:, :6], s0)
    rest, end = gated_delta_rule(q[:, 6:], k[:, 6:], v[:, 6:], g[:, 6:], beta[:, 6:], mid)
    assert (torch.cat((first, rest), 1) - ref).abs().max() < 1e-4
    assert (end - s).abs().max() < 1e-4


def test_ssd_scan_chunks_equal_the_recurrence() -> None:
    b, t, h, p, n = 2, 13, 4, 3, 5
    x, bm, cm = rand(b, t, h, p), rand(b, t, h, n), rand(b, t, h, n)
    dt, a, s0 = rand(b, t, h).abs(), -rand(h).abs(), rand(b, h, p, n)
    s, outs = s0.clone(), []
    for i in range(t):
        decay = (dt[:, i] * a).exp()[..., None, None]
        s = decay * s + (dt[:, i, :, None] * x[:, i])[..., None] * bm[:, i, :, None, :]
        outs.append((s * cm[:, i, :, None, :]).sum(-1))
    ref = torch.stack(outs, dim=1)
    # as the delta rule's: t * n = 65 products per value at worst, measured 3e-7
    for chunk in (1, 4, 64):
        out, state = ssd_scan(x, dt, a, bm, cm, s0, chunk=chunk)
        assert (out - ref).abs().max() < 1e-4 and (state - s).abs().max() < 1e-4


@pytest.mark.parametrize(
    ("mode", "extra"),
    [
        (RoutingMode.SOFTMAX_TOPK, {"renormalize": True}),
        (RoutingMode.TOPK_SOFTMAX, {"bias": True}),
        (
            RoutingMode.SIGMOID_GROUPED,
            {"num_groups": 2, "topk_groups": 1, "scaling": 2.0, "renormalize": True},
        ),
    ],
)
@torch.no_grad()
def test_moe_dispatch_equals_a_per_token_loop(mode: RoutingMode, extra: dict[str, Any]) -> None:
    e, hid, inter, t = 8, 16, 12, 37
    cfg = RoutingConfig(mode=mode, num_experts=e, top_k=3, **extra)
    router = Router(hid, cfg)
    banks: list[GatedExperts | PlainExperts | ClampedSwigluExperts] = [
        GatedExperts(e, hid, inter),
        PlainExperts(e, hid, inter),
        ClampedSwigluExperts(e, hid, inter, alpha=1.7, limit=0.5),
    ]
    with torch.no_grad():
        for module in [router, *banks]:
            for param in module.parameters():
                param.copy_(rand(*param.shape))
    x = rand(t, hid)
    routing = router(x)
    assert routing.index.shape == (t, 3) and routing.weight.shape == (t, 3)
    assert (routing.index.sort(-1).values.diff(dim=-1) > 0).all()  # distinct experts
    if mode is RoutingMode.SIGMOID_GROUPED:  # one group of four experts per token
        assert ((routing.index // 4) == (routing.index[:, :1] // 4)).all()
        # three fp32 weights renormalized and scaled by 2: a few ulps (measured 2.4e-7)
        assert torch.allclose(routing.weight.sum(-1), torch.full((t,), 2.0))
    for bank in banks:
        got = bank(x, routing)
        want = torch.zeros_like(x)
        for i in range(t):  # the definition: one token, one chosen expert at a time
            for j in range(3):
                expert = bank.expert(int(routing.index[i, j]), x[i : i + 1])[0]
                want[i] += routing.weight[i, j] * expert
        # batched GEMMs (another row count, another MKL order) against one token at a time:
        # reductions of 16 and 12 terms, relative to the outputs' scale: 1e-5 = 84 eps,
        # above order_bound(16, 1) = 1.9e-6 of it (measured 2.8e-7 of it)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_window_start_reads_only_the_last_window_positions() -> None:
    assert window_start(10, 1, None) == 0
    assert window_start(10, 1, 4) == 6  # query at 9 sees 6, 7, 8, 9
    assert window_start(10, 3, 4) == 4  # first query at 7 sees 4 ..
    assert window_start(3, 3, 4) == 0


def test_unsupported_architecture_is_refused_with_the_supported_list(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"]})
    )
    for load in (load_model, load_hybrid_model):
        with pytest.raises(UnsupportedModelError) as err:
            load(tmp_path)
        message = str(err.value)
        assert "'mamba'" in message and "MambaForCausalLM" in message
        assert all(t in message for t in SUPPORTED_MODEL_TYPES)


def test_load_model_loads_hybrid_checkpoints_too() -> None:
    assert isinstance(load_model("tiny-random-gemma3").model, HybridLM)
