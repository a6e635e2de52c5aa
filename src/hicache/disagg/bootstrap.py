"""The bootstrap server of a prefill instance and its client on the decode side.

The router gives each request a room and sends it to both instances; it never talks to
this port. The decode side does, over plain HTTP with JSON bodies:

=========================  ==============================================================
``GET /health``            ``{"ok": true}``: the prefill instance is up
``GET /layout``            its :class:`~hicache.disagg.layout.InstanceLayout`
``POST /register``         a :class:`~hicache.disagg.layout.Registration`: 200, or 409
                           (the room is in use or was used) / 400 (a layout mismatch, a
                           body that cannot be read) with ``{"error": why}``
``POST /status``           ``{"rooms": [n, ...], "wait_s": s}``: each room's
                           :class:`~hicache.disagg.rooms.RoomStatus`, answered as soon as
                           one of them is closed or after ``wait_s`` (at most 1 s): a
                           long poll, also the decode side's health check of the prefill
``POST /abort``            ``{"room": n, "why": text}``: the decode side gives the room
                           up; ``{"closed": bool}``: False while the sender is still
                           writing (it stops, and the room closes ``ABORTED``)
=========================  ==============================================================

:class:`PrefillRooms` is the room table (:class:`~hicache.disagg.rooms.RoomTable`) under
one lock and condition, shared by the server's handler threads, the engine thread (a
request's claim) and the sender (:mod:`hicache.disagg.sender`).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from hicache.disagg.layout import InstanceLayout, LayoutMismatch, Registration, check_pair
from hicache.disagg.rooms import RoomResult, RoomStatus, RoomTable
from hicache.failures import Failure, FailureKind

log = logging.getLogger(__name__)

__all__ = ["BootstrapClient", "BootstrapServer", "BootstrapUnreachable", "PrefillRooms", "Refused"]

MAX_WAIT_S = 1.0
"""The longest a ``/status`` long poll waits."""
MAX_BODY_BYTES = 16 << 20
"""The largest body the bootstrap server reads (a registration lists page ids)."""


@dataclass(frozen=True, slots=True)
class Refused:
    """A registration the prefill side refused: ``why``; ``mismatch``: the pair's
    layouts differ (else the room is in use or was used)."""

    why: str
    mismatch: bool = False


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
    ) -> None:
        self.layout = layout
        self._table = RoomTable(
            timeout_s=timeout_s, closed_ttl_s=closed_ttl_s, work_timeout_s=work_timeout_s
        )
        self._cond = threading.Condition()

    def claim(self, room: int) -> str | None:
        """The prefill request of ``room`` arrived; None, or why it is refused."""
        with self._cond:
            return self._table.claim(room, time.monotonic())

    def register(self, registration: Registration) -> Refused | None:
        """The decode side's pages of a room; None when accepted, else why they are
        refused (the layouts differ: the room fails on both sides; the room is in use or
        was used)."""
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
            why = self._table.register(registration, time.monotonic())
            self._cond.notify_all()
            return None if why is None else Refused(why)

    def registered(self, room: int) -> bool:
        """Whether the decode side has registered ``room``'s pages, or the room is
        closed (nothing more will come for it)."""
        with self._cond:
            return self._table.registered(room)

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

    def status(self, rooms: Sequence[int], wait_s: float = 0.0) -> list[RoomStatus | None]:
        """Each room's status, once one of them is closed or ``wait_s`` has passed."""
        deadline = time.monotonic() + max(0.0, min(wait_s, MAX_WAIT_S))
        with self._cond:
            while True:
                got = [self._table.status(r) for r in rooms]
                left = deadline - time.monotonic()
                if left <= 0 or any(s is not None and s.state.closed for s in got):
                    return got
                self._cond.wait(left)

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
    from the constructor when the port cannot be bound (in use, or not local)."""

    def __init__(self, rooms: PrefillRooms, host: str, port: int) -> None:
        self.rooms = rooms
        self._stopped = threading.Event()
        handler = _handler(rooms, self._stopped)
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


def _handler(rooms: PrefillRooms, stopped: threading.Event) -> type[BaseHTTPRequestHandler]:
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
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> Any:
            n = int(self.headers.get("Content-Length") or 0)
            if not 0 < n <= MAX_BODY_BYTES:
                raise ValueError(f"a body of {n} bytes (1 to {MAX_BODY_BYTES} accepted)")
            return json.loads(self.rfile.read(n))

        def _stopped(self) -> bool:
            if stopped.is_set():
                self.close_connection = True
                self._send(503, {"error": "the prefill instance is stopping"})
                return True
            return False

        def do_GET(self) -> None:
            if self._stopped():
                return
            if self.path == "/health":
                self._send(200, {"ok": True})
            elif self.path == "/layout":
                self._send(200, rooms.layout.to_json())
            else:
                self._send(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:
            if self._stopped():
                return
            try:
                body = self._body()
                if self.path == "/register":
                    refused = rooms.register(Registration.from_json(body))
                    if refused is None:
                        self._send(200, {"ok": True})
                    else:
                        self._send(400 if refused.mismatch else 409, {"error": refused.why})
                elif self.path == "/status":
                    got = rooms.status(
                        [int(r) for r in body["rooms"]], float(body.get("wait_s", 0))
                    )
                    self._send(200, {"rooms": [None if s is None else s.to_json() for s in got]})
                elif self.path == "/abort":
                    closed = rooms.abort(int(body["room"]), str(body.get("why", "aborted")))
                    self._send(200, {"closed": closed})
                else:
                    self._send(404, {"error": f"no route {self.path}"})
            except (KeyError, TypeError, ValueError) as exc:
                self._send(400, {"error": f"{type(exc).__name__}: {exc}"})

    return Handler


class BootstrapUnreachable(ConnectionError):
    """The prefill instance's bootstrap server did not answer; :attr:`failure` says so
    as a request's error: :attr:`~hicache.failures.FailureKind.REFUSED` when its host
    name does not resolve (the request named a bogus address), else
    :attr:`~hicache.failures.FailureKind.PEER_TIMEOUT`."""

    def __init__(self, message: str, *, unknown_host: bool = False) -> None:
        super().__init__(message)
        kind = FailureKind.REFUSED if unknown_host else FailureKind.PEER_TIMEOUT
        self.failure = Failure(message, kind)


def _unknown_host(exc: BaseException) -> bool:
    """Whether ``exc`` (an httpx error) comes from a host name that does not resolve."""
    unknown = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}
    seen: BaseException | None = exc
    for _ in range(8):  # the cause chain: httpx -> httpcore -> socket.gaierror
        if seen is None:
            return False
        if isinstance(seen, socket.gaierror) and seen.errno in unknown:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class BootstrapClient:
    """The decode side's calls to one prefill instance's bootstrap server at
    ``host:port`` (one thread uses it). Every call raises :class:`BootstrapUnreachable`
    when the server does not answer within ``timeout_s`` (plus the long poll's wait)."""

    def __init__(self, host: str, port: int, timeout_s: float = 5.0) -> None:
        self.address = f"{host}:{port}"
        self._host = host
        self._timeout_s = timeout_s
        nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]  # a body follows its headers
        self._http = httpx.Client(
            base_url=f"http://{self.address}",
            timeout=timeout_s,
            transport=httpx.HTTPTransport(socket_options=nodelay),
        )

    def _post(self, path: str, body: object, extra_s: float = 0.0) -> httpx.Response:
        try:
            return self._http.post(path, json=body, timeout=self._timeout_s + extra_s)
        except httpx.HTTPError as exc:
            if _unknown_host(exc):
                raise BootstrapUnreachable(
                    f"bootstrap_host {self._host!r} does not resolve to an address ({exc})",
                    unknown_host=True,
                ) from None
            raise BootstrapUnreachable(
                f"the prefill instance's bootstrap server at {self.address} did not answer"
                f" within {self._timeout_s + extra_s:g} s ({type(exc).__name__}: {exc})"
            ) from None

    def register(self, registration: Registration) -> Failure | None:
        """Register a room's pages; None when accepted, else the prefill side's refusal:
        :attr:`~hicache.failures.FailureKind.REFUSED` for the room (in use, used, or a
        layout mismatch: 409 or 400), else
        :attr:`~hicache.failures.FailureKind.PEER_FAILED` (it is stopping, or answered
        something else)."""
        r = self._post("/register", registration.to_json())
        if r.status_code == 200:
            return None
        kind = FailureKind.REFUSED if r.status_code in (400, 409) else FailureKind.PEER_FAILED
        return Failure(f"the prefill instance refused the room: {_error_of(r)}", kind)

    def status(self, rooms: Sequence[int], wait_s: float) -> list[RoomStatus | None]:
        """Each room's status (a long poll of at most ``wait_s``)."""
        r = self._post("/status", {"rooms": list(rooms), "wait_s": wait_s}, extra_s=wait_s)
        if r.status_code != 200:
            raise BootstrapUnreachable(
                f"{self.address}/status answered {r.status_code}: {_error_of(r)}"
            )
        return [None if s is None else RoomStatus.from_json(s) for s in r.json()["rooms"]]

    def abort(self, room: int, why: str) -> bool:
        """Give ``room`` up; whether the prefill side has closed it (no write follows)."""
        r = self._post("/abort", {"room": room, "why": why})
        return r.status_code == 200 and bool(r.json().get("closed"))

    def close(self) -> None:
        self._http.close()


def _error_of(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {r.status_code}: {r.text[:200]}"
