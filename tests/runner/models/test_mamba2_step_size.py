"""Mamba2's step sizes as the checkpoint bounds them (``time_step_limit``), not by
``time_step_min`` (an initialisation range only).

The tiny model :data:`SMALL_STEP_MODEL` has ``time_step_min = 0.01`` and step sizes
mostly below it, its ``time_step_limit`` the default ``(0, inf)``: clamping at
``time_step_min`` moved its logits by 0.34 against transformers 5.25. Compared here with
transformers and with a float64 per-token recurrence written from the equations alone.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hicache.runner.checkpoints import SMALL_STEP_MODEL
from hicache.runner.models.mamba2 import Mamba2Mixer, Mamba2Spec
from hicache.runner.models.recurrent import RecurrentState
from tests.helpers.numerics import order_bound
from tests.runner.models.hybrid_fixtures import (
    hf_logits,
    hf_twin,
    hybrid_model,
    new_pool,
    prompt,
    slots_for,
    step,
)

N = 26
PAGES = [5, 0, 6, 2, 4, 1, 3]


def _mixers() -> list[Mamba2Mixer]:
    return [m for m in hybrid_model(SMALL_STEP_MODEL).model.modules() if isinstance(m, Mamba2Mixer)]


def _reference_mixer(mixer: Mamba2Mixer, x: torch.Tensor) -> torch.Tensor:
    """``x (T, hidden)`` -> ``(T, hidden)`` in float64, one token at a time from a zero
    state: ``S <- exp(dt A) S + dt x B^T``, ``y = S C + D x`` per head, with
    ``dt = clamp(softplus(dt_raw + dt_bias), *time_step_limit)``."""
    sp = mixer.spec
    w = {k: v.detach().double() for k, v in mixer.state_dict().items()}
    x = x.double()
    proj = x @ w["in_proj.weight"].T + w.get("in_proj.bias", 0.0)
    z, xbc, dt_raw = proj.split([sp.inner, sp.conv_dim, sp.num_heads], dim=-1)
    k = sp.conv_kernel
    padded = torch.cat((torch.zeros(k - 1, sp.conv_dim, dtype=x.dtype), xbc))
    taps = w["conv1d.weight"][:, 0, :]  # (conv_dim, K)
    conv = torch.stack([(padded[t : t + k].T * taps).sum(-1) for t in range(len(x))])
    conv = F.silu(conv + w.get("conv1d.bias", 0.0))
    gs = sp.n_groups * sp.state_size
    xs, b, c = conv.split([sp.inner, gs, gs], dim=-1)
    per_group = sp.num_heads // sp.n_groups
    dt = F.softplus(dt_raw + w["dt_bias"]).clamp(*sp.time_step_limit)
    a = -w["A_log"].exp()
    state = torch.zeros(sp.num_heads, sp.head_dim, sp.state_size, dtype=x.dtype)
    ys = []
    for t in range(len(x)):
        xt = xs[t].view(sp.num_heads, sp.head_dim)
        bt = b[t].view(sp.n_groups, sp.state_size).repeat_interleave(per_group, dim=0)
        ct = c[t].view(sp.n_groups, sp.state_size).repeat_interleave(per_group, dim=0)
        decay = (dt[t] * a).exp()[:, None, None]
        state = decay * state + dt[t][:, None, None] * xt[:, :, None] * bt[:, None, :]
        ys.append((state @ ct[:, :, None])[..., 0] + w["D"][:, None] * xt)
    y = torch.stack(ys).reshape(len(x), sp.inner) * F.silu(z)
    group = sp.inner // sp.n_groups
    g = y.view(len(x), sp.n_groups, group)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + sp.eps)
    return (g.reshape(len(x), sp.inner) * w["norm.weight"]) @ w["out_proj.weight"].T


def test_the_model_steps_below_time_step_min() -> None:
    """The premise: most step sizes of the prompt fall below ``time_step_min``."""
    hf = hf_twin(SMALL_STEP_MODEL).config
    assert hf.time_step_min == 0.01 and tuple(hf.time_step_limit) == (0.0, float("inf"))
    hidden = hybrid_model(SMALL_STEP_MODEL).model.config.hidden_size
    x = torch.randn(N, hidden, generator=torch.Generator().manual_seed(0))  # the share: of these
    for mixer in _mixers():
        assert mixer.spec.time_step_limit == (0.0, float("inf"))
        dt_raw = mixer.in_proj(x)[:, -mixer.spec.num_heads :]
        dt = F.softplus(dt_raw + mixer.dt_bias).detach()
        assert (dt < hf.time_step_min).float().mean() > 0.5


def test_logits_match_transformers_in_every_phase() -> None:
    """A full forward, then a prefix, chunks and single-token decodes carrying the state."""
    ids = prompt(SMALL_STEP_MODEL, N)
    ref = hf_logits(SMALL_STEP_MODEL, ids)
    tol = order_bound(128, ref.abs().max().item())  # as tests/runner/models/test_hybrid_models
    slots = slots_for(PAGES, N)
    logits, _ = step(SMALL_STEP_MODEL, new_pool(SMALL_STEP_MODEL), [ids], [0], [slots], None)
    assert (logits - ref).abs().max() <= tol
    pool, states, start = new_pool(SMALL_STEP_MODEL), None, 0
    for end in [8, 14, 15, 16, 22, N]:
        logits, out = step(SMALL_STEP_MODEL, pool, [ids[start:end]], [start], [slots], states)
        assert (logits - ref[start:end]).abs().max() <= tol, (start, end)
        states, start = out.states, end


@pytest.mark.parametrize("cuts", [[N], [9, 17, N], list(range(1, N + 1))])
def test_mixer_matches_a_float64_recurrence(cuts: list[int]) -> None:
    """Whole, in chunks and token by token, each mixer equals the float64 recurrence.

    fp32 against fp64: the largest reductions are ``in_proj``'s and ``out_proj``'s 64
    terms and the scan's sums over at most 26 tokens of 16-wide state products, the sum
    of their magnitudes below 64 here; 64 * eps32 * 64 = 4.9e-4 bounds the ordering and
    rounding of each step's sums (measured: 4e-7; a clamp at ``time_step_min`` moves the
    output by 0.02 to 0.04)."""
    torch.manual_seed(0)
    for mixer in _mixers():
        x = torch.randn(N, mixer.spec.hidden_size)
        ref = _reference_mixer(mixer, x)
        state = RecurrentState(
            conv=torch.zeros(1, *mixer.spec.state.conv), ssm=torch.zeros(1, *mixer.spec.state.ssm)
        )
        outs, start = [], 0
        with torch.no_grad():
            for end in cuts:
                y, state = mixer._step(x[None, start:end], state)
                outs.append(y[0])
                start = end
        got = torch.cat(outs).double()
        assert (got - ref).abs().max() <= order_bound(64, 64.0)


def test_a_limit_from_the_checkpoint_bounds_the_steps() -> None:
    """A checkpoint that asks for bounds gets them; a malformed one is refused by name."""
    mixer = _mixers()[0]
    x = torch.randn(N, mixer.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    sp = mixer.spec
    bounded = Mamba2Mixer(
        Mamba2Spec(
            hidden_size=sp.hidden_size,
            num_heads=sp.num_heads,
            head_dim=sp.head_dim,
            n_groups=sp.n_groups,
            state_size=sp.state_size,
            conv_kernel=sp.conv_kernel,
            conv_bias=sp.conv_bias,
            proj_bias=sp.proj_bias,
            time_step_limit=(0.01, 0.02),
            eps=sp.eps,
        ),
        mixer.layer_id,
    )
    bounded.load_state_dict(mixer.state_dict())
    zero = RecurrentState(conv=torch.zeros(1, *sp.state.conv), ssm=torch.zeros(1, *sp.state.ssm))
    with torch.no_grad():
        y, _ = bounded._step(x[None], zero)
    assert (y[0].double() - _reference_mixer(bounded, x)).abs().max() <= order_bound(64, 64.0)
    assert (y[0].double() - _reference_mixer(mixer, x)).abs().max() > 1e-3
    for bad in [(0.1, 0.01), (-1.0, 1.0), (float("nan"), 1.0), (0.0, 1.0, 2.0)]:
        with pytest.raises(ValueError, match="time_step_limit"):
            Mamba2Spec(
                hidden_size=64,
                num_heads=8,
                head_dim=8,
                n_groups=2,
                state_size=16,
                conv_kernel=4,
                conv_bias=True,
                proj_bias=False,
                time_step_limit=bad,  # type: ignore[arg-type]
                eps=1e-5,
            )
