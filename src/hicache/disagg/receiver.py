"""The decode side's receiver: registers each request's pages with its prefill instance
and follows the room until the pages have landed (:class:`DecodeReceiver`).

One thread per prefill instance (:class:`_Link`, keyed by its bootstrap address, in a
bounded pool that retires idle links: :mod:`hicache.disagg.links`) does, in a loop: the registrations and aborts the engine asked for, then one long poll of the
statuses of its rooms (``/status``, which answers as soon as one closes). A closed room
becomes one call: ``arrived(rid, result)`` when the prefill side reports ``SUCCESS``
(every byte has landed: the sender closes the room after its last write), else
``ended(rid, error)``; the engine applies them as step inputs. The long poll is also the
health check: when the prefill instance has not answered for ``health_bound_s`` (counted
from the start of the first call it did not answer; each call waits at most that long),
every room of it ends with an error, and so does a registration it does not answer.

Each ``error`` is a :class:`~hicache.failures.Failure` saying whose fault it was: the
room refused (in use, used, a layout mismatch) or a ``bootstrap_host`` that does not
resolve: ``REFUSED``; the prefill instance silent for the bound: ``PEER_TIMEOUT``; the
room failed on the prefill side: ``PEER_FAILED``.

An abort (:meth:`DecodeReceiver.abort`) is drained: the room is given up at the prefill
side, and ``ended`` comes only once the prefill side has closed it (no write can follow),
or after ``drain_timeout_s``; until then the request keeps its pages.

Only bootstrap addresses that ``allow`` admits are contacted (the HTTP server refuses
the others first, with a 400 naming ``bootstrap_host``; :meth:`DecodeReceiver.expect`
checks again); ``key``, when set, goes with every call (``Authorization: Bearer``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hicache.disagg.allow import BootstrapAllow
from hicache.disagg.bootstrap import BootstrapClient, BootstrapUnreachable
from hicache.disagg.layout import Registration
from hicache.disagg.links import LinkPool
from hicache.disagg.rooms import RoomResult, RoomState
from hicache.failures import Failure, FailureKind

log = logging.getLogger(__name__)

__all__ = ["BootstrapRefused", "DecodeReceiver"]

POLL_WAIT_S = 0.02
"""How long one status poll waits for a room to close (new registrations and aborts wait
at most this long for the link's thread)."""


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
    registered: bool = False
    drain_until: float | None = None
    """Set once aborted: ``ended`` is called when the prefill side has closed the room or
    at this ``time.monotonic()``."""
    why: str = ""
    failed: bool = False
    """The room closed without success after pages were written: draining."""


class DecodeReceiver:
    """Follows the rooms of a decode instance; see the module docstring. ``arrived`` and
    ``ended`` are called on the links' threads, once per expected request."""

    def __init__(
        self,
        arrived: Callable[[str, RoomResult], None],
        ended: Callable[[str, str], None],
        *,
        health_bound_s: float,
        drain_timeout_s: float,
        allow: BootstrapAllow | None = None,
        key: str | None = None,
        max_links: int = 64,
        link_idle_timeout_s: float = 30.0,
    ) -> None:
        self._arrived = arrived
        self._ended = ended
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
                if not self.rooms:
                    now = time.monotonic()
                    idle_since = idle_since or now
                    if now - idle_since >= idle_s and self.owner._links.retire(self.address, self):
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
        room = _Room(item.rid, item.registration.room)
        try:
            refused = self.client.register(item.registration)
        except BootstrapUnreachable as exc:
            self.owner._call_ended(item.rid, exc.failure)
            return
        if refused is not None:
            self.owner._call_ended(item.rid, refused)
            return
        room.registered = True
        self.rooms[item.rid] = room

    def _abort(self, item: _Abort) -> None:
        room = self.rooms.get(item.rid)
        if room is None:  # not registered (refused or ended): nothing can be written
            return
        room.why = item.why
        if room.drain_until is None:
            room.drain_until = time.monotonic() + self.owner._drain_timeout_s
        try:
            closed = self.client.abort(room.room, item.why)
        except BootstrapUnreachable:
            closed = False  # the drain bound (or the health bound) ends it
        if closed:
            self._end(room, item.why)

    def _poll(self) -> None:
        rooms = list(self.rooms.values())
        asked = time.monotonic()
        try:
            got = self.client.status([r.room for r in rooms], POLL_WAIT_S)
        except BootstrapUnreachable as exc:
            now = time.monotonic()
            since = self._unreachable_since = self._unreachable_since or asked
            if now - since >= self.owner._health_bound_s:
                why = f"{exc}; silent for {now - since:.1f} s, so its rooms failed"
                for r in rooms:
                    self._end(r, Failure(why, FailureKind.PEER_TIMEOUT))
                self._unreachable_since = None
            else:
                self._stop.wait(min(0.2, self.owner._health_bound_s / 4))
            return
        self._unreachable_since = None
        now = time.monotonic()
        for r, status in zip(rooms, got, strict=True):
            if status is not None and status.state.closed:
                if (
                    status.state is RoomState.SUCCESS
                    and status.result is not None
                    and r.drain_until is None
                ):
                    del self.rooms[r.rid]
                    self.owner._call_arrived(r.rid, status.result)
                elif status.written and not r.failed:
                    # a write that failed (a deadline) may still land: hold the pages for
                    # the drain bound before freeing them, never reuse them under it
                    r.failed = True
                    r.why = r.why or status.error or f"room {r.room} {status.state.value}"
                    r.drain_until = now + self.owner._drain_timeout_s
                elif not status.written or now >= (r.drain_until or now):
                    self._end(r, _peer_failed(r.why or status.error, r.room, status.state))
            elif r.drain_until is not None and now >= r.drain_until:
                self._end(r, f"{r.why} (the prefill side did not acknowledge the abort)")

    def _end(self, r: _Room, why: str) -> None:
        self.rooms.pop(r.rid, None)
        self.owner._call_ended(r.rid, why)


def _peer_failed(why: str | None, room: int, state: RoomState) -> str:
    """The error of a room the prefill side closed without success: its own kind when it
    has one (a refusal stays a refusal), else ``PEER_FAILED``."""
    if isinstance(why, Failure):
        return why
    return Failure(why or f"room {room} {state.value}", FailureKind.PEER_FAILED)
