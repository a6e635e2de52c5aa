"""What SGLang's storage metrics ask of a backend: the page count and bandwidth of each
get and set since the last ask (:class:`IoWindow`).

SGLang's cache controller calls ``get_stats()`` on its storage backend after each round of
storage work (when its metrics are on, ``--enable-metrics``) and feeds the
result, a ``StorageMetrics`` of four lists, into its Prometheus histograms
(``sglang:prefetch_pgs``, ``sglang:backup_pgs``, ``sglang:prefetch_bandwidth``,
``sglang:backup_bandwidth``, GB/s). SGLang's own Mooncake backend counts every page of an
operation, hit or not, over the operation's wall time; so does this window, so the two
backends' figures compare. Pure: no sglang import; thread-safe (SGLang's prefetch and
backup threads record, its scheduler drains).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["IoWindow", "IoWindowDrain"]


@dataclass(frozen=True)
class IoWindowDrain:
    """The operations recorded since the last drain, oldest first: pages per get
    (``prefetch_pgs``) and per set (``backup_pgs``), and each one's GB/s (10**9 B/s of
    page bytes over its wall time)."""

    prefetch_pgs: tuple[int, ...]
    backup_pgs: tuple[int, ...]
    prefetch_bandwidth: tuple[float, ...]
    backup_bandwidth: tuple[float, ...]


class IoWindow:
    """Page counts and bandwidths of gets and sets, drained by :meth:`drain`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pgs: dict[str, list[int]] = {"get": [], "set": []}
        self._gbps: dict[str, list[float]] = {"get": [], "set": []}

    def record(self, op: str, pages: int, page_bytes: int, seconds: float) -> None:
        """One ``op`` (``"get"`` or ``"set"``) of ``pages`` pages of ``page_bytes`` bytes
        that took ``seconds``."""
        if op not in self._pgs:
            raise ValueError(f"op={op!r} is invalid; choose 'get' or 'set'")
        gbps = pages * page_bytes / max(seconds, 1e-9) / 1e9
        with self._lock:
            self._pgs[op].append(pages)
            self._gbps[op].append(gbps)

    def drain(self) -> IoWindowDrain:
        """Everything recorded since the last drain (then forgotten)."""
        with self._lock:
            out = IoWindowDrain(
                prefetch_pgs=tuple(self._pgs["get"]),
                backup_pgs=tuple(self._pgs["set"]),
                prefetch_bandwidth=tuple(self._gbps["get"]),
                backup_bandwidth=tuple(self._gbps["set"]),
            )
            for lists in (self._pgs, self._gbps):
                for v in lists.values():
                    v.clear()
        return out
