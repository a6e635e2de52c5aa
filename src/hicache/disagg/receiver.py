"""The decode side's receiver: registers each request's pages with its prefill instance
and follows the room until the pages have landed (:class:`DecodeReceiver`).

One thread per prefill instance (:class:`_Link`, keyed by its bootstrap address, pooled by
:mod:`hicache.disagg.links`) loops over the registrations and aborts the engine asked for,
the re-aborts of rooms given up (every ``RETRY_S``), and one long poll of its rooms
(``/status``). A room's end reaches the engine as a step input: ``arrived(rid, result)``
(``SUCCESS``: every byte landed; the next poll reports the pages ``taken``),
``failed(rid, error)`` (given up while the prefill may still write: the request ends, its
pages stay *fenced*) or ``ended(rid, error)`` (no byte can land any more: the pages are free).
Invariant: pages are freed only on a fact (a refusal, a close, an acknowledged abort, the
instance gone), never on a timeout. Each ``error`` is a :class:`~hicache.failures.Failure`
(``REFUSED``, ``PEER_TIMEOUT``, ``PEER_FAILED``). Only addresses ``allow`` admits are
contacted; ``key``, when set, goes with every call. Why and how: ``docs/architecture.md``,
"A page given away is never written".
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hicache.disagg.allow import BootstrapAllow
from hicache.disagg.bootstrap_client import BootstrapClient, BootstrapUnreachable
from hicache.disagg.layout import Registration
from hicache.disagg.links import LinkPool
from hicache.disagg.rooms import RoomResult, RoomState
from hicache.failures import Failure, FailureKind

log = logging.getLogger(__name__)

__all__ = ["BootstrapRefused", "DecodeReceiver"]

POLL_WAIT_S = 0.02
"""How long one status poll waits for a room to close (new registrations and aborts wait
at most this long for the link's thread)."""
RETRY_S = 0.5
"""How often the abort of a room given up is sent again until it is acknowledged."""


class BootstrapRefused(ValueError):
    """A bootstrap address this instance may not contact (``--disaggregation-bootstrap-allow``)."""


@dataclass(frozen=True, slots=True)
class _Expect:
    rid: str
    registration: Registration


@dataclass(frozen=True, slots=True)
class _Abort:
    rid: str
    why: str


@dataclass(slots=True)
class _Room:
    rid: str
    room: int
    instance: str | None
    """The prefill instance the registration went to (None: none had answered yet)."""
    registered: bool = False
    """Its acceptance was read: it is polled (and so armed)."""
    why: str = ""
    drain_until: float | None = None
    """Set once the engine aborted it: the room is given up at this ``time.monotonic()``
    unless the prefill side has closed it by then."""
    given_up: bool = False
    """``failed`` was called: its pages are fenced until the room is settled (``ended``)."""
    retry_at: float = 0.0
    """When to send its abort again (given up or draining)."""


class DecodeReceiver:
    """Follows the rooms of a decode instance; see the module docstring. ``arrived`` and
    ``ended`` are called on the links' threads, once per expected request."""

    def __init__(
        self,
        arrived: Callable[[str, RoomResult], None],
        ended: Callable[[str, str], None],
        *,
        failed: Callable[[str, str], None],
        health_bound_s: float,
        drain_timeout_s: float,
        allow: BootstrapAllow | None = None,
        key: str | None = None,
        max_links: int = 64,
        link_idle_timeout_s: float = 30.0,
    ) -> None:
        self._arrived = arrived
        self._ended = ended
        self._failed = failed
        self._health_bound_s = health_bound_s
        self._drain_timeout_s = drain_timeout_s
        self._allow = allow if allow is not None else BootstrapAllow.parse(["*"])
        self._key = key
        self._links: LinkPool[_Link] = LinkPool(
            lambda host, port: _Link(self, host, port, health_bound_s),
            max_links=max_links,
            idle_timeout_s=link_idle_timeout_s,
        )
        self._where: dict[str, tuple[str, int]] = {}
        """rid -> the address of its link (engine thread only)."""

    @property
    def links(self) -> int:
        """How many links are open now."""
        return len(self._links)

    def check(self, host: str, port: int) -> None:
        """Raise when :meth:`expect` would refuse ``host:port`` now (any thread):
        :class:`BootstrapRefused` for an address not allowed,
        :class:`~hicache.disagg.links.LinksFull` when every link is busy and there is no
        place for a new one."""
        self._check_allowed(host, port)
        self._links.check(host, port)

    def expect(self, rid: str, host: str, port: int, registration: Registration) -> None:
        """Register ``registration`` (request ``rid``'s pages) with the prefill instance
        whose bootstrap server is ``host:port`` and follow its room (engine thread).
        Raises, with nothing sent, as :meth:`check` says."""
        self._check_allowed(host, port)
        self._links.post(host, port, _Expect(rid, registration))
        self._where[rid] = (host, port)

    def abort(self, rid: str, why: str) -> None:
        """Give request ``rid``'s room up (drained: see the module docstring)."""
        where = self._where.get(rid)
        if where is not None:
            self._links.post_existing(*where, _Abort(rid, why))

    def forget(self, rid: str) -> None:
        """Request ``rid`` has ended (engine thread)."""
        self._where.pop(rid, None)

    def close(self) -> None:
        """Stop every link; rooms still followed end with an error."""
        self._links.close()

    def _check_allowed(self, host: str, port: int) -> None:
        if not self._allow.allows(host, port):
            raise BootstrapRefused(
                f"bootstrap_host {host}:{port} is not an address this decode instance may"
                f" contact (--disaggregation-bootstrap-allow {self._allow}; loopback only"
                " unless the flag or --api-key is given)"
            )

    # called on the links' threads
    def _call_arrived(self, rid: str, result: RoomResult) -> None:
        try:
            self._arrived(rid, result)
        except Exception:
            log.exception("reporting the pages of %s failed", rid)

    def _call_ended(self, rid: str, why: str) -> None:
        try:
            self._ended(rid, why)
        except Exception:
            log.exception("reporting the end of %s failed", rid)

    def _call_failed(self, rid: str, why: str) -> None:
        try:
            self._failed(rid, why)
        except Exception:
            log.exception("reporting the failure of %s failed", rid)


class _Link:
    """The thread that follows one prefill instance's rooms."""

    def __init__(self, owner: DecodeReceiver, host: str, port: int, bound_s: float) -> None:
        self.owner = owner
        self.address = f"{host}:{port}"
        self.client = BootstrapClient(host, port, timeout_s=bound_s, key=owner._key)
        self.inbox: queue.Queue[_Expect | _Abort] = queue.Queue()
        self.rooms: dict[str, _Room] = {}
        self._pending = 0
        """Items posted and not yet handled (under ``_count``)."""
        self._count = threading.Lock()
        self.taken: list[int] = []
        """Rooms whose pages were taken (``arrived``), told with the next poll."""
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._unreachable_since: float | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"hicache-pd-link-{host}:{port}", daemon=True
        )

    @property
    def busy(self) -> bool:
        """An item posted is not handled yet, or a room is followed (any thread: an item
        becomes a room, or ends, before it stops counting as pending)."""
        with self._count:
            return self._pending > 0 or bool(self.rooms)

    def start(self) -> None:
        self._thread.start()

    def post(self, item: object) -> None:
        assert isinstance(item, (_Expect, _Abort))
        with self._count:
            self._pending += 1
        self.inbox.put(item)
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def join(self) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        idle_s = self.owner._links.idle_timeout_s
        idle_since: float | None = None
        try:
            while not self._stop.is_set():
                if self._take_inbox():
                    idle_since = None
                self._tend()
                if not self.taken and not any(r.registered for r in self.rooms.values()):
                    now = time.monotonic()
                    if self.rooms:  # only rooms given up: their aborts are resent
                        idle_since = None
                        self._wake.wait(min(RETRY_S, 0.1))
                    else:
                        idle_since = idle_since or now
                        retire = now - idle_since >= idle_s
                        if retire and self.owner._links.retire(self.address, self):
                            break  # out of the pool: nothing can be posted to it any more
                        self._wake.wait(min(0.5, max(0.01, idle_since + idle_s - now)))
                    self._wake.clear()
                    continue
                idle_since = None
                self._poll()
        except Exception:
            log.exception("the PD link to %s failed", self.client.address)
        finally:
            self.owner._links.discard(self.address, self)  # then nothing more is posted
            stopping = Failure("the decode instance is stopping", FailureKind.STOPPING)
            for r in list(self.rooms.values()):
                self._end(r, stopping)
            while not self.inbox.empty():
                item = self.inbox.get_nowait()
                if isinstance(item, _Expect):
                    self.owner._call_ended(item.rid, stopping)
                self._handled()
            self.client.close()
            self.owner._links.left(self)

    def _take_inbox(self) -> int:
        """Handle every item posted; returns how many."""
        n = 0
        while not self.inbox.empty():
            item = self.inbox.get_nowait()
            n += 1
            try:
                if isinstance(item, _Expect):
                    self._register(item)
                else:
                    self._abort(item)
            finally:
                self._handled()
        return n

    def _handled(self) -> None:
        with self._count:
            self._pending -= 1

    def _register(self, item: _Expect) -> None:
        room = _Room(item.rid, item.registration.room, self.client.instance)
        try:
            refused = self.client.register(item.registration)
        except BootstrapUnreachable as exc:
            if exc.failure.kind is FailureKind.REFUSED or exc.refused:
                # a bogus host, or nothing listens there: no prefill instance can read it
                self.owner._call_ended(item.rid, _gone(exc))
                return
            # it may be in the prefill instance's socket, read later: fenced until settled
            self.rooms[item.rid] = room
            self._give_up(room, exc.failure)
            return
        if refused is not None:
            self.owner._call_ended(item.rid, refused)
            return
        room.registered = True
        room.instance = self.client.instance
        self.rooms[item.rid] = room

    def _abort(self, item: _Abort) -> None:
        room = self.rooms.get(item.rid)
        if room is None or room.given_up or room.drain_until is not None:
            return  # not registered (nothing can be written), or already being settled
        room.why = item.why
        room.drain_until = time.monotonic() + self.owner._drain_timeout_s
        self._send_abort(room)

    def _give_up(self, r: _Room, why: str) -> None:
        """The request fails now; its pages stay fenced until the room is settled."""
        if r.given_up:
            return
        r.given_up, r.why = True, why
        r.retry_at = 0.0  # aborted by the next _tend (every failure is told first)
        self.owner._call_failed(r.rid, why)

    def _send_abort(self, r: _Room) -> bool:
        """Ask the prefill side to abort ``r``; ``ended`` when it acknowledged (no byte
        of the room can land any more) or is gone. Whether the prefill side answered."""
        r.retry_at = time.monotonic() + RETRY_S
        try:
            closed = self.client.abort(r.room, r.why or "aborted by the decode side")
        except BootstrapUnreachable as exc:
            if exc.refused:
                self._end(r, r.why or _gone(exc))
            return exc.refused
        if closed:
            self._end(r, r.why)
        return True

    def _tend(self) -> None:
        """Abort again the rooms given up or draining; give up drained ones; end the rooms
        of a prefill instance that another one replaced."""
        now = time.monotonic()
        answering = True  # one abort unanswered: the others wait for the next round
        for r in list(self.rooms.values()):
            if self._replaced(r):
                self._end(r, r.why or _replaced_error(r))
            elif r.drain_until is not None and now >= r.drain_until and not r.given_up:
                why = f"{r.why} (the prefill side did not acknowledge the abort)"
                self._give_up(r, Failure(why, FailureKind.PEER_TIMEOUT))
            elif answering and (r.given_up or r.drain_until is not None) and now >= r.retry_at:
                answering = self._send_abort(r)

    def _replaced(self, r: _Room) -> bool:
        """Whether another prefill instance than ``r``'s answers at the address now."""
        now = self.client.instance
        return r.instance is not None and now is not None and now != r.instance

    def _poll(self) -> None:
        rooms = [r for r in self.rooms.values() if r.registered]
        taken, self.taken = self.taken, []
        asked = time.monotonic()
        try:
            got = self.client.status([r.room for r in rooms], POLL_WAIT_S, taken)
        except BootstrapUnreachable as exc:
            self.taken = taken + self.taken  # told again with the next poll
            now = time.monotonic()
            since = self._unreachable_since = self._unreachable_since or asked
            if exc.refused:
                for r in rooms:  # nothing listens: the instance is gone, nothing can land
                    self._end(r, r.why or _gone(exc))
            elif now - since >= self.owner._health_bound_s:
                why = f"{exc}; silent for {now - since:.1f} s, so its rooms failed"
                for r in rooms:
                    self._give_up(r, Failure(why, FailureKind.PEER_TIMEOUT))
                self._unreachable_since = None
            else:
                self._stop.wait(min(0.2, self.owner._health_bound_s / 4))
            return
        self._unreachable_since = None
        for r, status in zip(rooms, got, strict=True):
            if r.rid not in self.rooms:
                continue
            if status is not None and status.state.closed:
                if (
                    status.state is RoomState.SUCCESS
                    and status.result is not None
                    and r.drain_until is None
                    and not r.given_up
                ):
                    del self.rooms[r.rid]
                    self.owner._call_arrived(r.rid, status.result)
                    self.taken.append(r.room)
                else:  # closed: the sender has stopped, no write of it can land
                    if r.given_up and status.state is RoomState.SUCCESS:
                        self._send_abort(r)  # so that the prefill does not report success
                    self._end(r, _peer_failed(r.why or status.error, r.room, status.state))
            elif self._replaced(r):
                self._end(r, r.why or _replaced_error(r))

    def _end(self, r: _Room, why: str) -> None:
        if self.rooms.pop(r.rid, None) is not None:
            self.owner._call_ended(r.rid, why)


def _peer_failed(why: str | None, room: int, state: RoomState) -> str:
    """The error of a room the prefill side closed without success: its own kind when it
    has one (a refusal stays a refusal), else ``PEER_FAILED``."""
    if isinstance(why, Failure):
        return why
    return Failure(why or f"room {room} {state.value}", FailureKind.PEER_FAILED)


def _gone(exc: BootstrapUnreachable) -> Failure:
    """The error of a room whose prefill instance cannot be reached at all: a bogus
    host is the request's fault, a refused connection the peer's (it is gone)."""
    if exc.failure.kind is FailureKind.REFUSED:
        return exc.failure
    return Failure(f"the prefill instance is gone: {exc}", FailureKind.PEER_FAILED)


def _replaced_error(r: _Room) -> Failure:
    return Failure(f"room {r.room}: the prefill instance was replaced", FailureKind.PEER_FAILED)
