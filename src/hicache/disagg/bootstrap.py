"""The bootstrap server of a prefill instance (its client: :mod:`.bootstrap_client`).

The decode side (never the router) talks to it over plain HTTP with JSON bodies:
``GET /health`` (never keyed), ``GET /layout`` (an
:class:`~hicache.disagg.layout.InstanceLayout`), ``POST /register`` (a
:class:`~hicache.disagg.layout.Registration`: 200, 409, 400 or 429), ``POST /status`` (a
long poll of at most :data:`MAX_STATUS_ROOMS` rooms, ``wait_s`` at most 1 s; it arms the
registered rooms it names and reports the ones taken) and ``POST /abort`` (``{"closed":
bool}``; True: no byte of the room will be written any more). While the instance is
unhealthy (:attr:`PrefillRooms.health`: a rank frozen or dead) ``/register`` and
``/status`` answer 503, as if unanswered. Invariants: with a key,
every route but ``/health`` needs ``Authorization: Bearer <key>`` (401 before the body is
read); a body past :data:`MAX_REGISTER_BYTES` / :data:`MAX_SMALL_BYTES` gets 413 unread;
every answer carries ``X-Hicache-Instance``, drawn at start, so a changed id means the
instance registered with is gone. :class:`PrefillRooms` is the
:class:`~hicache.disagg.rooms.RoomTable` under one lock and condition, shared by the handler
threads, the engine thread and the sender. The routes in full: ``docs/architecture.md``.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from hicache.disagg.layout import InstanceLayout, LayoutMismatch, Registration, check_pair
from hicache.disagg.rooms import RoomResult, RoomStatus, RoomTable
from hicache.failures import Failure, FailureKind

log = logging.getLogger(__name__)

__all__ = [
    "INSTANCE_HEADER",
    "BootstrapServer",
    "PrefillRooms",
    "Refused",
]

MAX_WAIT_S = 1.0
"""The longest a ``/status`` long poll waits."""
MAX_REGISTER_BYTES = 16 << 20
"""The largest ``/register`` body read (a registration lists the page ids of a prompt of
up to a million tokens at page size 1); a larger one gets a 413, unread."""
MAX_STATUS_ROOMS = 16384
"""The most rooms one ``/status`` asks for, and the most it names taken (the client asks
in slices of this many)."""
MAX_SMALL_BYTES = 64 + 2 * 24 * MAX_STATUS_ROOMS
"""The largest ``/status`` or ``/abort`` body read; a larger one gets a 413, unread."""
INSTANCE_HEADER = "X-Hicache-Instance"
"""The header naming the prefill instance (its bootstrap server's start) on every answer."""


@dataclass(frozen=True, slots=True)
class Refused:
    """A registration the prefill side refused: ``why``; ``mismatch``: the pair's
    layouts differ; ``busy``: the client holds too many open rooms (nothing changed);
    else the room is in use or was used."""

    why: str
    mismatch: bool = False
    busy: bool = False


def _healthy() -> str | None:
    return None


class PrefillRooms:
    """A prefill instance's rooms, thread-safe; see the module docstring. ``layout``: the
    instance's own, checked against each registration's."""

    def __init__(
        self,
        layout: InstanceLayout,
        *,
        timeout_s: float,
        closed_ttl_s: float,
        work_timeout_s: float = 300.0,
        max_rooms_per_client: int = 4096,
    ) -> None:
        self.layout = layout
        self.max_rooms_per_client = max_rooms_per_client
        self._table = RoomTable(
            timeout_s=timeout_s, closed_ttl_s=closed_ttl_s, work_timeout_s=work_timeout_s
        )
        self._cond = threading.Condition()
        self.health: Callable[[], str | None] = _healthy
        """Why the instance cannot serve its rooms now (a rank frozen or gone), or None:
        the engine sets it once started. While it says why, ``/register`` and
        ``/status`` answer 503 (the decode side counts it against its health bound)."""

    def claim(self, room: int) -> str | None:
        """The prefill request of ``room`` arrived; None, or why it is refused."""
        with self._cond:
            return self._table.claim(room, time.monotonic())

    def register(self, registration: Registration, client: str = "") -> Refused | None:
        """The decode side's pages of a room, from ``client`` (its address); None when
        accepted, else why they are refused (``client`` holds ``max_rooms_per_client``
        open rooms already: nothing changes; the layouts differ: the room fails on both
        sides; the room is in use or was used)."""
        with self._cond:
            busy = self._busy(client)
        if busy is not None:
            return busy
        try:
            check_pair(self.layout, registration.layout)
        except LayoutMismatch as exc:
            # the room is used up: its prefill request fails too, refused as the decode
            # side's is (the same status on both sides, whichever came first)
            mismatch = Failure(str(exc), FailureKind.REFUSED)
            with self._cond:
                self._table.claim(registration.room, time.monotonic())
                self._table.close(registration.room, time.monotonic(), error=mismatch)
                self._cond.notify_all()
            return Refused(str(exc), mismatch=True)
        with self._cond:
            busy = self._busy(client)
            if busy is not None:
                return busy
            why = self._table.register(registration, time.monotonic(), client)
            self._cond.notify_all()
            return None if why is None else Refused(why)

    def registered(self, room: int) -> bool:
        """Whether the decode side has registered ``room``'s pages, or the room is
        closed (nothing more will come for it)."""
        with self._cond:
            return self._table.registered(room)

    def registration(self, room: int) -> Registration | None:
        """``room``'s registration while it is open (None before, and once closed)."""
        with self._cond:
            return self._table.registration(room)

    def _busy(self, client: str) -> Refused | None:
        held = self._table.open_rooms_of(client)
        if held < self.max_rooms_per_client:
            return None
        return Refused(
            f"{client or 'this client'} holds {held} open rooms already"
            f" (--disaggregation-max-rooms-per-client {self.max_rooms_per_client}); retry"
            " when one has ended",
            busy=True,
        )

    def start(self, room: int) -> Registration | None:
        """``room``'s registration, the room moved to ``TRANSFERRING``; None while there
        is none (see :meth:`RoomTable.start`)."""
        with self._cond:
            return self._table.start(room, time.monotonic())

    def abort(self, room: int, why: str) -> bool:
        """The decode side gives ``room`` up; whether it is closed now."""
        with self._cond:
            closed = self._table.abort(room, why, time.monotonic())
            self._cond.notify_all()
            return closed

    def aborted(self, room: int) -> bool:
        with self._cond:
            return self._table.aborted(room)

    def close(
        self, room: int, *, result: RoomResult | None = None, error: str | None = None
    ) -> None:
        """End ``room`` (see :meth:`RoomTable.close`)."""
        with self._cond:
            self._table.close(room, time.monotonic(), result=result, error=error)
            self._cond.notify_all()

    def poll(
        self, rooms: Sequence[int], wait_s: float, taken: Sequence[int] = ()
    ) -> list[RoomStatus | None]:
        """The decode side's poll: the rooms whose pages it took (:meth:`RoomTable.take`),
        arm ``rooms`` (:meth:`RoomTable.arm`), then :meth:`status`."""
        with self._cond:
            for r in taken:
                self._table.take(r)
            if [r for r in rooms if self._table.arm(r)] or taken:
                self._cond.notify_all()
        return self.status(rooms, wait_s)

    def taken(self, room: int) -> bool:
        with self._cond:
            return self._table.taken(room)

    def status(self, rooms: Sequence[int], wait_s: float = 0.0) -> list[RoomStatus | None]:
        """Each room's status, once one of them is closed or ``wait_s`` has passed.
        Under the lock: one read of the rooms asked, then, on each wake, only the rooms
        closed since (:meth:`RoomTable.closed_since`), and one read at the end."""
        deadline = time.monotonic() + max(0.0, min(wait_s, MAX_WAIT_S))
        with self._cond:
            got = [self._table.status(r) for r in rooms]
            if any(s is not None and s.state.closed for s in got):
                return got
            asked: set[int] | None = None
            seen = self._table.closes
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
                if self._table.closes == seen:
                    continue  # only a close can end the wait
                closed = self._table.closed_since(seen)
                seen = self._table.closes
                if asked is None:
                    asked = set(rooms)
                if closed is None or not asked.isdisjoint(closed):
                    break
            return [self._table.status(r) for r in rooms]

    def poke(self) -> None:
        """Wake whoever waits in :meth:`wait` (new work for the sender)."""
        with self._cond:
            self._cond.notify_all()

    def wait(self, timeout_s: float) -> None:
        """Block until a room changes or ``timeout_s`` passes (the sender's idle wait)."""
        with self._cond:
            self._cond.wait(timeout_s)

    def expire(self) -> list[int]:
        """Fail the rooms whose other side never came; returns them."""
        with self._cond:
            failed = self._table.expire(time.monotonic())
            if failed:
                self._cond.notify_all()
            return failed

    def __len__(self) -> int:
        with self._cond:
            return len(self._table)


class BootstrapServer:
    """The HTTP side of :class:`PrefillRooms`, on ``host:port`` (its own thread). OSError
    from the constructor when the port cannot be bound (in use, or not local). ``key``:
    when set, every route but ``/health`` needs ``Authorization: Bearer <key>`` (401
    before the body is read, and nothing changes)."""

    def __init__(
        self, rooms: PrefillRooms, host: str, port: int, *, key: str | None = None
    ) -> None:
        if key is not None and not key:
            raise ValueError("key='' is invalid; an empty key would let anyone in")
        self.rooms = rooms
        self.instance = uuid.uuid4().hex
        """This server's id, on every answer (:data:`INSTANCE_HEADER`)."""
        self._stopped = threading.Event()
        handler = _handler(rooms, self._stopped, key, self.instance)
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="hicache-bootstrap",
            daemon=True,
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop serving and release the port; idempotent. Connections still open get a 503
        and are closed from then on."""
        self._stopped.set()
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()


class _Refuse(Exception):
    """An answer other than 200, and whether the connection must close (a body unread)."""

    def __init__(self, status: int, why: str, *, unread: bool = False) -> None:
        super().__init__(why)
        self.status = status
        self.unread = unread


def _handler(
    rooms: PrefillRooms, stopped: threading.Event, key: str | None, instance: str
) -> type[BaseHTTPRequestHandler]:
    expected = None if key is None else f"Bearer {key}".encode()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # headers and body go out as two writes: without this, Nagle's algorithm holds
            # the body until the client's delayed ACK of the headers (~40 ms a reply)
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("bootstrap: " + format, *args)

        def _send(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header(INSTANCE_HEADER, instance)
            self.end_headers()
            self.wfile.write(data)

        def _authorize(self) -> None:
            if expected is None:
                return
            given = (self.headers.get("Authorization") or "").encode()
            if not hmac.compare_digest(given, expected):
                raise _Refuse(
                    401,
                    "the bootstrap server needs the pair's key (Authorization: Bearer; the"
                    " same --api-key or --disaggregation-bootstrap-key on both instances)",
                    unread=True,
                )

        def _body(self, limit: int) -> Any:
            text = self.headers.get("Content-Length")
            if text is None or not text.strip().isdigit():
                raise _Refuse(411, "a body needs its Content-Length", unread=True)
            n = int(text)
            if n > limit:
                raise _Refuse(
                    413, f"a body of {n} bytes is too large here ({limit} at most)", unread=True
                )
            if n == 0:
                raise ValueError("the body is empty")
            return json.loads(self.rfile.read(n))

        def _stopped(self) -> bool:
            if stopped.is_set():
                self.close_connection = True
                self._send(503, {"error": "the prefill instance is stopping"})
                return True
            return False

        def _refuse(self, exc: _Refuse) -> None:
            if exc.unread:
                self.close_connection = True  # the body is not read: the stream is lost
            self._send(exc.status, {"error": str(exc)})

        def do_GET(self) -> None:
            if self._stopped():
                return
            try:
                if self.path == "/health":
                    self._send(200, {"ok": True})
                elif self.path == "/layout":
                    self._authorize()
                    self._send(200, rooms.layout.to_json())
                else:
                    self._send(404, {"error": f"no route {self.path}"})
            except _Refuse as exc:
                self._refuse(exc)

        def do_POST(self) -> None:
            if self._stopped():
                return
            try:
                if self.path not in ("/register", "/status", "/abort"):
                    raise _Refuse(404, f"no route {self.path}", unread=True)
                self._authorize()
                why = None if self.path == "/abort" else rooms.health()
                if why is not None:  # the decode side counts it as an unanswered poll
                    raise _Refuse(503, f"the prefill instance is unhealthy: {why}", unread=True)
                if self.path == "/register":
                    body = self._body(MAX_REGISTER_BYTES)
                    registration = Registration.from_json(body)
                    refused = rooms.register(registration, self.client_address[0])
                    if refused is None:
                        self._send(200, {"ok": True})
                    else:
                        status = 429 if refused.busy else 400 if refused.mismatch else 409
                        self._send(status, {"error": refused.why})
                elif self.path == "/status":
                    body = self._body(MAX_SMALL_BYTES)
                    asked, taken = body["rooms"], body.get("taken", [])
                    for name, rs in (("rooms", asked), ("taken", taken)):
                        if not isinstance(rs, list) or len(rs) > MAX_STATUS_ROOMS:
                            raise ValueError(f"{name} must be a list of at most {MAX_STATUS_ROOMS}")
                    got = rooms.poll(
                        [int(r) for r in asked],
                        float(body.get("wait_s", 0)),
                        [int(r) for r in taken],
                    )
                    self._send(200, {"rooms": [None if s is None else s.to_json() for s in got]})
                else:
                    body = self._body(MAX_SMALL_BYTES)
                    closed = rooms.abort(int(body["room"]), str(body.get("why", "aborted")))
                    self._send(200, {"closed": closed})
            except _Refuse as exc:
                self._refuse(exc)
            except (KeyError, TypeError, ValueError) as exc:
                self._send(400, {"error": f"{type(exc).__name__}: {exc}"})

    return Handler
