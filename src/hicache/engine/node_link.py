"""The liveness link between node 0 and each other node (tensor parallelism across nodes).

Node 0 listens (:class:`NodeLinks`, on its ``--dist-init-addr`` host, at a port the system
picks, published in the rendezvous store); every other node's ``hicache serve`` connects
(:class:`NodeLink`) and sends one JSON object per line: ``{"node": r}`` first, then
``{"ready": true}`` once its ranks have built their engines or ``{"error": line}``, then
every :data:`~hicache.engine.heartbeat.BEAT_INTERVAL_S` ``{"beat": {rank: age_s}}`` (how
long ago each of its ranks last beat on its own host) and ``{"dead": line}`` when one of
its ranks died. Node 0 reads a node as lost when its connection closes (killed), as
silent when nothing came for :data:`~hicache.engine.heartbeat.SILENT_AFTER_S` (frozen) or
it reports a rank silent; a node reads rank 0 as gone when the connection closes. No
clock crosses machines: each side times with its own monotonic clock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hicache.engine.heartbeat import SILENT_AFTER_S

log = logging.getLogger(__name__)

__all__ = ["NodeLink", "NodeLinks"]


@dataclass(slots=True)
class _Node:
    """What node 0 knows of one other node (guarded by :attr:`NodeLinks._lock`)."""

    ranks: range
    last: float = field(default_factory=time.monotonic)
    ages: dict[int, float] = field(default_factory=dict)
    ready: bool = False
    error: str | None = None
    lost: str | None = None


class NodeLinks:
    """Node 0's end: one entry per other node of ``nnodes``, each running ``local``
    ranks. ``start(host)`` listens; :meth:`wait_ready`, :meth:`silent`,
    :meth:`failure` read what the nodes said; ``on_failure`` (set by :meth:`watch`) is
    called once, on a reader thread, when a node is lost or reports a dead rank."""

    def __init__(self, nnodes: int, local: int) -> None:
        self._nodes = {r: _Node(range(r * local, (r + 1) * local)) for r in range(1, nnodes)}
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._closing = threading.Event()
        self._on_failure: Callable[[str], None] | None = None
        self._failure: str | None = None

    def start(self, host: str) -> str:
        """Listen on ``host`` (a port the system picks); returns ``host:port``."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(len(self._nodes) + 4)
        self._sock = sock
        threading.Thread(target=self._accept, name="hicache-node-links", daemon=True).start()
        port = sock.getsockname()[1]
        return f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._closing.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(
                target=self._read, args=(conn,), name="hicache-node-link", daemon=True
            ).start()

    def _read(self, conn: socket.socket) -> None:
        node: int | None = None
        with contextlib.suppress(OSError, ValueError), conn.makefile("r") as lines:
            for line in lines:
                msg = json.loads(line)
                if node is None:
                    node = int(msg["node"])
                    if node not in self._nodes:
                        return
                    continue
                self._heard(node, msg)
        if node is not None and node in self._nodes:
            ranks = self._nodes[node].ranks
            who = ", ".join(str(r) for r in ranks)
            self._lost(node, f"node {node} (rank {who}) was lost: its link to rank 0 closed")

    def _heard(self, node: int, msg: dict[str, object]) -> None:
        entry = self._nodes[node]
        with self._lock:
            entry.last = time.monotonic()
            beat = msg.get("beat")
            if isinstance(beat, dict):
                entry.ages = {int(r): float(a) for r, a in beat.items()}
            if msg.get("ready"):
                entry.ready = True
            if isinstance(msg.get("error"), str):
                entry.error = f"node {node}: {msg['error']}"
        if isinstance(msg.get("dead"), str):
            self._lost(node, f"node {node}: {msg['dead']}")

    def _lost(self, node: int, why: str) -> None:
        with self._lock:
            entry = self._nodes[node]
            if entry.lost is None:
                entry.lost = why
            if self._closing.is_set() or self._failure is not None:
                return
            self._failure = why
            report = self._on_failure
        if report is not None:
            log.critical("%s; the engine stops", why)
            try:
                report(why)
            except Exception:
                log.exception("reporting a lost node failed")

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """Call ``on_failure(why)`` once when a node is lost or reports a dead rank (at
        once if one has)."""
        with self._lock:
            self._on_failure = on_failure
            why = self._failure
        if why is not None:
            on_failure(why)

    def failure(self) -> str | None:
        """Why a node was lost or a rank of it died, naming it; None while all live."""
        with self._lock:
            return self._failure

    def problem(self) -> str | None:
        """A node's start error, or a node lost, naming it; None otherwise."""
        with self._lock:
            for entry in self._nodes.values():
                if entry.error is not None:
                    return entry.error
                if entry.lost is not None:
                    return entry.lost
        return None

    def wait_ready(self, deadline: float, timeout_s: float) -> None:
        """Until every node said ready (by ``deadline``, ``time.monotonic()``);
        RuntimeError naming the first node that failed or did not make it."""
        while True:
            problem = self.problem()
            if problem is not None:
                raise RuntimeError(problem)
            with self._lock:
                waiting = [r for r, e in self._nodes.items() if not e.ready]
            if not waiting:
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"node {waiting[0]} did not build its ranks' engines within"
                    f" {timeout_s:g} s (--dist-init-timeout)"
                )
            time.sleep(0.1)

    def silent(self) -> str | None:
        """One line naming each rank of another node that has stopped answering (its
        node silent, or the rank's own heartbeat there old); None while all answer."""
        if self._closing.is_set():
            return None
        now = time.monotonic()
        quiet = []
        with self._lock:
            for node, entry in self._nodes.items():
                if entry.lost is not None:
                    continue
                since = now - entry.last
                for rank in entry.ranks:
                    age = max(since, entry.ages.get(rank, 0.0))
                    if age > SILENT_AFTER_S:
                        quiet.append(f"rank {rank} (node {node}) has not answered for {age:.0f} s")
        if not quiet:
            return None
        return "; ".join(quiet) + " (frozen or overloaded): the ranks wait for it"

    def close(self) -> None:
        """Stop listening and drop every link (the other nodes then stop their ranks).
        Idempotent."""
        self._closing.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                conn.close()


class NodeLink:
    """Node ``node``'s end: connected to node 0's ``address`` (``host:port``) within
    ``timeout_s``; :meth:`send` one message, :attr:`lost` once node 0 closed it."""

    def __init__(self, address: str, node: int, timeout_s: float) -> None:
        host, _, port = address.rpartition(":")
        self._sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
        self._sock.settimeout(None)
        self._send_lock = threading.Lock()
        self._gone = threading.Event()
        self.send({"node": node})
        threading.Thread(target=self._watch, name="hicache-node-link", daemon=True).start()

    def _watch(self) -> None:
        with contextlib.suppress(OSError):
            while self._sock.recv(4096):
                pass
        self._gone.set()

    @property
    def lost(self) -> bool:
        """Whether node 0 closed the link (rank 0 stopped or is gone)."""
        return self._gone.is_set()

    def wait_lost(self, timeout_s: float) -> bool:
        return self._gone.wait(timeout_s)

    def send(self, message: dict[str, object]) -> None:
        """Send ``message`` (errors of a closed link are ignored: :attr:`lost` says so)."""
        data = (json.dumps(message) + "\n").encode()
        with self._send_lock, contextlib.suppress(OSError):
            self._sock.sendall(data)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader; the peer sees EOF
        with contextlib.suppress(OSError):
            self._sock.close()
