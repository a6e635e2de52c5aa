"""Giving freed heap memory back to the OS once the engine goes idle after a peak.

A burst of wide requests (``n`` copies, top-k logprobs) allocates a lot on the host: the
logits' log-softmax and top-k per step, the log-probability records, the response bodies.
Freed, most of it stays in glibc's heaps (the main one and one arena per thread): glibc
gives back only the top of a heap past its trim threshold, and that threshold grows with
the large blocks a process frees. ``malloc_trim(0)`` hands every free page of every arena
back to the OS (``madvise``), which brings the resident set near its level before the
burst (see ``docs/benchmarks/memory.md``).

:class:`IdleTrimmer` decides when: once the loop has been idle for :data:`IDLE_S`
after at least one busy round, once more ``interval_s`` later if it is still idle (what
the server freed after the engine went idle, building and sending the last responses,
goes back too), and never more often than once per ``interval_s`` seconds.
:func:`malloc_trim` is the call itself, a no-op (None) where there is no glibc.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from hicache.validate import require

log = logging.getLogger(__name__)

IDLE_S = 1.0
"""Seconds the loop must have been idle (after being busy) before a trim."""
DEFAULT_TRIM_INTERVAL_S = 10.0
"""The default of ``EngineConfig.memory_trim_interval_s``."""

TrimFunction = Callable[[], bool | None]
"""Releases free heap memory; True when some was released, False when none, None when
the platform cannot (not Linux with glibc)."""


@cache
def _libc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` through ctypes; None when this is not Linux with glibc."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def trim_supported() -> bool:
    """Whether :func:`malloc_trim` can release memory here (Linux with glibc)."""
    return _libc_malloc_trim() is not None


def malloc_trim() -> bool | None:
    """``malloc_trim(0)``: give every free page of glibc's heaps back to the OS. True when
    memory was released, False when there was none to release, None when not supported."""
    fn = _libc_malloc_trim()
    if fn is None:
        return None
    return bool(fn(0))


@dataclass(frozen=True, slots=True)
class TrimRecord:
    """One trim: when (``clock`` seconds), what the trim function answered, how long it took."""

    at: float
    released: bool | None
    took_s: float


class IdleTrimmer:
    """Calls ``trim`` when the engine loop has been idle for ``idle_s`` seconds after
    being busy, and once more ``interval_s`` later if it is still idle; never twice within
    ``interval_s`` seconds (``interval_s`` 0: never at all).

    The loop calls :meth:`after_round` once per round, saying whether the round did work.
    A busy round marks memory as possibly freed; the first idle round at least
    ``idle_s`` after the last busy one, and at least ``interval_s`` after the last trim,
    trims, clears the mark and arms the follow-up: the first idle round ``interval_s``
    after that trim trims again (unless the loop was busy meanwhile: then the mark rules
    again). A trim that is due but rate-limited happens as soon as the interval has passed,
    if the loop is still idle then. After the follow-up, nothing until the next busy round.
    Runs on the engine thread.
    """

    def __init__(
        self,
        interval_s: float,
        *,
        idle_s: float = IDLE_S,
        trim: TrimFunction = malloc_trim,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        require(
            isinstance(interval_s, int | float) and interval_s >= 0,
            "memory_trim_interval_s",
            interval_s,
            "must be a number of seconds >= 0 (0: off)",
        )
        require(idle_s >= 0, "idle_s", idle_s, "must be a number of seconds >= 0")
        self.interval_s = float(interval_s)
        self.idle_s = idle_s
        self._trim = trim
        self._clock = clock
        self._busy_at: float | None = None  # last busy round since the last trim
        self._follow_up = False  # one more trim is due interval_s after the last one
        self._last: TrimRecord | None = None
        self.trims = 0
        """Trims done so far."""

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0

    @property
    def last(self) -> TrimRecord | None:
        """The last trim (None before the first)."""
        return self._last

    def after_round(self, busy: bool) -> TrimRecord | None:
        """Note one loop round; trim now if due (see the class). Returns the trim done, if any."""
        if not self.enabled:
            return None
        now = self._clock()
        if busy:
            self._busy_at = now
            return None
        if self._busy_at is not None:
            if now - self._busy_at < self.idle_s:
                return None
        elif not self._follow_up:
            return None
        if self._last is not None and now - self._last.at < self.interval_s:
            return None
        self._follow_up = self._busy_at is not None  # this one ends a busy period
        self._busy_at = None
        try:
            released = self._trim()
        except Exception:  # a failing trim must not stop the loop: log it, do not retry soon
            log.exception("returning freed memory to the OS failed")
            released = None
        record = TrimRecord(at=now, released=released, took_s=self._clock() - now)
        self._last = record
        self.trims += 1
        log.debug("malloc_trim after a busy period: %s in %.1f ms", released, record.took_s * 1e3)
        return record
