"""Self-healing L3: which bad records a write may replace, and the keys read bad.

A backend instance remembers the keys its reads found *replaceable* (:data:`REPLACEABLE`),
and its next write of such a key overwrites the record instead of skipping it
(``HiCacheStorage._overwrite``, atomically where the backend can: a reader sees the old
record or the new one), counted in ``StorageStats.repaired``; a later good read unmarks it.
Invariants: ``corrupt`` and ``stale`` records are replaceable; ``foreign`` ones never are
(they may be good data for another reader: a tenant's namespace, say); ``absent``,
``timeout`` and ``error`` have nothing to heal. Nothing is ever deleted on a read: an
overwrite only puts a good, freshly computed page in place, so a race with another
writer costs one extra write, never a good record. A key no instance writes again stays a
counted miss. Why overwrite and not delete, and each miss kind: ``docs/l3-keys.md``,
"Healing".
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from hicache.storage.stats import MissReason, SetOutcome

__all__ = ["MAX_BAD_KEYS", "REPLACEABLE", "BadRecords"]

REPLACEABLE = frozenset({MissReason.CORRUPT, MissReason.STALE})
"""Misses whose record the next write of the same key overwrites (see the module)."""

MAX_BAD_KEYS = 16384
"""Keys read bad remembered per backend instance (least recently marked forgotten first:
such a key stays a miss until it is read bad again)."""


class BadRecords:
    """Thread-safe, bounded set of keys whose last read found a replaceable record.

    Reads :meth:`note` their outcomes (a replaceable miss marks the key, a good record
    unmarks it: someone healed it); a write asks :meth:`flags` which of its keys to
    overwrite and reports what it did with :meth:`written`, which unmarks the keys it
    stored.
    """

    def __init__(self, limit: int = MAX_BAD_KEYS) -> None:
        if limit < 1:
            raise ValueError(f"limit={limit!r} is invalid; must be >= 1")
        self._limit = limit
        self._lock = threading.Lock()
        self._keys: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._keys

    def note(self, keys: Sequence[str], reasons: Sequence[MissReason | None]) -> None:
        """One read's outcome per key: mark the replaceable misses, unmark the good."""
        with self._lock:
            for k, r in zip(keys, reasons, strict=True):
                if r is None:
                    self._keys.pop(k, None)
                elif r in REPLACEABLE:
                    self._keys[k] = None
                    self._keys.move_to_end(k)
            while len(self._keys) > self._limit:
                self._keys.popitem(last=False)

    def flags(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether a write must overwrite its record (it was read bad)."""
        with self._lock:
            if not self._keys:
                return [False] * len(keys)
            return [k in self._keys for k in keys]

    def written(
        self, keys: Sequence[str], outcomes: Sequence[SetOutcome], replace: Sequence[bool]
    ) -> int:
        """A write's outcome: unmark every key it stored; returns how many of those it
        stored over a record read bad (``replace``), i.e. records repaired."""
        healed = 0
        with self._lock:
            for k, o, r in zip(keys, outcomes, replace, strict=True):
                if o is SetOutcome.WRITTEN:
                    self._keys.pop(k, None)
                    healed += int(r)
        return healed
