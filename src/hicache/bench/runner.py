"""Per-config orchestration of the HTTP serving benchmarks (``multiturn``, ``long-context``).

* :func:`run_configs`: one :data:`Workload` per config, each on a fresh server of
  :func:`hicache.bench.serverproc.config_server` (or once on ``--url``), after a warm-up
  request and a flush; it gets a :class:`Session` (client, URL, progress bar, timed
  flushes) and its requests come back as a :class:`ConfigRun`;
* :func:`run_repeated`: every config's server (:data:`ServerFactory`) started once, then
  ``R`` repetitions of a workload per config, the configs in alternating order
  (:mod:`hicache.bench.pairs`), one under load at a time, each run between two flushes
  (:class:`RepeatedRuns`);
* :class:`Pacer`: Poisson spacing of request starts (``--request-rate``);
* the flags both benchmarks share (:func:`add_common_args`, :func:`parse_with_preset`)
  and the servers' sizes from them (:func:`tier_sizes`, :func:`round_to_pages`,
  :func:`server_spec`);
* :data:`TOKEN_LO`, :data:`TOKEN_HI`: the range of the synthetic token ids.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import random
import shlex
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager, AsyncExitStack, ExitStack
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from hicache.bench.httpclient import (
    RequestRecord,
    flush_cache,
    published_after,
    server_agreement,
    server_counters,
    server_ttft,
    stream_request,
)
from hicache.bench.pairs import alternating_order
from hicache.bench.serverproc import (
    ADMIN_KEY,
    CONFIG_NAMES,
    ConfigSkippedError,
    ServerError,
    ServerProcess,
    ServerSpec,
    config_server,
)

__all__ = [
    "TOKEN_HI",
    "TOKEN_LO",
    "ConfigRun",
    "Pacer",
    "RepeatedRuns",
    "ServerFactory",
    "Session",
    "Workload",
    "add_common_args",
    "bench_client",
    "parse_with_preset",
    "round_to_pages",
    "run_configs",
    "run_repeated",
    "server_spec",
    "tier_sizes",
    "warm_up",
]

TOKEN_LO, TOKEN_HI = 1000, 30000
"""Synthetic token ids are drawn from ``[TOKEN_LO, TOKEN_HI)``."""


# ---------------------------------------------------------------------------- configs


@dataclass
class Session:
    """What a workload gets while one config runs: the server, a progress bar, a flush."""

    client: httpx.AsyncClient
    url: str
    progress: tqdm
    flush_s: float = 0.0
    """Seconds spent in :meth:`flush` (left out of throughput wall time)."""

    async def flush(self) -> None:
        self.flush_s += await flush_cache(self.client, self.url)


Workload = Callable[[Session], Awaitable[list[list[RequestRecord]]]]
"""Runs the requests of one config; returns them grouped by round / phase."""


@dataclass
class ConfigRun:
    """The requests of one config, grouped, with its wall time (s, flushes excluded)."""

    name: str
    groups: list[list[RequestRecord]]
    wall_s: float
    server_ttft_mean_s: float | None
    flags: list[str] = field(default_factory=list)
    server_cpu_s: float | None = None
    """CPU time (s, user + system) the server process used during the run; None when
    unknown (``--url``, no ``/proc``)."""
    load_1m: float | None = None
    """The machine's 1-minute load average when the run ended (other jobs show here)."""
    group_wall_s: list[float] | None = None
    """Wall time of each group (s), when the groups pool several runs (see
    :func:`hicache.bench.results.pool_runs`); None: each group's first start to last end."""
    agreement_s: float = 0.0
    """Seconds the server's rank 0 spent in the agreement collectives during the run
    (``hicache_tp_agreement_seconds_total``; 0.0 with one rank)."""
    agreement_steps: int = 0
    """Engine steps under tensor parallelism during the run (``hicache_tp_steps_total``)."""
    counters: dict[str, float] = field(default_factory=dict)
    """Every ``/metrics`` sample's change over the run, by sample name (labels summed;
    meaningful for counters: ``hicache_l3_read_bytes_total``, ...)."""

    @property
    def agreement_us_per_step(self) -> float | None:
        """Mean agreement overhead per engine step (µs); None without TP steps."""
        return self.agreement_s / self.agreement_steps * 1e6 if self.agreement_steps else None


def bench_client(parallel: int, timeout_s: float) -> httpx.AsyncClient:
    """The benchmarks' HTTP client: ``parallel`` (+4) connections, ``timeout_s`` per
    request, and the admin key as its bearer token on every request (what an ``smg
    --api-key`` in front of the servers asks its clients for; a hicache server without
    ``--api-key`` ignores it)."""
    limits = httpx.Limits(max_connections=parallel + 4, max_keepalive_connections=parallel + 4)
    return httpx.AsyncClient(
        limits=limits,
        timeout=httpx.Timeout(timeout_s, connect=30.0),
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
    )


async def warm_up(client: httpx.AsyncClient, url: str, api: str = "completions") -> None:
    """One short unrelated request (by ``api``, :data:`hicache.bench.httpclient.APIS`),
    so first-call costs are out of the way."""
    warm = random.Random(-1)
    ids = [warm.randrange(TOKEN_LO, TOKEN_HI) for _ in range(32)]
    await stream_request(api, client, url, ids, 2, group=-1, client_id=-1)


CpuClock = Callable[[], float | None]
"""A server's CPU seconds so far (:meth:`hicache.bench.serverproc.ServerProcess.cpu_seconds`)."""


def _no_cpu() -> float | None:
    return None


def _load_1m() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


async def _timed_run(
    name: str,
    client: httpx.AsyncClient,
    url: str,
    workload: Workload,
    total: int,
    desc: str,
    cpu: CpuClock = _no_cpu,
) -> ConfigRun:
    """``POST /flush_cache``, then ``workload`` timed; then another flush (untimed), which
    also waits for the server's L2 / L3 writes to land, so that none of this run's
    background work overlaps what runs next. The server's CPU time (``cpu``) is taken
    from just before the workload to just after it."""
    await flush_cache(client, url)
    ttft0 = await server_ttft(client, url)
    agree0 = await server_agreement(client, url)
    counters0 = await server_counters(client, url)
    cpu0 = cpu()
    with tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False) as bar:
        session = Session(client, url, bar)
        t0 = time.perf_counter()
        groups = await workload(session)
        wall = time.perf_counter() - t0 - session.flush_s
    cpu1 = cpu()
    ttft1 = await server_ttft(client, url)
    agree1 = await server_agreement(client, url)
    counters1 = await _counters_after(client, url, t0 + wall + session.flush_s)
    await flush_cache(client, url)
    n = ttft1[1] - ttft0[1]
    return ConfigRun(
        name,
        groups,
        wall,
        (ttft1[0] - ttft0[0]) / n if n else None,
        server_cpu_s=cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None,
        load_1m=_load_1m(),
        agreement_s=agree1[0] - agree0[0],
        agreement_steps=agree1[1] - agree0[1],
        counters={k: v - counters0.get(k, 0.0) for k, v in counters1.items()},
    )


async def _counters_after(
    client: httpx.AsyncClient, url: str, since: float, wait_s: float = 2.0
) -> dict[str, float]:
    """:func:`server_counters` from cache figures the engine published after ``since``
    (``perf_counter``; ``hicache_stats_age_seconds`` tells), polled for up to ``wait_s``:
    the figures are published every ``stats_interval_s``, not on every request."""
    end = time.perf_counter() + wait_s
    while True:
        counters = await server_counters(client, url)
        now = time.perf_counter()
        if published_after(counters, since, now) or now > end:
            return counters
        await asyncio.sleep(0.05)


async def _run_session(
    name: str, url: str, workload: Workload, total: int, parallel: int, timeout_s: float
) -> ConfigRun:
    async with bench_client(parallel, timeout_s) as client:
        await warm_up(client, url)
        return await _timed_run(name, client, url, workload, total, name)


def run_configs(
    configs: Sequence[str],
    spec: ServerSpec,
    workload: Workload,
    *,
    total_requests: int,
    parallel: int,
    url: str | None = None,
    timeout_s: float = 600.0,
) -> tuple[list[ConfigRun], dict[str, str]]:
    """Run ``workload`` once per config, each on a fresh server (or once on ``url``).

    Returns the runs and ``{config: reason}`` for configs skipped or failed (the reason
    is printed, with the server's log tail on failure).
    """
    _quiet_httpx()
    runs: list[ConfigRun] = []
    problems: dict[str, str] = {}
    for name in configs:
        try:
            if url is not None:
                run = asyncio.run(
                    _run_session(name, url, workload, total_requests, parallel, timeout_s)
                )
            else:
                with config_server(name, spec) as server:
                    run = asyncio.run(
                        _run_session(
                            name, server.url, workload, total_requests, parallel, timeout_s
                        )
                    )
                    run.flags = list(server.flags)
            runs.append(run)
        except ConfigSkippedError as exc:
            _note(problems, name, f"skipped: {exc}")
        except (ServerError, httpx.HTTPError) as exc:
            _note(problems, name, f"failed: {type(exc).__name__}: {exc}")
    return runs, problems


def _quiet_httpx() -> None:
    """httpx logs every request at INFO: thousands of lines (and client CPU) per run."""
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


def _note(problems: dict[str, str], name: str, why: str) -> None:
    problems[name] = why
    print(f"{name}: {why}", file=sys.stderr)


@dataclass
class RepeatedRuns:
    """What :func:`run_repeated` measured: ``runs[r][config]`` is repetition ``r``'s run
    of ``config`` (absent once the config failed or when it was skipped), ``order[r]``
    the order the configs ran in during repetition ``r``."""

    configs: list[str]
    order: list[tuple[str, ...]]
    runs: list[dict[str, ConfigRun]]
    problems: dict[str, str]

    def of(self, name: str) -> list[ConfigRun]:
        """Every run of config ``name``, in repetition order."""
        return [rep[name] for rep in self.runs if name in rep]


ServerFactory = Callable[[str], AbstractContextManager[ServerProcess]]
"""Config name -> a context that starts its server (and helpers) and stops them on exit;
raises ConfigSkippedError or ServerError (:func:`hicache.bench.serverproc.config_server`)."""


def run_repeated(
    configs: Sequence[str],
    server_for: ServerFactory,
    workload_for: Callable[[int, str], Workload],
    *,
    repeats: int,
    total_requests: int,
    parallel: int,
    url: str | None = None,
    timeout_s: float = 600.0,
    api: str = "completions",
) -> RepeatedRuns:
    """Start every config's server once (``server_for(name)``, side by side; or use
    ``url`` for the one config), warm each up, then run ``repeats`` repetitions: in
    repetition ``r`` every config runs ``workload_for(r, name)`` in turn, in
    :func:`hicache.bench.pairs.alternating_order`, one config under load at a time, each
    run between two ``POST /flush_cache`` (:func:`_timed_run`). A config that fails to
    start, or fails in a repetition, is reported in ``problems`` and left out from then
    on; the others go on. ``api``: the route the warm-up request goes by (the workload
    picks its own).
    """
    if url is not None and len(configs) != 1:
        raise ValueError(f"--url serves one config, not {list(configs)}")
    _quiet_httpx()
    order = alternating_order(configs, repeats)
    problems: dict[str, str] = {}
    with ExitStack() as stack:
        servers: dict[str, _Server] = {}
        if url is not None:
            servers[configs[0]] = _Server(url, [], _no_cpu)
        for name in configs if url is None else ():
            try:
                sp = stack.enter_context(server_for(name))
            except ConfigSkippedError as exc:
                _note(problems, name, f"skipped: {exc}")
            except ServerError as exc:
                _note(problems, name, f"failed: {type(exc).__name__}: {exc}")
            else:
                servers[name] = _Server(sp.url, list(sp.flags), sp.cpu_seconds)
        runs = asyncio.run(
            _repeat(
                servers, order, workload_for, total_requests, parallel, timeout_s, problems, api
            )
        )
    return RepeatedRuns(list(configs), order, runs, problems)


@dataclass(frozen=True)
class _Server:
    """A started server as :func:`_repeat` uses it."""

    url: str
    flags: list[str]
    cpu: CpuClock


async def _repeat(
    servers: Mapping[str, _Server],
    order: Sequence[tuple[str, ...]],
    workload_for: Callable[[int, str], Workload],
    total: int,
    parallel: int,
    timeout_s: float,
    problems: dict[str, str],
    api: str,
) -> list[dict[str, ConfigRun]]:
    runs: list[dict[str, ConfigRun]] = [{} for _ in order]
    async with AsyncExitStack() as stack:
        clients = {
            n: await stack.enter_async_context(bench_client(parallel, timeout_s)) for n in servers
        }
        alive: list[str] = []
        for name, server in servers.items():
            try:
                await warm_up(clients[name], server.url, api)
                alive.append(name)
            except (ServerError, httpx.HTTPError) as exc:
                _note(problems, name, f"failed: {type(exc).__name__}: {exc}")
        for r, names in enumerate(order):
            for name in names:
                if name not in alive:
                    continue
                desc = f"{name} {r + 1}/{len(order)}"
                sv = servers[name]
                try:
                    run = await _timed_run(
                        name, clients[name], sv.url, workload_for(r, name), total, desc, sv.cpu
                    )
                except (ServerError, httpx.HTTPError) as exc:
                    why = f"failed in repetition {r + 1}: {type(exc).__name__}: {exc}"
                    _note(problems, name, why)
                    alive.remove(name)
                    continue
                run.flags = list(sv.flags)
                runs[r][name] = run
    return runs


class Pacer:
    """Spaces request starts by exponential gaps of mean ``1 / rate`` s (inf: no wait)."""

    def __init__(self, rate: float, seed: int) -> None:
        self.rate = rate
        self.rng = random.Random(seed)
        self.next_t = 0.0

    async def wait(self) -> None:
        if math.isinf(self.rate):
            return
        now = time.perf_counter()
        start = max(now, self.next_t)
        self.next_t = start + self.rng.expovariate(self.rate)
        await asyncio.sleep(start - now)


# ---------------------------------------------------------------------------- flags, sizes


def round_to_pages(tokens: float, page_size: int) -> int:
    """``tokens`` rounded up to a whole number of pages, in tokens (at least one page)."""
    return max(1, math.ceil(tokens / page_size)) * page_size


def tier_sizes(args: argparse.Namespace, working_set: int, min_l1: int) -> tuple[int, float]:
    """(L1 tokens, L2 ratio): L1 ~ a quarter of ``working_set`` tokens (>= ``min_l1``),
    L2 = 1.5 x the working set unless given."""
    ps = args.page_size
    l1 = args.l1_tokens or max(round_to_pages(working_set / 4, ps), round_to_pages(min_l1, ps))
    ratio = args.hicache_ratio or max(2.0, float(math.ceil(1.5 * working_set / l1)))
    return l1, ratio


def add_common_args(
    p: argparse.ArgumentParser, presets: Sequence[str] = ("tiny", "default-model", "gpu")
) -> None:
    """Flags shared by the serving benchmarks (server, configs, pacing, outputs);
    ``presets``: the names ``--preset`` takes (the benchmark's own)."""
    p.add_argument("--preset", choices=tuple(presets), default="tiny", help="sizes, model")
    p.add_argument("--model-path", help="model of the servers (preset default)")
    p.add_argument("--configs", default=",".join(CONFIG_NAMES), help="comma list of configs")
    p.add_argument("--url", default=None, help="use this running server (one config) instead")
    p.add_argument("--output-length", type=int, help="max_tokens per request")
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s (Poisson)")
    p.add_argument("--max-parallel", type=int, default=None, help="requests in flight at most")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--l1-tokens", type=int, default=None, help="L1 size (default: see doc)")
    p.add_argument("--hicache-ratio", type=float, default=None, help="L2 = ratio x L1")
    p.add_argument(
        "--tp-size",
        default="1",
        help="comma list of tensor-parallel sizes (e.g. 1,2): every config runs at each",
    )
    p.add_argument("--server-args", default="", help="more `hicache serve` flags, quoted")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="server start, s")
    p.add_argument("--request-timeout", type=float, default=600.0, help="per request, s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")


def parse_with_preset(
    p: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    presets: Mapping[str, Mapping[str, Any]],
) -> argparse.Namespace:
    """Parse ``argv`` with the chosen preset's values (from ``presets``) as defaults."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=sorted(presets), default="tiny")
    known, _ = pre.parse_known_args(argv)
    p.set_defaults(**presets[known.preset])
    return p.parse_args(argv)


def server_spec(args: argparse.Namespace, l1: int, ratio: float) -> ServerSpec:
    return ServerSpec(
        model_path=args.model_path,
        page_size=args.page_size,
        l1_tokens=l1,
        l2_ratio=ratio,
        extra_flags=tuple(shlex.split(args.server_args)),
        startup_timeout_s=args.startup_timeout,
    )
