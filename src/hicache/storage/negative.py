"""The negative lookup cache: L3 page keys the store lately did not have.

When a lookup's run stops at key ``n`` (:meth:`HiCacheStorage.batch_exists`), key ``n`` and
every key chained after it are absent until someone writes it; this cache remembers each
miss for ``ttl_s`` seconds, so the next lookup through it asks fewer keys or none. Rules
(the invariants the tests hold): :meth:`NegativeCache.to_ask` of a run is the index of its
first key remembered missing within ``ttl_s`` (the run's length when none; 0: no store call);
:meth:`NegativeCache.missed` stamps one key with the clock now, at most ``max_entries`` kept
(least recently remembered or consulted first out); :meth:`NegativeCache.forget` drops keys
at once (this instance wrote them, or is about to); a miss older than ``ttl_s`` is dropped
when met, so staleness is bounded by ``ttl_s`` and a stale miss only loses a hit, never
serves bytes. Keys are chained under their namespace, so one map serves every namespace.
Pure data: no threads, no IO; the clock (monotonic seconds) is injectable. One thread owns
an instance (the L3 lookup thread, :mod:`hicache.controller.storage_controller`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from hicache.config import DEFAULT_NEGATIVE_ENTRIES, DEFAULT_NEGATIVE_TTL_S
from hicache.keys import PageKey
from hicache.validate import int_at_least, is_finite_number, require

__all__ = ["NegativeCache"]


class NegativeCache:
    """Page keys the store did not have, each for ``ttl_s`` seconds, at most
    ``max_entries`` of them (LRU). ``clock``: seconds, monotonic (``time.monotonic``)."""

    def __init__(
        self,
        ttl_s: float = DEFAULT_NEGATIVE_TTL_S,
        max_entries: int = DEFAULT_NEGATIVE_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        require(
            is_finite_number(ttl_s) and ttl_s > 0,
            "ttl_s",
            ttl_s,
            "must be a finite number of seconds > 0 (a TTL of 0 is no negative cache)",
        )
        int_at_least("max_entries", max_entries, 1)
        self.ttl_s = float(ttl_s)
        self.max_entries = max_entries
        self._clock = clock
        self._missed: OrderedDict[str, float] = OrderedDict()
        """Key string -> when it was found missing (clock seconds); oldest use first."""

    def __len__(self) -> int:
        """Keys remembered (expired ones included until met or pushed out)."""
        return len(self._missed)

    def __contains__(self, key: PageKey) -> bool:
        """Whether ``key`` is remembered missing and still fresh (does not reorder)."""
        at = self._missed.get(key.key)
        return at is not None and self._clock() - at <= self.ttl_s

    def to_ask(self, keys: Sequence[PageKey]) -> int:
        """How many leading keys of the run ``keys`` the store must be asked about: the
        index of the first one remembered missing within ``ttl_s`` (that entry becomes the
        most recently used), or ``len(keys)``. Expired entries met on the way are
        dropped."""
        if not self._missed:
            return len(keys)
        now = self._clock()
        for i, k in enumerate(keys):
            at = self._missed.get(k.key)
            if at is None:
                continue
            if now - at > self.ttl_s:
                del self._missed[k.key]
                continue
            self._missed.move_to_end(k.key)
            return i
        return len(keys)

    def missed(self, key: PageKey) -> None:
        """Remember ``key`` as missing from now on (replacing an older stamp), pushing
        out the least recently used key beyond ``max_entries``."""
        self._missed[key.key] = self._clock()
        self._missed.move_to_end(key.key)
        while len(self._missed) > self.max_entries:
            self._missed.popitem(last=False)

    def forget(self, keys: Iterable[PageKey]) -> None:
        """Drop ``keys``: written by this instance (or being written), so ask again."""
        for k in keys:
            self._missed.pop(k.key, None)
