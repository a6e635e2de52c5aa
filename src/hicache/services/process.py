"""Process plumbing shared by the service launchers: free ports, readiness, stopping.

Every server binds 127.0.0.1 unless told otherwise; processes are stopped by PID (SIGTERM,
then SIGKILL after a grace period). Children get ``PR_SET_PDEATHSIG`` on Linux so they die
with the process that started them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

__all__ = [
    "LOOPBACK",
    "ServiceError",
    "ServiceUnavailableError",
    "die_with_parent",
    "free_port",
    "free_ports",
    "freeze_process",
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


def die_with_parent() -> None:
    """``preexec_fn``: the child gets SIGTERM when its parent dies (Linux; no-op elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


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
