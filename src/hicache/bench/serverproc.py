"""Server subprocesses for the serving benchmarks: one ``hicache serve`` per cache config.

* :class:`ServerProcess`: ``python -m hicache.cli serve ...`` on a free 127.0.0.1 port,
  waited for through ``GET /health``, stopped by PID (SIGTERM, then SIGKILL after a grace
  period); :meth:`ServerProcess.cpu_seconds` reads its CPU time. Its stdout and stderr
  go to a temp log file, whose tail is shown on failure (and which is kept then); on a
  clean stop the log is removed.
* :func:`mooncake_service`: a fresh Mooncake service on free ports, launched by
  :class:`hicache.services.mooncake_process.MooncakeProcess` (the one launcher).
* :func:`config_server`: the server of one named config (:data:`CONFIG_NAMES`, parsed
  from ``--configs`` by :func:`parse_configs`) with any helper it needs (an L3 directory,
  a Mooncake service), torn down on exit; :class:`ServerSpec` is what all configs share.

Children get ``PR_SET_PDEATHSIG``, so they die with the benchmark if it is killed. The
requests sent to these servers are in :mod:`hicache.bench.httpclient`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from hicache.services.mooncake import mooncake_master_path
from hicache.services.mooncake_process import MooncakeProcess
from hicache.services.process import (
    LOOPBACK,
    LoggedProcess,
    ServiceError,
    ServiceUnavailableError,
    free_port,
)

__all__ = [
    "CONFIG_NAMES",
    "SCHEDULER_CONFIGS",
    "TP_SUFFIX",
    "ConfigSkippedError",
    "ServerError",
    "ServerProcess",
    "ServerSpec",
    "config_server",
    "mooncake_service",
    "parse_configs",
    "parse_tp_sizes",
    "process_cpu_seconds",
    "split_tp",
    "with_tp",
]

CONFIG_NAMES: tuple[str, ...] = (
    "no_cache",
    "l1",
    "l1_l2",
    "l1_l2_l3_file",
    "l1_l2_l3_mooncake",
)
"""The cache configurations a serving benchmark can compare, from none to L1+L2+L3."""

SCHEDULER_CONFIGS: dict[str, tuple[str, ...]] = {
    "l1_no_group_rule": ("--schedule-policy", "fcfs", "--max-running-requests-per-group", "0"),
    "l1_lpm": ("--schedule-policy", "lpm"),
}
"""``l1`` under other admission rules (``l1`` itself runs the defaults: ``fcfs`` and a
group may hold half the running slots): what the scheduling policy costs or gains on a
workload. Only when named in ``--configs``."""


class ServerError(RuntimeError):
    """A server (or a service it needs) failed to start or to answer."""


class ConfigSkippedError(RuntimeError):
    """A config cannot run on this machine (e.g. no ``mooncake_master`` binary)."""


def parse_configs(text: str) -> list[str]:
    """A comma list of config names -> list; ValueError naming the unknown ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = (*CONFIG_NAMES, *SCHEDULER_CONFIGS)
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"--configs={text!r} is invalid; choose from {','.join(known)}")
    return names


ADMIN_KEY_ENV = "HICACHE_ADMIN_API_KEY"
ADMIN_KEY = os.environ.get(ADMIN_KEY_ENV) or secrets.token_urlsafe(24)
"""The admin key the benchmarks flush with (``/flush_cache`` needs ``--admin-api-key``):
``$HICACHE_ADMIN_API_KEY`` (for a server of one's own, ``--url``), else one made for this
process, which the servers the benchmarks start are given."""


class ServerProcess(LoggedProcess):
    """One ``hicache serve`` subprocess; ``start()`` / ``close()`` or a ``with`` block.

    ``flags`` are ``hicache serve`` flags (without ``--host`` / ``--port``, which are
    chosen here). ``startup_timeout_s`` bounds the wait for ``/health`` (seconds).
    ``grpc``: also serve smg's gRPC worker protocol (``--grpc-mode``) on a free port of
    its own (:attr:`grpc_url`, the worker URL smg takes).
    """

    log_prefix = "hicache-bench-server-"

    def __init__(
        self,
        flags: Sequence[str],
        *,
        host: str = LOOPBACK,
        startup_timeout_s: float = 300.0,
        grace_s: float = 10.0,
        grpc: bool = False,
    ) -> None:
        super().__init__(grace_s)
        self.flags = list(flags)
        self.host = host
        self.port = 0
        self.grpc = grpc
        self.grpc_port = 0
        """The gRPC port (with ``grpc``; 0 before :meth:`start`)."""
        self.startup_timeout_s = startup_timeout_s

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def grpc_url(self) -> str:
        """``grpc://host:port``: the server as an smg gRPC worker (with ``grpc``)."""
        return f"grpc://{self.host}:{self.grpc_port}"

    @property
    def command(self) -> list[str]:
        """The command line that starts the server (for logs and docs)."""
        return [sys.executable, "-m", "hicache.cli", "serve", *self.flags]

    def _admin_flags(self) -> list[str]:
        """``--admin-api-key`` with the benchmarks' key (they flush between runs), unless
        the flags set one."""
        if any(f.startswith("--admin-api-key") for f in self.flags):
            return []
        return [f"--admin-api-key={ADMIN_KEY}"]  # one token: a key may start with "-"

    def start(self) -> ServerProcess:
        """Launch and wait until ``/health`` answers 200; ServerError (with the log) if not."""
        self.port = free_port(self.host)
        grpc_flags: list[str] = []
        if self.grpc:
            self.grpc_port = free_port(self.host)
            while self.grpc_port == self.port:
                self.grpc_port = free_port(self.host)
            grpc_flags = ["--grpc-mode", "--grpc-port", str(self.grpc_port)]
        self.spawn(
            [
                *self.command,
                *self._admin_flags(),
                *grpc_flags,
                "--host",
                self.host,
                "--port",
                str(self.port),
            ]
        )
        assert self.proc is not None
        end = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < end:
                if self.proc.poll() is not None:
                    self._fail(f"the server exited with status {self.proc.returncode}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        self._fail(f"the server did not answer /health within {self.startup_timeout_s:g} s")
        raise AssertionError("unreachable")  # pragma: no cover

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system, s, all threads) the server has used so far, from
        ``/proc/PID/stat``; None when it is not running or ``/proc`` is not there."""
        if self.proc is None:
            return None
        return process_cpu_seconds(self.proc.pid)

    def _fail(self, why: str) -> None:
        self.close(keep_log=True)
        raise ServerError(f"{why}\n{self.describe_log()}")

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's log ("" when there is none)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def describe_log(self, lines: int = 40) -> str:
        """Where the log is and its tail, for error messages."""
        return f"--- server log {self.log_path} (last {lines} lines) ---\n{self.log_tail(lines)}"


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc``); None if unreadable."""
    try:  # "pid (comm) S ppid ...": utime and stime are fields 14 and 15
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


@contextmanager
def mooncake_service(segment_size: str, startup_timeout_s: float = 60.0) -> Iterator[str]:
    """A fresh Mooncake service (:class:`hicache.services.mooncake_process.MooncakeProcess`)
    for one config; yields its ``master_server_address``. ConfigSkippedError when Mooncake
    is not installed here; ServerError when it does not become ready."""
    if mooncake_master_path() is None:
        raise ConfigSkippedError(
            "mooncake_master not found (pip install mooncake-transfer-engine-non-cuda)"
        )
    mc = MooncakeProcess(segment_size=segment_size, startup_timeout_s=startup_timeout_s)
    try:
        mc.start()
    except ServiceUnavailableError as e:
        raise ConfigSkippedError(str(e)) from None
    except ServiceError as e:
        raise ServerError(str(e)) from None
    try:
        yield mc.master_server_address
    finally:
        mc.close()


@dataclass(frozen=True, kw_only=True)
class ServerSpec:
    """What every config's server shares: the model and the tier sizes (tokens).

    ``l1_tokens``: ``--max-total-tokens``; ``l2_ratio``: ``--hicache-ratio`` (L2 = ratio x
    L1) for the configs with L2; ``extra_flags``: more ``hicache serve`` flags for all.
    """

    model_path: str | None
    page_size: int
    l1_tokens: int
    l2_ratio: float
    extra_flags: tuple[str, ...] = ()
    startup_timeout_s: float = 300.0
    mooncake_segment: str = "1GiB"

    def base_flags(self) -> list[str]:
        flags = ["--page-size", str(self.page_size), "--max-total-tokens", str(self.l1_tokens)]
        if self.model_path is not None:
            flags = ["--model-path", self.model_path, *flags]
        return [*flags, *self.extra_flags]


TP_SUFFIX = "@tp"
"""A config name ``NAME@tpN`` is config ``NAME`` on a server with ``--tp-size N``
(:func:`with_tp`, :func:`split_tp`)."""


def split_tp(name: str) -> tuple[str, int]:
    """``"l1_l2@tp2"`` -> ``("l1_l2", 2)``; a name without the suffix has TP size 1.
    ValueError naming the name when the size is not an int >= 1."""
    base, sep, size = name.partition(TP_SUFFIX)
    if not sep:
        return name, 1
    if not size.isdigit() or int(size) < 1:
        raise ValueError(
            f"config {name!r}: the tensor-parallel size after {TP_SUFFIX} must be an int >= 1"
        )
    return base, int(size)


def parse_tp_sizes(text: str) -> list[int]:
    """``--tp-size`` as a comma list (``"1,2"``) of distinct ints >= 1; ValueError naming it."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise ValueError(f"--tp-size={text!r} is invalid; give distinct ints >= 1, e.g. 1,2")
    return sizes


def with_tp(configs: Sequence[str], sizes: Sequence[int]) -> list[str]:
    """Every config at every size: the names unchanged for ``[1]``, else ``NAME@tpN`` for
    each config, then each size (``l1@tp1, l1@tp2, l1_l2@tp1, ...``)."""
    if list(sizes) == [1]:
        return list(configs)
    return [f"{c}{TP_SUFFIX}{t}" for c in configs for t in sizes]


@contextmanager
def config_server(name: str, spec: ServerSpec) -> Iterator[ServerProcess]:
    """Start the server of config ``name`` (and its L3 helpers); stop all on exit.

    ``no_cache``: ``--disable-radix-cache``; ``l1``: the radix cache alone; ``l1_l2``:
    ``--enable-hierarchical-cache``; ``l1_l2_l3_file``: plus the file backend in a fresh
    temp dir (removed after); ``l1_l2_l3_mooncake``: plus Mooncake through a fresh local
    service (ConfigSkippedError when its binary is missing). ``l1_no_group_rule`` and
    ``l1_lpm``: ``l1`` with the flags of :data:`SCHEDULER_CONFIGS`. ``NAME@tpN``: config
    ``NAME`` with ``--tp-size N`` (:func:`split_tp`).
    """
    name, tp = split_tp(name)
    if name not in CONFIG_NAMES and name not in SCHEDULER_CONFIGS:
        raise ValueError(
            f"config {name!r} is unknown; choose from {(*CONFIG_NAMES, *SCHEDULER_CONFIGS)}"
        )
    flags = spec.base_flags() + list(SCHEDULER_CONFIGS.get(name, ()))
    if tp > 1:
        flags += ["--tp-size", str(tp)]
    with ExitStack() as stack:
        if name == "no_cache":
            flags.append("--disable-radix-cache")
        if name.startswith("l1_l2"):
            flags += ["--enable-hierarchical-cache", "--hicache-ratio", f"{spec.l2_ratio:g}"]
        if name == "l1_l2_l3_file":
            root = tempfile.mkdtemp(prefix="hicache-bench-l3-")
            stack.callback(shutil.rmtree, root, True)
            extra = json.dumps({"file_path": root})
            flags += ["--hicache-storage-backend", "file"]
            flags += ["--hicache-storage-backend-extra-config", extra]
        if name == "l1_l2_l3_mooncake":
            master = stack.enter_context(mooncake_service(spec.mooncake_segment))
            extra = json.dumps({"master_server_address": master})
            flags += ["--hicache-storage-backend", "mooncake"]
            flags += ["--hicache-storage-backend-extra-config", extra]
        server = stack.enter_context(ServerProcess(flags, startup_timeout_s=spec.startup_timeout_s))
        yield server
