"""The Mooncake service (:mod:`hicache.services.mooncake`) as a child process, on free ports.

:class:`MooncakeProcess` runs ``python -m hicache.services.mooncake`` on free 127.0.0.1
ports, waits for its JSON ready line and knows its addresses and PIDs (the service and its
``mooncake_master``), so benchmarks and tests can use it, crash it (:meth:`kill`) or freeze
it (:meth:`freeze` / :meth:`thaw`). The child's stderr goes to a temp log file whose tail is
put in errors; the log is removed by :meth:`close`. The child gets ``PR_SET_PDEATHSIG``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hicache.services.mooncake import mooncake_available
from hicache.services.process import (
    LOOPBACK,
    ServiceError,
    ServiceUnavailableError,
    free_ports,
    freeze_process,
    popen_dying_with_parent,
    stop_process,
)

__all__ = ["MooncakeProcess"]


class MooncakeProcess:
    """One Mooncake service child process; ``start()`` / ``close()`` or a ``with`` block.

    ``segment_size``: the holder's segment, e.g. ``"1GiB"``; ``startup_timeout_s``: how long
    to wait for the ready line (seconds). ``start()`` raises ServiceUnavailableError when
    Mooncake is not installed here and ServiceError (with the log tail) when the service
    does not become ready.
    """

    def __init__(
        self,
        *,
        segment_size: str = "1GiB",
        startup_timeout_s: float = 60.0,
        host: str = LOOPBACK,
    ) -> None:
        self.segment_size = segment_size
        self.startup_timeout_s = startup_timeout_s
        self.host = host
        self.proc: subprocess.Popen[bytes] | None = None
        self.master_pid: int | None = None
        self.master_server_address = ""
        self.log_path: Path | None = None

    @property
    def extra_config(self) -> dict[str, Any]:
        """The backend extra config of a client of this service."""
        return {"master_server_address": self.master_server_address}

    @property
    def pids(self) -> list[int]:
        """The master's PID, then the service's (holder) PID, of those known."""
        out = [] if self.master_pid is None else [self.master_pid]
        return out + ([] if self.proc is None else [self.proc.pid])

    def start(self) -> MooncakeProcess:
        why = mooncake_available()
        if why is not None:
            raise ServiceUnavailableError(why)
        master, metrics = free_ports(2, self.host)
        fd, name = tempfile.mkstemp(prefix="hicache-mooncake-", suffix=".log")
        self.log_path = Path(name)
        cmd = [sys.executable, "-m", "hicache.services.mooncake", "--host", self.host,
               "--master-port", str(master), "--metrics-port", str(metrics),
               "--segment-size", self.segment_size]  # fmt: skip
        with open(fd, "wb") as log:
            self.proc = popen_dying_with_parent(  # no orphan if the parent crashes
                cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL
            )
        ready = self._read_ready(self.startup_timeout_s)
        if ready is None:
            tail = self.log_tail()
            self.close()
            raise ServiceError(f"the Mooncake service did not become ready; log tail:\n{tail}")
        self.master_pid = int(ready["master_pid"])
        self.master_server_address = str(ready["master_server_address"])
        return self

    def _read_ready(self, timeout_s: float) -> dict[str, Any] | None:
        proc = self.proc
        assert proc is not None and proc.stdout is not None
        end = time.monotonic() + timeout_s
        buf = b""
        while time.monotonic() < end and b"\n" not in buf:
            r, _, _ = select.select([proc.stdout], [], [], 0.2)
            if r:
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    return None
                buf += chunk
            elif proc.poll() is not None:
                return None
        try:
            doc = json.loads(buf.split(b"\n", 1)[0])
        except json.JSONDecodeError:
            return None
        ok = isinstance(doc, dict) and doc.get("event") == "ready" and "master_pid" in doc
        return doc if ok else None

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the service's stderr log ("" when there is none)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]

    def freeze(self) -> None:
        """SIGSTOP the master and the holder (an unresponsive store); returns once every
        thread of both has stopped."""
        for pid in self.pids:
            freeze_process(pid)

    def thaw(self) -> None:
        """SIGCONT what :meth:`freeze` stopped."""
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the service and its master at once (a crash, not a shutdown)."""
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def close(self) -> None:
        """Stop the service by PID (SIGTERM: holder closed, master stopped), make sure the
        master is gone, remove the log (idempotent, never raises)."""
        if self.proc is not None:
            self.thaw()
            stop_process(self.proc, grace_s=20.0)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None
        if self.master_pid is not None:
            stop_process(self.master_pid, grace_s=2.0)
            self.master_pid = None
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
            self.log_path = None

    def __enter__(self) -> MooncakeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
