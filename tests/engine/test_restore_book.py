"""The restore book alone (pure): bounds, states, TTL deadlines, ended operations kept."""

from __future__ import annotations

import pytest

from hicache.engine import restore_book
from hicache.engine.restore_book import RestoreBook, RestoreBusy, RestoreState


def book(max_ops: int = 2, max_bytes: int = 100) -> RestoreBook:
    return RestoreBook(max_ops=max_ops, max_bytes=max_bytes)


def test_reserve_is_bounded_by_ops_and_bytes_of_operations_not_ended() -> None:
    b = book()
    one = b.reserve(session_id="a", tokens=8, nbytes=60, ttl_ms=1000, now=0.0)
    assert one.state is RestoreState.QUEUED and one.deadline == 1.0
    with pytest.raises(RestoreBusy, match="needs 50 bytes of L2 and restores hold 60 of the 100"):
        b.reserve(session_id="b", tokens=8, nbytes=50, ttl_ms=1000, now=0.0)
    two = b.reserve(session_id="b", tokens=8, nbytes=40, ttl_ms=1000, now=0.0)
    with pytest.raises(RestoreBusy, match="restore-max-ops=2"):
        b.reserve(session_id="c", tokens=8, nbytes=0, ttl_ms=1000, now=0.0)
    b.change(one.operation_id, state=RestoreState.CANCELLED)
    b.reserve(session_id="c", tokens=8, nbytes=60, ttl_ms=1000, now=0.0)  # room again
    assert [op.session_id for op in b.live()] == ["b", "c"]
    assert b.get(two.operation_id) == two


def test_an_ended_operation_changes_no_more_and_due_skips_queued_ones() -> None:
    b = book()
    op = b.reserve(session_id="a", tokens=8, nbytes=1, ttl_ms=10, now=0.0)
    assert b.due(now=5.0) == []  # queued: its start is applied first
    b.change(op.operation_id, state=RestoreState.LOADING)
    assert b.due(now=0.009) == [] and b.due(now=0.010) == [op.operation_id]
    b.change(op.operation_id, state=RestoreState.EXPIRED)
    kept = b.change(op.operation_id, state=RestoreState.READY)
    assert kept is not None and kept.state is RestoreState.EXPIRED
    assert b.due(now=5.0) == [] and b.change("restore-none", state=RestoreState.READY) is None


def test_only_the_most_recent_ended_operations_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(restore_book, "ENDED_KEPT", 2)
    b = book(max_ops=5, max_bytes=10**6)
    ids = []
    for i in range(3):
        op = b.reserve(session_id=f"s{i}", tokens=4, nbytes=1, ttl_ms=1000)
        b.change(op.operation_id, state=RestoreState.RELEASED)
        ids.append(op.operation_id)
    assert b.get(ids[0]) is None and b.get(ids[1]) is not None and b.get(ids[2]) is not None
