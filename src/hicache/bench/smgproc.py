"""SGLang's real router, ``smg launch``, in front of hicache servers (benchmarks, tests).

:class:`Smg` is one ``smg launch`` subprocess on free 127.0.0.1 ports (API and Prometheus),
logging at debug level to its own file. ``start()`` returns once smg lists every worker as
registered, ready and healthy (``GET /workers``) within ``startup_timeout_s``; ``close()``
stops it by PID (SIGTERM, then SIGKILL), keeping the log when asked. Use it (or
:func:`smg_router`) as a context manager. Regular mode: ``Smg(worker_urls=[a, b],
policy="cache_aware")``; PD mode: ``Smg(prefill=[(url, bootstrap_port)], decode=[url])``
(port None gives ``none``); a gRPC worker's URL is ``grpc://host:port``
(:attr:`hicache.bench.serverproc.ServerProcess.grpc_url`). Without an ``smg`` executable (:func:`smg_path`) ``start()``
raises :class:`SmgNotFoundError` (a skip in tests). Health checks and load polls run
every second (smg's defaults: 60 s and 10 s); ``extra_args`` adds other flags.
``add_worker()`` registers one more worker while smg runs (say one it took out).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from hicache.services.process import LOOPBACK, LoggedProcess, free_port

__all__ = [
    "SMG_HINT",
    "Smg",
    "SmgError",
    "SmgNotFoundError",
    "find_smg",
    "smg_path",
    "smg_router",
]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class SmgError(RuntimeError):
    """smg did not start, or did not reach the state its caller waited for (the message has
    its log's tail)."""


def smg_path() -> str | None:
    """The ``smg`` executable: beside this Python's (the venv's), else on ``PATH``."""
    beside = Path(sys.executable).parent / "smg"
    if beside.is_file():
        return str(beside)
    return shutil.which("smg")


class SmgNotFoundError(SmgError):
    """There is no ``smg`` executable (``pip install smg``)."""


SMG_HINT = "pip install smg, in the dev extras"
"""How to get ``smg``."""


def find_smg() -> str:
    """The ``smg`` executable (:func:`smg_path`); :class:`SmgNotFoundError` when none."""
    path = smg_path()
    if path is None:
        raise SmgNotFoundError(f"smg (SGLang's router) is not installed ({SMG_HINT})")
    return path


class Smg(LoggedProcess):
    """One ``smg launch`` subprocess (see the module's docstring).

    ``worker_urls``: regular workers; ``prefill`` (``(url, bootstrap_port or None)``)
    and ``decode``: PD workers (``--pd-disaggregation``); give one kind or the other.
    ``policy``: ``--policy``; ``api_key``: smg's ``--api-key`` (smg then wants it from
    its clients, :attr:`headers`, and sends it to the workers). ``health_check_interval_s``
    and ``health_failure_threshold``: how often smg probes each worker's ``/health`` and
    after how many failures in a row it takes the worker out; ``load_monitor_interval_s``:
    how often it polls their loads; ``shutdown_grace_s``: how long smg waits for requests
    in flight once told to stop (its default, 180 s, makes every stop take 5 s);
    ``log_level``: smg's ``--log-level`` (its log file is what :class:`SmgError` shows).
    """

    log_prefix = "hicache-smg-"

    def __init__(
        self,
        *,
        worker_urls: Sequence[str] = (),
        prefill: Sequence[tuple[str, int | None]] = (),
        decode: Sequence[str] = (),
        policy: str = "cache_aware",
        api_key: str | None = None,
        health_check_interval_s: int = 1,
        health_failure_threshold: int = 2,
        load_monitor_interval_s: int = 1,
        shutdown_grace_s: int = 1,
        extra_args: Sequence[str] = (),
        log_level: str = "debug",
        startup_timeout_s: float = 60.0,
        grace_s: float = 10.0,
    ) -> None:
        super().__init__(grace_s)
        pd = bool(prefill or decode)
        if pd == bool(worker_urls):
            raise ValueError(
                "give worker_urls (regular mode) or prefill and decode (PD mode), not both"
                f" nor neither: worker_urls={list(worker_urls)!r}, prefill={list(prefill)!r},"
                f" decode={list(decode)!r}"
            )
        if pd and not (prefill and decode):
            raise ValueError(
                f"PD mode needs at least one prefill and one decode worker: prefill="
                f"{list(prefill)!r}, decode={list(decode)!r}"
            )
        self.worker_urls = list(worker_urls)
        self.prefill = list(prefill)
        self.decode = list(decode)
        self.policy = policy
        self.api_key = api_key
        self.health_check_interval_s = health_check_interval_s
        self.health_failure_threshold = health_failure_threshold
        self.load_monitor_interval_s = load_monitor_interval_s
        self.shutdown_grace_s = shutdown_grace_s
        self.extra_args = list(extra_args)
        self.log_level = log_level
        self.startup_timeout_s = startup_timeout_s
        self.port = 0

    # ------------------------------------------------------------------ what it runs

    @property
    def pd(self) -> bool:
        """Whether smg runs in PD mode."""
        return bool(self.prefill)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        """What a client of this smg sends (its API key, when one is set)."""
        return {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}

    @property
    def expected_urls(self) -> list[str]:
        """Every worker URL smg was given."""
        return [*self.worker_urls, *(u for u, _ in self.prefill), *self.decode]

    def command(self, binary: str, port: int, metrics_port: int) -> list[str]:
        """The ``smg launch`` command line."""
        cmd = [binary, "launch", "--host", LOOPBACK, "--port", str(port)]
        cmd += ["--prometheus-host", LOOPBACK, "--prometheus-port", str(metrics_port)]
        cmd += ["--policy", self.policy, "--log-level", self.log_level]
        cmd += ["--health-check-interval-secs", str(self.health_check_interval_s)]
        cmd += ["--health-failure-threshold", str(self.health_failure_threshold)]
        cmd += ["--load-monitor-interval", str(self.load_monitor_interval_s)]
        cmd += ["--shutdown-grace-period-secs", str(self.shutdown_grace_s)]
        cmd += ["--worker-startup-check-interval", "1"]
        cmd += ["--worker-startup-timeout-secs", str(max(1, int(self.startup_timeout_s)))]
        if self.api_key is not None:
            cmd += [f"--api-key={self.api_key}"]  # one token: a key may start with "-"
        if self.pd:
            cmd.append("--pd-disaggregation")
            for url, bootstrap in self.prefill:
                cmd += ["--prefill", url, "none" if bootstrap is None else str(bootstrap)]
            for url in self.decode:
                cmd += ["--decode", url]
        else:
            cmd += ["--worker-urls", *self.worker_urls]
        return [*cmd, *self.extra_args]

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Smg:
        """Launch smg and wait until every worker is registered, ready and healthy;
        :class:`SmgError` (with the log's tail) when it exits or does not get there."""
        binary = find_smg()
        self.port, metrics_port = free_port(), free_port()
        while metrics_port == self.port:
            metrics_port = free_port()
        self.spawn(
            self.command(binary, self.port, metrics_port), env={**os.environ, "NO_COLOR": "1"}
        )
        try:
            self.wait_workers(
                lambda ws: _all_ready(ws, self.expected_urls),
                self.startup_timeout_s,
                f"every worker ({', '.join(self.expected_urls)}) registered, ready and healthy",
            )
        except BaseException:
            self.close(keep_log=True)
            raise
        return self

    # ------------------------------------------------------------------ reading it

    def workers(self) -> list[dict[str, Any]]:
        """smg's ``GET /workers`` list (each worker's ``url``, ``runtime_type``,
        ``worker_type``, ``is_healthy``, ``status``, ``engine_load`` ...)."""
        r = httpx.get(f"{self.url}/workers", headers=self.headers, timeout=5.0)
        r.raise_for_status()
        return list(r.json()["workers"])

    def worker(self, url: str) -> dict[str, Any] | None:
        """smg's entry for the worker at ``url`` (None: not registered)."""
        return next((w for w in self.workers() if w.get("url") == url), None)

    def wait_workers(
        self,
        until: Callable[[list[dict[str, Any]]], bool],
        timeout_s: float,
        what: str,
    ) -> list[dict[str, Any]]:
        """Poll ``GET /workers`` every 0.1 s until ``until(workers)``; returns that list.
        :class:`SmgError` naming ``what``, the last list and the log's tail when smg exits
        or ``timeout_s`` seconds pass first."""
        end = time.monotonic() + timeout_s
        last: list[dict[str, Any]] | str = "no answer yet"
        while time.monotonic() < end:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise SmgError(f"smg exited (status {code}) before {what}\n{self.describe_log()}")
            try:
                workers = self.workers()
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if until(workers):
                    return workers
                last = workers
            time.sleep(0.1)
        shown = last if isinstance(last, str) else json.dumps(last, indent=1)[:4000]
        raise SmgError(
            f"smg did not reach: {what} within {timeout_s:g} s; last /workers: {shown}\n"
            f"{self.describe_log()}"
        )

    def add_worker(self, url: str) -> str:
        """Register the worker at ``url`` (``POST /workers``, ``{"url": url}``), say one
        smg took out (``--remove-unhealthy-workers``); returns the worker id smg gives it.
        smg registers it in the background (202): wait for it with :meth:`wait_workers`.
        :class:`SmgError` with smg's answer and its log's tail when it refuses (409: the
        URL is registered already)."""
        r = httpx.post(f"{self.url}/workers", json={"url": url}, headers=self.headers, timeout=5.0)
        if r.status_code != 202:
            raise SmgError(
                f"smg refused to add worker {url}: {r.status_code} {r.text}\n{self.describe_log()}"
            )
        return str(r.json()["worker_id"])

    def log_text(self) -> str:
        """smg's log so far, colour codes removed ("" when there is none)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return _ANSI.sub("", self.log_path.read_text(errors="replace"))

    def wait_log(self, text: str, timeout_s: float = 30.0) -> None:
        """Wait until smg's log holds ``text`` (polled every 0.1 s); :class:`SmgError`
        with the log's tail when smg exits or ``timeout_s`` seconds pass first. smg
        lists a worker ready before it has registered the worker's tokenizer, for one."""
        end = time.monotonic() + timeout_s
        while text not in self.log_text():
            if self.proc is None or self.proc.poll() is not None or time.monotonic() > end:
                raise SmgError(f"smg's log did not show {text!r}\n{self.describe_log()}")
            time.sleep(0.1)

    def describe_log(self, lines: int = 60) -> str:
        """Where the log is and its last ``lines`` lines, for error messages."""
        tail = "\n".join(self.log_text().splitlines()[-lines:])
        return f"--- smg log {self.log_path} (last {lines} lines) ---\n{tail}"


def _all_ready(workers: list[dict[str, Any]], urls: Sequence[str]) -> bool:
    by_url = {w.get("url"): w for w in workers}
    return all(
        u in by_url and by_url[u].get("is_healthy") and by_url[u].get("status") == "ready"
        for u in urls
    )


@contextmanager
def smg_router(**kwargs: Any) -> Iterator[Smg]:
    """``with smg_router(worker_urls=[...], policy=...) as smg:`` — :class:`Smg` started,
    and stopped on exit whatever happens."""
    with Smg(**kwargs) as smg:
        yield smg
