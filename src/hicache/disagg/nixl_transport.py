"""A :class:`~hicache.disagg.transport.Transport` over NIXL's UCX backend:
:class:`NixlTransport`.

One NIXL agent with the UCX backend per instance, no metadata listener: peers learn of
each other only through :attr:`~NixlTransport.endpoint`, ASCII ``"nixl1:"`` + base64 of a
JSON object (the agent's metadata, base64 again, and the registered regions: address,
bytes, CUDA or not, device); read it after :meth:`~NixlTransport.register`. Invariants: a
write posts one transfer per pair of memory types and polls until every one is done, one
fails or the deadline passes, then releases the handles; a handle NIXL will not release
yet is kept and released by :meth:`~NixlTransport.quiet`, which the sender waits on before
it closes the room. UCX listens on every interface's address (``UCX_NET_DEVICES=lo`` before
the agent starts leaves only loopback). The flow: ``docs/architecture.md``, "Transports".
"""

from __future__ import annotations

import base64
import binascii
import bisect
import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hicache.disagg.transport import Region, Span, TransferFailed, Transport, TransportUnavailable

__all__ = ["NixlTransport"]

_PREFIX = "nixl1:"
_POLL_MAX_S = 0.001
"""The longest sleep between two polls of a write's transfers."""


def _mem(cuda: bool) -> str:
    return "VRAM" if cuda else "DRAM"


@dataclass(frozen=True, slots=True)
class _Peer:
    """A loaded remote agent: its name and its registered regions, sorted by address."""

    name: str
    starts: tuple[int, ...]
    regions: tuple[Region, ...]

    def region_of(self, addr: int, nbytes: int) -> Region | None:
        i = bisect.bisect(self.starts, addr) - 1
        if i < 0:
            return None
        r = self.regions[i]
        return r if addr + nbytes <= r.addr + r.nbytes else None


def _decode_endpoint(endpoint: str) -> tuple[bytes, list[Region]]:
    """``(metadata, regions)`` of an endpoint; ValueError saying what is wrong."""
    if not endpoint.startswith(_PREFIX):
        raise ValueError(f"it does not start with {_PREFIX!r}: {endpoint[:40]!r}")
    try:
        doc = json.loads(base64.b64decode(endpoint[len(_PREFIX) :], validate=True))
        md = base64.b64decode(doc["md"], validate=True)
        regions = [Region(int(a), int(n), bool(c), int(d)) for a, n, c, d in doc["regions"]]
    except (binascii.Error, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"it is not a NIXL endpoint ({type(e).__name__}: {e})") from None
    return md, regions


class NixlTransport(Transport):
    """A NIXL agent named ``name`` (unique among the agents that talk to it) with the UCX
    backend; :class:`TransportUnavailable` when NIXL or its UCX plugin is missing. See the
    module docstring."""

    name = "nixl"

    def __init__(self, name: str) -> None:
        if not name or not name.isprintable():
            raise ValueError(f"name={name!r} is invalid; must be a non-empty printable string")
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise TransportUnavailable(
                "the nixl transfer backend needs NIXL: pip install -r requirements/nixl.txt "
                f"(nixl and nixl-cu12, --no-deps) ({e})"
            ) from e
        try:
            agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        except Exception as e:  # the binding raises its own exception types
            raise TransportUnavailable(f"NIXL agent {name!r} did not start: {e}") from e
        if "UCX" not in agent.backends:
            raise TransportUnavailable(
                f"NIXL has no UCX plugin here (plugins: {agent.get_plugin_list()})"
            )
        self.agent_name = name
        self._agent: Any = agent
        self._regions: list[Region] = []  # sorted by address
        self._starts: list[int] = []
        self._reg_descs: list[Any] = []
        self._peers: dict[str, _Peer] = {}
        self._unsettled: dict[str, list[Any]] = {}  # handles a failed write could not release
        self._endpoint: str | None = None
        self._closed = False

    def register(self, regions: Sequence[Region]) -> None:
        """Register each region with UCX (``DRAM`` for host RAM, ``VRAM`` for CUDA memory);
        RuntimeError naming the region NIXL refused."""
        self._check_open()
        for r in regions:
            if r.nbytes <= 0:
                raise ValueError(f"{r}: nbytes must be > 0")
            try:
                descs = self._agent.register_memory(
                    [(r.addr, r.nbytes, r.device, "")], _mem(r.cuda), backends=["UCX"]
                )
            except Exception as e:
                raise RuntimeError(f"NIXL refused to register {r}: {e}") from e
            self._reg_descs.append(descs)
            i = bisect.bisect(self._starts, r.addr)
            self._starts.insert(i, r.addr)
            self._regions.insert(i, r)
        self._endpoint = None

    @property
    def endpoint(self) -> str:
        """``"nixl1:"`` + base64 JSON of the agent metadata and the registered regions."""
        self._check_open()
        if self._endpoint is None:
            md = self._agent.get_agent_metadata()
            doc = {
                "md": base64.b64encode(md).decode("ascii"),
                "regions": [[r.addr, r.nbytes, r.cuda, r.device] for r in self._regions],
            }
            raw = json.dumps(doc, separators=(",", ":")).encode()
            self._endpoint = _PREFIX + base64.b64encode(raw).decode("ascii")
        return self._endpoint

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the nixl transport {self.agent_name!r} is closed")

    def _local_region(self, span: Span) -> Region:
        i = bisect.bisect(self._starts, span.src) - 1
        if span.nbytes > 0 and i >= 0:
            r = self._regions[i]
            if span.src + span.nbytes <= r.addr + r.nbytes:
                return r
        raise ValueError(f"{span}: the source is not inside one registered region")

    def _peer(self, endpoint: str) -> _Peer:
        peer = self._peers.get(endpoint)
        if peer is not None:
            return peer
        try:
            md, regions = _decode_endpoint(endpoint)
        except ValueError as e:
            raise TransferFailed(f"nixl: bad peer endpoint: {e}") from None
        try:
            name = self._agent.add_remote_agent(md)
        except Exception as e:
            raise TransferFailed(f"nixl: cannot load the peer's metadata: {e}") from e
        if isinstance(name, bytes):
            name = name.decode()
        regions.sort(key=lambda r: r.addr)
        peer = _Peer(str(name), tuple(r.addr for r in regions), tuple(regions))
        self._peers[endpoint] = peer
        return peer

    def _forget(self, endpoint: str) -> None:
        """Unload a peer after a failure, so that a later write loads it anew."""
        peer = self._peers.pop(endpoint, None)
        if peer is not None and peer.name not in {p.name for p in self._peers.values()}:
            with contextlib.suppress(Exception):  # already gone, or NIXL refuses: no more to do
                self._agent.remove_remote_agent(peer.name)

    def write(self, peer: str, spans: Sequence[Span], timeout_s: float) -> None:
        """Write every span to ``peer`` (a :attr:`endpoint`); see the module docstring.

        :class:`TransferFailed` for a malformed ``peer``, a destination outside the
        peer's registered regions, a peer that is gone or refuses, or the deadline
        passing; ValueError for a span whose source is not in a registered region."""
        self._check_open()
        local = [self._local_region(s) for s in spans]
        p = self._peer(peer)
        if not spans:
            return
        deadline = time.monotonic() + timeout_s
        total = sum(s.nbytes for s in spans)
        what = f"nixl: writing {len(spans)} spans ({total} bytes) to agent {p.name!r}"
        groups: dict[tuple[bool, int, bool, int], tuple[list[Any], list[Any]]] = {}
        for s, lr in zip(spans, local, strict=True):
            rr = p.region_of(s.dst, s.nbytes)
            if rr is None:
                raise TransferFailed(f"{what}: {s}: the destination is not in the peer's regions")
            src, dst = groups.setdefault((lr.cuda, lr.device, rr.cuda, rr.device), ([], []))
            src.append((s.src, s.nbytes, lr.device))
            dst.append((s.dst, s.nbytes, rr.device))
        handles: list[Any] = []
        try:
            for (lcuda, _, rcuda, _), (src, dst) in groups.items():
                ldescs = self._agent.get_xfer_descs(src, _mem(lcuda))
                rdescs = self._agent.get_xfer_descs(dst, _mem(rcuda))
                h = self._agent.initialize_xfer("WRITE", ldescs, rdescs, p.name)
                handles.append(h)
                if self._agent.transfer(h) == "ERR":
                    raise TransferFailed(f"{what}: NIXL refused to post the transfer")
            self._wait(handles, deadline, what, timeout_s)
        except TransferFailed:
            self._release(handles, peer)
            self._forget(peer)
            raise
        except Exception as e:  # the binding's errors (a disconnected peer, ...)
            self._release(handles, peer)
            self._forget(peer)
            raise TransferFailed(f"{what}: {type(e).__name__}: {e}") from e
        self._release(handles)

    def _wait(self, handles: list[Any], deadline: float, what: str, timeout_s: float) -> None:
        pending = list(handles)
        pause = 0.0
        while pending:
            still = []
            for h in pending:
                st = self._agent.check_xfer_state(h)
                if st == "ERR":
                    raise TransferFailed(f"{what}: the transfer failed (peer gone or refused)")
                if st != "DONE":
                    still.append(h)
            pending = still
            if not pending:
                return
            now = time.monotonic()
            if now >= deadline:
                raise TransferFailed(f"{what}: still running after {timeout_s:g} s")
            pause = min(_POLL_MAX_S, pause * 2 or 0.00005, deadline - now)
            time.sleep(pause)

    def _release(self, handles: list[Any], peer: str | None = None) -> None:
        """Release ``handles`` (a running transfer is cancelled); those NIXL refuses to
        release (it could not cancel them) are kept for :meth:`quiet` under ``peer``."""
        for h in handles:
            try:
                self._agent.release_xfer_handle(h)
            except Exception:
                if peer is not None:
                    self._unsettled.setdefault(peer, []).append(h)

    def quiet(self, peer: str, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the transfers a failed write to ``peer`` could not
        cancel to end (released once NIXL lets them go); whether none is left."""
        deadline = time.monotonic() + timeout_s
        while self._unsettled.get(peer):
            left = self._unsettled.pop(peer)
            self._release(left, peer)
            if self._unsettled.get(peer) and time.monotonic() >= deadline:
                return False
            if self._unsettled.get(peer):
                time.sleep(_POLL_MAX_S)
        return True

    def close(self) -> None:
        """Deregister the memory, unload the peers and stop the agent; idempotent."""
        if self._closed:
            return
        self._closed = True
        for name in {p.name for p in self._peers.values()}:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(name)
        self._peers.clear()
        for descs in self._reg_descs:
            self._agent.deregister_memory(descs, backends=["UCX"])
        self._reg_descs.clear()
        self._regions.clear()
        self._starts.clear()
        self._agent = None  # the binding's destructor stops UCX and its listeners

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._regions)} regions"
        return f"NixlTransport(agent={self.agent_name!r}, {state})"
