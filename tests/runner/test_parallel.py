"""The tensor-parallel layers on two real gloo ranks equal the unsharded layers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hicache.runner.parallel import (
    ColumnParallelLinear,
    HeadParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    RowPieces,
    Split,
    TPGroup,
    VocabParallelEmbedding,
    row_pieces,
    shard_dims,
)
from tests.helpers.ranks import run_ranks

VOCAB, DIM, HIDDEN = 11, 6, 8  # 11 is odd: the vocabulary is padded to 12 over 2 ranks


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "emb": torch.randn(VOCAB, DIM, generator=g),
        "up": torch.randn(HIDDEN, DIM, generator=g),
        "up_b": torch.randn(HIDDEN, generator=g),
        "down": torch.randn(DIM, HIDDEN, generator=g),
        "down_b": torch.randn(DIM, generator=g),
    }


def _reference() -> torch.Tensor:
    w = _full()
    ids = torch.tensor([0, 5, 10, 3])
    x = F.embedding(ids, w["emb"])
    h = F.silu(F.linear(x, w["up"], w["up_b"]))
    y = F.linear(h, w["down"], w["down_b"])
    return F.linear(y, w["emb"])


def _rank(rank: int, n: int, out: str) -> list[list[float]]:
    tp = TPGroup.of()
    assert (tp.rank, tp.size) == (rank, n)
    w = _full()
    emb = VocabParallelEmbedding(VOCAB, DIM, tp=tp)
    up = ColumnParallelLinear(DIM, HIDDEN, bias=True, tp=tp)
    down = RowParallelLinear(HIDDEN, DIM, bias=True, tp=tp)
    head = ParallelLMHead(VOCAB, DIM, tp=tp)
    module = torch.nn.ModuleDict({"emb": emb, "up": up, "down": down, "head": head})
    dims = shard_dims(module)
    padded = 12 if n == 2 else VOCAB
    assert dims == {
        "emb.weight": Split(0, padded, full=VOCAB),
        "up.weight": Split(0, full=HIDDEN),
        "up.bias": Split(0, full=HIDDEN),
        "down.weight": Split(1, full=HIDDEN),
        "head.weight": Split(0, padded, full=VOCAB),
    }
    full = {
        "emb.weight": w["emb"],
        "up.weight": w["up"],
        "up.bias": w["up_b"],
        "down.weight": w["down"],
        "down.bias": w["down_b"],
        "head.weight": w["emb"],
    }
    with torch.no_grad():
        for name, p in module.named_parameters():
            split = dims.get(name)
            p.copy_(full[name] if split is None else tp.shard(full[name], *split))
    ids = torch.tensor([0, 5, 10, 3])
    logits = head(down(F.silu(up(emb(ids)))))
    return logits.tolist()


@pytest.mark.parametrize("ranks", [1, 2])
def test_sharded_layers_equal_the_full_ones(tmp_path: Path, ranks: int) -> None:
    results = run_ranks(_rank, ranks, tmp_path)
    ref = _reference()
    for r in results:
        got = torch.tensor(r)
        assert got.shape == (4, VOCAB)
        # sums of 6 and 8 fp32 terms, the row-parallel one in two halves all-reduced, at
        # |z| <= 21 (sum|terms| <= 22): a few ulps, within 1e-5 + 1e-5 |z| (measured 3.8e-6
        # on every dispatch; order_bound(8, 22) = 2.1e-5 is the worst case)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_row_pieces_gather_each_parts_share_in_order() -> None:
    """A fused ``[a (4) | b (2) | c (6)]`` over 2 ranks, ``c`` in blocks of 3: each rank
    takes its half of every part, in part order; the halves of both ranks are every row
    once. A size that does not divide a part's blocks is refused naming it."""
    full = torch.arange(12.0)[:, None].expand(12, 2)
    got = []
    for r in range(2):
        spec = RowPieces.split([4, 2, 6], TPGroup(r, 2), "fused", unit=(1, 1, 3))
        assert spec.length == 6
        got.append(spec.cut(full)[:, 0].tolist())
    assert got == [[0, 1, 4, 6, 7, 8], [2, 3, 5, 9, 10, 11]]
    cols = RowPieces(1, ((1, 1), (3, 1))).cut(torch.arange(8.0).reshape(2, 4))
    assert cols.tolist() == [[1.0, 3.0], [5.0, 7.0]]
    with pytest.raises(ValueError, match="does not divide the 3 n_groups"):
        RowPieces.split([6], TPGroup(0, 2), "n_groups", unit=2)
    with pytest.raises(ValueError, match="run past the 4 rows"):
        RowPieces(0, ((3, 2),)).cut(torch.zeros(4))

    class Fused(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(2, 6)

        def tp_pieces(self) -> dict[str, RowPieces]:
            return {"proj.weight": RowPieces(0, ((0, 6),))}

    outer = torch.nn.Sequential(torch.nn.Identity(), Fused())
    assert row_pieces(outer) == {"1.proj.weight": RowPieces(0, ((0, 6),))}


def test_shard_pads_and_part_refuses_with_the_numbers() -> None:
    tp = TPGroup(rank=1, size=2)
    t = torch.arange(5.0).reshape(5, 1)
    assert tp.shard(t, 0, padded=6).flatten().tolist() == [3.0, 4.0, 0.0]
    assert TPGroup(rank=0, size=2).shard(t, 0, padded=6).flatten().tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="size 2 does not divide the 5 heads"):
        tp.part(5, "heads")
    with pytest.raises(ValueError, match="rank=2 must be in"):
        TPGroup(rank=2, size=2)


def test_head_ranges_are_cut_whatever_the_rank() -> None:
    """A :class:`HeadParallelLinear` holds the rows of its head range: 2 heads of width 3
    over 4 ranks, head ``r // 2`` on rank ``r`` (replicated), weight and bias rows alike;
    its :class:`Split` cuts them from the full tensor, whose length it checks."""
    w = torch.arange(6 * DIM, dtype=torch.float32).reshape(6, DIM)
    b = torch.arange(6, dtype=torch.float32)
    for rank in range(4):
        tp = TPGroup(rank=rank, size=4)
        with torch.device("meta"):
            kv = HeadParallelLinear(DIM, 2, 3, (rank // 2, 1), bias=True, tp=tp)
        assert tuple(kv.weight.shape) == (3, DIM) and kv.out_features == 6
        dims = shard_dims(torch.nn.ModuleDict({"kv": kv}))
        rows = (3 * (rank // 2), 3)
        assert dims == {
            "kv.weight": Split(0, rows=rows, full=6),
            "kv.bias": Split(0, rows=rows, full=6),
        }
        assert torch.equal(tp.shard(w, *dims["kv.weight"]), w[rows[0] : rows[0] + 3])
        assert torch.equal(tp.shard(b, *dims["kv.bias"]), b[rows[0] : rows[0] + 3])
    tp = TPGroup(rank=3, size=4)
    with pytest.raises(ValueError, match=r"dim 0 of the full tensor is 5 long; want 6"):
        tp.shard(w[:5], 0, rows=(3, 3), full=6)
    with pytest.raises(ValueError, match=r"rows=\(4, 3\) \(start, length\) of dim 0 do not lie"):
        tp.shard(w, 0, rows=(4, 3))
    with pytest.raises(ValueError, match="no padding with a row range"):
        tp.shard(w, 0, 8, rows=(0, 3))
    with pytest.raises(
        ValueError, match=r"heads=\(2, 1\) \(first, count\) do not lie within the 2"
    ):
        HeadParallelLinear(DIM, 2, 3, (2, 1), bias=False, tp=tp)
