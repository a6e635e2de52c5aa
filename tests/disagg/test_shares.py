"""Which decode ranks each prefill rank writes (shares_of), exactly on tiny layouts, and
every pair of TP sizes applied as memcpy: each decode rank's pool ends equal to its heads
of the prompt's K/V, every byte written once."""

from __future__ import annotations

import ctypes
from dataclasses import replace

import pytest
import torch

from hicache.disagg.layout import InstanceLayout, RankTarget, Registration, StoreLayout, StoreTarget
from hicache.disagg.pages import Columns, PoolGeometry
from hicache.disagg.sender import SendJob, SourcePages, plan_spans
from hicache.disagg.shares import Share, shares_of
from hicache.heads import HeadSplit
from hicache.memory.device_pool import DevicePool
from hicache.spec import KVSpec

HEAD = 16  # bytes of one head's row: 4 float32


def layout(
    tp: int, kv_heads: int = 2, num_heads: int = 8, *, whole: bool = False
) -> InstanceLayout:
    local = HeadSplit(num_heads, kv_heads, tp).local_kv_heads
    store = StoreLayout(
        "full", 2, 2, (kv_heads if whole else local) * HEAD, "float32", 0 if whole else kv_heads
    )
    return InstanceLayout("m", "f", 2, tp, whole, "mooncake", (store,), num_heads=num_heads)


def table(p: int, d: int, **kw: object) -> dict[int, list[Share]]:
    lp, ld = layout(p, **kw), layout(d, **kw)  # type: ignore[arg-type]
    return {r: shares_of(lp, ld, "full", r) for r in range(p)}


def test_split_heads_go_head_by_head() -> None:
    whole = Columns(0, 0, HEAD)
    assert table(1, 1) == {0: [Share(0, Columns(0, 0, 2 * HEAD))]}
    assert table(2, 2) == {0: [Share(0, whole)], 1: [Share(1, whole)]}
    # one prefill rank holds both heads: decode rank d gets head d
    assert table(1, 2) == {0: [Share(0, Columns(0, 0, HEAD)), Share(1, Columns(HEAD, 0, HEAD))]}
    # two prefill ranks fill the two heads of one decode rank
    assert table(2, 1) == {
        0: [Share(0, Columns(0, 0, HEAD))],
        1: [Share(0, Columns(0, HEAD, HEAD))],
    }
    # prefill heads replicated (ranks 0, 1 hold head 0; 2, 3 head 1): decode rank d takes
    # its head from the (d % 2)-th replica
    assert table(4, 2) == {0: [Share(0, whole)], 1: [], 2: [], 3: [Share(1, whole)]}
    # decode heads replicated: each holder is written by the one prefill rank holding it
    assert table(2, 4) == {
        0: [Share(0, whole), Share(1, whole)],
        1: [Share(2, whole), Share(3, whole)],
    }
    # four heads, 2 -> 1: each prefill rank's two heads are one run of columns
    assert table(2, 1, kv_heads=4) == {
        0: [Share(0, Columns(0, 0, 2 * HEAD))],
        1: [Share(0, Columns(0, 2 * HEAD, 2 * HEAD))],
    }


def test_whole_rows_go_whole_from_one_rank_each() -> None:
    assert table(2, 4, whole=True) == {
        0: [Share(0, None), Share(2, None)],
        1: [Share(1, None), Share(3, None)],
    }
    assert table(4, 1, whole=True) == {0: [Share(0, None)], 1: [], 2: [], 3: []}


def _pool(
    split: HeadSplit | None, kv_heads: int, truth: torch.Tensor | None, pages: int
) -> DevicePool:
    heads = kv_heads if split is None else split.local_kv_heads
    pool = DevicePool(
        KVSpec(num_layers=2, num_kv_heads=heads, head_dim=4, dtype="float32"), pages, 2
    )
    if truth is None:
        pool.buffer.fill_(-1.0)
    else:
        pick = range(kv_heads) if split is None else split.kv_heads
        pool.buffer.copy_(truth[:, :, :, list(pick), :])
    return pool


SIZES = [(p, d, kv) for kv in (1, 2, 4) for p in (1, 2, 4, 8) for d in (1, 2, 4, 8)]


@pytest.mark.parametrize(("p", "d", "kv_heads"), SIZES)
def test_every_pair_of_sizes_fills_every_decode_rank_exactly(p: int, d: int, kv_heads: int) -> None:
    """The prefill ranks' pools hold their heads of a random prompt (pages 1, 2, 3 of 4);
    the spans each plans (:func:`plan_spans`), applied as memcpy, fill each decode rank's
    pages 3, 0, 2 with exactly its heads, and touch nothing else."""
    lp, ld = layout(p, kv_heads), layout(d, kv_heads)
    truth = torch.randn(2, 2, 8, kv_heads, 4, generator=torch.Generator().manual_seed(p * 100 + d))
    src = [_pool(lp.heads(lp.stores[0], r), kv_heads, truth, 4) for r in range(p)]
    dst = [_pool(ld.heads(ld.stores[0], r), kv_heads, None, 4) for r in range(d)]
    reg = Registration(
        room=1,
        layout=ld,
        ranks=tuple(
            RankTarget(f"d{r}", {"full": PoolGeometry.of(pool).to_dict()})
            for r, pool in enumerate(dst)
        ),
        prompt_len=6,
        prompt_hash="h",
        skip_pages=0,
        targets=(StoreTarget("full", 0, (3, 0, 2)),),
    )
    written: dict[str, int] = {}
    for r, pool in enumerate(src):
        job = SendJob(
            rid="x",
            room=1,
            prompt_len=6,
            prompt_hash="h",
            sources=(SourcePages("full", PoolGeometry.of(pool), 0, (1, 2, 3)),),
            upto=3,
        )
        for endpoint, spans in plan_spans(job, reg, layout=lp, rank=r):
            written[endpoint] = written.get(endpoint, 0) + sum(s.nbytes for s in spans)
            for s in spans:
                ctypes.memmove(s.dst, s.src, s.nbytes)
    for r, pool in enumerate(dst):
        split = ld.heads(ld.stores[0], r)
        assert split is not None
        want = torch.full_like(pool.buffer, -1.0)
        mine = truth[:, :, :, list(split.kv_heads), :]
        for src_page, dst_page in ((1, 3), (2, 0), (3, 2)):
            want[:, :, 2 * dst_page : 2 * dst_page + 2] = mine[
                :, :, 2 * src_page : 2 * src_page + 2
            ]
        assert torch.equal(pool.buffer, want), (p, d, kv_heads, r)
        # every byte once: 3 pages of 2 slots, K and V, 2 layers, its heads' rows
        assert written[f"d{r}"] == 3 * 2 * 2 * 2 * split.local_kv_heads * HEAD


def test_whole_row_pools_of_every_size_pair_are_filled_whole() -> None:
    for p in (1, 2, 4):
        for d in (1, 2, 4):
            lp, ld = layout(p, whole=True), layout(d, whole=True)
            covered = sorted(s.decode_rank for r in range(p) for s in shares_of(lp, ld, "full", r))
            assert covered == list(range(d))


def test_a_registration_must_name_every_decode_rank() -> None:
    with pytest.raises(ValueError, match="names 1 ranks for a decode instance of tp_size 2"):
        Registration(1, layout(2), (RankTarget("d0", {}),), 6, "h", 0, ())
    reg = Registration(1, layout(2), (RankTarget("d0", {}), RankTarget("d1", {})), 6, "h", 0, ())
    assert Registration.from_json(reg.to_json()) == reg
    assert replace(reg, skip_pages=1) != reg
