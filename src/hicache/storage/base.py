"""The L3 storage contract: :class:`HiCacheStorage` and its options.

A backend stores one record (:mod:`hicache.storage.record`) per page key and moves pages
between itself and a host (L2) pool; every operation is batched and page-granular.
Invariants: ``batch_exists`` counts present keys from the first, in a row; a page
``batch_get`` reports False has unspecified host content; ``batch_set`` skips present keys
unless a read found the record bad (healing, :mod:`hicache.storage.heal`). Every call has a
deadline (``StorageOptions.timeout_s``); a backend failure or timeout never raises and never
hangs (a miss / False, a counter, a WARNING); only misuse raises. Host pages a get handed
out are reused only once ``host_writes_settled`` says True. A record's checksum and payload
come from one read of the page, so a page changed under a late put reads ``corrupt``, never
another page's bytes. Construction does no IO; ``start`` / ``close`` are idempotent; the
prefetch and backup threads call concurrently. Subclasses implement ``_start`` / ``_close``
/ ``_exists`` / ``_get`` / ``_set`` (``_overwrite`` to heal). Head and component records and
the details of each rule: ``docs/architecture.md``, "The L3 storage contract".
"""

from __future__ import annotations

import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

from hicache.heads import HeadSplit
from hicache.keys import HEAD_RECORDS, Namespace, PageKey
from hicache.memory import HostPool
from hicache.memory.state_pool import StatePool
from hicache.storage.allowed import AllowedNamespaces
from hicache.storage.announce import Announcements, announce_key
from hicache.storage.deadline import DeadlineRunner
from hicache.storage.headio import (
    HeadPages,
    HeadRecords,
    StageCache,
    check_split,
    page_outcomes,
)
from hicache.storage.heal import BadRecords
from hicache.storage.pageio import HostPages, Payloads
from hicache.storage.record import HEADER_SIZE
from hicache.storage.slotio import StateSlots
from hicache.storage.stats import MissReason, SetOutcome, SetResult, StatsRecorder, StorageStats

_R = TypeVar("_R")

__all__ = [
    "ConfiguredStorage",
    "Deadline",
    "ExistsRun",
    "HiCacheStorage",
    "StorageError",
    "StorageOptions",
]


@dataclass(frozen=True, slots=True)
class ExistsRun:
    """What one lookup of a run of keys found: the first ``present`` keys are present.
    ``failed``: the call hit a backend error or overran its deadline, so the keys from
    ``present`` on are unknown, not known absent (never remembered as misses); ``why``
    says how it failed (the backend's reason)."""

    present: int
    failed: bool = False
    why: str = ""


class StorageError(RuntimeError):
    """A backend could not be started (bad address, service down, missing package)."""


@dataclass(frozen=True, kw_only=True)
class StorageOptions:
    """Options common to all backends.

    ``timeout_s``: deadline of one batch operation, seconds. ``connect_timeout_s``: deadline
    of :meth:`HiCacheStorage.start`, seconds. ``max_batch_pages``: a backend splits larger
    batches into chunks of this many pages (bounds staging memory and request sizes).
    ``stall_s``: a batch operation that takes at least this many seconds is counted as a
    stall (``StorageStats.stalls``, ``hicache_l3_stalls_total``). The default, 0.5 s, is
    a hundred times what a healthy local Redis, Mooncake or file batch of 64 pages takes
    (milliseconds), and a quarter of the ``timeout`` prefetch policy's base wait (2 s):
    an operation that slow already costs a waiting request a good part of its prefetch.
    """

    timeout_s: float = 5.0
    connect_timeout_s: float = 10.0
    max_batch_pages: int = 64
    stall_s: float = 0.5

    def __post_init__(self) -> None:
        for name in ("timeout_s", "connect_timeout_s", "stall_s"):
            v = getattr(self, name)
            ok = (
                isinstance(v, (int, float))
                and not isinstance(v, bool)
                and math.isfinite(v)
                and v > 0
            )
            if not ok:
                raise ValueError(f"{name}={v!r} is invalid; must be a finite number of seconds > 0")
        v = self.max_batch_pages
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"max_batch_pages={v!r} is invalid; must be an int >= 1")

    KEYS: ClassVar[tuple[str, ...]] = (
        "timeout_s",
        "connect_timeout_s",
        "max_batch_pages",
        "stall_s",
    )

    @classmethod
    def from_extra(
        cls, extra: Mapping[str, Any], base: StorageOptions | None = None
    ) -> StorageOptions:
        """``base`` (or defaults) with any of :attr:`KEYS` present in ``extra`` overriding."""
        base = base or cls()
        kw = {k: extra.get(k, getattr(base, k)) for k in cls.KEYS}
        return cls(**kw)


class Deadline:
    """A point in time ``timeout_s`` seconds from now (monotonic clock)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._end = time.monotonic() + timeout_s

    @property
    def remaining(self) -> float:
        """Seconds left (never negative)."""
        return max(0.0, self._end - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self._end


class HiCacheStorage(ABC):
    """Base of every L3 backend (see the module docstring for the contract)."""

    name: ClassVar[str] = "storage"
    """Registry name; also used in logs and metrics."""

    def __init__(self, namespace: Namespace, options: StorageOptions | None = None) -> None:
        if not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
        self._namespace = namespace
        self._options = options or StorageOptions()
        self._allowed = AllowedNamespaces(namespace)
        self._records: HeadRecords | None = None
        """The rank's head split and record group (:meth:`use_heads`)."""
        self._stages = StageCache()
        """Staging buffers of head-record batches, reused once no call can touch them."""
        self._stats = StatsRecorder(self.name, self._options.stall_s)
        self._bad = BadRecords()
        """Keys whose record a read found replaceable: the next write overwrites them."""
        self._life = threading.Lock()
        self._started = False
        self._closed = False
        self._host_io: DeadlineRunner | None = None
        """The runner through which this backend makes calls that write host pages
        (``writes_host=True``); None when it writes host pages only on the calling thread."""

    EXTRA_KEYS: ClassVar[tuple[str, ...]] = ()
    """The backend-specific extra-config keys this class accepts (besides the
    :class:`StorageOptions` keys, which any backend takes)."""

    @classmethod
    def parse_extra_config(cls, extra: Mapping[str, Any]) -> Any:
        """Validate this backend's extra-config keys, without IO; returns the settings
        object :meth:`from_settings` takes. Raises ValueError naming the key, the value and
        what is accepted. The default accepts no key and returns None."""
        if extra:
            raise ValueError(f"{cls.name} backend takes no extra config; got keys {sorted(extra)}")
        return None

    @classmethod
    def from_settings(
        cls, namespace: Namespace, options: StorageOptions, settings: Any
    ) -> HiCacheStorage:
        """An unstarted instance from :meth:`parse_extra_config`'s result."""
        return cls(namespace, options)

    @classmethod
    def from_extra_config(
        cls, namespace: Namespace, extra_config: Mapping[str, Any], options: StorageOptions
    ) -> HiCacheStorage:
        """Parse then build (``options`` keys already removed). A custom class may override
        this instead of the two steps; its keys are then checked only when it is built."""
        return cls.from_settings(namespace, options, cls.parse_extra_config(extra_config))

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def namespace(self) -> Namespace:
        return self._namespace

    @property
    def options(self) -> StorageOptions:
        return self._options

    @property
    def started(self) -> bool:
        return self._started and not self._closed

    def start(self) -> None:
        """Connect / open; raises :class:`StorageError` when the backend is unusable."""
        with self._life:
            if self._closed:
                raise StorageError(f"{self.name} storage is closed; create a new one")
            if self._started:
                return
            self._start()
            self._started = True

    def close(self) -> None:
        """Release connections, threads and registrations (idempotent, never raises)."""
        with self._life:
            if self._closed:
                return
            self._closed = True
            if self._started:
                try:
                    self._close()
                except Exception as e:
                    self._stats.error("close", repr(e))

    def __enter__(self) -> HiCacheStorage:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def use_heads(self, heads: HeadSplit) -> None:
        """The K/V heads this rank's pools hold and which it writes: needed before any
        page operation under a ``records="head"`` namespace (ValueError under another, or
        naming the numbers when the rank does not hold whole records of the namespace's
        ``head_group`` heads)."""
        if not isinstance(heads, HeadSplit):
            raise TypeError(f"heads must be a HeadSplit, got {type(heads).__name__}")
        if self._namespace.records != HEAD_RECORDS:
            raise ValueError(
                f"use_heads needs a records='head' namespace; this one has"
                f" records={self._namespace.records!r}"
            )
        self._records = HeadRecords(heads, self._namespace.head_group)
        self._allowed.use_heads(heads)  # slot components' records are per rank

    @property
    def heads(self) -> HeadSplit | None:
        """The rank's head split (:meth:`use_heads`); None under a ``"page"`` namespace."""
        return None if self._records is None else self._records.split

    @property
    def writes_pages(self) -> bool:
        """Whether a :meth:`batch_set` of this rank writes any record: False only for a
        rank whose K/V heads a lower rank holds too (replicated heads) under head records.
        """
        return self._records is None or self._records.split.writes_any

    def _split(self, key: PageKey | None = None) -> HeadRecords | None:
        """The rank's head records applying to ``key`` (any page key when None): None for
        page records and for keys of slot components."""
        if self._namespace.records != HEAD_RECORDS:
            return None
        if key is not None and self._allowed.whole(key):
            return None
        if self._records is None:
            raise StorageError(
                f"{self.name} storage has a records='head' namespace; call use_heads() first"
            )
        return self._records

    def probe_previous(self, key: PageKey) -> bool:
        """Whether the previous spec version's record ``key``
        (:func:`hicache.keys.previous_page_key`) is present; counted in
        ``StorageStats.previous`` when it is. One lookup, fail-soft (False)."""
        self._require_started()
        try:
            found = self._contains([key], Deadline(self._options.timeout_s)) == [True]
        except Exception as e:
            self._stats.error("exists (previous version)", repr(e))
            return False
        if found:
            self._stats.previous(1)
        return found

    def announce(self, keys: Sequence[PageKey], ttl_s: float) -> int:
        """Say that this instance is writing ``keys`` and expects them to land within
        ``ttl_s`` seconds: one announcement record per key
        (:mod:`hicache.storage.announce`), replaced where the backend can overwrite (a key
        announced before). Returns the records stored; fail-soft (0, an error counted)."""
        self._require_started()
        if not keys:
            return 0
        now = time.time()
        marks = [announce_key(k) for k in keys]
        items = Announcements([(now, now + ttl_s)] * len(keys))

        def write() -> Sequence[SetOutcome]:
            deadline = Deadline(self._options.timeout_s)
            done = self._overwrite(marks, items, deadline, [True] * len(marks))
            return self._set(marks, items, deadline) if done is None else done

        with self._stats.timed("set"):  # a small set, timed as one
            out = self._guarded("announce", len(marks), write, SetOutcome.FAILED)
        return sum(o is not SetOutcome.FAILED for o in out)

    def announced(self, key: PageKey) -> float:
        """Seconds until the announcement of ``key`` (:meth:`announce`) expires; 0.0 when
        there is none, it expired, it cannot be read or the call failed (fail-soft)."""
        return self.announced_many([key])[0]

    def announced_many(self, keys: Sequence[PageKey]) -> list[float]:
        """:meth:`announced` of each of ``keys``, in one call to the store."""
        self._require_started()
        if not keys:
            return []
        marks = [announce_key(k) for k in keys]
        items = Announcements.empty(len(keys))
        with self._stats.timed("exists"):  # a lookup, timed as one
            got: list[MissReason | None] = self._guarded(
                "announced",
                len(keys),
                lambda: self._get(marks, items, Deadline(self._options.timeout_s)),
                MissReason.ERROR,
            )
        now = time.time()
        return [0.0 if g is not None else max(0.0, items.until(i) - now) for i, g in enumerate(got)]

    def host_writes_settled(self, timeout_s: float) -> bool:
        """True once no backend call that was handed host pages is still running.

        Waits up to ``timeout_s`` seconds (0: just look). After True, no byte of any
        ``batch_get`` that has returned can land in any host page any more; pages a get
        reported False for (a timeout) may be reused from then on. False means some call
        that overran its deadline may still write the pages it was handed: keep every page
        of such gets away from other users and ask again later. Calls of a ``batch_get``
        still in progress on another thread do not count (that get has not returned).

        The default answers from :attr:`_host_io` (a backend that hands host pages to a
        :class:`~hicache.storage.deadline.DeadlineRunner` with ``writes_host=True``); a
        backend without one writes host pages only on the calling thread, before its
        ``batch_get`` returns, and is settled always. Valid before :meth:`start` and after
        :meth:`close` (a stuck call outlives the backend). Never raises but for a bad
        ``timeout_s``.
        """
        ok = (
            isinstance(timeout_s, (int, float))
            and not isinstance(timeout_s, bool)
            and math.isfinite(timeout_s)
            and timeout_s >= 0
        )
        if not ok:
            raise ValueError(f"timeout_s={timeout_s!r} is invalid; must be seconds >= 0")
        runner = self._host_io
        return True if runner is None else runner.wait_host_writes(timeout_s)

    def stats(self) -> StorageStats:
        """A frozen snapshot of this instance's counters."""
        return self._stats.snapshot()

    # -- public batched operations --------------------------------------------------------
    def batch_exists(self, keys: Sequence[PageKey]) -> int:
        """Number of consecutive keys, from the first, present in the backend (0 on failure)."""
        return self.exists_run(keys).present

    def exists_run(self, keys: Sequence[PageKey]) -> ExistsRun:
        """:meth:`batch_exists`, saying too whether the call failed (an error or a deadline
        overrun: what it did not find is unknown rather than absent)."""
        self._require_started()
        if not keys:
            return ExistsRun(0)
        split = self._split()
        wanted = keys if split is None else split.keys(keys)
        with self._stats.timed("exists") as timer:
            try:
                hits = self._exists(wanted, Deadline(self._options.timeout_s))
            except Exception as e:
                self._stats.error("exists", repr(e))
                hits = 0
        hits = max(0, min(hits, len(wanted)))
        if split is not None:
            hits //= split.per_page
        self._stats.exists(len(keys), hits)
        why = (timer.why or "exists failed") if timer.failed else ""
        return ExistsRun(hits, failed=timer.failed, why=why)

    def batch_get(
        self, keys: Sequence[PageKey], host: HostPool, pages: Sequence[int] | torch.Tensor
    ) -> list[bool]:
        """Read ``keys[i]`` into host page ``pages[i]``; True where the page is now valid."""
        self._require_started()
        self._check_host(host)
        split = self._split(keys[0] if keys else None)
        if split is None:
            return self._get_payloads(keys, HostPages(host, pages, for_get=True))
        check_split(split.split, host)
        if split.per_page == 1:  # the rank's heads are one record: a page record's bytes
            return self._get_payloads(split.keys(keys), HostPages(host, pages, for_get=True))
        hp = HeadPages(
            host,
            pages,
            range(split.per_page),
            for_get=True,
            group=split.group,
            stages=self._stages,
        )
        if len(keys) != len(hp.pages):
            raise ValueError(f"{len(keys)} keys but {len(hp.pages)} pages; they must pair up")
        ok = hp.page_ok(self._get_payloads(split.keys(keys), hp))
        self._restage(hp)
        return ok

    def _restage(self, hp: HeadPages) -> None:
        """Keep ``hp``'s staging buffer for reuse unless a call that overran its deadline
        may still write (or read) it."""
        if self.host_writes_settled(0):
            self._stages.give(hp.stage)

    def batch_get_state(
        self, keys: Sequence[PageKey], pool: StatePool, slots: Sequence[int] | torch.Tensor
    ) -> list[bool]:
        """Read the component record ``keys[i]`` into slot ``slots[i]`` of the host state
        pool ``pool``; True where the slot now holds the snapshot."""
        self._require_started()
        return self._get_payloads(keys, StateSlots(pool, slots, for_get=True))

    def batch_contains(self, keys: Sequence[PageKey]) -> list[bool]:
        """Whether each key is present, one by one (all False on failure)."""
        self._require_started()
        if not keys:
            return []
        split = self._split(keys[0])
        wanted = keys if split is None else split.keys(keys)
        with self._stats.timed("exists"):
            found = self._guarded(
                "exists",
                len(wanted),
                lambda: self._contains(wanted, Deadline(self._options.timeout_s)),
                False,
            )
        if split is not None:
            n = split.per_page
            found = [all(found[i : i + n]) for i in range(0, len(found), n)]
        self._stats.exists(len(keys), sum(found))
        return found

    def batch_get_payloads(self, keys: Sequence[PageKey], payloads: Payloads) -> list[bool]:
        """Read ``keys[i]``'s record into item ``i`` of ``payloads``, any
        :class:`~hicache.storage.pageio.Payloads` (an engine integration's pages, say);
        True where the item passed every check and was delivered (``payloads.commit``).
        The same checks, deadline, counters and healing as :meth:`batch_get`."""
        self._require_started()
        return self._get_payloads(keys, payloads)

    def batch_set_payloads(self, keys: Sequence[PageKey], payloads: Payloads) -> SetResult:
        """Write item ``i`` of ``payloads`` as the record of ``keys[i]`` (present keys are
        skipped), as :meth:`batch_set` does for host pool pages."""
        self._require_started()
        return self._set_payloads(keys, payloads)

    def _get_payloads(self, keys: Sequence[PageKey], hp: Payloads) -> list[bool]:
        self._check_lengths(keys, hp)
        if not keys:
            return []
        with self._stats.timed("get") as timer:
            reasons: list[MissReason | None] = self._guarded(
                "get",
                len(keys),
                lambda: self._get(keys, hp, Deadline(self._options.timeout_s)),
                MissReason.ERROR,
            )
            timer.timed_out = timer.timed_out or MissReason.TIMEOUT in reasons
        ok = [r is None for r in reasons]
        try:
            hp.commit(ok)
        except Exception as e:  # staging scatter failed: nothing delivered
            self._stats.error("get (commit)", repr(e))
            reasons = [MissReason.ERROR] * len(keys)
            ok = [False] * len(keys)
        hits = sum(ok)
        misses = [r for r in reasons if r is not None]
        self._bad.note([k.key for k in keys], reasons)
        self._stats.log_misses("get", [k.key for k in keys], reasons)
        self._stats.got([k.key for k in keys], hits, hits * (hp.payload_len + HEADER_SIZE), misses)
        return ok

    def batch_set(
        self, keys: Sequence[PageKey], host: HostPool, pages: Sequence[int] | torch.Tensor
    ) -> SetResult:
        """Write host page ``pages[i]`` under ``keys[i]``; present keys are skipped.

        Returns one :class:`SetOutcome` per key: written now, already present, or failed.
        """
        self._require_started()
        self._check_host(host)
        split = self._split(keys[0] if keys else None)
        if split is None:
            return self._set_payloads(keys, HostPages(host, pages, for_get=False))
        check_split(split.split, host)
        mine = split.written()
        n = len(pages)
        if len(keys) != n:
            raise ValueError(f"{len(keys)} keys but {n} pages; they must pair up")
        if not mine:  # a replica: a lower rank writes these heads
            return SetResult.of([SetOutcome.SKIPPED] * n)
        if split.per_page == 1:  # the rank's heads are one record: a page record's bytes
            return self._set_payloads(split.keys(keys), HostPages(host, pages, for_get=False))
        hp = HeadPages(host, pages, mine, for_get=False, group=split.group, stages=self._stages)
        per_record = self._set_payloads(split.keys(keys, mine), hp)
        self._restage(hp)
        return SetResult.of(page_outcomes(per_record.outcomes, len(mine)))

    def batch_set_state(
        self, keys: Sequence[PageKey], pool: StatePool, slots: Sequence[int] | torch.Tensor
    ) -> SetResult:
        """Write slot ``slots[i]`` of the host state pool ``pool`` as the component record
        ``keys[i]``; present keys are skipped (as :meth:`batch_set`)."""
        self._require_started()
        return self._set_payloads(keys, StateSlots(pool, slots, for_get=False))

    def _set_payloads(self, keys: Sequence[PageKey], hp: Payloads) -> SetResult:
        self._check_lengths(keys, hp)
        if not keys:
            return SetResult(())
        with self._stats.timed("set"):
            replace = self._bad.flags([k.key for k in keys])

            def write() -> Sequence[SetOutcome]:
                deadline = Deadline(self._options.timeout_s)
                outcome = self._overwrite(keys, hp, deadline, replace) if any(replace) else None
                return self._set(keys, hp, deadline) if outcome is None else outcome

            outcome = self._guarded("set", len(keys), write, SetOutcome.FAILED)
            repaired = self._bad.written([k.key for k in keys], outcome, replace)
            if repaired:
                self._stats.repaired(repaired)
        written = outcome.count(SetOutcome.WRITTEN)
        skipped = outcome.count(SetOutcome.SKIPPED)
        failed = len(keys) - written - skipped
        self._stats.put(
            len(keys), written, skipped, failed, written * (hp.payload_len + HEADER_SIZE)
        )
        return SetResult.of(outcome)

    # -- helpers ----------------------------------------------------------------------------
    def _guarded(self, op: str, n: int, call: Callable[[], Sequence[_R]], failed: _R) -> list[_R]:
        """The ``n`` per-key results of backend ``call``; where it raises or returns other
        than ``n`` results, the error is recorded under ``op`` and every key gets
        ``failed`` (a backend failure never raises out of a batch call)."""
        try:
            out = list(call())
            if len(out) != n:
                raise RuntimeError(f"backend returned {len(out)} results for {n} keys")
        except Exception as e:
            self._stats.error(op, repr(e))
            out = [failed] * n
        return out

    def allow_tenant(self, tenant_salt: str) -> None:
        """Also store and accept records of ``tenant_salt``'s namespace (this instance's
        namespace with that salt, for every allowed component), for keys chained under it."""
        self._allowed.allow_tenant(tenant_salt)

    def allow_component(self, component: str, *, slots: bool = False) -> None:
        """Also store and accept records of ``component``'s namespace (this instance's
        namespace with that component, for every allowed tenant): component records such
        as recurrent-state snapshots (``"mamba"``) or sliding-window pages (``"swa"``).
        ``slots``: its records are whole state slots, one per key even under head
        records."""
        self._allowed.allow_component(component, slots=slots)

    def allow_whole(self, namespace: Namespace) -> None:
        """Keys of ``namespace`` (an engine's side pool's pages, say) are one record
        each, never split per head under a ``records="head"`` namespace; their records
        still carry this instance's namespace digest."""
        self._allowed.allow_whole(namespace)

    def _digest_of(self, key: PageKey) -> bytes:
        """The namespace digest ``key``'s record must carry: the key's own when it is this
        instance's namespace or an allowed tenant's, else this instance's (so a record
        written or read under any other namespace is foreign)."""
        return self._allowed.digest_of(key)

    def _require_started(self) -> None:
        if not self.started:
            state = "closed" if self._closed else "not started"
            raise StorageError(f"{self.name} storage is {state}; call start() (or use `with`)")

    def _check_host(self, host: HostPool) -> None:
        ns = self._namespace
        if (
            host.layout is not ns.layout
            or host.page_size != ns.page_size
            or host.spec.dtype != ns.kv_dtype
        ):
            raise ValueError(
                f"host pool (layout={host.layout.value}, page_size={host.page_size}, "
                f"dtype={host.spec.dtype}) does not match the storage namespace "
                f"(layout={ns.layout.value}, page_size={ns.page_size}, dtype={ns.kv_dtype})"
            )

    @staticmethod
    def _check_lengths(keys: Sequence[PageKey], hp: Payloads) -> None:
        if len(keys) != len(hp):
            raise ValueError(f"{len(keys)} keys but {len(hp)} pages; they must pair up")

    # -- backend hooks ------------------------------------------------------------------------
    @abstractmethod
    def _start(self) -> None:
        """Open connections / directories; raise StorageError when unusable."""

    @abstractmethod
    def _close(self) -> None:
        """Release everything :meth:`_start` acquired."""

    @abstractmethod
    def _exists(self, keys: Sequence[PageKey], deadline: Deadline) -> int:
        """Consecutive present keys from the first."""

    def _contains(self, keys: Sequence[PageKey], deadline: Deadline) -> list[bool]:
        """Presence of each key; the default asks :meth:`_exists` key by key (a backend
        with a batched lookup may override)."""
        out: list[bool] = []
        for k in keys:
            if deadline.expired:
                self._stats.timeout("exists", deadline.timeout_s)
                return out + [False] * (len(keys) - len(out))
            out.append(self._exists([k], deadline) == 1)
        return out

    @abstractmethod
    def _get(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline
    ) -> list[MissReason | None]:
        """Read each record into ``pages``; None where the page passed all checks.

        Must call ``self._stats.error`` / ``self._stats.timeout`` for ERROR / TIMEOUT misses.
        """

    @abstractmethod
    def _set(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline
    ) -> list[SetOutcome]:
        """Write each page's record unless its key is present."""

    def _overwrite(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline, replace: Sequence[bool]
    ) -> list[SetOutcome] | None:
        """As :meth:`_set`, but write ``keys[i]``'s record even when the key is present
        where ``replace[i]`` (a read found its record bad): ``WRITTEN`` when this call
        stored it. Atomic where the backend can: a reader sees the old record or the new
        one. Only ever called with a good page, so a record someone else rewrote in
        between is replaced by an equally good one, never lost. None (the default): this
        backend cannot overwrite; the base then calls :meth:`_set` (no healing)."""
        return None


class ConfiguredStorage(HiCacheStorage):
    """A backend whose extra config is one frozen settings class, ``SETTINGS`` (with its
    ``EXTRA_KEYS`` and a ``from_extra(extra)`` validator), kept as ``self.config``: the
    parse and build steps of :class:`HiCacheStorage` follow from it."""

    SETTINGS: ClassVar[Any]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        settings = cls.__dict__.get("SETTINGS")
        if settings is not None:
            cls.EXTRA_KEYS = tuple(settings.EXTRA_KEYS)

    def __init__(
        self, namespace: Namespace, options: StorageOptions | None = None, *, config: Any
    ) -> None:
        super().__init__(namespace, options)
        self.config = config

    @classmethod
    def parse_extra_config(cls, extra: Mapping[str, Any]) -> Any:
        """The validated ``SETTINGS`` of ``extra`` (see that class for the keys)."""
        return cls.SETTINGS.from_extra(extra)

    @classmethod
    def from_settings(
        cls, namespace: Namespace, options: StorageOptions, settings: Any
    ) -> HiCacheStorage:
        if not isinstance(settings, cls.SETTINGS):
            raise TypeError(
                f"{cls.name} backend settings must be a {cls.SETTINGS.__name__}, got {settings!r}"
            )
        return cls(namespace, options, config=settings)
