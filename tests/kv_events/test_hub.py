"""The hub: ordered batches, a stalled subscriber dropped and counted, resync, replay."""

from __future__ import annotations

import threading
import time

import pytest

from hicache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    KvEventHub,
    KvEventHubConfig,
    Medium,
    ReplayUnavailable,
    SubscriberLagged,
    SubscriptionClosed,
)

A = BlockStored((1, 2), None, (1, 2, 3, 4), 2, Medium.DEVICE)
B = BlockStored((3,), 1, (5, 6), 2, Medium.DEVICE)
C = BlockStored((7,), None, (8, 9), 2, Medium.HOST, "acme")


def _hub(**kw: int) -> KvEventHub:
    return KvEventHub(KvEventHubConfig(**kw), clock=lambda: 100.0)


def test_a_new_subscriber_gets_a_snapshot_then_live_batches() -> None:
    hub = _hub()
    hub.publish([A, B, C])
    hub.publish([BlockRemoved((2,), Medium.DEVICE)])
    with hub.subscribe() as sub:
        snap = sub.get(0)
        # Parents first; a chain broken by the removal becomes two events.
        assert snap == KvEventBatch(
            2,
            100.0,
            (
                AllBlocksCleared(),
                BlockStored((1, 3), None, (1, 2, 5, 6), 2, Medium.DEVICE),
                C,
            ),
            snapshot=True,
        )
        assert sub.get(0) is None
        assert hub.publish([]) is None
        hub.publish([AllBlocksCleared()])
        assert sub.get(0) == KvEventBatch(3, 100.0, (AllBlocksCleared(),))
    assert hub.snapshot().events == (AllBlocksCleared(),)
    assert hub.stats().subscribers == 0


def test_a_stalled_subscriber_is_dropped_and_counted_and_never_blocks_publish() -> None:
    hub = _hub(buffer_batches=2)
    stalled = hub.subscribe()
    live = hub.subscribe()
    start = time.monotonic()
    for _ in range(100):
        hub.publish([A])
        assert live.get(0) is not None  # a reader keeping up loses nothing
    assert time.monotonic() - start < 1.0
    stats = hub.stats()
    # The stalled one holds its snapshot and 2 batches (capacity 2 + the snapshot)...
    assert stats.published_batches == 100
    assert stats.dropped_batches == 98 and stats.dropped_events == 98
    assert stats.lagged_subscriptions == 1
    assert stalled.lagged and stalled.dropped_batches == 98 and not live.lagged
    # ...reads what it holds, then learns it fell behind.
    assert [stalled.get(0).sequence_number for _ in range(3)] == [0, 1, 2]  # type: ignore[union-attr]
    with pytest.raises(SubscriberLagged):
        stalled.get(0)
    stalled.close()
    # Resubscribing resyncs: a snapshot at the last sequence.
    again = hub.subscribe()
    assert again.get(0) == KvEventBatch(
        100,
        100.0,
        (AllBlocksCleared(), BlockStored((1, 2), None, (1, 2, 3, 4), 2, Medium.DEVICE)),
        True,
    )
    again.close()
    live.close()


def test_resume_replays_kept_batches_or_refuses() -> None:
    hub = _hub(history_batches=2)
    for _ in range(4):
        hub.publish([A])
    with hub.subscribe(3) as sub:
        assert sub.get(0).sequence_number == 4  # type: ignore[union-attr]
        assert sub.get(0) is None
    with hub.subscribe(4) as sub:
        assert sub.get(0) is None
    with pytest.raises(ReplayUnavailable):
        hub.subscribe(1)  # batch 2 is no longer kept
    with pytest.raises(ReplayUnavailable):
        hub.subscribe(5)  # from the future (a restarted publisher)


def test_close_wakes_a_waiting_reader() -> None:
    hub = _hub()
    sub = hub.subscribe()
    sub.get(0)
    got: list[object] = []

    def read() -> None:
        got.extend(sub)  # the iteration ends when the hub closes

    reader = threading.Thread(target=read)
    reader.start()
    hub.publish([A])
    hub.close()
    reader.join(5)
    assert not reader.is_alive()
    assert [b.sequence_number for b in got] == [1]  # type: ignore[attr-defined]
    with pytest.raises(SubscriptionClosed):
        hub.subscribe()
    assert hub.publish([A]) is None
