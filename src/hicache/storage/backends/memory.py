"""A fake in-memory L3 backend with injectable latency and failures, for controller tests.

Records live in a :class:`MemoryStore` (a dict behind a lock); instances the registry
creates with the same ``store`` name share one. Faults (:class:`MemoryFaults`, at creation
or :meth:`MemoryStorage.set_faults`): ``delay_s`` (s before every batch operation; at or
past the deadline it fails as a timeout at the deadline), ``fail_after`` (operations before
every further one fails as an error; ``None`` never, ``0`` from the start), ``get_delay_s``
(a get's read sleeps on a ``writes_host`` :class:`~hicache.storage.deadline.DeadlineRunner`
and writes its host pages late, after ``batch_get`` returned: ``host_writes_settled`` is
False until then; ``layer_first`` gets land in a staging copy), and ``fault_rank`` (faults
only in that tensor-parallel rank; ``None``: every process). E.g. extra config
``{"get_delay_s": 1.0, "timeout_s": 0.2}``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hicache.keys import Namespace, PageKey
from hicache.storage.base import Deadline, HiCacheStorage, StorageOptions
from hicache.storage.blob import decode_page, encode_page
from hicache.storage.deadline import DeadlineRunner
from hicache.storage.pageio import Payloads
from hicache.storage.stats import MissReason, SetOutcome

__all__ = ["MemoryFaults", "MemorySettings", "MemoryStorage", "MemoryStore", "shared_store"]


class MemoryStore:
    """A thread-safe ``key -> record bytes`` map; what the fake backend stores into."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._data.get(key)

    def put_if_absent(self, key: str, blob: bytes) -> bool:
        """Store ``blob`` unless ``key`` is present; True when it was stored."""
        with self._lock:
            if key in self._data:
                return False
            self._data[key] = blob
            return True

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._data

    def replace(self, key: str, blob: bytes) -> None:
        """Overwrite ``key`` (a healing write; tests use it to plant bad records)."""
        with self._lock:
            self._data[key] = blob

    def delete(self, key: str) -> None:
        with self._lock:
            self._data.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)


_SHARED: dict[str, MemoryStore] = {}
_SHARED_LOCK = threading.Lock()


def shared_store(name: str) -> MemoryStore:
    """The process-wide store called ``name`` (created on first use)."""
    with _SHARED_LOCK:
        return _SHARED.setdefault(name, MemoryStore())


@dataclass(frozen=True, kw_only=True)
class MemoryFaults:
    """Injected faults; see the module docstring."""

    delay_s: float = 0.0
    fail_after: int | None = None
    get_delay_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("delay_s", "get_delay_s"):
            d = getattr(self, name)
            if not (
                isinstance(d, (int, float))
                and not isinstance(d, bool)
                and math.isfinite(d)
                and d >= 0
            ):
                raise ValueError(
                    f"{name}={d!r} is invalid; must be a finite number of seconds >= 0"
                )
        f = self.fail_after
        if f is not None and (not isinstance(f, int) or isinstance(f, bool) or f < 0):
            raise ValueError(f"fail_after={f!r} is invalid; must be None or an int >= 0")


@dataclass(frozen=True, kw_only=True)
class MemorySettings:
    """The ``memory`` backend's parsed extra config: the shared store's name and faults."""

    store: str = "default"
    faults: MemoryFaults = field(default_factory=MemoryFaults)
    fault_rank: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.store, str) or not self.store:
            raise ValueError(f"store={self.store!r} is invalid; must be a non-empty str")
        r = self.fault_rank
        if r is not None and (not isinstance(r, int) or isinstance(r, bool) or r < 0):
            raise ValueError(f"fault_rank={r!r} is invalid; must be None or an int >= 0")

    def faults_here(self) -> MemoryFaults:
        """The faults for this process: all of them unless ``fault_rank`` names another
        tensor-parallel rank than this process's (rank 0 without a process group)."""
        if self.fault_rank is None or self.fault_rank == _process_rank():
            return self.faults
        return MemoryFaults()


def _process_rank() -> int:
    """This process's rank in the initialized ``torch.distributed`` group, else 0."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _Fault(Exception):
    def __init__(self, reason: MissReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


class MemoryStorage(HiCacheStorage):
    """In-memory backend (registry name ``memory``)."""

    name: ClassVar[str] = "memory"
    EXTRA_KEYS: ClassVar[tuple[str, ...]] = (
        "store",
        "delay_s",
        "fail_after",
        "get_delay_s",
        "fault_rank",
    )

    def __init__(
        self,
        namespace: Namespace,
        options: StorageOptions | None = None,
        *,
        store: MemoryStore | None = None,
        faults: MemoryFaults | None = None,
    ) -> None:
        super().__init__(namespace, options)
        self.store = store if store is not None else MemoryStore()
        self._faults = faults or MemoryFaults()
        self._ops = 0
        self._ops_lock = threading.Lock()
        self._runner = DeadlineRunner("memory-late-get", workers=2)
        self._host_io = self._runner

    @classmethod
    def parse_extra_config(cls, extra: Mapping[str, Any]) -> MemorySettings:
        """Keys: ``store`` (shared store name, default ``"default"``), ``delay_s``,
        ``fail_after``, ``get_delay_s``, ``fault_rank`` (see the module docstring)."""
        unknown = sorted(set(extra) - set(cls.EXTRA_KEYS))
        if unknown:
            raise ValueError(
                f"memory backend: unknown extra config keys {unknown}; allowed {cls.EXTRA_KEYS}"
            )
        faults = MemoryFaults(
            delay_s=extra.get("delay_s", 0.0),
            fail_after=extra.get("fail_after"),
            get_delay_s=extra.get("get_delay_s", 0.0),
        )
        return MemorySettings(
            store=extra.get("store", "default"), faults=faults, fault_rank=extra.get("fault_rank")
        )

    @classmethod
    def from_settings(
        cls, namespace: Namespace, options: StorageOptions, settings: Any
    ) -> MemoryStorage:
        if not isinstance(settings, MemorySettings):
            raise TypeError(f"memory backend settings must be MemorySettings, got {settings!r}")
        store = shared_store(settings.store)
        return cls(namespace, options, store=store, faults=settings.faults_here())

    @property
    def faults(self) -> MemoryFaults:
        return self._faults

    def set_faults(self, faults: MemoryFaults) -> None:
        """Replace the injected faults (takes effect on the next operation)."""
        self._faults = faults

    def _start(self) -> None:
        self._runner.start()

    def _close(self) -> None:
        self._runner.close(join_s=0.1)  # a late get runs on; host_writes_settled tracks it

    def _inject(self, op: str, deadline: Deadline) -> None:
        """Apply the faults to one operation; raises _Fault when it must fail."""
        faults = self._faults
        with self._ops_lock:
            self._ops += 1
            n = self._ops
        if faults.fail_after is not None and n > faults.fail_after:
            self._stats.error(
                op, f"injected failure (operation {n} > fail_after={faults.fail_after})"
            )
            raise _Fault(MissReason.ERROR)
        if faults.delay_s > 0:
            if faults.delay_s >= deadline.timeout_s:
                time.sleep(deadline.remaining)
                self._stats.timeout(op, deadline.timeout_s)
                raise _Fault(MissReason.TIMEOUT)
            time.sleep(faults.delay_s)

    def _exists(self, keys: Sequence[PageKey], deadline: Deadline) -> int:
        try:
            self._inject("exists", deadline)
        except _Fault:
            return 0
        n = 0
        for k in keys:
            if not self.store.contains(k.key):
                break
            n += 1
        return n

    def _get(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline
    ) -> list[MissReason | None]:
        try:
            self._inject("get", deadline)
        except _Fault as f:
            return [f.reason] * len(keys)
        delay = self._faults.get_delay_s
        if delay <= 0:
            return self._read(keys, pages)

        def late_read() -> list[MissReason | None]:
            time.sleep(delay)
            return self._read(keys, pages)

        res = self._runner.call(
            late_read, deadline.remaining, refuse_if_stuck=False, writes_host=True
        )
        if res.ok and res.value is not None:
            return res.value
        if res.timed_out:
            self._stats.timeout("get", deadline.timeout_s)
            return [MissReason.TIMEOUT] * len(keys)
        self._stats.error("get", repr(res.error))
        return [MissReason.ERROR] * len(keys)

    def _read(self, keys: Sequence[PageKey], pages: Payloads) -> list[MissReason | None]:
        """Check each record and write it into its host page (the caller's or a worker's)."""
        return [
            decode_page(self.store.get(k.key), self._digest_of(k), k, pages, i)
            for i, k in enumerate(keys)
        ]

    def _set(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline
    ) -> list[SetOutcome]:
        return self._overwrite(keys, pages, deadline, [False] * len(keys))

    def _overwrite(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline, replace: Sequence[bool]
    ) -> list[SetOutcome]:
        try:
            self._inject("set", deadline)
        except _Fault:
            return [SetOutcome.FAILED] * len(keys)
        out: list[SetOutcome] = []
        for i, k in enumerate(keys):
            if replace[i]:
                self.store.replace(k.key, encode_page(self._digest_of(k), k, pages, i))
                out.append(SetOutcome.WRITTEN)
                continue
            if self.store.contains(k.key):
                out.append(SetOutcome.SKIPPED)
                continue
            stored = self.store.put_if_absent(k.key, encode_page(self._digest_of(k), k, pages, i))
            out.append(SetOutcome.WRITTEN if stored else SetOutcome.SKIPPED)
        return out
