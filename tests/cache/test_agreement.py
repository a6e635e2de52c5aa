"""The per-step agreement's bookkeeping, in one process.

The collective is the only thing not run for real here: :class:`_Paired` is rank 0 of a
two-rank group whose other rank's tensor is the one another :class:`Agreement` built from
its own votes (what gloo would reduce with), so the rows, the reduction's meaning and
the divergence check are the real code's. Real ranks: ``test_rank_agreement.py``.
"""

from __future__ import annotations

import pytest
import torch

from hicache.cache import HiCache
from hicache.config import CacheConfig, PrefetchConfig
from hicache.controller.agreement import (
    Agreement,
    LocalRecords,
    RanksDiverged,
    ReadProgress,
    Verdict,
    Vote,
)
from hicache.controller.completions import L3Read
from hicache.controller.rank_group import RankGroup
from hicache.keys import Namespace
from hicache.spec import KVSpec
from hicache.storage.registry import create_storage


class _Capture(RankGroup):
    """One rank of a group that keeps the tensor it was asked to reduce (a group of
    several ranks, as far as the agreement sees: it makes its collective)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: torch.Tensor | None = None

    @property
    def multi(self) -> bool:
        return True

    def all_reduce_min(self, t: torch.Tensor) -> torch.Tensor:
        self.sent = t.clone()
        return t


class _Paired(RankGroup):
    """Rank 0 of two: reduces with the other rank's tensor ``other``."""

    def __init__(self, other: torch.Tensor) -> None:
        super().__init__()
        self.size, self.other = 2, other

    @property
    def multi(self) -> bool:
        return True

    def all_reduce_min(self, t: torch.Tensor) -> torch.Tensor:
        torch.minimum(t, self.other, out=t)
        return t


def _other(transfer: list[Vote], l3: list[Vote], give_up: bool = False, cap: int = 8) -> _Paired:
    capture = _Capture()
    Agreement(capture, cap).agree((transfer, l3), give_up=give_up)
    assert capture.sent is not None
    return _Paired(capture.sent)


def test_one_rank_gets_its_own_votes_back() -> None:
    got = Agreement(RankGroup.single(), 4).agree(
        ([Vote(3, arrived=True, value=1)], [Vote(5, True, 7, final=True, flag=True, ready=True)])
    )
    assert got.lanes[0] == (Verdict(3, True, 1, False, False, False),)
    assert got.lanes[1] == (Verdict(5, True, 7, True, True, True),)
    assert not got.gave_up and got.deferred == 0


def test_values_reduce_min_all_any() -> None:
    mine = [Vote(1, True, 4, final=True, flag=True, ready=False), Vote(2, True, 2, ready=True)]
    theirs = [Vote(1, True, 3, final=False, flag=True, ready=True), Vote(2, False, 9)]
    got = Agreement(_other([], theirs), 8).agree(([], mine))
    # hit/done: the minimum; final/flag/arrived: on every rank; ready: on some rank
    assert got.lanes[1] == (
        Verdict(1, arrived=True, value=3, final=False, flag=True, ready=True),
        Verdict(2, arrived=False, value=2, final=False, flag=False, ready=True),
    )


def test_a_rank_past_its_deadline_gives_up_for_all() -> None:
    assert Agreement(_other([], [], give_up=True), 8).agree(([], [])).gave_up
    assert not Agreement(_other([], [], give_up=False), 8).agree(([], [])).gave_up


def test_ops_beyond_capacity_wait_oldest_first_lanes_taking_turns() -> None:
    transfer = [Vote(i, True) for i in (1, 2, 3)]
    l3 = [Vote(i, True) for i in (10, 11)]
    got = Agreement(RankGroup.single(), 3).agree((transfer, l3))
    assert [v.op_id for v in got.lanes[0]] == [1, 2]
    assert [v.op_id for v in got.lanes[1]] == [10]
    assert got.deferred == 2


def test_ranks_listing_other_ops_raise_on_every_rank() -> None:
    with pytest.raises(RanksDiverged, match="row 1"):
        Agreement(_other([], [Vote(4, True)]), 8).agree(([], [Vote(5, True)]))
    with pytest.raises(RanksDiverged, match="1 to 2 in-flight ops"):  # one more op there
        Agreement(_other([Vote(1, True)], [Vote(4, True)]), 8).agree(([], [Vote(4, True)]))


@pytest.mark.parametrize(
    ("votes", "match"),
    [
        ([Vote(2, True), Vote(1, True)], "increasing op-id order"),
        ([Vote(1, True), Vote(1, True)], "increasing op-id order"),
        ([Vote(0, True)], "out of range"),
        ([Vote(1, True, value=-1)], "must be >= 0"),
    ],
)
def test_bad_votes_are_refused(votes: list[Vote], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Agreement(RankGroup.single(), 4).agree(([], votes))


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        Agreement(RankGroup.single(), 0)


def test_local_read_records_fold_into_progress() -> None:
    got = LocalRecords()
    got.put(L3Read(7, 0, final=False, records=True))
    got.put(L3Read(7, 3, final=False))
    got.put(L3Read(7, 2, final=True))  # a final record never lowers the progress
    assert got.reads[7] == ReadProgress(done=3, final=True, records=True)
    got.clear()
    assert len(got) == 0


def test_rank_group_reduces_int64_on_cpu_only() -> None:
    g = RankGroup.single()
    assert g.min(5) == 5 and g.max(5) == 5 and not g.multi
    with pytest.raises(ValueError, match="int64"):
        g.all_reduce_min(torch.zeros(2, dtype=torch.int32))


def test_attach_storage_refuses_a_group_the_cache_was_not_built_with() -> None:
    class _Two(RankGroup):
        def __init__(self) -> None:
            super().__init__()
            self.size, self.rank = 2, 1

    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32")
    cfg = CacheConfig(page_size=2, device_tokens=8, hicache_ratio=2.0)
    ns = Namespace.for_spec(
        spec, model="m", weights_fingerprint="w", layout=cfg.mem_layout, page_size=2
    )
    with HiCache(cfg, spec).start() as cache:
        storage = create_storage("memory", namespace=ns)
        with pytest.raises(ValueError, match=r"rank 1 of 2, but the cache is rank 0 of 1"):
            cache.l3.attach(storage, ns, PrefetchConfig(), _Two())
        assert not (cache.l3.attached is not None)
        cache.l3.attach(
            create_storage("memory", namespace=ns), ns, PrefetchConfig(), cache.context.ranks
        )
        assert (cache.l3.attached is not None) and cache.sync() == 0  # nothing in flight
