"""One prefill rank's view of its rooms, as its sender reads and ends them: :class:`RankRooms`.

Every rank of a prefill instance writes its own share of a room's pages
(:mod:`hicache.disagg.shares`), but only rank 0 holds the room table
(:class:`~hicache.disagg.bootstrap.PrefillRooms`). What rank 0 learns of a room reaches
every rank once per step, as a :class:`RoomNews` (:meth:`RankRooms.learn`): registered
(with the decode side's :class:`~hicache.disagg.layout.Registration`, or the error of a room
closed before), armed (the sender may write), stopped (aborted, or a share failed), taken.
What a rank's sender ends goes the other way as :class:`ShareEnd` s
(:meth:`RankRooms.ended_shares`); rank 0 closes the room once every rank's share has ended
(:class:`~hicache.engine.roles.prefill.PrefillRole`). Invariant: a share ends only when its
sender writes no more of it, so a room closed on every share's end has no write in flight.
Thread-safe: the sender's thread and the engine's share one lock and condition.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from hicache.disagg.layout import Registration
from hicache.disagg.rooms import RoomResult, RoomState, RoomStatus

__all__ = ["RankRooms", "RoomNews", "ShareEnd"]


@dataclass(frozen=True, slots=True)
class ShareEnd:
    """Rank ``rank``'s share of ``room`` ended: written (``error`` None; rank 0's carries
    the room's ``result``), or not (``error``; nothing more of it is written)."""

    room: int
    rank: int
    error: str | None = None
    result: RoomResult | None = None


@dataclass(frozen=True, slots=True)
class RoomNews:
    """What rank 0 tells every rank of its rooms at one step: ``registered`` (room,
    registration; None with the error of a room that closed first), ``armed`` rooms,
    ``stopped`` (room, why), ``taken`` rooms and ``closed`` ones (every share ended)."""

    registered: tuple[tuple[int, Registration | None, str | None], ...] = ()
    armed: tuple[int, ...] = ()
    stopped: tuple[tuple[int, str], ...] = ()
    taken: tuple[int, ...] = ()
    closed: tuple[int, ...] = ()


@dataclass(slots=True)
class _Room:
    registration: Registration | None = None
    error: str | None = None
    """Why the room closed before it was registered, or was stopped."""
    armed: bool = False
    stopped: bool = False
    closed: bool = False
    """This rank's share has ended."""
    taken: bool = False


@dataclass
class RankRooms:
    """See the module docstring. ``rank``: this rank (0 holds the room table)."""

    rank: int
    _rooms: dict[int, _Room] = field(default_factory=dict)
    _ended: list[ShareEnd] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)

    # ------------------------------------------------------------------ the engine's side

    def learn(self, news: RoomNews) -> None:
        """Apply rank 0's ``news`` (every rank, the same news at the same step)."""
        with self._cond:
            for room, reg, error in news.registered:
                r = self._rooms.setdefault(room, _Room())
                r.registration, r.error = reg, error
            for room in news.armed:
                self._rooms.setdefault(room, _Room()).armed = True
            for room, why in news.stopped:
                r = self._rooms.setdefault(room, _Room())
                r.stopped, r.error = True, r.error or why
            for room in news.taken:
                self._rooms.setdefault(room, _Room()).taken = True
            self._cond.notify_all()

    def registered(self, room: int) -> bool:
        """Whether ``room`` is registered, or closed before it was."""
        with self._cond:
            r = self._rooms.get(room)
            return r is not None and (r.registration is not None or r.error is not None)

    def ended_shares(self) -> list[ShareEnd]:
        """The shares this rank's sender ended since the last call."""
        with self._cond:
            out, self._ended = self._ended, []
            return out

    def forget(self, room: int) -> None:
        """``room``'s request has ended here: nothing more is read of it."""
        with self._cond:
            self._rooms.pop(room, None)

    # ------------------------------------------------------------------ the sender's side

    def start(self, room: int) -> Registration | None:
        """``room``'s registration once it is armed and not stopped; else None."""
        with self._cond:
            r = self._rooms.get(room)
            if r is None or not r.armed or r.stopped or r.closed:
                return None
            return r.registration

    def status(self, rooms: Sequence[int]) -> list[RoomStatus | None]:
        """Each room as far as this rank knows: closed (``FAILED``, with its error) once it
        closed before its registration or was stopped, else None (still open)."""
        with self._cond:
            out: list[RoomStatus | None] = []
            for room in rooms:
                r = self._rooms.get(room)
                if r is not None and r.error is not None and (r.stopped or r.registration is None):
                    out.append(RoomStatus(room, RoomState.FAILED, error=r.error))
                else:
                    out.append(None)
            return out

    def aborted(self, room: int) -> bool:
        """Whether ``room`` was stopped (the sender checks between writes)."""
        with self._cond:
            r = self._rooms.get(room)
            return r is not None and r.stopped

    def close(
        self, room: int, *, result: RoomResult | None = None, error: str | None = None
    ) -> None:
        """This rank's share of ``room`` ended (once; later calls do nothing): written with
        ``result``, else failed with ``error``."""
        with self._cond:
            r = self._rooms.setdefault(room, _Room())
            if r.closed:
                return
            r.closed = True
            ok = result is not None and not r.stopped
            why = None if ok else (r.error if r.stopped else None) or error or "failed"
            self._ended.append(ShareEnd(room, self.rank, why, result if ok else None))
            if self.rank:
                r.taken = True  # a follower reports nothing of it: rank 0 does
            self._cond.notify_all()

    def taken(self, room: int) -> bool:
        """Whether the decode side took ``room``'s pages (rank 0 learned it)."""
        with self._cond:
            r = self._rooms.get(room)
            return r is not None and r.taken

    def expire(self) -> list[int]:
        """Rooms expire in rank 0's table; nothing here."""
        return []

    def poke(self) -> None:
        """Wake whoever waits in :meth:`wait`."""
        with self._cond:
            self._cond.notify_all()

    def wait(self, timeout_s: float) -> None:
        """Block until something changes or ``timeout_s`` passes (the sender's idle wait)."""
        with self._cond:
            self._cond.wait(timeout_s)
