"""The bootstrap rooms of a prefill instance: which requests are paired, and how far each
transfer is (:class:`RoomTable`, a plain data structure; the bootstrap server holds it
under its lock).

A *room* is the 63-bit number the router gives one request and sends to both sides with
it. The prefill side learns of it twice, in either order: from its own request
(:meth:`RoomTable.claim`, when the request arrives) and from the decode side's
registration of the pages it allocated (:meth:`RoomTable.register`). A room goes::

    BOOTSTRAPPING ──both sides known──▶ WAITING_FOR_INPUT ──pages handed──▶ TRANSFERRING
          │                                   │                                │
          └──────────── timeout, a side fails, the decode side aborts ─────────┤
                                                                               ▼
                                                  SUCCESS | FAILED | ABORTED (closed)

``WAITING_FOR_INPUT``: the prefill is queued or computing. ``TRANSFERRING``: the sender
writes the pages (chunk by chunk as the prefill computes them). Every state ends on its
own (:meth:`RoomTable.expire`): ``BOOTSTRAPPING`` fails after ``timeout_s`` without the
other side; ``WAITING_FOR_INPUT`` fails after ``work_timeout_s`` (nothing was written);
``TRANSFERRING`` past ``work_timeout_s`` is aborted as the decode side would abort it
(the sender stops between two writes and closes it, never under a write); a closed room
is forgotten after ``closed_ttl_s``. A closed room's number stays refused for ``closed_ttl_s`` (a room is single-use:
a second request or registration under a live or recently closed room is refused). An
abort asked while transferring closes the room only when the sender stops
(:meth:`RoomTable.abort` then :meth:`RoomTable.close`), so the decode side frees its pages
after the last write, never under one.

Times are ``time.monotonic()`` seconds, passed in: nothing here reads a clock or blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from hicache.disagg.layout import Registration

__all__ = ["RoomResult", "RoomState", "RoomStatus", "RoomTable"]


class RoomState(str, enum.Enum):
    """Where a room is (see the module docstring)."""

    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def closed(self) -> bool:
        """No byte moves for the room any more."""
        return self in (RoomState.SUCCESS, RoomState.FAILED, RoomState.ABORTED)


@dataclass(frozen=True, slots=True)
class RoomResult:
    """What the prefill side tells the decode side when the pages have landed:
    ``first_token`` (sampled by the prefill) and the prompt tokens its cache served
    (``cached_device``, ``cached_host``, ``cached_storage``)."""

    first_token: int
    cached_device: int = 0
    cached_host: int = 0
    cached_storage: int = 0


@dataclass(frozen=True, slots=True)
class RoomStatus:
    """A room as the decode side reads it: its ``state``, the ``result`` once
    ``SUCCESS``, the ``error`` once ``FAILED`` or ``ABORTED``; ``written``: the sender
    started writing its pages (a failed room's late bytes may still land then: the decode
    side holds the pages for its drain bound before it frees them)."""

    room: int
    state: RoomState
    result: RoomResult | None = None
    error: str | None = None
    written: bool = False

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "room": self.room,
            "state": self.state.value,
            "written": self.written,
        }
        if self.result is not None:
            r = self.result
            out["result"] = {
                "first_token": r.first_token,
                "cached_device": r.cached_device,
                "cached_host": r.cached_host,
                "cached_storage": r.cached_storage,
            }
        if self.error is not None:
            out["error"] = self.error
        return out

    @classmethod
    def from_json(cls, d: dict[str, object]) -> RoomStatus:
        """The status ``to_json`` wrote; ValueError on anything else."""
        try:
            result = d.get("result")
            res = None
            if isinstance(result, dict):
                res = RoomResult(
                    first_token=int(result["first_token"]),
                    cached_device=int(result.get("cached_device", 0)),
                    cached_host=int(result.get("cached_host", 0)),
                    cached_storage=int(result.get("cached_storage", 0)),
                )
            error = d.get("error")
            return cls(
                room=int(d["room"]),  # type: ignore[call-overload]
                state=RoomState(d["state"]),
                result=res,
                error=None if error is None else str(error),
                written=bool(d.get("written", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a room status that cannot be read: {d!r} ({exc})") from None


@dataclass(slots=True)
class _Room:
    number: int
    since: float
    """When the room entered its state (the timeouts count from there)."""
    state: RoomState = RoomState.BOOTSTRAPPING
    claimed: bool = False
    """The prefill side's request has arrived."""
    registration: Registration | None = None
    """The decode side's pages, once registered."""
    abort_asked: bool = False
    written: bool = False
    """The sender took the registration (it may have written pages since)."""
    result: RoomResult | None = None
    error: str | None = None


@dataclass
class RoomTable:
    """The rooms of one prefill instance; see the module docstring. ``timeout_s``: how
    long a room waits for its other side (:meth:`expire`); ``closed_ttl_s``: how long a
    closed room's number stays refused; ``work_timeout_s``: how long a room with both
    sides may stay ``WAITING_FOR_INPUT``, and then ``TRANSFERRING``, before it ends."""

    timeout_s: float
    closed_ttl_s: float
    work_timeout_s: float = 300.0
    _rooms: dict[int, _Room] = field(default_factory=dict)

    def __len__(self) -> int:
        """Rooms not closed."""
        return sum(1 for r in self._rooms.values() if not r.state.closed)

    def claim(self, room: int, now: float) -> str | None:
        """The prefill side's request of ``room`` arrived; None when accepted, else why it
        is refused (the room is in use by another request, or closed recently)."""
        r = self._rooms.get(room)
        if r is None:
            self._rooms[room] = _Room(room, now, claimed=True)
            return None
        if r.claimed or r.state.closed:
            return _reused(r)
        r.claimed = True
        self._both(r, now)
        return None

    def register(self, registration: Registration, now: float) -> str | None:
        """The decode side registered the pages of ``registration.room``; None when
        accepted, else why it is refused."""
        room = registration.room
        r = self._rooms.get(room)
        if r is None:
            self._rooms[room] = _Room(room, now, registration=registration)
            return None
        if r.registration is not None or r.state.closed:
            return _reused(r)
        r.registration = registration
        self._both(r, now)
        return None

    def registered(self, room: int) -> bool:
        """Whether ``room`` has the decode side's registration, or is closed."""
        r = self._rooms.get(room)
        return r is not None and (r.registration is not None or r.state.closed)

    def start(self, room: int, now: float) -> Registration | None:
        """The prefill's pages are ready: move ``room`` to ``TRANSFERRING`` and return the
        decode side's registration; None while it has not registered (or the room is
        closed or aborted: see :meth:`state`)."""
        r = self._rooms.get(room)
        if r is None or r.registration is None or r.state is not RoomState.WAITING_FOR_INPUT:
            return None
        if r.abort_asked:
            return None
        r.state, r.since, r.written = RoomState.TRANSFERRING, now, True
        return r.registration

    def abort(self, room: int, why: str, now: float) -> bool:
        """The decode side aborts ``room``: closed at once (``ABORTED``) unless the
        sender is writing, which then stops and closes it (:meth:`close`). Returns whether
        it is closed now. An unknown room is remembered as aborted (its prefill request,
        if it comes, is refused)."""
        r = self._rooms.get(room)
        if r is None:
            r = self._rooms[room] = _Room(room, now)
        if r.state.closed:
            return True
        r.abort_asked = True
        r.error = r.error or why
        if r.state is RoomState.TRANSFERRING:
            return False
        r.state, r.since = RoomState.ABORTED, now
        return True

    def aborted(self, room: int) -> bool:
        """Whether the decode side asked to abort ``room`` (the sender checks between
        writes)."""
        r = self._rooms.get(room)
        return r is not None and r.abort_asked

    def close(
        self, room: int, now: float, *, result: RoomResult | None = None, error: str | None = None
    ) -> None:
        """End ``room``: ``SUCCESS`` with ``result``, else ``ABORTED`` when the decode side
        asked for it, else ``FAILED`` with ``error``. Idempotent (a closed room stays as it
        closed)."""
        r = self._rooms.get(room)
        if r is None:
            r = self._rooms[room] = _Room(room, now)
        if r.state.closed:
            return
        if result is not None and not r.abort_asked:
            r.state, r.result = RoomState.SUCCESS, result
        elif r.abort_asked:
            r.state = RoomState.ABORTED
        else:
            r.state, r.error = RoomState.FAILED, error or "failed"
        r.since = now

    def status(self, room: int) -> RoomStatus | None:
        """``room`` as the decode side reads it; None for a room never seen."""
        r = self._rooms.get(room)
        if r is None:
            return None
        error = r.error if r.state.closed else None
        return RoomStatus(room, r.state, r.result, error, r.written)

    def expire(self, now: float) -> list[int]:
        """End the rooms past their state's bound (see the module docstring): fail those
        whose other side has not come within ``timeout_s`` (``BOOTSTRAPPING``) or whose
        prefill has not started sending within ``work_timeout_s``
        (``WAITING_FOR_INPUT``), ask the sender to stop those still ``TRANSFERRING``
        after ``work_timeout_s`` (:meth:`aborted`: it closes them), and forget closed
        rooms older than ``closed_ttl_s``. Returns the rooms failed or aborted now."""
        failed = []
        for r in list(self._rooms.values()):
            age = now - r.since
            if r.state is RoomState.BOOTSTRAPPING and age > self.timeout_s:
                side = "decode" if r.claimed else "prefill"
                r.state, r.since = RoomState.FAILED, now
                r.error = f"room {r.number}: the {side} side's request did not come within {self.timeout_s:g} s"
                failed.append(r.number)
            elif r.state is RoomState.WAITING_FOR_INPUT and age > self.work_timeout_s:
                r.state, r.since = RoomState.FAILED, now
                r.error = (
                    f"room {r.number}: the prefill did not start sending within"
                    f" {self.work_timeout_s:g} s of both sides' requests"
                )
                failed.append(r.number)
            elif (
                r.state is RoomState.TRANSFERRING
                and not r.abort_asked
                and age > self.work_timeout_s
            ):
                r.abort_asked = True  # the sender stops between two writes, then closes it
                r.error = r.error or (
                    f"room {r.number}: the transfer did not end within {self.work_timeout_s:g} s"
                )
                failed.append(r.number)
            elif r.state.closed and age > self.closed_ttl_s:
                del self._rooms[r.number]
        return failed

    def _both(self, r: _Room, now: float) -> None:
        if r.claimed and r.registration is not None and r.state is RoomState.BOOTSTRAPPING:
            r.state, r.since = RoomState.WAITING_FOR_INPUT, now


def _reused(r: _Room) -> str:
    if r.state is RoomState.ABORTED:
        return f"bootstrap room {r.number} was aborted by the decode side ({r.error})"
    if r.state is RoomState.FAILED:
        return f"bootstrap room {r.number} has failed ({r.error}); a room is single-use"
    if r.state.closed:
        return (
            f"bootstrap room {r.number} was used by a request that has ended; a room is single-use"
        )
    return f"bootstrap room {r.number} is in use by another request"
