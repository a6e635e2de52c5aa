"""Outcomes and counters of L3 operations: miss reasons, a frozen stats snapshot, a recorder.

Every page an L3 read does not deliver is a *miss* with one :class:`MissReason`. The
:class:`StatsRecorder` (thread-safe) counts operations, pages, bytes and misses by reason,
and logs at WARNING: records that fail checks once per batch (a count per reason and the
first affected key, so a flood of bad records does not flood the log), and each backend
error or timeout with its cause.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["MissReason", "SetOutcome", "SetResult", "StatsRecorder", "StorageStats"]

log = logging.getLogger("hicache.storage")


class MissReason(str, enum.Enum):
    """Why a page was not delivered from L3."""

    ABSENT = "absent"
    """No record under the key (never written, evicted or removed)."""
    CORRUPT = "corrupt"
    """A record is there but fails a check: magic, header size, length or checksum."""
    STALE = "stale"
    """An intact-looking record of another spec (record) version: written by an engine of
    an older or newer key spec; never read as data."""
    FOREIGN = "foreign"
    """A valid record of another namespace or other tokens (digest or fingerprint differ)."""
    TIMEOUT = "timeout"
    """The operation's deadline passed before the page was read."""
    ERROR = "error"
    """The backend failed (connection lost, IO error, error code)."""


class SetOutcome(enum.Enum):
    """What a set did with one page."""

    WRITTEN = "written"
    """This call stored the page's record."""
    SKIPPED = "skipped"
    """The key was already present (written earlier, by anyone); nothing written. The page
    is backed up all the same."""
    FAILED = "failed"
    """Not stored: backend error, timeout, full store."""


@dataclass(frozen=True, slots=True)
class SetResult:
    """What one ``batch_set`` did: ``outcomes[i]`` is the fate of ``keys[i]``.

    ``written + present + failed == len(outcomes)``. Count ``written`` pages (and their
    bytes) as backed-up traffic; ``present`` pages were already in L3 and cost nothing.
    """

    outcomes: tuple[SetOutcome, ...]

    @classmethod
    def of(cls, outcomes: Sequence[SetOutcome]) -> SetResult:
        return cls(tuple(outcomes))

    def __len__(self) -> int:
        return len(self.outcomes)

    @property
    def written(self) -> int:
        """Pages whose record this call stored."""
        return sum(o is SetOutcome.WRITTEN for o in self.outcomes)

    @property
    def present(self) -> int:
        """Pages whose key was already present (nothing written)."""
        return sum(o is SetOutcome.SKIPPED for o in self.outcomes)

    @property
    def failed(self) -> int:
        """Pages not stored."""
        return sum(o is SetOutcome.FAILED for o in self.outcomes)

    @property
    def ok(self) -> list[bool]:
        """Per page: True when its record is in L3 now (written or present)."""
        return [o is not SetOutcome.FAILED for o in self.outcomes]

    @property
    def all_ok(self) -> bool:
        """Every page is in L3 now (True for an empty batch)."""
        return SetOutcome.FAILED not in self.outcomes


def _empty_misses() -> Mapping[str, int]:
    return MappingProxyType({r.value: 0 for r in MissReason})


@dataclass(frozen=True, kw_only=True)
class StorageStats:
    """A snapshot of one backend instance's counters since it was created.

    Counts are in pages (keys) unless named otherwise; bytes are record bytes (header and
    payload) moved to or from the backend. ``misses`` maps every :class:`MissReason` value
    to the pages missed for it; ``get_pages == get_hits + sum(misses.values())``.
    ``set_pages == set_written + set_skipped + set_failed``. ``errors`` counts backend
    failures (exceptions, error codes, failed writes) and ``timeouts`` deadline overruns,
    both per operation batch, not per page. ``repaired``: pages whose record a read
    found ``corrupt`` or ``stale`` and a later write overwrote (:mod:`hicache.storage.heal`;
    also counted in ``set_written``).
    """

    exists_calls: int = 0
    exists_keys: int = 0
    exists_hits: int = 0
    get_calls: int = 0
    get_pages: int = 0
    get_hits: int = 0
    set_calls: int = 0
    set_pages: int = 0
    set_written: int = 0
    set_skipped: int = 0
    set_failed: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0
    timeouts: int = 0
    repaired: int = 0
    misses: Mapping[str, int] = field(default_factory=_empty_misses)

    def miss(self, reason: MissReason | str) -> int:
        """Pages missed for ``reason``."""
        return self.misses[MissReason(reason).value]


class StatsRecorder:
    """Thread-safe mutable counters behind :class:`StorageStats`."""

    def __init__(self, backend: str) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()
        self._misses: Counter[str] = Counter()

    def exists(self, keys: int, hits: int) -> None:
        """One batch_exists over ``keys`` keys that found ``hits`` consecutive hits."""
        with self._lock:
            self._c["exists_calls"] += 1
            self._c["exists_keys"] += keys
            self._c["exists_hits"] += hits

    def got(
        self, keys: Sequence[str], hits: int, bytes_read: int, misses: Sequence[MissReason]
    ) -> None:
        """One batch_get of ``keys``: ``hits`` pages delivered, one reason per missed page."""
        with self._lock:
            self._c["get_calls"] += 1
            self._c["get_pages"] += len(keys)
            self._c["get_hits"] += hits
            self._c["bytes_read"] += bytes_read
            for r in misses:
                self._misses[r.value] += 1

    def put(self, pages: int, written: int, skipped: int, failed: int, bytes_written: int) -> None:
        """One batch_set over ``pages`` pages."""
        with self._lock:
            self._c["set_calls"] += 1
            self._c["set_pages"] += pages
            self._c["set_written"] += written
            self._c["set_skipped"] += skipped
            self._c["set_failed"] += failed
            self._c["bytes_written"] += bytes_written

    def repaired(self, pages: int) -> None:
        """A write overwrote ``pages`` records its reads had found bad; logged at INFO."""
        with self._lock:
            self._c["repaired"] += pages
        log.info("L3 %s: replaced %d bad record(s)", self._backend, pages)

    def error(self, op: str, detail: str) -> None:
        """A backend failure during ``op``; logged at WARNING."""
        with self._lock:
            self._c["errors"] += 1
        log.warning("L3 %s: %s failed: %s", self._backend, op, detail)

    def timeout(self, op: str, timeout_s: float) -> None:
        """``op`` overran its deadline of ``timeout_s`` seconds; logged at WARNING."""
        with self._lock:
            self._c["timeouts"] += 1
        log.warning("L3 %s: %s timed out after %.3f s", self._backend, op, timeout_s)

    def log_misses(
        self, op: str, keys: Sequence[str], reasons: Sequence[MissReason | None]
    ) -> None:
        """Log one WARNING summarising a batch's records that failed checks (if any).

        Only ``corrupt``, ``stale`` and ``foreign`` are logged here; ``timeout`` and ``error`` are
        logged (with their cause) by :meth:`timeout` and :meth:`error`, ``absent`` not at all.
        """
        logged = (MissReason.CORRUPT, MissReason.STALE, MissReason.FOREIGN)
        bad = [(k, r) for k, r in zip(keys, reasons, strict=True) if r in logged]
        if not bad:
            return
        counts = Counter(r.value for _, r in bad if r is not None)
        summary = ", ".join(f"{n} {name}" for name, n in sorted(counts.items()))
        log.warning(
            "L3 %s: %s: %d of %d pages rejected (%s); first: %s",
            self._backend,
            op,
            len(bad),
            len(keys),
            summary,
            bad[0][0],
        )

    def snapshot(self) -> StorageStats:
        """A frozen copy of the counters."""
        with self._lock:
            c = dict(self._c)
            misses = {r.value: self._misses.get(r.value, 0) for r in MissReason}
        return StorageStats(misses=MappingProxyType(misses), **c)
