"""The decode side's client of a prefill instance's bootstrap server.

One :class:`BootstrapClient` per prefill instance, used by one thread; every call raises
:class:`BootstrapUnreachable` when the server does not answer in time. The routes and
their bounds: :mod:`hicache.disagg.bootstrap`.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

import httpx

from hicache.disagg.bootstrap import INSTANCE_HEADER, MAX_STATUS_ROOMS
from hicache.disagg.layout import Registration
from hicache.disagg.rooms import RoomStatus
from hicache.failures import Failure, FailureKind

__all__ = ["BootstrapClient", "BootstrapUnreachable"]


class BootstrapUnreachable(ConnectionError):
    """The prefill instance's bootstrap server did not answer; :attr:`failure` says so
    as a request's error: :attr:`~hicache.failures.FailureKind.REFUSED` when its host
    name does not resolve (the request named a bogus address), else
    :attr:`~hicache.failures.FailureKind.PEER_TIMEOUT`. ``refused``: nothing listens on
    its port (the connection was refused, not left unanswered)."""

    def __init__(self, message: str, *, unknown_host: bool = False, refused: bool = False) -> None:
        super().__init__(message)
        kind = FailureKind.REFUSED if unknown_host else FailureKind.PEER_TIMEOUT
        self.failure = Failure(message, kind)
        self.refused = refused


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

    def __init__(
        self, host: str, port: int, timeout_s: float = 5.0, *, key: str | None = None
    ) -> None:
        self.address = f"{host}:{port}"
        self._host = host
        self.instance: str | None = None
        """The instance id of the last answer (:data:`INSTANCE_HEADER`); None before one."""
        self._timeout_s = timeout_s
        nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]  # a body follows its headers
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        self._http = httpx.Client(
            base_url=f"http://{self.address}",
            timeout=timeout_s,
            headers=headers,
            transport=httpx.HTTPTransport(socket_options=nodelay),
        )

    def _post(self, path: str, body: object, extra_s: float = 0.0) -> httpx.Response:
        try:
            r = self._http.post(path, json=body, timeout=self._timeout_s + extra_s)
        except httpx.HTTPError as exc:
            if _unknown_host(exc):
                raise BootstrapUnreachable(
                    f"bootstrap_host {self._host!r} does not resolve to an address ({exc})",
                    unknown_host=True,
                ) from None
            raise BootstrapUnreachable(
                f"the prefill instance's bootstrap server at {self.address} did not answer"
                f" within {self._timeout_s + extra_s:g} s ({type(exc).__name__}: {exc})",
                refused=_refused(exc),
            ) from None
        self.instance = r.headers.get(INSTANCE_HEADER, self.instance)
        return r

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

    def status(
        self, rooms: Sequence[int], wait_s: float, taken: Sequence[int] = ()
    ) -> list[RoomStatus | None]:
        """Each room's status (a long poll of at most ``wait_s``, on the first
        :data:`MAX_STATUS_ROOMS` of them; the rest are read at once); ``taken``: rooms
        whose pages this side took since the last poll."""
        out: list[RoomStatus | None] = []
        for i in range(0, max(1, len(rooms), len(taken)), MAX_STATUS_ROOMS):
            wait = wait_s if i == 0 else 0.0
            body = {
                "rooms": list(rooms[i : i + MAX_STATUS_ROOMS]),
                "wait_s": wait,
                "taken": list(taken[i : i + MAX_STATUS_ROOMS]),
            }
            r = self._post("/status", body, extra_s=wait)
            if r.status_code != 200:
                raise BootstrapUnreachable(
                    f"{self.address}/status answered {r.status_code}: {_error_of(r)}"
                )
            out += [None if s is None else RoomStatus.from_json(s) for s in r.json()["rooms"]]
        return out

    def abort(self, room: int, why: str) -> bool:
        """Give ``room`` up; whether the prefill side has closed it (no write follows)."""
        r = self._post("/abort", {"room": room, "why": why})
        return r.status_code == 200 and bool(r.json().get("closed"))

    def close(self) -> None:
        self._http.close()


def _refused(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a refused connection."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return isinstance(exc, httpx.ConnectError) and "refused" in str(exc).lower()


def _error_of(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {r.status_code}: {r.text[:200]}"
