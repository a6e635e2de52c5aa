"""What the ``mooncake`` backend checks on the network: a responsive master, its own listeners.

:func:`probe_master`: ``MooncakeDistributedStore.setup`` holds the GIL while it retries a
master that does not answer (about 90 s in this Mooncake version), so no thread-based
deadline can cut it short. Before calling it the backend therefore makes sure, within
``connect_timeout_s``, that a live master is there: it connects and sends
:data:`PROBE` (64 zero bytes, not a valid request: coro_rpc requests start with the magic
byte 0x21), which a live master answers at once by closing the connection. A port that
refuses, or that accepts and stays silent (a frozen master: the kernel still completes
handshakes into its listen backlog; a TCP black hole), fails the probe.

:func:`tcp_listeners`: the TCP sockets this process listens on (from ``/proc/net/tcp`` and
``/proc/net/tcp6``, matched to this process's socket inodes), to say where the transfer
engine listens (see docs/security.md).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from hicache.storage.base import StorageError

__all__ = ["PROBE", "Listener", "probe_master", "tcp_listeners"]

PROBE = bytes(64)
"""Sent by :func:`probe_master`: not a valid request, so a live master drops the connection."""


def probe_master(address: str, timeout_s: float) -> None:
    """Return once the master at ``host:port`` has answered; StorageError (one line,
    naming the address and the timeout) when it does not within ``timeout_s`` seconds."""
    end = time.monotonic() + timeout_s
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    except (OSError, ValueError) as e:
        raise StorageError(
            f"mooncake backend: cannot reach the master at {address} within {timeout_s:g} s "
            f"(connect_timeout_s): {e}"
        ) from None
    with sock:
        try:
            sock.settimeout(max(end - time.monotonic(), 1e-3))
            sock.sendall(PROBE)
            sock.recv(1)  # b"" (closed) or any byte: something alive answered
        except TimeoutError:
            raise StorageError(
                f"mooncake backend: the master at {address} accepted a connection but did not "
                f"answer within {timeout_s:g} s (connect_timeout_s); is it frozen, or not a "
                "Mooncake master?"
            ) from None
        except OSError:  # reset by the peer: an answer too
            pass


@dataclass(frozen=True, slots=True)
class Listener:
    """One listening TCP socket: ``host`` as the kernel reports it (``0.0.0.0``, ``::``,
    ``127.0.0.1``, ...) and ``port``."""

    host: str
    port: int

    @property
    def address(self) -> str:
        """``host:port``, IPv6 hosts in brackets."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def loopback_only(self) -> bool:
        """True when only this host can connect (127.0.0.0/8 or ::1)."""
        return self.host.startswith("127.") or self.host == "::1"


def _addr(hexaddr: str) -> str:
    raw = bytes.fromhex(hexaddr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    if words[:12] == b"\0" * 10 + b"\xff\xff":  # v4-mapped
        return socket.inet_ntop(socket.AF_INET, words[12:])
    return socket.inet_ntop(socket.AF_INET6, words)


def tcp_listeners(pid: int | None = None) -> list[Listener]:
    """TCP sockets in LISTEN state owned by process ``pid`` (this one by default), sorted.

    Linux only; an empty list where ``/proc`` is not readable.
    """
    pid = os.getpid() if pid is None else pid
    inodes: set[str] = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return []
    out: set[Listener] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and f[9] in inodes:  # 0A = LISTEN
                host, port = f[1].rsplit(":", 1)
                out.add(Listener(_addr(host), int(port, 16)))
    return sorted(out, key=lambda x: (x.port, x.host))
