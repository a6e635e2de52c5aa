"""Server subprocesses for the serving benchmarks: one ``hicache serve`` per cache config.

* :class:`ServerProcess`: ``python -m hicache.cli serve ...`` on a free 127.0.0.1 port,
  waited for through ``GET /health``, stopped by PID (SIGTERM, then SIGKILL after a grace
  period). Its stdout and stderr go to a temp log file, whose tail is shown on failure
  (and which is kept then); on a clean stop the log is removed.
* :class:`MooncakeProcess`: ``python -m hicache.storage.mooncake_service`` on free ports;
  its JSON ``ready`` line on stdout gives the ``master_server_address``.
* :func:`config_server`: the server of one named config (:data:`CONFIG_NAMES`) with any
  helper it needs (an L3 directory, a Mooncake service), torn down on exit.
* :func:`stream_completion`: one streamed ``/v1/completions`` request, timed
  (:class:`RequestRecord`); :func:`flush_cache`, :func:`server_ttft`: small HTTP helpers.

Children get ``PR_SET_PDEATHSIG``, so they die with the benchmark if it is killed.
"""

from __future__ import annotations

import asyncio
import json
import math
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from hicache.storage.services import (
    LOOPBACK,
    die_with_parent,
    free_port,
    mooncake_master_path,
    stop_process,
)

__all__ = [
    "CONFIG_NAMES",
    "ConfigSkippedError",
    "MooncakeProcess",
    "RequestRecord",
    "ServerError",
    "ServerProcess",
    "ServerSpec",
    "config_server",
    "flush_cache",
    "parse_configs",
    "round_to_pages",
    "server_ttft",
    "stream_completion",
]

CONFIG_NAMES: tuple[str, ...] = (
    "no_cache",
    "l1",
    "l1_l2",
    "l1_l2_l3_file",
    "l1_l2_l3_mooncake",
)
"""The cache configurations a serving benchmark can compare, from none to L1+L2+L3."""
TIERS: tuple[str, ...] = ("device", "host", "storage")
"""The tiers of ``usage.cached_tokens_details``."""


class ServerError(RuntimeError):
    """A server (or a service it needs) failed to start or to answer."""


class ConfigSkippedError(RuntimeError):
    """A config cannot run on this machine (e.g. no ``mooncake_master`` binary)."""


def round_to_pages(tokens: float, page_size: int) -> int:
    """``tokens`` rounded up to a whole number of pages, in tokens (at least one page)."""
    return max(1, math.ceil(tokens / page_size)) * page_size


def parse_configs(text: str) -> list[str]:
    """A comma list of config names -> list; ValueError naming the unknown ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in CONFIG_NAMES]
    if bad or not names:
        raise ValueError(f"--configs={text!r} is invalid; choose from {','.join(CONFIG_NAMES)}")
    return names


class ServerProcess:
    """One ``hicache serve`` subprocess; ``start()`` / ``close()`` or a ``with`` block.

    ``flags`` are ``hicache serve`` flags (without ``--host`` / ``--port``, which are
    chosen here). ``startup_timeout_s`` bounds the wait for ``/health`` (seconds).
    """

    def __init__(
        self,
        flags: Sequence[str],
        *,
        host: str = LOOPBACK,
        startup_timeout_s: float = 300.0,
        grace_s: float = 10.0,
    ) -> None:
        self.flags = list(flags)
        self.host = host
        self.port = 0
        self.startup_timeout_s = startup_timeout_s
        self.grace_s = grace_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def command(self) -> list[str]:
        """The command line that starts the server (for logs and docs)."""
        return [sys.executable, "-m", "hicache.cli", "serve", *self.flags]

    def start(self) -> ServerProcess:
        """Launch and wait until ``/health`` answers 200; ServerError (with the log) if not."""
        self.port = free_port(self.host)
        fd, name = tempfile.mkstemp(prefix="hicache-bench-server-", suffix=".log")
        self.log_path = Path(name)
        cmd = [*self.command, "--host", self.host, "--port", str(self.port)]
        with open(fd, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )
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

    def close(self, *, keep_log: bool = False) -> None:
        """Stop the server by PID (SIGTERM, then SIGKILL); remove its log unless kept."""
        if self.proc is not None:
            stop_process(self.proc, grace_s=self.grace_s)
            self.proc = None
        if self.log_path is not None and not keep_log:
            self.log_path.unlink(missing_ok=True)
            self.log_path = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        failed = exc_type is not None and not issubclass(exc_type, KeyboardInterrupt)
        if failed and self.proc is not None:
            print(self.describe_log(), file=sys.stderr)
        self.close(keep_log=failed)


class MooncakeProcess:
    """``python -m hicache.storage.mooncake_service`` on free ports (a ``with`` block).

    ConfigSkippedError when the ``mooncake_master`` binary is missing; ServerError when
    the service does not print its ready line within ``startup_timeout_s`` seconds.
    """

    def __init__(self, *, segment_size: str = "1GiB", startup_timeout_s: float = 60.0) -> None:
        self.segment_size = segment_size
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.master_server_address = ""
        self._log: Path | None = None

    def start(self) -> MooncakeProcess:
        if mooncake_master_path() is None:
            raise ConfigSkippedError(
                "mooncake_master not found (pip install mooncake-transfer-engine-non-cuda)"
            )
        master, metrics = free_port(), free_port()
        while metrics == master:
            metrics = free_port()
        fd, name = tempfile.mkstemp(prefix="hicache-bench-mooncake-", suffix=".log")
        self._log = Path(name)
        cmd = [sys.executable, "-m", "hicache.storage.mooncake_service",
               "--master-port", str(master), "--metrics-port", str(metrics),
               "--segment-size", self.segment_size]  # fmt: skip
        with open(fd, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], self.startup_timeout_s)
        line = self.proc.stdout.readline() if ready else b""
        try:
            doc = json.loads(line)
            if doc.get("event") != "ready":
                raise ValueError(doc)
            self.master_server_address = str(doc["master_server_address"])
        except (ValueError, KeyError, TypeError):
            tail = self._log.read_text(errors="replace")[-4000:]
            self.close()
            raise ServerError(f"the Mooncake service did not become ready:\n{tail}") from None
        return self

    def close(self) -> None:
        """Stop the service by PID (it stops its master) and remove its log."""
        if self.proc is not None:
            stop_process(self.proc, grace_s=15.0)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None
        if self._log is not None:
            self._log.unlink(missing_ok=True)
            self._log = None

    def __enter__(self) -> MooncakeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


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


@contextmanager
def config_server(name: str, spec: ServerSpec) -> Iterator[ServerProcess]:
    """Start the server of config ``name`` (and its L3 helpers); stop all on exit.

    ``no_cache``: ``--disable-radix-cache``; ``l1``: the radix cache alone; ``l1_l2``:
    ``--enable-hierarchical-cache``; ``l1_l2_l3_file``: plus the file backend in a fresh
    temp dir (removed after); ``l1_l2_l3_mooncake``: plus Mooncake through a fresh local
    service (ConfigSkippedError when its binary is missing).
    """
    if name not in CONFIG_NAMES:
        raise ValueError(f"config {name!r} is unknown; choose from {CONFIG_NAMES}")
    flags = spec.base_flags()
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
            mc = stack.enter_context(MooncakeProcess(segment_size=spec.mooncake_segment))
            extra = json.dumps({"master_server_address": mc.master_server_address})
            flags += ["--hicache-storage-backend", "mooncake"]
            flags += ["--hicache-storage-backend-extra-config", extra]
        server = stack.enter_context(ServerProcess(flags, startup_timeout_s=spec.startup_timeout_s))
        yield server


async def flush_cache(client: httpx.AsyncClient, url: str, *, tries: int = 50) -> float:
    """``POST /flush_cache`` (retried while the server says requests are in flight, 409).

    Returns the seconds it took; ServerError if it never succeeds.
    """
    t = time.perf_counter()
    for _ in range(tries):
        r = await client.post(f"{url}/flush_cache")
        if r.status_code == 200:
            return time.perf_counter() - t
        if r.status_code != 409:
            raise ServerError(f"POST /flush_cache answered {r.status_code}: {r.text}")
        await asyncio.sleep(0.1)
    raise ServerError(f"POST /flush_cache kept answering 409 after {tries} tries")


async def server_ttft(client: httpx.AsyncClient, url: str) -> tuple[float, int]:
    """The server's TTFT histogram totals from ``/metrics``: (sum in seconds, count)."""
    text = (await client.get(f"{url}/metrics")).text
    total, count = 0.0, 0
    for line in text.splitlines():
        if line.startswith("hicache_ttft_seconds_sum"):
            total = float(line.split()[-1])
        elif line.startswith("hicache_ttft_seconds_count"):
            count = int(float(line.split()[-1]))
    return total, count


@dataclass(frozen=True)
class RequestRecord:
    """One finished request. Times in seconds (``perf_counter``), token counts in tokens."""

    group: int
    """Round (multiturn) or phase (long context) index, from 0."""
    client: int
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    latency_s: float
    start_s: float
    end_s: float
    cached: dict[str, int]
    """Prompt tokens served from each tier: ``{"device", "host", "storage"}``."""


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    prompt: list[int],
    max_tokens: int,
    *,
    group: int,
    client_id: int,
) -> RequestRecord:
    """Send one streamed, greedy ``/v1/completions`` request and time it.

    TTFT = from sending to the first SSE ``data:`` event (the server sends one as soon as
    a token adds text, or when the request ends). ServerError on a non-200 answer or a
    stream without a final ``usage``.
    """
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] | None = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise ServerError(f"/v1/completions answered {resp.status_code}: {text}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            if first is None:
                first = time.perf_counter()
            chunk = json.loads(data)
            if "error" in chunk:
                raise ServerError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    if usage is None or first is None:
        raise ServerError("the stream ended without a final chunk carrying usage")
    details = usage.get("cached_tokens_details") or {}
    return RequestRecord(
        group=group,
        client=client_id,
        prompt_tokens=int(usage["prompt_tokens"]),
        output_tokens=int(usage["completion_tokens"]),
        ttft_s=first - start,
        latency_s=end - start,
        start_s=start,
        end_s=end,
        cached={t: int(details.get(t, 0)) for t in TIERS},
    )
