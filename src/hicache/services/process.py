"""Process plumbing shared by the service launchers: free ports, readiness, stopping.

Every server binds 127.0.0.1 unless told otherwise; processes are stopped by PID (SIGTERM,
then SIGKILL after a grace period). Children get ``PR_SET_PDEATHSIG`` on Linux so they die
with the process that started them (:func:`popen_dying_with_parent`).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

__all__ = [
    "LOOPBACK",
    "LoggedProcess",
    "ServiceError",
    "ServiceUnavailableError",
    "free_port",
    "free_ports",
    "freeze_process",
    "popen_dying_with_parent",
    "stop_process",
    "wait_for_port",
]

LOOPBACK = "127.0.0.1"


class ServiceUnavailableError(RuntimeError):
    """A service cannot run here: its binary or client package is not installed."""


class ServiceError(RuntimeError):
    """A service was launched but did not become ready (the message has its log tail)."""


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picked it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(n: int, host: str = LOOPBACK) -> list[int]:
    """``n`` distinct ports that were free on ``host`` a moment ago."""
    ports: list[int] = []
    while len(ports) < n:
        p = free_port(host)
        if p not in ports:
            ports.append(p)
    return ports


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


def _die_with_parent() -> None:
    """``preexec_fn``: the child gets SIGTERM when its parent dies (Linux; no-op elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


_SETPRIV = shutil.which("setpriv") if sys.platform == "linux" else None


def popen_dying_with_parent(args: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(args, **kwargs)`` whose child gets SIGTERM when this process dies.

    On Linux with util-linux's ``setpriv``, the child runs as ``setpriv --pdeathsig TERM
    -- args`` (same PID: setpriv execs ``args``). No Python runs in the child between fork
    and exec then, so no library's fork handlers do: with a ``preexec_fn``, a child forked
    while gRPC streams run here can abort in gRPC's handlers before it execs. Without
    ``setpriv``, a ``preexec_fn`` sets the signal (elsewhere than Linux: none).
    """
    if "preexec_fn" in kwargs:
        raise ValueError("popen_dying_with_parent sets the child's death signal itself")
    if _SETPRIV is not None:
        return subprocess.Popen([_SETPRIV, "--pdeathsig", "TERM", "--", *args], **kwargs)
    return subprocess.Popen(list(args), preexec_fn=_die_with_parent, **kwargs)


def freeze_process(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped (a group stop is
    asynchronous: a thread may run on for a moment, say to answer one more request).
    ServiceError if it has not stopped within ``timeout_s`` seconds."""
    os.kill(pid, signal.SIGSTOP)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        states = []
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:  # "pid (comm) S ...": the state follows the last ')'
                states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):
                continue
        if states and all(st in ("T", "t") for st in states):
            return
        time.sleep(0.005)
    raise ServiceError(f"process {pid} did not stop within {timeout_s:g} s of SIGSTOP")


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


P = TypeVar("P", bound="LoggedProcess")


class LoggedProcess:
    """A subprocess whose output goes to a log file of its own: launched by
    :meth:`spawn`, stopped by PID (:func:`stop_process`, after ``grace_s``) by
    :meth:`close`, which removes the log unless asked to keep it; in a ``with`` block the
    log is kept, and its tail printed, when the block fails. A subclass gives ``start``
    (launch and wait until ready) and ``describe_log``."""

    log_prefix = "hicache-process-"

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    def start(self: P) -> P:
        raise NotImplementedError

    def describe_log(self) -> str:
        """Where the log is and its tail, for error messages."""
        raise NotImplementedError

    def spawn(self, cmd: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        """Launch ``cmd`` (stdin closed, stdout and stderr to a new log file), dying with
        this process."""
        fd, name = tempfile.mkstemp(prefix=self.log_prefix, suffix=".log")
        self.log_path = Path(name)
        with open(fd, "wb") as log:
            self.proc = popen_dying_with_parent(
                list(cmd),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=None if env is None else dict(env),
            )

    def close(self, *, keep_log: bool = False) -> None:
        """Stop the process by PID (SIGTERM, then SIGKILL after ``grace_s``); remove its
        log unless ``keep_log``. Idempotent."""
        if self.proc is not None:
            stop_process(self.proc, grace_s=self.grace_s)
            self.proc = None
        if self.log_path is not None and not keep_log:
            self.log_path.unlink(missing_ok=True)
            self.log_path = None

    def __enter__(self: P) -> P:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        failed = exc_type is not None and not issubclass(exc_type, KeyboardInterrupt)
        if failed and self.log_path is not None:
            print(self.describe_log(), file=sys.stderr)
        self.close(keep_log=failed)
