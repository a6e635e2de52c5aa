"""The hub: the engine publishes KV event batches, each subscriber reads its own buffer.

:meth:`KvEventHub.publish` runs in the owner's thread and never waits on a subscriber:
each subscriber has a bounded buffer of batches; one that is full when a batch comes
is *lagged*: that batch and every later one are dropped for it (counted), and once it
has read what its buffer held, :meth:`KvEventSubscription.get` raises
:class:`SubscriberLagged` (a gRPC stream ends with ``DATA_LOSS``; the subscriber
resubscribes). A subscription that starts from sequence 0 begins with a snapshot batch
(``AllBlocksCleared`` then every resident page as :class:`BlockStored`, parents first)
taken from the hub's own mirror of what it published, so it is exact at its sequence
number; a resume from a later cursor replays the kept history or raises
:class:`ReplayUnavailable`. The hub starts no thread; :meth:`KvEventHub.close` ends
every subscription.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from hicache.kv_events.records import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    Medium,
)
from hicache.tokens import decode_tokens, encode_tokens
from hicache.validate import int_at_least

__all__ = [
    "KvEventHub",
    "KvEventHubConfig",
    "KvEventHubStats",
    "KvEventSubscription",
    "ReplayUnavailable",
    "SubscriberLagged",
    "SubscriptionClosed",
]


class SubscriberLagged(Exception):
    """The subscriber's buffer overflowed: batches were dropped for it; resubscribe."""


class SubscriptionClosed(Exception):
    """The subscription (or the whole hub) was closed."""


class ReplayUnavailable(Exception):
    """A resume cursor the kept history does not reach back to (or one from the future)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KvEventHubConfig:
    """Sizes of the hub's buffers.

    Attributes:
        buffer_batches: batches a subscriber may have unread before it is lagged.
        history_batches: batches kept for resuming subscribers (0: none; every
            resubscription then starts from a snapshot).
    """

    buffer_batches: int = 4096
    history_batches: int = 1024

    def __post_init__(self) -> None:
        int_at_least("buffer_batches", self.buffer_batches, 1)
        int_at_least("history_batches", self.history_batches, 0)


@dataclass(frozen=True, slots=True)
class KvEventHubStats:
    """Counters since the hub was made.

    Attributes:
        published_batches / published_events: what the owner published.
        delivered_batches: batches put into subscriber buffers (one per subscriber).
        dropped_batches / dropped_events: batches (and their events) a lagged subscriber
            did not get, summed over subscribers.
        lagged_subscriptions: subscriptions that overflowed.
        subscribers: subscriptions open now.
        sequence_number: the last published batch's number (0: none yet).
        resident_blocks: pages the mirror holds as resident now.
    """

    published_batches: int
    published_events: int
    delivered_batches: int
    dropped_batches: int
    dropped_events: int
    lagged_subscriptions: int
    subscribers: int
    sequence_number: int
    resident_blocks: int


@dataclass(frozen=True, slots=True)
class _Block:
    """One resident page as the mirror keeps it (its token ids as ``uint32`` bytes)."""

    parent: int | None
    tokens: bytes
    block_size: int
    medium: Medium
    cache_salt: str | None


class KvEventSubscription:
    """One subscriber's view of the hub: a bounded buffer of batches, read in order.

    Thread-safe; meant to be read by one thread (a gRPC stream, the ZMQ publisher).
    Iterating yields batches until the subscription ends (closed: the loop stops;
    lagged: :class:`SubscriberLagged` is raised).
    """

    def __init__(self, hub: KvEventHub, capacity: int) -> None:
        self._hub = hub
        self._capacity = capacity
        self._buffer: deque[KvEventBatch] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._lagged = False
        self._closed = False
        self.dropped_batches = 0
        """Batches dropped for this subscriber since it lagged."""
        self.dropped_events = 0
        """Events of those batches."""

    @property
    def lagged(self) -> bool:
        """The buffer overflowed; later batches are dropped for this subscriber."""
        return self._lagged

    def get(self, timeout: float | None = None) -> KvEventBatch | None:
        """The next batch, waiting up to ``timeout`` seconds (None: forever); ``None`` if
        none came in time. Raises :class:`SubscriberLagged` once the buffered batches are
        read after an overflow, :class:`SubscriptionClosed` once closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._buffer:
                if self._lagged:
                    raise SubscriberLagged(
                        f"KV event subscriber fell behind: {self.dropped_batches} batches dropped"
                    )
                if self._closed:
                    raise SubscriptionClosed("KV event subscription closed")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)
            return self._buffer.popleft()

    def __iter__(self) -> Iterator[KvEventBatch]:
        while True:
            try:
                batch = self.get()
            except SubscriptionClosed:
                return
            if batch is not None:
                yield batch

    def close(self) -> None:
        """End the subscription (idempotent): the hub forgets it, readers wake."""
        self._hub._forget(self)
        self._end()

    def __enter__(self) -> KvEventSubscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ hub side

    def _offer(self, batch: KvEventBatch) -> bool:
        """Buffer ``batch``; False (dropped, counted) when lagged or full."""
        with self._cond:
            if self._closed:
                return False
            if self._lagged or len(self._buffer) >= self._capacity:
                self._lagged = True
                self.dropped_batches += 1
                self.dropped_events += len(batch.events)
                self._cond.notify_all()
                return False
            self._buffer.append(batch)
            self._cond.notify_all()
            return True

    def _offer_first(self, batch: KvEventBatch) -> None:
        """Put ``batch`` ahead of everything buffered (the snapshot, built after the
        subscription was registered); never dropped."""
        with self._cond:
            self._buffer.appendleft(batch)
            self._cond.notify_all()

    def _end(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class KvEventHub:
    """Publishes KV event batches to subscribers (see the module docstring).

    ``clock``: the batches' timestamp source (seconds since the epoch).
    """

    def __init__(
        self,
        config: KvEventHubConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config or KvEventHubConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._subs: list[KvEventSubscription] = []
        self._history: deque[KvEventBatch] = deque(maxlen=self.config.history_batches or 1)
        self._mirror: dict[int, _Block] = {}
        self._seq = 0
        self._closed = False
        self._published_batches = 0
        self._published_events = 0
        self._delivered = 0
        self._dropped_batches = 0
        self._dropped_events = 0
        self._lagged = 0

    # ------------------------------------------------------------------ owner

    def publish(self, events: Sequence[KvEvent]) -> KvEventBatch | None:
        """Publish ``events`` as the next batch (owner thread; never blocks on a
        subscriber). Returns the batch, or ``None`` when ``events`` is empty or the hub
        is closed."""
        if not events:
            return None
        with self._lock:
            if self._closed:
                return None
            self._seq += 1
            batch = KvEventBatch(self._seq, self._clock(), tuple(events))
            self._apply(batch.events)
            if self.config.history_batches:
                self._history.append(batch)
            self._published_batches += 1
            self._published_events += len(batch.events)
            for sub in self._subs:
                was_lagged = sub.lagged
                if sub._offer(batch):
                    self._delivered += 1
                else:
                    self._dropped_batches += 1
                    self._dropped_events += len(batch.events)
                    if not was_lagged:
                        self._lagged += 1
            return batch

    def close(self) -> None:
        """End every subscription; later publishes are ignored (idempotent)."""
        with self._lock:
            self._closed = True
            subs, self._subs = self._subs, []
        for sub in subs:
            sub._end()

    def __enter__(self) -> KvEventHub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ subscribers

    def subscribe(self, start_sequence_number: int = 0) -> KvEventSubscription:
        """A new subscription. From 0: it starts with a snapshot batch (resync). From
        ``n > 0`` (the last sequence the subscriber applied): it starts with the kept
        batches after ``n``; raises :class:`ReplayUnavailable` when the history does not
        reach back to ``n + 1`` or ``n`` is beyond the last published batch, and
        :class:`SubscriptionClosed` when the hub is closed."""
        int_at_least("start_sequence_number", start_sequence_number, 0)
        with self._lock:  # the publisher waits only for a copy of the mirror
            if self._closed:
                raise SubscriptionClosed("KV event hub closed")
            resident: list[tuple[int, _Block]] | None = None
            if start_sequence_number == 0:
                resident, seq = list(self._mirror.items()), self._seq
                first: list[KvEventBatch] = []
            else:
                first = self._replay(start_sequence_number)
            sub = KvEventSubscription(self, self.config.buffer_batches + len(first) + 1)
            for batch in first:
                sub._offer(batch)
            self._subs.append(sub)
        if resident is not None:  # ahead of any live batch offered meanwhile
            sub._offer_first(_snapshot(resident, seq, self._clock()))
        return sub

    def snapshot(self) -> KvEventBatch:
        """``AllBlocksCleared`` then every resident page, at the last published sequence."""
        with self._lock:
            resident, seq = list(self._mirror.items()), self._seq
        return _snapshot(resident, seq, self._clock())

    def stats(self) -> KvEventHubStats:
        """The counters now."""
        with self._lock:
            return KvEventHubStats(
                published_batches=self._published_batches,
                published_events=self._published_events,
                delivered_batches=self._delivered,
                dropped_batches=self._dropped_batches,
                dropped_events=self._dropped_events,
                lagged_subscriptions=self._lagged,
                subscribers=len(self._subs),
                sequence_number=self._seq,
                resident_blocks=len(self._mirror),
            )

    # ------------------------------------------------------------------ internals

    def _forget(self, sub: KvEventSubscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def _replay(self, cursor: int) -> list[KvEventBatch]:
        if cursor > self._seq:
            raise ReplayUnavailable(
                f"start_sequence_number={cursor} is past the last batch {self._seq}"
            )
        if cursor == self._seq:
            return []
        kept = (
            [b for b in self._history if b.sequence_number > cursor]
            if self.config.history_batches
            else []
        )
        if not kept or kept[0].sequence_number != cursor + 1:
            raise ReplayUnavailable(
                f"start_sequence_number={cursor}: batches after it are no longer kept"
            )
        return kept

    def _apply(self, events: Sequence[KvEvent]) -> None:
        """Keep the mirror of resident pages in step with ``events``."""
        mirror = self._mirror
        for event in events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                size = event.block_size
                for i, h in enumerate(event.block_hashes):
                    tokens = encode_tokens(event.token_ids[i * size : (i + 1) * size])
                    mirror[h] = _Block(parent, tokens, size, event.medium, event.cache_salt)
                    parent = h
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    mirror.pop(h, None)
            elif isinstance(event, AllBlocksCleared):
                mirror.clear()


def _snapshot(resident: list[tuple[int, _Block]], seq: int, now: float) -> KvEventBatch:
    """The resync batch at sequence ``seq`` of the mirror's ``resident`` pages (in their
    insertion order: parents first); a chain of one medium and salt is one event."""
    events: list[KvEvent] = [AllBlocksCleared()]
    run: list[tuple[int, _Block]] = []
    for h, block in resident:
        if run:
            last_h, last = run[-1]
            same = (block.medium, block.cache_salt, block.block_size) == (
                last.medium,
                last.cache_salt,
                last.block_size,
            )
            if not (same and block.parent == last_h):
                events.append(_stored(run))
                run = []
        run.append((h, block))
    if run:
        events.append(_stored(run))
    return KvEventBatch(seq, now, tuple(events), snapshot=True)


def _stored(run: list[tuple[int, _Block]]) -> BlockStored:
    """One event for a chain of blocks (each the parent of the next)."""
    first = run[0][1]
    return BlockStored(
        block_hashes=tuple(h for h, _ in run),
        parent_block_hash=first.parent,
        token_ids=tuple(decode_tokens(b"".join(b.tokens for _, b in run))),
        block_size=first.block_size,
        medium=first.medium,
        cache_salt=first.cache_salt,
    )
