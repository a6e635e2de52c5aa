"""Which heads and groups of a recurrent layer each tensor-parallel rank holds, and the
checkpoint rows it gathers, exactly: Mamba2 (heads in groups of B/C) and Gated DeltaNet
(value heads in key heads) split their heads always and their groups while there are at
least as many as ranks; with more ranks than groups, ``size / groups`` consecutive ranks
hold the same group (its B/C or q/k rows alike), each with its share of the group's heads.
Mamba2's gated norm over a group spread on 4 real gloo ranks equals one rank's.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hicache.runner.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetSpec
from hicache.runner.models.mamba2 import Mamba2Mixer, Mamba2Spec
from hicache.runner.models.norms import GroupGatedRMSNorm
from hicache.runner.parallel import RowPieces, TPGroup
from tests.helpers.ranks import run_ranks


def mamba(heads: int = 8, groups: int = 2) -> Mamba2Spec:
    """``heads`` heads of 2 channels in ``groups`` groups of state 3: ``inner = 2 heads``,
    ``in_proj = [z | x | B | C | dt]``, the conv ``[x | B | C]``."""
    return Mamba2Spec(
        hidden_size=4,
        num_heads=heads,
        head_dim=2,
        n_groups=groups,
        state_size=3,
        conv_kernel=4,
        conv_bias=True,
        proj_bias=False,
        time_step_limit=(0.0, float("inf")),
        eps=1e-5,
    )


def deltanet(keys: int, values: int = 4) -> GatedDeltaNetSpec:
    """``keys`` key heads of 2 and ``values`` value heads of 3."""
    return GatedDeltaNetSpec(
        hidden_size=4,
        num_k_heads=keys,
        num_v_heads=values,
        k_dim=2,
        v_dim=3,
        conv_kernel=4,
        eps=1e-6,
    )


def pieces(module: torch.nn.Module) -> dict[str, tuple[tuple[int, int], ...]]:
    assert isinstance(module, Mamba2Mixer | GatedDeltaNet)
    return {name: p.pieces for name, p in module.tp_pieces().items()}


def held(spec: Mamba2Spec | GatedDeltaNetSpec, size: int) -> list[tuple[range, list[int]]]:
    """Per rank: its heads (value heads) and its groups (key heads), model numbering."""
    out = []
    for r in range(size):
        s = spec.head_split(TPGroup(r, size))
        out.append((range(s.first_head, s.first_head + s.local_heads), list(s.kv_heads)))
    return out


def test_mamba2_groups_are_split_then_replicated() -> None:
    spec = mamba()
    assert held(spec, 2) == [(range(0, 4), [0]), (range(4, 8), [1])]
    assert held(spec, 4) == [
        (range(0, 2), [0]),
        (range(2, 4), [0]),
        (range(4, 6), [1]),
        (range(6, 8), [1]),
    ]
    assert held(mamba(groups=1), 2) == [(range(0, 4), [0]), (range(4, 8), [0])]
    local = spec.split(TPGroup(3, 4))
    assert (local.num_heads, local.n_groups, local.inner) == (2, 1, 4)
    assert local.state.conv == (4 + 2 * 3, 3) and local.state.ssm == (2, 2, 3)


def test_mamba2_rows_of_each_rank() -> None:
    """``in_proj`` rows: z ``[0, 16)``, x ``[16, 32)``, B ``[32, 38)``, C ``[38, 44)``, dt
    ``[44, 52)``; the conv: x ``[0, 16)``, B ``[16, 22)``, C ``[22, 28)``. At 4 ranks ranks 0
    and 1 gather group 0's B/C rows, 2 and 3 group 1's, each its own 2 heads."""
    with torch.device("meta"):
        ranks = [pieces(Mamba2Mixer(mamba(), 0, TPGroup(r, 4))) for r in range(4)]
        two = pieces(Mamba2Mixer(mamba(), 0, TPGroup(1, 2)))
    assert ranks[1] == {
        "in_proj.weight": ((4, 4), (20, 4), (32, 3), (38, 3), (46, 2)),
        "conv1d.weight": ((4, 4), (16, 3), (22, 3)),
        "conv1d.bias": ((4, 4), (16, 3), (22, 3)),
        "dt_bias": ((2, 2),),
        "A_log": ((2, 2),),
        "D": ((2, 2),),
        "norm.weight": ((4, 4),),
    }
    assert ranks[2]["in_proj.weight"] == ((8, 4), (24, 4), (35, 3), (41, 3), (48, 2))
    assert ranks[0]["conv1d.weight"] == ((0, 4), (16, 3), (22, 3))
    assert ranks[3]["conv1d.weight"] == ((12, 4), (19, 3), (25, 3))
    # two ranks: whole groups, as before replication existed
    assert two["in_proj.weight"] == ((8, 8), (24, 8), (35, 3), (41, 3), (48, 4))
    assert two["conv1d.weight"] == ((8, 8), (19, 3), (25, 3))


def test_deltanet_key_heads_are_split_then_replicated() -> None:
    assert held(deltanet(2), 2) == [(range(0, 2), [0]), (range(2, 4), [1])]
    assert held(deltanet(1), 2) == [(range(0, 2), [0]), (range(2, 4), [0])]
    assert held(deltanet(2), 4) == [
        (range(0, 1), [0]),
        (range(1, 2), [0]),
        (range(2, 3), [1]),
        (range(3, 4), [1]),
    ]
    local = deltanet(1).split(TPGroup(1, 2))
    assert (local.num_k_heads, local.num_v_heads) == (1, 2)
    assert local.state.conv == (2 * 2 + 2 * 3, 3) and local.state.ssm == (2, 2, 3)


def test_deltanet_rows_of_each_rank() -> None:
    """One key head of 4 value heads: ``in_proj_qkvz = [q (2) | k (2) | v (12) | z (12)]``,
    ``in_proj_ba = [b (4) | a (4)]``, the conv ``[q (2) | k (2) | v (12)]``. Both ranks
    gather q and k; rank 1 value heads 2 and 3 of v, z, b, a and the conv's v."""
    with torch.device("meta"):
        one = [pieces(GatedDeltaNet(deltanet(1), 0, TPGroup(r, 2))) for r in range(2)]
        two = pieces(GatedDeltaNet(deltanet(2), 0, TPGroup(1, 2)))
    assert one[0] == {
        "in_proj_qkvz.weight": ((0, 10), (16, 6)),
        "in_proj_ba.weight": ((0, 2), (4, 2)),
        "conv1d.weight": ((0, 10),),
        "dt_bias": ((0, 2),),
        "A_log": ((0, 2),),
    }
    assert one[1] == {
        "in_proj_qkvz.weight": ((0, 4), (10, 6), (22, 6)),
        "in_proj_ba.weight": ((2, 2), (6, 2)),
        "conv1d.weight": ((0, 4), (10, 6)),
        "dt_bias": ((2, 2),),
        "A_log": ((2, 2),),
    }
    # two key heads over two ranks: each its key head's whole block, as before
    assert two == {
        "in_proj_qkvz.weight": ((16, 16),),
        "in_proj_ba.weight": ((4, 4),),
        "conv1d.weight": ((2, 2), (6, 2), (14, 6)),
        "dt_bias": ((2, 2),),
        "A_log": ((2, 2),),
    }


def test_row_pieces_within_parts_merge_adjacent_rows() -> None:
    assert RowPieces.within([4, 2, 6], [(2, 2), (0, 2), (0, 3)]).pieces == ((2, 7),)
    assert RowPieces.within([4, 6], [(0, 2), (3, 3)], dim=1) == RowPieces(1, ((0, 2), (7, 3)))
    with pytest.raises(ValueError, match=r"rows \(3, 2\) do not lie within a part of 4 rows"):
        RowPieces.within([4], [(3, 2)])


@pytest.mark.parametrize(
    ("spec", "size", "named"),
    [
        (lambda: mamba(heads=6, groups=3), 2, "mamba_num_heads=6, n_groups=3"),
        (lambda: mamba(heads=6, groups=1), 4, "mamba_num_heads=6, n_groups=1"),
        (lambda: deltanet(3, 6), 2, "linear_num_value_heads=6, linear_num_key_heads=3"),
    ],
)
def test_a_size_that_splits_neither_way_is_refused_with_the_numbers(
    spec: object, size: int, named: str
) -> None:
    assert callable(spec)
    with pytest.raises(ValueError, match=f"tensor-parallel size {size} cannot split {named}:"):
        spec().split(TPGroup(0, size))


def _norm_rank(rank: int, n: int, out: str, x: list[float], gate: list[float]) -> int:
    """Rank ``rank`` of 4: its quarter of 2 groups of 8 channels (each group on 2 ranks)."""
    tp = TPGroup.of()
    norm = GroupGatedRMSNorm(4, 4, 1e-5, tp=tp, replicas=2)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 16)[rank * 4 : (rank + 1) * 4])
        xs, gs = (torch.tensor(t).view(3, 16)[:, rank * 4 : (rank + 1) * 4] for t in (x, gate))
        torch.save(norm(xs, gs), Path(out, f"norm{rank}.pt"))
    return rank


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="4 ranks need 2 CPU cores")
def test_a_group_on_several_ranks_is_normalized_as_on_one(tmp_path: Path) -> None:
    """3 tokens, 2 groups of 8 channels on 4 gloo ranks (2 per group): the ranks' outputs
    side by side equal one rank's norm of all 16 channels within fp32 rounding (sums of 8
    squares in another order)."""
    torch.manual_seed(0)
    x, gate = torch.randn(3, 16), torch.randn(3, 16)
    run_ranks(_norm_rank, 4, tmp_path, x.flatten().tolist(), gate.flatten().tolist())
    whole = GroupGatedRMSNorm(16, 8, 1e-5)
    with torch.no_grad():
        whole.weight.copy_(torch.linspace(0.5, 2.0, 16))
        want = whole(x, gate)
    got = torch.cat([torch.load(tmp_path / f"norm{r}.pt") for r in range(4)], dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
