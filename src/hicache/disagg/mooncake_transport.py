"""A :class:`~hicache.disagg.transport.Transport` over Mooncake's transfer engine:
:class:`MooncakeTransport`.

Peer to peer without a metadata server (``P2PHANDSHAKE``): a peer's
:attr:`~MooncakeTransport.endpoint` is ``"host:rpc_port"`` (its handshake server); data
moves over the engine's TCP transport (RDMA where NICs have it). Security: the engine
listens on two TCP ports on every interface whatever ``host`` is (``MC_TCP_BIND_ADDRESS``
does not change them), so anyone reaching the host can write into the registered regions:
run it on a trusted network (``docs/security.md``). Invariants: a write submits one
transfer per span and polls them until all are done, one fails or ``timeout_s`` passes; a
peer is probed (``send_probe``, on a helper thread, one per peer) before the first write's
handshake, so a frozen peer fails the write at its deadline; transfers left running when a
write gives up are polled by :meth:`~MooncakeTransport.quiet` until each ends, so a room
closes only once none can land. The flow: ``docs/architecture.md``, "Transports".
"""

from __future__ import annotations

import bisect
import ipaddress
import threading
import time
from collections.abc import Sequence
from typing import Any

from hicache.disagg.transport import Region, Span, TransferFailed, Transport, TransportUnavailable

__all__ = ["MooncakeTransport", "parse_endpoint"]

_BAD_IDS = (0, -1, 2**64 - 1)
"""What ``transfer_submit_write`` returns when it could not submit (the binding's
``batch_id_t`` is unsigned: -1 comes back as 2**64 - 1, and 0 is never a live batch)."""
_DONE, _PENDING, _FAILED, _TIMEOUT = 1, 0, -1, -2
"""``transfer_check_status`` answers."""
_POLL_MAX_S = 0.001
"""The longest sleep between two polls of a write's pending transfers."""


class _Probe:
    """``engine.send_probe(peer)`` on a daemon thread: :meth:`wait` for its return code.

    The thread holds a reference to the engine, so the engine outlives a probe that is
    still blocked when the transport closes."""

    def __init__(self, engine: Any, peer: str) -> None:
        self._done = threading.Event()
        self.rc: int | None = None
        self._thread = threading.Thread(
            target=self._run, args=(engine, peer), name=f"mooncake-probe-{peer}", daemon=True
        )
        self._thread.start()

    def _run(self, engine: Any, peer: str) -> None:
        try:
            self.rc = int(engine.send_probe(peer))
        finally:
            self._done.set()

    def wait(self, timeout_s: float) -> int | None:
        """The probe's return code (0: the peer answered), or None if it is still waiting."""
        self._done.wait(max(0.0, timeout_s))
        return self.rc if self._done.is_set() else None


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"a.b.c.d:port"`` as ``(address, port)``; ValueError saying what is wrong."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"endpoint {endpoint!r} is not 'IPv4address:port'")
    try:
        addr = ipaddress.IPv4Address(host)
    except ValueError:
        raise ValueError(f"endpoint {endpoint!r}: {host!r} is not an IPv4 address") from None
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"endpoint {endpoint!r}: port {port} is out of [1, 65535]")
    return str(addr), int(port)


class MooncakeTransport(Transport):
    """Mooncake's transfer engine, told to peers as ``host`` (an IPv4 address).

    Starts the engine at construction (:class:`TransportUnavailable` when the package is
    missing or the engine does not start); see the module docstring for what it listens
    on and how a write is bounded.
    """

    name = "mooncake"

    def __init__(self, host: str, *, protocol: str = "tcp") -> None:
        try:
            addr = ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"host={host!r} is invalid; must be an IPv4 address") from None
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise TransportUnavailable(
                "the mooncake transfer backend needs Mooncake's transfer engine: "
                "pip install mooncake-transfer-engine-non-cuda (or mooncake-transfer-engine "
                f"on CUDA hosts), and apt-get install libibverbs1 ({e})"
            ) from e
        self._engine: Any = TransferEngine()
        rc = self._engine.initialize(str(addr), "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise TransportUnavailable(
                f"Mooncake's transfer engine did not start at {addr} "
                f"(protocol {protocol!r}, peer-to-peer handshake): initialize returned {rc}"
            )
        self._endpoint = f"{addr}:{self._engine.get_rpc_port()}"
        self._starts: list[int] = []  # registered regions, sorted by address
        self._ends: list[int] = []
        self._registered: list[int] = []
        self._reached: set[str] = set()  # peers that answered a probe
        self._probes: dict[str, _Probe] = {}  # probes still out
        self._unsettled: dict[str, list[int]] = {}  # transfers a failed write left running
        self._closed = False

    @property
    def endpoint(self) -> str:
        """``"host:rpc_port"``: the engine's handshake server."""
        return self._endpoint

    def register(self, regions: Sequence[Region]) -> None:
        """Register each region with the engine (host RAM as ``*``, device memory as
        ``cuda:N``); RuntimeError naming the region the engine refused."""
        self._check_open()
        for r in regions:
            if r.nbytes <= 0:
                raise ValueError(f"{r}: nbytes must be > 0")
            location = f"cuda:{r.device}" if r.cuda else "*"
            rc = self._engine.register_memory(r.addr, r.nbytes, location)
            if rc != 0:
                raise RuntimeError(f"Mooncake refused to register {r} (returned {rc})")
            self._registered.append(r.addr)
            i = bisect.bisect(self._starts, r.addr)
            self._starts.insert(i, r.addr)
            self._ends.insert(i, r.addr + r.nbytes)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the mooncake transport is closed")

    def _check_local(self, span: Span) -> None:
        i = bisect.bisect(self._starts, span.src) - 1
        if span.nbytes <= 0 or i < 0 or span.src + span.nbytes > self._ends[i]:
            raise ValueError(f"{span}: the source is not inside one registered region")

    def write(self, peer: str, spans: Sequence[Span], timeout_s: float) -> None:
        """Write every span to ``peer`` (a :attr:`endpoint`); see the module docstring.

        :class:`TransferFailed` for a malformed ``peer``, a peer that cannot be reached or
        refuses a transfer, or the deadline passing; ValueError for a span whose source is
        not in a registered region."""
        self._check_open()
        try:
            parse_endpoint(peer)
        except ValueError as e:
            raise TransferFailed(f"mooncake: bad peer {e}") from None
        for s in spans:
            self._check_local(s)
        if not spans:
            return
        deadline = time.monotonic() + timeout_s
        total = sum(s.nbytes for s in spans)
        what = f"mooncake: writing {len(spans)} spans ({total} bytes) to {peer}"
        if peer not in self._reached:
            self._reach(peer, deadline, what, timeout_s)
        pending: list[int] = []
        try:
            for s in spans:
                bid = self._engine.transfer_submit_write(peer, s.src, s.dst, s.nbytes)
                if bid in _BAD_IDS:
                    raise TransferFailed(
                        f"{what}: the engine could not submit {s} (peer unreachable, or the "
                        "destination is not in its registered memory)"
                    )
                pending.append(bid)
            self._wait(pending, deadline, what, len(spans), timeout_s)
        except TransferFailed:
            self._unsettled.setdefault(peer, []).extend(self._running(pending))
            raise

    def _running(self, ids: list[int]) -> list[int]:
        """Those of ``ids`` still running (the others' records are freed by the poll)."""
        return [bid for bid in ids if self._engine.transfer_check_status(bid) == _PENDING]

    def quiet(self, peer: str, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the transfers a failed write to ``peer`` left
        running to end; whether none is left."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = self._unsettled.get(peer)
            if not left:
                self._unsettled.pop(peer, None)
                return True
            self._unsettled[peer] = self._running(left)
            if self._unsettled[peer] and time.monotonic() >= deadline:
                return False
            if self._unsettled[peer]:
                time.sleep(_POLL_MAX_S)

    def _wait(
        self, pending: list[int], deadline: float, what: str, count: int, timeout_s: float
    ) -> None:
        """Poll ``pending`` (each submitted write's ids, emptied as they end) until every
        one is done; TransferFailed when one fails or at ``deadline``."""
        pause = 0.0
        while pending:
            still: list[int] = []
            for i, bid in enumerate(pending):
                st = self._engine.transfer_check_status(bid)
                if st == _PENDING:
                    still.append(bid)
                elif st != _DONE:
                    pending[:] = still + pending[i + 1 :]
                    why = "timed out in the engine" if st == _TIMEOUT else "failed"
                    raise TransferFailed(f"{what}: a transfer {why} (peer gone or refused it)")
            pending[:] = still
            if not pending:
                return
            now = time.monotonic()
            if now >= deadline:
                raise TransferFailed(
                    f"{what}: {len(pending)} of {count} transfers still running after "
                    f"{timeout_s:g} s"
                )
            pause = min(_POLL_MAX_S, pause * 2 or 0.00005, deadline - now)
            time.sleep(pause)

    def _reach(self, peer: str, deadline: float, what: str, timeout_s: float) -> None:
        """Probe ``peer`` (or wait on the probe already out) until ``deadline``."""
        probe = self._probes.get(peer)
        if probe is None:
            probe = self._probes[peer] = _Probe(self._engine, peer)
        rc = probe.wait(deadline - time.monotonic())
        if rc is None:
            raise TransferFailed(f"{what}: the peer did not answer a probe within {timeout_s:g} s")
        del self._probes[peer]
        if rc != 0:
            raise TransferFailed(
                f"{what}: the peer does not answer (probe returned {rc}: nothing listens "
                "there, or it is not a Mooncake transfer engine)"
            )
        self._reached.add(peer)

    def close(self) -> None:
        """Unregister every region and stop the engine (its listeners close); idempotent."""
        if self._closed:
            return
        self._closed = True
        for addr in self._registered:
            self._engine.unregister_memory(addr)
        self._registered.clear()
        self._probes.clear()  # a probe still out keeps the engine alive until it returns
        self._starts.clear()
        self._ends.clear()
        self._engine = None  # the binding's destructor stops the engine

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._registered)} regions"
        return f"MooncakeTransport(endpoint={self._endpoint!r}, {state})"
