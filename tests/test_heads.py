"""HeadSplit: the heads each tensor-parallel rank holds, and the writer of each K/V head."""

from __future__ import annotations

import pytest

from hicache.heads import HeadSplit


def layout(h: int, kv: int, n: int) -> list[tuple[range, list[int], bool]]:
    splits = [HeadSplit(h, kv, n, r) for r in range(n)]
    return [
        (range(s.first_head, s.first_head + s.local_heads), list(s.kv_heads), s.writes_any)
        for s in splits
    ]


def test_heads_are_split_while_ranks_do_not_outnumber_them() -> None:
    assert layout(8, 4, 2) == [(range(0, 4), [0, 1], True), (range(4, 8), [2, 3], True)]
    assert layout(8, 2, 1) == [(range(0, 8), [0, 1], True)]


def test_kv_heads_are_replicated_when_ranks_outnumber_them() -> None:
    assert layout(8, 2, 4) == [
        (range(0, 2), [0], True),
        (range(2, 4), [0], False),
        (range(4, 6), [1], True),
        (range(6, 8), [1], False),
    ]
    # every rank's query heads read the K/V head it holds
    for n in (1, 2, 4, 8):
        for r in range(n):
            s = HeadSplit(8, 2, n, r)
            group = 8 // 2
            assert {q // group for q in range(s.first_head, s.first_head + s.local_heads)} <= set(
                s.kv_heads
            )


def test_the_writer_of_a_head_is_the_lowest_rank_holding_it() -> None:
    assert [HeadSplit(8, 2, 4, 0).writer(h) for h in range(2)] == [0, 2]
    assert [HeadSplit(8, 4, 2, 1).writer(h) for h in range(4)] == [0, 0, 1, 1]
    assert HeadSplit(8, 2, 4, 2).writes(1) and not HeadSplit(8, 2, 4, 3).writes(1)
    with pytest.raises(ValueError, match=r"^kv_head=2 is invalid"):
        HeadSplit(8, 2, 4, 0).writer(2)


@pytest.mark.parametrize(
    ("h", "kv", "n"),
    [(4, 2, 3), (12, 4, 8), (8, 4, 16)],
)
def test_a_size_that_splits_neither_way_is_refused_with_the_numbers(
    h: int, kv: int, n: int
) -> None:
    with pytest.raises(ValueError, match=rf"size {n} cannot split num_attention_heads={h},"):
        HeadSplit(h, kv, n, 0)


def test_bad_fields_are_named() -> None:
    with pytest.raises(ValueError, match=r"^tp_rank=2 is invalid"):
        HeadSplit(4, 2, 2, 2)
    with pytest.raises(ValueError, match=r"^num_heads=6 is not a multiple of num_kv_heads=4"):
        HeadSplit(6, 4)
