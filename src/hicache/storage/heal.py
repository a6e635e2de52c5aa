"""Self-healing L3: which bad records a write may replace, and the keys read bad.

A read that finds a record failing its checks reports a miss; left alone, that record
would stay under its key for good: the recompute's backup finds the key present and skips
it (``SetOutcome.SKIPPED``), so the prefix stays a miss and every later request reads the
bad record again. So a backend instance remembers the keys its reads found *replaceable*
(:data:`REPLACEABLE`), and its next write of such a key overwrites the record instead of
skipping it (``HiCacheStorage._overwrite``), atomically where the backend can (a reader
sees the old record or the new one, never neither): the page is healed by the next backup
of it, and counted (``StorageStats.repaired``).

Why overwrite-by-next-write and not delete-on-read: between a read that found a bad
record and any action on it, another instance may have replaced it with a good one. A
delete would destroy that good record (no backend here has a compare-and-delete that
covers them all: Mooncake has none); an overwrite only ever puts a good record (the
writer's own freshly computed page) in place of whatever is there, so a race costs one
extra write of an equally good page, never a good record. A false alarm (a record read
bad by a torn or failed transfer that is good in the store) costs the same. What it does
not do is heal a key no instance writes again; such a key stays a counted miss, as before.

Which misses are replaceable (``docs/l3-keys.md``, *Healing*):

- ``corrupt``: the record fails its own integrity checks (length, magic, header size,
  checksum). It is nobody's data; replace it.
- ``stale``: an intact record of another spec version under a key of this version. Keys
  carry the version (prefix and namespace digest), so no engine of any version reads a
  record of another version under this key as data: it was planted or mis-stored. Replace.
- ``foreign``: an intact record of *this* version whose namespace digest or token
  fingerprint differ. It may be good data for another reader: an instance that allows a
  tenant's namespace stamps that tenant's digest, and one that does not (yet) expects its
  own, so the two disagree on what belongs under the same key; each overwriting the other
  would ping-pong for ever and destroy a tenant's good records. A fingerprint mismatch is
  a SHA-256 collision or a planted record. Never replaced: a miss, counted, as before.
- ``absent``, ``timeout``, ``error``: nothing to heal (an absent key is written anyway).
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
