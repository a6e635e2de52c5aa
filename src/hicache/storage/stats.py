"""Outcomes and counters of L3 operations: miss reasons, a frozen stats snapshot, a recorder.

Every page an L3 read does not deliver is a *miss* with one :class:`MissReason`. The
:class:`StatsRecorder` (thread-safe) counts operations, pages, bytes and misses by reason,
and logs at WARNING: records that fail checks once per batch (a count per reason and the
first affected key, so a flood of bad records does not flood the log), and each backend
error or timeout with its cause.

Waits are counted per operation (:data:`OPS`: ``exists``, ``get``, ``set``): each public
batch call is timed (:meth:`StatsRecorder.timed`) into a latency histogram
(:class:`OpLatency`); a call that took at least the stall threshold is a *stall*, one
during which the backend reported a deadline overrun (or refused to call a stuck server)
a *timeout*. A frozen server shows as both: timeouts where the deadline ended the wait,
stalls wherever a caller waited long.
"""

from __future__ import annotations

import bisect
import enum
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = [
    "LATENCY_BUCKETS_S",
    "OPS",
    "MissReason",
    "OpLatency",
    "SetOutcome",
    "SetResult",
    "StatsRecorder",
    "StorageStats",
]

OPS: tuple[str, ...] = ("exists", "get", "set")
"""The operations whose waits are counted: ``exists`` (``batch_exists``,
``batch_contains``), ``get`` (``batch_get``, ``batch_get_state``), ``set``
(``batch_set``, ``batch_set_state``)."""

LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Upper bounds (seconds) of the latency histogram buckets; a last one is unbounded."""

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


def _per_op() -> Mapping[str, int]:
    return MappingProxyType(dict.fromkeys(OPS, 0))


@dataclass(frozen=True, slots=True)
class OpLatency:
    """The latency histogram of one operation's batch calls.

    ``counts[i]``: calls that took at most ``LATENCY_BUCKETS_S[i]`` seconds and more than
    the bound before (not cumulative); ``counts[-1]``: those beyond the last bound, so
    ``len(counts) == len(LATENCY_BUCKETS_S) + 1`` and ``sum(counts) == calls``.
    ``sum_s``: their total seconds.
    """

    counts: tuple[int, ...] = (0,) * (len(LATENCY_BUCKETS_S) + 1)
    sum_s: float = 0.0

    @property
    def calls(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus buckets: ``(le, calls at most le)``, ending with ``("+Inf", calls)``."""
        out, run = [], 0
        for bound, n in zip((*map(str, LATENCY_BUCKETS_S), "+Inf"), self.counts, strict=True):
            run += n
            out.append((bound, run))
        return out


def _empty_latency() -> Mapping[str, OpLatency]:
    return MappingProxyType({op: OpLatency() for op in OPS})


@dataclass(frozen=True, kw_only=True)
class StorageStats:
    """A snapshot of one backend instance's counters since it was created.

    Counts are in pages (keys) unless named otherwise; bytes are record bytes (header and
    payload) moved to or from the backend. ``misses`` maps every :class:`MissReason` value
    to the pages missed for it; ``get_pages == get_hits + sum(misses.values())``.
    ``set_pages == set_written + set_skipped + set_failed``. ``errors`` counts backend
    failures (exceptions, error codes, failed writes) and ``timeouts`` deadline overruns,
    both per operation batch, not per page.

    Per operation (every key of :data:`OPS`): ``stalls[op]``: batch calls that took at
    least ``stall_s`` seconds (the backend's stall threshold); ``op_timeouts[op]``: batch
    calls during which a deadline was overrun (or a call refused while an earlier one
    was stuck), each counted once however many backend calls it made; ``latency[op]``:
    their latency histogram. ``repaired``: pages whose record a read found ``corrupt`` or
    ``stale`` and a later write overwrote (:mod:`hicache.storage.heal`; also counted in
    ``set_written``). ``previous``: lookups that missed here and found the previous spec
    version's record of their first page (one probe per lookup that found nothing,
    ``HiCacheStorage.probe_previous``): records an older engine wrote that this one
    cannot read (its pages are recomputed and written anew).
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
    previous: int = 0
    misses: Mapping[str, int] = field(default_factory=_empty_misses)
    backend: str = ""
    """The backend's registry name (``file``, ``redis``, ...)."""
    stall_s: float = 0.5
    stalls: Mapping[str, int] = field(default_factory=_per_op)
    op_timeouts: Mapping[str, int] = field(default_factory=_per_op)
    latency: Mapping[str, OpLatency] = field(default_factory=_empty_latency)

    def miss(self, reason: MissReason | str) -> int:
        """Pages missed for ``reason``."""
        return self.misses[MissReason(reason).value]


class _OpTimer:
    """One batch call being timed (:meth:`StatsRecorder.timed`); ``timed_out`` is set when
    a deadline was overrun during it, ``failed`` when it or a backend error was, ``why``
    says what failed last (empty: nothing)."""

    __slots__ = ("failed", "op", "timed_out", "why")

    def __init__(self, op: str) -> None:
        self.op = op
        self.timed_out = False
        self.failed = False
        self.why = ""


class StatsRecorder:
    """Thread-safe mutable counters behind :class:`StorageStats`.

    ``stall_s``: a batch call that takes at least this many seconds is a stall."""

    def __init__(self, backend: str, stall_s: float = 0.5) -> None:
        self._backend = backend
        self._stall_s = stall_s
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()
        self._misses: Counter[str] = Counter()
        self._stalls: Counter[str] = Counter()
        self._op_timeouts: Counter[str] = Counter()
        self._latency = {op: [0] * (len(LATENCY_BUCKETS_S) + 1) for op in OPS}
        self._latency_sum = dict.fromkeys(OPS, 0.0)
        self._current = threading.local()  # this thread's _OpTimer, while one runs

    @contextmanager
    def timed(self, op: str) -> Iterator[_OpTimer]:
        """Time one batch call of ``op`` (one of :data:`OPS`) on this thread: its latency,
        a stall when it took ``stall_s`` or more, a timeout when :meth:`timeout` was
        called meanwhile on this thread (or the caller set ``timed_out``)."""
        if op not in OPS:
            raise ValueError(f"op={op!r} is invalid; one of {OPS}")
        timer = _OpTimer(op)
        outer = getattr(self._current, "timer", None)
        self._current.timer = timer
        start = time.monotonic()
        try:
            yield timer
        finally:
            took = time.monotonic() - start
            self._current.timer = outer
            slot = bisect.bisect_left(LATENCY_BUCKETS_S, took)
            with self._lock:
                self._latency[op][slot] += 1
                self._latency_sum[op] += took
                if took >= self._stall_s:
                    self._stalls[op] += 1
                if timer.timed_out:
                    self._op_timeouts[op] += 1
            if took >= self._stall_s and not timer.timed_out:  # a timeout is logged already
                log.warning(
                    "L3 %s: %s stalled: %.3f s (stall threshold %.3f s)",
                    self._backend,
                    op,
                    took,
                    self._stall_s,
                )

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

    def previous(self, found: int) -> None:
        """A probe found ``found`` records of the previous spec version."""
        with self._lock:
            self._c["previous"] += found

    def error(self, op: str, detail: str) -> None:
        """A backend failure during ``op``; logged at WARNING."""
        with self._lock:
            self._c["errors"] += 1
        timer = getattr(self._current, "timer", None)
        if timer is not None:
            timer.failed = True
            timer.why = f"{op} failed: {detail}"
        log.warning("L3 %s: %s failed: %s", self._backend, op, detail)

    def timeout(self, op: str, timeout_s: float) -> None:
        """``op`` overran its deadline of ``timeout_s`` seconds; logged at WARNING."""
        with self._lock:
            self._c["timeouts"] += 1
        timer = getattr(self._current, "timer", None)
        if timer is not None:
            timer.timed_out = timer.failed = True
            timer.why = f"{op} timed out after {timeout_s:g} s"
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
            stalls = {op: self._stalls.get(op, 0) for op in OPS}
            op_timeouts = {op: self._op_timeouts.get(op, 0) for op in OPS}
            latency = {op: OpLatency(tuple(self._latency[op]), self._latency_sum[op]) for op in OPS}
        return StorageStats(
            misses=MappingProxyType(misses),
            backend=self._backend,
            stall_s=self._stall_s,
            stalls=MappingProxyType(stalls),
            op_timeouts=MappingProxyType(op_timeouts),
            latency=MappingProxyType(latency),
            **c,
        )
