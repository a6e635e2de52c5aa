"""Follower ranks' heartbeats: a liveness signal rank 0 reads without any collective.

Each follower process runs a daemon thread that writes ``time.monotonic()`` (the system's
monotonic clock, the same in every process of the host) into its slot of an array shared
with rank 0 every :data:`BEAT_INTERVAL_S` seconds, from its start to its exit, whatever its
engine is doing (a forward or a collective releases the GIL). A rank whose slot is older
than :data:`SILENT_AFTER_S` has stopped answering: frozen (SIGSTOP), swapped out, or stuck
holding the GIL. Rank 0 reports it (:meth:`Heartbeats.silent`, read by ``/health``) while
the step's collectives, which wait up to ``--collective-timeout``, still wait for it; the
report ends by itself once the rank beats again.
"""

from __future__ import annotations

import threading
import time
from typing import Any

BEAT_INTERVAL_S = 0.5
"""Seconds between two beats of a follower."""
SILENT_AFTER_S = 5.0
"""A follower whose last beat is older than this (seconds) has stopped answering: ten
beats missed, far above a loaded host's scheduling delays."""


class Heartbeats:
    """One slot per rank of ``size`` (slot 0, rank 0's, unused), shared with the followers:
    built by rank 0 from its multiprocessing context ``ctx`` and passed to each follower
    when it is spawned (in its :class:`~hicache.engine.ranks.RankSetup`). Every slot starts
    at the time of building, so a follower has :data:`SILENT_AFTER_S` to start beating."""

    def __init__(self, size: int, ctx: Any) -> None:
        self.size = size
        self._slots: Any = ctx.RawArray("d", size)  # seconds, time.monotonic()
        now = time.monotonic()
        for rank in range(size):
            self._slots[rank] = now

    def start(self, rank: int) -> None:
        """Beat for ``rank`` (in its follower process) every :data:`BEAT_INTERVAL_S` on a
        daemon thread, until the process exits."""

        def beat() -> None:
            while True:
                self._slots[rank] = time.monotonic()
                time.sleep(BEAT_INTERVAL_S)

        threading.Thread(target=beat, name=f"hicache-heartbeat-{rank}", daemon=True).start()

    def ages(self, ranks: list[int]) -> dict[int, float]:
        """Seconds since each of ``ranks`` last beat."""
        now = time.monotonic()
        return {rank: now - float(self._slots[rank]) for rank in ranks}

    def silent(self, pids: dict[int, int] | None = None) -> str | None:
        """One line naming each follower silent for more than :data:`SILENT_AFTER_S`
        (those of ``pids``, rank -> pid, named with their pid, when given) and for how long; None
        while every follower beats."""
        now = time.monotonic()
        quiet = []
        for rank in range(1, self.size) if pids is None else sorted(pids):
            age = now - float(self._slots[rank])
            if age > SILENT_AFTER_S:
                pid = (pids or {}).get(rank)
                who = f"rank {rank}" if pid is None else f"rank {rank} (pid {pid})"
                quiet.append(f"{who} has not answered for {age:.0f} s")
        if not quiet:
            return None
        return "; ".join(quiet) + " (frozen or overloaded): the ranks wait for it"


__all__ = ["BEAT_INTERVAL_S", "SILENT_AFTER_S", "Heartbeats"]
