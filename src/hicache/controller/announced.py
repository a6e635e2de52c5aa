"""Lookups waiting for announced pages: :class:`AnnouncedWaits`, on the L3 lookup thread.

A lookup's run of keys stops at the first absent page. When that page is announced
(:meth:`HiCacheStorage.announce`: a writer said it is on its way), the lookup waits for
it instead of reporting the miss: it asks the store again every :data:`ANNOUNCED_POLL_S`
until the run stops at a page that is not announced (that miss remembered), reaches its
end, fails, or its wait ends: ``wait_s`` after it began, earlier when the announcement
expires first, or when the lookup's :class:`WaitGain` says a read of the run it could
reach (its pages present and those announced in a row after them) would no longer pay
(not at all when it never would). A page announced is never remembered as a miss, so the
negative cache cannot hide it once it lands. Other lookups and reads go on meanwhile
(the thread polls between its other ops). ``wait_s`` 0: announcements are not read and
no lookup waits. The flow: ``docs/architecture.md``, "The next turn finds the previous
answer".
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

from hicache.keys import PageKey
from hicache.storage.base import HiCacheStorage
from hicache.storage.negative import NegativeCache

__all__ = ["ANNOUNCED_POLL_S", "ANY_GAIN", "AnnouncedWaits", "Stop", "WaitGain", "Waiting"]

ANNOUNCED_POLL_S = 0.002
"""How often a lookup waiting for an announced page asks the store again (seconds)."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class WaitGain:
    """How long waiting for announced pages can pay, by the run a lookup could then read:
    a run of ``pages`` pages (counted from the lookup's first key) is worth
    :meth:`seconds` of waiting, ``pages * per_page_s - fixed_s`` from ``min_pages`` pages
    on and nothing below (``per_page_s`` infinite: any wait, from ``min_pages`` on). The
    lookup's owner derives it from the rule that decides whether the hit is read
    (:meth:`hicache.cache.l3.reads.Reads.wait_gain`): recomputing the run minus restoring
    it, by the measured rates, or a threshold in pages."""

    min_pages: int = 1
    fixed_s: float = 0.0
    per_page_s: float = math.inf

    def seconds(self, pages: int) -> float:
        """Seconds a wait for a run of ``pages`` pages may last (<= 0: none)."""
        if pages < self.min_pages or pages <= 0:
            return 0.0
        if self.per_page_s == math.inf:
            return math.inf
        return pages * self.per_page_s - self.fixed_s

    def pages_for(self, seconds: float) -> int | None:
        """The fewest pages whose run is worth ``seconds`` (> 0) of waiting; None: no run is."""
        if self.per_page_s == math.inf:
            return max(1, self.min_pages)
        if self.per_page_s <= 0:
            return None
        return max(1, self.min_pages, math.ceil((seconds + self.fixed_s) / self.per_page_s))


ANY_GAIN = WaitGain()
"""Any run of a page or more is worth the whole wait (a lookup whose owner did not say)."""


class Stop(Enum):
    """What :meth:`AnnouncedWaits.stopped` made of a run stopped at an absent page."""

    MISS = "miss"
    """Not announced: the miss is remembered (with a negative cache)."""
    WAIT = "wait"
    """Announced, and worth waiting for: the lookup waits."""
    NOT_WORTH = "not_worth"
    """Announced, but the run it could reach is not worth any wait (:class:`WaitGain`):
    the lookup ends now, the page not remembered as missing."""


@dataclass(slots=True)
class Waiting(Generic[T]):
    """Lookup ``op`` of run ``keys``, ``asked`` of them asked: the first ``hit`` are
    present; ``gain``: what waiting can pay. Until ``ended``, it waits until ``until``
    (monotonic seconds) at the latest; once ended, ``expired`` says the wait ran out with
    the page still announced, and ``error`` why the store failed (empty: it did not)."""

    op: T
    keys: Sequence[PageKey]
    asked: int
    hit: int
    started: float
    until: float
    next_poll: float
    gain: WaitGain = ANY_GAIN
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

    def stopped(
        self,
        op: T,
        keys: Sequence[PageKey],
        asked: int,
        hit: int,
        gain: WaitGain = ANY_GAIN,
    ) -> Stop:
        """Lookup ``op``'s run stopped at ``keys[hit]`` (``hit < asked``, the store did
        not fail): when that page is announced and ``gain`` says the run it could reach is
        worth a wait, the lookup waits (:attr:`Stop.WAIT`: its record comes from
        :meth:`poll`); announced but not worth it, :attr:`Stop.NOT_WORTH`; else the miss is
        remembered (:attr:`Stop.MISS`)."""
        left, allowed = self._bound(keys, asked, hit, gain)
        if left <= 0:
            if self._negative is not None:
                self._negative.missed(keys[hit])
            return Stop.MISS
        if allowed <= 0:
            return Stop.NOT_WORTH
        now = self._clock()
        until = now + min(left, allowed)
        self._waiting.append(
            Waiting(op, keys, asked, hit, now, until, now + ANNOUNCED_POLL_S, gain)
        )
        return Stop.WAIT

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
            left, allowed = self._bound(w.keys, w.asked, w.hit, w.gain)
            if left <= 0:
                if self._negative is not None:
                    self._negative.missed(w.keys[w.hit])
                w.ended = True
                return
            w.until = min(w.started + allowed, now + left)
        if closing or now >= w.until:
            w.ended = w.expired = True
            return
        w.next_poll = now + ANNOUNCED_POLL_S

    def _bound(
        self, keys: Sequence[PageKey], asked: int, hit: int, gain: WaitGain
    ) -> tuple[float, float]:
        """``(left, allowed)`` for a run stopped at ``keys[hit]``: the seconds its
        announcement has left (0: none, or waits are off), and the longest wait from its
        start that can pay: ``wait_s`` at most, and ``gain`` of the run it could reach,
        the pages announced in a row from ``keys[hit]`` (within ``asked``) added. Those are
        asked of the store in batches of 1, 2, 4, ... only as far as they can raise the
        bound (with :data:`ANY_GAIN`, ``keys[hit]`` alone: one small read)."""
        if self.wait_s <= 0:
            return 0.0, 0.0
        cap = max(1, self._storage.options.max_batch_pages)
        enough = gain.pages_for(self.wait_s)  # a longer run cannot raise the bound
        want = hit + 1 if enough is None else max(hit + 1, min(asked, enough))
        reach, batch, left = hit, 1, 0.0
        while reach < want:
            lefts = self._storage.announced_many(keys[reach : min(want, reach + batch)])
            if reach == hit:
                left = lefts[0]
            n = next((i for i, x in enumerate(lefts) if x <= 0), len(lefts))
            reach += n
            if n < len(lefts):
                break
            batch = min(2 * batch, cap)
        if left <= 0:
            return 0.0, 0.0
        return left, min(self.wait_s, gain.seconds(reach))
