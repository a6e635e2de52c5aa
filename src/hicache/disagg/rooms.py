"""The bootstrap rooms of a prefill instance: which requests are paired, and how far each
transfer is (:class:`RoomTable`, a plain data structure; the bootstrap server holds it
under its lock).

A *room* is the 63-bit number the router gives one request and sends to both sides; the
prefill side learns of it from its own request (:meth:`RoomTable.claim`) and from the decode
side's registration (:meth:`RoomTable.register`), in either order. States:
``BOOTSTRAPPING`` → ``WAITING_FOR_INPUT`` → ``TRANSFERRING`` → ``SUCCESS`` | ``FAILED`` |
``ABORTED`` (closed). Invariants: the sender writes only into an *armed* room
(:meth:`RoomTable.arm`: named by the decode side's status poll); every state ends on its
own (:meth:`RoomTable.expire`: ``timeout_s``, ``work_timeout_s``); a transferring room
closes only when the sender stops, never under a write; a room is single-use, its number
refused for ``closed_ttl_s`` after it closed; every operation is O(1) or O(what is asked),
never a walk of every room. Times are ``time.monotonic()`` seconds, passed in: nothing
here reads a clock or blocks. The life of a room: ``docs/architecture.md``, "Rooms".
"""

from __future__ import annotations

import base64
import enum
import heapq
from collections import deque
from dataclasses import dataclass, field

from hicache.disagg.layout import Registration
from hicache.logprob import TokenLogprob, logprobs_from_wire, logprobs_to_wire

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
    ``first_token`` (sampled by the prefill), the prompt tokens its cache served
    (``cached_device``, ``cached_host``, ``cached_storage``), and what the decode side
    needs to answer as one plain instance would: ``first_logprob`` (the first token's log
    probability, when the request asked ``logprobs``), ``prompt_logprobs`` (one entry per
    prompt token, None where not scored, when it asked them) and ``sampler_state`` (the
    request's random generator state after the first draw; None for greedy)."""

    first_token: int
    cached_device: int = 0
    cached_host: int = 0
    cached_storage: int = 0
    first_logprob: TokenLogprob | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    sampler_state: bytes | None = None

    def lean(self) -> RoomResult:
        """This result without what only the decode side's answer needs (the logprobs,
        the generator state: up to kilobytes per prompt token), as a closed room keeps it
        once that side has taken it."""
        return RoomResult(
            self.first_token, self.cached_device, self.cached_host, self.cached_storage
        )

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "first_token": self.first_token,
            "cached_device": self.cached_device,
            "cached_host": self.cached_host,
            "cached_storage": self.cached_storage,
        }
        if self.first_logprob is not None:
            out["first_logprob"] = self.first_logprob.to_wire()
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = logprobs_to_wire(self.prompt_logprobs)
        if self.sampler_state is not None:
            out["sampler_state"] = base64.b64encode(self.sampler_state).decode("ascii")
        return out

    @classmethod
    def from_json(cls, d: dict[str, object]) -> RoomResult:
        """The result ``to_json`` wrote; KeyError, TypeError or ValueError on anything
        else."""
        first = d.get("first_logprob")
        prompt = d.get("prompt_logprobs")
        state = d.get("sampler_state")
        if state is not None and not isinstance(state, str):
            raise ValueError(f"sampler_state must be base64, got {type(state).__name__}")
        return cls(
            first_token=int(d["first_token"]),  # type: ignore[call-overload]
            cached_device=int(d.get("cached_device", 0)),  # type: ignore[call-overload]
            cached_host=int(d.get("cached_host", 0)),  # type: ignore[call-overload]
            cached_storage=int(d.get("cached_storage", 0)),  # type: ignore[call-overload]
            first_logprob=None if first is None else TokenLogprob.from_wire(first),
            prompt_logprobs=None if prompt is None else logprobs_from_wire(prompt),
            sampler_state=None if state is None else base64.b64decode(state, validate=True),
        )


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
            out["result"] = self.result.to_json()
        if self.error is not None:
            out["error"] = self.error
        return out

    @classmethod
    def from_json(cls, d: dict[str, object]) -> RoomStatus:
        """The status ``to_json`` wrote; ValueError on anything else."""
        try:
            result = d.get("result")
            res = RoomResult.from_json(result) if isinstance(result, dict) else None
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
    armed: bool = False
    """The decode side polled the room after its registration was accepted."""
    taken: bool = False
    """The decode side took the pages of the room, closed ``SUCCESS`` (:meth:`take`)."""
    written: bool = False
    """The sender took the registration (it may have written pages since)."""
    result: RoomResult | None = None
    error: str | None = None
    owner: str | None = None
    """The client that registered the room (counted in ``open_rooms_of`` while it is open)."""


CLOSED_LOG = 4096
"""How many of the latest closes :meth:`RoomTable.closed_since` remembers."""


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
    _open: int = 0
    _held: dict[str, int] = field(default_factory=dict)
    closes: int = 0
    """How many times a room has closed (a long poll's cursor)."""
    _closed_log: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=CLOSED_LOG))
    """``(closes after it, room)`` of the latest closes."""
    _bootstrapping: list[tuple[float, int]] = field(default_factory=list)
    """A heap of ``(since, room)`` of rooms that entered ``BOOTSTRAPPING`` (entries of
    rooms that have moved on since are stale: :meth:`expire` skips them)."""
    _working: list[tuple[float, int]] = field(default_factory=list)
    """A heap of ``(since, room)`` of rooms that entered ``WAITING_FOR_INPUT`` or
    ``TRANSFERRING`` (stale entries skipped as above)."""
    _closed: list[tuple[float, int]] = field(default_factory=list)
    """A heap of ``(since, room)`` of closed rooms (:meth:`expire` forgets them)."""

    def __len__(self) -> int:
        """Rooms not closed."""
        return self._open

    def open_rooms_of(self, client: str) -> int:
        """Open rooms ``client`` registered."""
        return self._held.get(client, 0)

    def closed_since(self, closes: int) -> list[int] | None:
        """The rooms closed since :attr:`closes` was ``closes``; None when that is further
        back than the log remembers (the caller reads its rooms again)."""
        n = self.closes - closes
        if n <= 0:
            return []
        if n > len(self._closed_log):
            return None
        return [room for _, room in list(self._closed_log)[-n:]]

    def _new(self, room: int, now: float, **fields: object) -> _Room:
        r = self._rooms[room] = _Room(room, now, **fields)  # type: ignore[arg-type]
        self._open += 1
        heapq.heappush(self._bootstrapping, (now, room))
        return r

    def _closing(self, r: _Room, state: RoomState, now: float) -> None:
        """Move open ``r`` to closed ``state``."""
        assert not r.state.closed and state.closed
        r.state, r.since = state, now
        r.registration = None  # its page lists are not needed any more
        self._open -= 1
        if r.owner is not None:
            left = self._held.get(r.owner, 0) - 1
            if left > 0:
                self._held[r.owner] = left
            else:
                self._held.pop(r.owner, None)
        self.closes += 1
        self._closed_log.append((self.closes, r.number))
        heapq.heappush(self._closed, (now, r.number))

    def claim(self, room: int, now: float) -> str | None:
        """The prefill side's request of ``room`` arrived; None when accepted, else why it
        is refused (the room is in use by another request, or closed recently)."""
        r = self._rooms.get(room)
        if r is None:
            self._new(room, now, claimed=True)
            return None
        if r.claimed or r.state.closed:
            return _reused(r)
        r.claimed = True
        self._both(r, now)
        return None

    def register(self, registration: Registration, now: float, client: str = "") -> str | None:
        """``client`` (the decode side) registered the pages of ``registration.room``;
        None when accepted, else why it is refused."""
        room = registration.room
        r = self._rooms.get(room)
        if r is None:
            r = self._new(room, now, registration=registration)
        elif r.registration is not None or r.state.closed:
            return _reused(r)
        else:
            r.registration = registration
            self._both(r, now)
        r.owner = client
        self._held[client] = self._held.get(client, 0) + 1
        return None

    def registered(self, room: int) -> bool:
        """Whether ``room`` has the decode side's registration, or is closed."""
        r = self._rooms.get(room)
        return r is not None and (r.registration is not None or r.state.closed)

    def registration(self, room: int) -> Registration | None:
        """``room``'s registration while it is open (None before, and once closed)."""
        r = self._rooms.get(room)
        return None if r is None else r.registration

    def start(self, room: int, now: float) -> Registration | None:
        """The prefill's pages are ready: move ``room`` to ``TRANSFERRING`` and return the
        decode side's registration; None while it has not registered or is not armed
        (:meth:`arm`), or the room is closed or aborted."""
        r = self._rooms.get(room)
        if r is None or r.registration is None or r.state is not RoomState.WAITING_FOR_INPUT:
            return None
        if r.abort_asked or not r.armed:
            return None
        r.state, r.since, r.written = RoomState.TRANSFERRING, now, True
        heapq.heappush(self._working, (now, room))
        return r.registration

    def arm(self, room: int) -> bool:
        """The decode side polled ``room``: it knows its registration was accepted, so
        the sender may write (see the module docstring). Whether it was armed now."""
        r = self._rooms.get(room)
        if r is None or r.registration is None or r.armed or r.state.closed:
            return False
        r.armed = True
        return True

    def abort(self, room: int, why: str, now: float) -> bool:
        """The decode side aborts ``room``: closed at once (``ABORTED``) unless the
        sender is writing, which then stops and closes it (:meth:`close`). Returns whether
        it is closed now. An unknown room is remembered as aborted (its prefill request,
        if it comes, is refused)."""
        r = self._rooms.get(room)
        if r is None:
            r = self._new(room, now)
        if r.state.closed:
            if r.state is RoomState.SUCCESS and not r.taken and not r.abort_asked:
                r.abort_asked, r.error = True, why  # written, but the decode side failed
            return True
        r.abort_asked = True
        r.error = r.error or why
        if r.state is RoomState.TRANSFERRING:
            return False
        self._closing(r, RoomState.ABORTED, now)
        return True

    def take(self, room: int) -> None:
        """The decode side has taken ``room``'s pages (it read the room ``SUCCESS`` and
        runs its request): only now may the prefill side's request report success."""
        r = self._rooms.get(room)
        if r is not None and r.state is RoomState.SUCCESS and not r.abort_asked:
            r.taken = True
            if r.result is not None:  # kept for closed_ttl_s: only what is still read
                r.result = r.result.lean()

    def taken(self, room: int) -> bool:
        """Whether the decode side took ``room``'s pages (:meth:`take`)."""
        r = self._rooms.get(room)
        return r is not None and r.taken

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
            r = self._new(room, now)
        if r.state.closed:
            return
        if result is not None and not r.abort_asked:
            r.result = result
            self._closing(r, RoomState.SUCCESS, now)
        elif r.abort_asked:
            self._closing(r, RoomState.ABORTED, now)
        else:
            r.error = error or "failed"
            self._closing(r, RoomState.FAILED, now)

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
        rooms older than ``closed_ttl_s``. Returns the rooms failed or aborted now.
        O(rooms due, and stale entries) with heaps of deadlines, never a walk of every
        room."""
        failed = []
        q = self._bootstrapping
        while q and now - q[0][0] > self.timeout_s:
            since, room = heapq.heappop(q)
            r = self._rooms.get(room)
            if r is None or r.state is not RoomState.BOOTSTRAPPING or r.since != since:
                continue  # it moved on since (its entry is stale)
            side = "decode" if r.claimed else "prefill"
            self._closing(r, RoomState.FAILED, now)
            r.error = f"room {r.number}: the {side} side's request did not come within {self.timeout_s:g} s"
            failed.append(r.number)
        q = self._working
        while q and now - q[0][0] > self.work_timeout_s:
            since, room = heapq.heappop(q)
            r = self._rooms.get(room)
            if r is None or r.since != since:
                continue  # it moved on since (its entry is stale)
            if r.state is RoomState.WAITING_FOR_INPUT:
                self._closing(r, RoomState.FAILED, now)
                r.error = (
                    f"room {r.number}: the prefill did not start sending within"
                    f" {self.work_timeout_s:g} s of both sides' requests"
                )
                failed.append(r.number)
            elif r.state is RoomState.TRANSFERRING and not r.abort_asked:
                r.abort_asked = True  # the sender stops between two writes, then closes it
                r.error = r.error or (
                    f"room {r.number}: the transfer did not end within {self.work_timeout_s:g} s"
                )
                failed.append(r.number)
        q = self._closed
        while q and now - q[0][0] > self.closed_ttl_s:
            since, room = heapq.heappop(q)
            r = self._rooms.get(room)
            if r is not None and r.state.closed and r.since == since:
                del self._rooms[room]
        return failed

    def _both(self, r: _Room, now: float) -> None:
        if r.claimed and r.registration is not None and r.state is RoomState.BOOTSTRAPPING:
            r.state, r.since = RoomState.WAITING_FOR_INPUT, now
            heapq.heappush(self._working, (now, r.number))


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
