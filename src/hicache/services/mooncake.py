"""A local Mooncake Store service: ``mooncake_master`` plus a long-lived segment holder.

Mooncake objects live in segments mounted by clients and vanish with the mounting client;
an engine's client mounts none (:mod:`hicache.storage.backends.mooncake`), so L3 contents
live in this service's holder and outlive any one engine.

Run ``hicache store mooncake``. Defaults: 127.0.0.1; master RPC port 50051, its HTTP port
50052; a 4 GiB segment; ``P2PHANDSHAKE`` metadata over ``tcp``. When ready it prints one
JSON line (``{"event": "ready", "master_server_address": ..., "pid": ..., "master_pid":
...}``); SIGTERM or SIGINT stops it cleanly. As a child process (benchmarks, tests):
:class:`hicache.services.mooncake_process.MooncakeProcess`. The master binds the given
host; the transfer engine's own listeners in the holder listen on all interfaces in this
Mooncake version (docs/security.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hicache.services.process import (
    ServiceError,
    ServiceUnavailableError,
    popen_dying_with_parent,
    stop_process,
    wait_for_port,
)

__all__ = [
    "MooncakeService",
    "MooncakeServiceConfig",
    "main",
    "mooncake_available",
    "mooncake_master_path",
    "parse_size",
]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_MASTER_PORT = 50051
DEFAULT_METRICS_PORT = 50052
DEFAULT_SEGMENT_SIZE = 4 << 30
DEFAULT_LOCAL_BUFFER_SIZE = 16 << 20


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


def mooncake_available() -> str | None:
    """None when the Mooncake client and master can run here, else what is missing."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return (
            "mooncake.store cannot be imported (pip install mooncake-transfer-engine-non-cuda; "
            f"apt-get install libibverbs1): {e}"
        )
    if mooncake_master_path() is None:
        return "mooncake_master not found (pip install mooncake-transfer-engine-non-cuda)"
    return None


def _call_with_deadline(fn: Callable[[], Any], timeout_s: float, name: str) -> Any:
    """Run ``fn`` on a daemon thread; its value, or ServiceError after ``timeout_s`` seconds.

    A call that overruns keeps running on its (daemon) thread: it cannot be cancelled.
    """
    box: list[Any] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as e:
            err.append(e)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise ServiceError(f"{name} did not return within {timeout_s:g} s")
    if err:
        raise ServiceError(f"{name} failed: {err[0]!r}")
    return box[0]


def parse_size(text: str) -> int:
    """``"4GiB"``, ``"256MiB"``, ``"512MB"``, ``"1048576"`` -> bytes."""
    t = text.strip().lower().replace(" ", "")
    units = {
        "kib": 1 << 10,
        "mib": 1 << 20,
        "gib": 1 << 30,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "b": 1,
    }
    try:
        for suffix, mult in units.items():
            if t.endswith(suffix):
                return int(float(t[: -len(suffix)]) * mult)
        return int(t)
    except ValueError:
        raise ValueError(
            f"size {text!r} is invalid; use e.g. 4GiB, 512MiB or a byte count"
        ) from None


@dataclass(frozen=True, kw_only=True)
class MooncakeServiceConfig:
    """Where and how big: see the module docstring for defaults."""

    host: str = DEFAULT_HOST
    master_port: int = DEFAULT_MASTER_PORT
    metrics_port: int = DEFAULT_METRICS_PORT
    segment_size: int = DEFAULT_SEGMENT_SIZE
    local_buffer_size: int = DEFAULT_LOCAL_BUFFER_SIZE
    lease_ttl_ms: int | None = None
    master_binary: str | None = None
    start_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host={self.host!r} is invalid; must be a non-empty address")
        for name in ("master_port", "metrics_port"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 65535:
                raise ValueError(f"{name}={v!r} is invalid; must be a TCP port in [1, 65535]")
        if self.master_port == self.metrics_port:
            raise ValueError(
                f"metrics_port={self.metrics_port} is invalid; must differ from master_port"
            )
        for name in ("segment_size", "local_buffer_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1 << 20:
                raise ValueError(f"{name}={v!r} is invalid; must be an int >= 1 MiB (bytes)")
        if self.lease_ttl_ms is not None and self.lease_ttl_ms < 1:
            raise ValueError(f"lease_ttl_ms={self.lease_ttl_ms!r} is invalid; must be None or >= 1")

    @property
    def master_server_address(self) -> str:
        return f"{self.host}:{self.master_port}"


class MooncakeService:
    """Owns the master process and the segment-holding client; ``start()`` / ``close()``."""

    def __init__(
        self, config: MooncakeServiceConfig, *, master_log: IO[bytes] | None = None
    ) -> None:
        self.config = config
        self._master_log = master_log
        self.master: subprocess.Popen[bytes] | None = None
        self._holder: Any = None

    @property
    def master_server_address(self) -> str:
        return self.config.master_server_address

    def start(self) -> MooncakeService:
        """Start the master, wait for it, mount the holder's segment.

        Raises ServiceUnavailableError (binary missing) or ServiceError (did not start).
        """
        c = self.config
        binary = c.master_binary or mooncake_master_path()
        if binary is None or not Path(binary).is_file():
            raise ServiceUnavailableError(
                "mooncake_master not found: pip install mooncake-transfer-engine-non-cuda "
                "(and apt install libibverbs1)"
            )
        args = [
            str(binary),
            f"--rpc_address={c.host}",
            f"--rpc_port={c.master_port}",
            f"--metrics_host={c.host}",
            f"--metrics_port={c.metrics_port}",
            f"--http_metadata_server_host={c.host}",
            "--enable_http_metadata_server=false",
        ]
        if c.lease_ttl_ms is not None:
            args.append(f"--default_kv_lease_ttl={c.lease_ttl_ms}")
        out = self._master_log if self._master_log is not None else None
        self.master = popen_dying_with_parent(args, stdout=out, stderr=out)
        if not wait_for_port(c.host, c.master_port, c.start_timeout_s, self.master):
            self.close()
            raise ServiceError(f"mooncake_master did not start on {c.master_server_address}")
        try:
            self._mount()
        except BaseException:
            self.close()
            raise
        return self

    def _mount(self) -> None:
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", self.config.host)
        from mooncake.store import MooncakeDistributedStore

        c = self.config
        holder = MooncakeDistributedStore()
        rc = _call_with_deadline(
            lambda: holder.setup(
                c.host,
                "P2PHANDSHAKE",
                c.segment_size,
                c.local_buffer_size,
                "tcp",
                "",
                c.master_server_address,
            ),
            c.start_timeout_s,
            "mooncake segment holder setup",
        )
        if rc != 0:
            raise ServiceError(f"segment holder could not join {c.master_server_address}: rc={rc}")
        self._holder = holder

    def close(self) -> None:
        """Unmount the holder's segment and stop the master (idempotent, never raises)."""
        holder, self._holder = self._holder, None
        if holder is not None:
            with contextlib.suppress(ServiceError):
                _call_with_deadline(holder.close, 15.0, "mooncake segment holder close")
        if self.master is not None:
            stop_process(self.master)
            self.master = None

    def __enter__(self) -> MooncakeService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hicache store mooncake",
        description="Run mooncake_master and a segment-holding client so L3 outlives engines.",
    )
    p.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default %(default)s)")
    p.add_argument(
        "--master-port",
        type=int,
        default=DEFAULT_MASTER_PORT,
        help="master RPC port (default %(default)s)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help="master HTTP metrics port (default %(default)s)",
    )
    p.add_argument(
        "--segment-size",
        default="4GiB",
        help="holder segment size, e.g. 4GiB, 512MiB (default %(default)s)",
    )
    p.add_argument(
        "--local-buffer-size", default="16MiB", help="holder local buffer (default %(default)s)"
    )
    p.add_argument(
        "--lease-ttl-ms",
        type=int,
        default=None,
        help="object read-lease TTL (master default if unset)",
    )
    p.add_argument(
        "--master-binary", default=None, help="mooncake_master path (default: the one in the wheel)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the service until SIGTERM / SIGINT; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        config = MooncakeServiceConfig(
            host=args.host,
            master_port=args.master_port,
            metrics_port=args.metrics_port,
            segment_size=parse_size(args.segment_size),
            local_buffer_size=parse_size(args.local_buffer_size),
            lease_ttl_ms=args.lease_ttl_ms,
            master_binary=args.master_binary,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    service = MooncakeService(config)
    try:
        service.start()
    except (ServiceError, ServiceUnavailableError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        ready = {
            "event": "ready",
            "master_server_address": config.master_server_address,
            "metrics_port": config.metrics_port,
            "segment_size": config.segment_size,
            "pid": os.getpid(),
            "master_pid": service.master.pid if service.master else None,
        }
        print(json.dumps(ready), flush=True)
        while not stop.wait(0.5):
            if service.master is not None and service.master.poll() is not None:
                print("error: mooncake_master exited", file=sys.stderr)
                return 1
        return 0
    finally:
        service.close()


if __name__ == "__main__":
    sys.exit(main())
