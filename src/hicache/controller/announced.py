"""Lookups waiting for announced pages: :class:`AnnouncedWaits`, on the L3 lookup thread.

A lookup's run of keys stops at the first absent page. When that page is announced
(:meth:`HiCacheStorage.announce`: a writer said it is on its way), the lookup waits for
it instead of reporting the miss: it asks the store again every :data:`ANNOUNCED_POLL_S`
until the run stops at a page that is not announced (that miss remembered), reaches its
end, fails, or its wait ends: ``wait_s`` after it began, or earlier when the
announcement expires first. A page announced is never remembered as a miss, so the
negative cache cannot hide it once it lands. Other lookups and reads go on meanwhile
(the thread polls between its other ops). ``wait_s`` 0: announcements are not read and
no lookup waits. The flow: ``docs/architecture.md``, "The next turn finds the previous
answer".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from hicache.keys import PageKey
from hicache.storage.base import HiCacheStorage
from hicache.storage.negative import NegativeCache

__all__ = ["ANNOUNCED_POLL_S", "AnnouncedWaits", "Waiting"]

ANNOUNCED_POLL_S = 0.002
"""How often a lookup waiting for an announced page asks the store again (seconds)."""

T = TypeVar("T")


@dataclass(slots=True)
class Waiting(Generic[T]):
    """Lookup ``op`` of run ``keys``, ``asked`` of them asked: the first ``hit`` are
    present. Until ``ended``, it waits until ``until`` (monotonic seconds) at the latest;
    once ended, ``expired`` says the wait ran out with the page still announced, and
    ``error`` why the store failed (empty: it did not)."""

    op: T
    keys: Sequence[PageKey]
    asked: int
    hit: int
    started: float
    until: float
    next_poll: float
    ended: bool = False
    expired: bool = False
    error: str = ""


class AnnouncedWaits(Generic[T]):
    """The lookups waiting for announced pages on one lookup thread (its alone).

    ``storage``: the backend asked; ``negative``: the thread's negative cache (None:
    off); ``wait_s``: the longest wait, seconds (0: off); ``clock``: monotonic seconds."""

    def __init__(
        self,
        storage: HiCacheStorage,
        negative: NegativeCache | None,
        wait_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._storage = storage
        self._negative = negative
        self.wait_s = wait_s
        self._clock = clock
        self._waiting: list[Waiting[T]] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def stopped(self, op: T, keys: Sequence[PageKey], asked: int, hit: int) -> bool:
        """Lookup ``op``'s run stopped at ``keys[hit]`` (``hit < asked``, the store did
        not fail): when that page is announced the lookup waits (True: its record comes
        from :meth:`poll`); else the miss is remembered and False returned."""
        left = self._announced(keys[hit])
        if left <= 0:
            if self._negative is not None:
                self._negative.missed(keys[hit])
            return False
        now = self._clock()
        until = now + min(left, self.wait_s)
        self._waiting.append(Waiting(op, keys, asked, hit, now, until, now + ANNOUNCED_POLL_S))
        return True

    def timeout(self) -> float | None:
        """Seconds until the next poll is due (None: no lookup waits)."""
        if not self._waiting:
            return None
        return max(0.0, min(w.next_poll for w in self._waiting) - self._clock())

    def poll(self, *, closing: bool = False) -> list[Waiting[T]]:
        """Ask the store again for each waiting lookup due (every one when ``closing``,
        which ends them all); returns those whose wait ended, in the order they began."""
        now = self._clock()
        ended: list[Waiting[T]] = []
        still: list[Waiting[T]] = []
        for w in self._waiting:
            if closing or now >= w.next_poll:
                self._ask(w, now, closing=closing)
            (ended if w.ended else still).append(w)
        self._waiting = still
        return ended

    def _ask(self, w: Waiting[T], now: float, *, closing: bool) -> None:
        run = self._storage.exists_run(w.keys[w.hit : w.asked])
        w.hit += run.present
        if run.failed or w.hit == w.asked:
            w.ended, w.error = True, run.why
            return
        if run.present:  # the run grew: it stops at another page now
            left = self._announced(w.keys[w.hit])
            if left <= 0:
                if self._negative is not None:
                    self._negative.missed(w.keys[w.hit])
                w.ended = True
                return
            w.until = min(w.started + self.wait_s, now + left)
        if closing or now >= w.until:
            w.ended = w.expired = True
            return
        w.next_poll = now + ANNOUNCED_POLL_S

    def _announced(self, key: PageKey) -> float:
        """Seconds the announcement of ``key`` has left (0: none, or waits are off)."""
        return self._storage.announced(key) if self.wait_s > 0 else 0.0
