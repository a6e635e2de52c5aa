"""``hicache bench routing``: how well requests land where their prefix is, behind smg.

``--instances`` (2 to 4) ``hicache serve --grpc-mode`` workers with a small L1 and a larger
L2 serve one multi-tenant workload (:func:`workload`): ``--tenants`` tenants, each with a
distinct system prompt of ``--system-tokens`` ids, each request a tenant's prompt plus a
question of its own; ``--active-tenants`` tenants are active at a time and every
``--shift-every`` requests the longest-active one leaves and the next on a ring of all
tenants arrives (churn), so a tenant comes back after its prefix has left L1 (held in
L2 where it went before). The same workload runs once per *arm*, each from flushed
workers, the arms alternated over ``--rounds`` (each round rotates their order):

* ``grpc_cache_aware``: smg ``cache_aware`` over gRPC, routing by the workers' KV events
  (event-driven);
* ``http_cache_aware``: smg ``cache_aware`` over HTTP (its approximate tree of the
  request texts, here the ids as text, that it routed);
* ``grpc_round_robin`` and ``http_round_robin``: smg ``round_robin`` (the same routing
  over both protocols: their TTFTs compare the transports);
* ``oracle``: no router: each request goes straight to the worker that holds most of its
  prefix at that moment, read from every worker's KV event stream
  (:class:`hicache.bench.residency.ResidencyWatch`), plus the prefixes it sent there in
  the last 5 s (hindsight: a prefill under way counts where it was sent); a miss
  everywhere goes to the worker with the fewest requests in flight.

Every arm sends each request as token ids to ``/generate``, streamed, ``--concurrency``
at a time. Churn that makes a router's own memory wrong: ``--routers`` smg replicas per
arm take the requests in turn (each sees half of them), optionally joined in smg's HA
mesh (``--smg-mesh``, which shares their approximate trees); ``--direct-share`` of the
requests go straight to a worker drawn at random (the same in every arm), as traffic
that reaches a worker another way. Figures per arm: cached share of the routed requests
(the answers' ``cached_tokens`` over their prompt tokens), the same for the direct ones,
the workers' own hit counters over their looked-up tokens (all requests), TTFT p50 and
p99 (routed; client side: send to first streamed token), requests/s (requests over the
segment's wall time), requests per worker. smg's warm-up slice (a share of cache hits
and misses diverted to a worker with few pages) is off unless ``--smg-warmup``;
``--smg-booking-ms`` sets smg's ``--selection-accounting-ttl-ms`` (its bookings of a
routed prefix on the chosen worker until the worker's events report it; off by
default). A
benchmark, not a test: it asserts nothing. Method and results:
``docs/benchmarks/routing.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import re
import sys
import time
from collections import Counter, deque
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from hicache.bench.httpclient import flush_cache, parse_metrics, published_after
from hicache.bench.pairs import quantile
from hicache.bench.plot import plot_setups, print_table
from hicache.bench.report import write_json
from hicache.bench.residency import ResidencyWatch, page_hashes
from hicache.bench.runner import TOKEN_HI, TOKEN_LO
from hicache.bench.serverproc import ServerProcess
from hicache.bench.smgproc import Smg
from hicache.services.process import LOOPBACK, free_ports

__all__ = [
    "ARMS",
    "ArmRun",
    "Request",
    "RequestResult",
    "RoutingSpec",
    "main",
    "run",
    "summarize",
    "workload",
]

ARMS: tuple[str, ...] = (
    "grpc_cache_aware",
    "http_cache_aware",
    "grpc_round_robin",
    "http_round_robin",
    "oracle",
)
"""The arms, in their first round's order."""

_BRANCH = re.compile(r'branch="([a-z_]+)"')
"""A routing decision's branch in smg's debug log (``event_hit``, ``event_miss``,
``all_overloaded_fallback``, ...)."""

_CACHE_COUNTERS = (
    "hicache_device_hit_tokens_total",
    "hicache_host_hit_tokens_total",
    "hicache_storage_hit_tokens_total",
)


@dataclass(frozen=True, kw_only=True)
class RoutingSpec:
    """The bench's sizes (tokens, requests) and servers; validated on construction."""

    model_path: str = "tiny-random-llama"
    device: str = "cpu"
    instances: int = 2
    page_size: int = 16
    l1_tokens: int = 2048
    l2_ratio: float = 4.0
    tenants: int = 24
    active_tenants: int = 8
    shift_every: int = 4
    system_tokens: int = 512
    question_tokens: int = 32
    max_tokens: int = 4
    requests: int = 192
    concurrency: int = 4
    rounds: int = 1
    routers: int = 2
    arms: tuple[str, ...] = ARMS
    smg_warmup: bool = False
    smg_booking_ms: int = 0
    smg_mesh: bool = True
    direct_share: float = 0.0
    seed: int = 0
    startup_timeout_s: float = 120.0
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in (
            "page_size",
            "l1_tokens",
            "tenants",
            "active_tenants",
            "shift_every",
            "system_tokens",
            "question_tokens",
            "max_tokens",
            "requests",
            "concurrency",
            "rounds",
            "routers",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid; must be an int >= 1")
        if isinstance(self.smg_booking_ms, bool) or not (
            isinstance(self.smg_booking_ms, int) and self.smg_booking_ms >= 0
        ):
            raise ValueError(f"smg_booking_ms={self.smg_booking_ms!r} is invalid; an int >= 0")
        if not 2 <= self.instances <= 4:
            raise ValueError(f"instances={self.instances!r} is invalid; 2 to 4")
        if not 0.0 <= self.direct_share < 1.0:
            raise ValueError(f"direct_share={self.direct_share!r} is invalid; in [0, 1)")
        if self.routers > 4:
            raise ValueError(f"routers={self.routers!r} is invalid; 1 to 4")
        if self.active_tenants > self.tenants:
            raise ValueError(
                f"active_tenants={self.active_tenants} is more than tenants={self.tenants}"
            )
        if not self.l2_ratio >= 1.0:
            raise ValueError(f"l2_ratio={self.l2_ratio!r} is invalid; must be >= 1 (L2 >= L1)")
        prompt = self.system_tokens + self.question_tokens
        if prompt + self.max_tokens > self.l1_tokens:
            raise ValueError(
                f"a request ({prompt} prompt + {self.max_tokens} new tokens) does not fit"
                f" l1_tokens={self.l1_tokens}"
            )
        bad = [a for a in self.arms if a not in ARMS]
        if bad or not self.arms or len(set(self.arms)) != len(self.arms):
            raise ValueError(f"arms={self.arms!r} is invalid; distinct names from {ARMS}")

    def worker_flags(self) -> list[str]:
        """``hicache serve`` flags of every worker (``--grpc-mode`` is added by
        :class:`ServerProcess`)."""
        return [
            "--model-path",
            self.model_path,
            "--device",
            self.device,
            "--page-size",
            str(self.page_size),
            "--max-total-tokens",
            str(self.l1_tokens),
            "--enable-hierarchical-cache",
            "--hicache-ratio",
            f"{self.l2_ratio:g}",
        ]


@dataclass(frozen=True, slots=True)
class Request:
    """One request of the workload: its tenant, its prompt's token ids, and the worker
    it goes to straight, bypassing routing (``--direct-share``), or None (routed)."""

    tenant: int
    ids: tuple[int, ...]
    direct: int | None = None


def workload(spec: RoutingSpec) -> list[Request]:
    """The requests in order (deterministic in ``spec.seed``; see the module docstring)."""
    rng = random.Random(spec.seed)
    lane = random.Random(spec.seed + 1)  # its own stream: the routed requests stay the same
    systems = [
        tuple(rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(spec.system_tokens))
        for _ in range(spec.tenants)
    ]
    active = deque(range(spec.active_tenants))
    arriving = spec.active_tenants
    out: list[Request] = []
    for i in range(spec.requests):
        if i and i % spec.shift_every == 0:
            active.popleft()
            active.append(arriving % spec.tenants)
            arriving += 1
        tenant = rng.choice(active)
        question = tuple(rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(spec.question_tokens))
        direct = lane.randrange(spec.instances) if lane.random() < spec.direct_share else None
        out.append(Request(tenant, systems[tenant] + question, direct))
    return out


@dataclass(slots=True)
class RequestResult:
    """One request's outcome: ``status`` (HTTP code, ``timeout`` or ``error``), TTFT and
    latency (s, client side), prompt and cached tokens from the answer (None when the
    answer had none), the worker index (oracle and direct requests) and whether the
    request went straight to it (``--direct-share``)."""

    status: str = "none"
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    worker: int | None = None
    direct: bool = False
    error: str | None = None


@dataclass
class ArmRun:
    """One arm's pass over the workload: per-request results (workload order), wall
    time (s), per worker the requests it finished and its cache counters' growth, and
    how often smg's logs name each routing branch (``branch="event_hit"``, ...: its
    debug log, the event-driven arm's), over the arm's routers."""

    arm: str
    round: int
    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0
    worker_requests: list[int] = field(default_factory=list)
    worker_hit_tokens: list[float] = field(default_factory=list)
    worker_query_tokens: list[float] = field(default_factory=list)
    router_branches: dict[str, int] = field(default_factory=dict)


# ------------------------------------------------------------------ talking to workers


def _flush(workers: Sequence[ServerProcess]) -> None:
    """Empty every worker's L1 and L2 (its admin route, retried while a request runs)."""

    async def flush_all() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            for worker in workers:
                await flush_cache(client, worker.url, tries=100)

    asyncio.run(flush_all())


def _counters(workers: Sequence[ServerProcess]) -> list[dict[str, float]]:
    return [parse_metrics(httpx.get(f"{w.url}/metrics", timeout=10).text) for w in workers]


def _counters_after(
    workers: Sequence[ServerProcess], since: float, wait_s: float = 5.0
) -> list[dict[str, float]]:
    """:func:`_counters` once every worker's cache figures were published after ``since``
    (``perf_counter`` s; ``hicache_stats_age_seconds`` tells), polled for up to
    ``wait_s``: the engine publishes them every ``stats_interval_s``, not per request."""
    end = time.perf_counter() + wait_s
    while True:
        counters = _counters(workers)
        now = time.perf_counter()
        if all(published_after(c, since, now) for c in counters) or now > end:
            return counters
        time.sleep(0.05)


async def _send(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], out: RequestResult
) -> None:
    """One streamed ``/generate``: TTFT at the first event with output, cached and
    prompt tokens from the last event's ``meta_info``."""
    start = time.perf_counter()
    last: dict[str, Any] | None = None
    try:
        async with client.stream("POST", f"{url}/generate", json=body) as r:
            out.status = str(r.status_code)
            if r.status_code != 200:
                out.error = (await r.aread()).decode(errors="replace")[:300]
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line.removeprefix("data: "))
                event = event[0] if isinstance(event, list) else event
                if out.ttft_s is None and (event.get("output_ids") or event.get("text")):
                    out.ttft_s = time.perf_counter() - start
                last = event
    except httpx.TimeoutException:
        out.status = "timeout"
    except httpx.HTTPError as exc:
        out.status, out.error = "error", f"{type(exc).__name__}: {exc}"
    out.latency_s = time.perf_counter() - start
    meta = (last or {}).get("meta_info") or {}
    if out.status == "200" and meta:
        out.prompt_tokens = meta.get("prompt_tokens")
        out.cached_tokens = meta.get("cached_tokens")
        if out.ttft_s is None:
            out.ttft_s = out.latency_s


class _Oracle:
    """Picks, per request, the worker that holds the longest prefix of it, else the one
    with the fewest requests in flight (then the lowest index).

    What a worker holds is what its KV event stream reports resident (its watch), plus
    the pages of the requests the oracle sent it in the last ``booking_s`` seconds
    (hindsight: a prefix whose prefill is under way is where it was sent, before the
    worker's events say so).
    """

    def __init__(
        self, watches: Sequence[ResidencyWatch], page_size: int, booking_s: float = 5.0
    ) -> None:
        self.watches = list(watches)
        self.page_size = page_size
        self.booking_s = booking_s
        self.in_flight = [0] * len(watches)
        self.booked: list[dict[int, float]] = [{} for _ in watches]
        """Per worker: page hash -> when the oracle last sent a request with it."""

    def _held(self, w: int, hashes: Sequence[int], now: float) -> int:
        resident = self.watches[w].held_pages(hashes)
        booked = self.booked[w]
        n = 0
        for h in hashes:
            if n >= resident and now - booked.get(h, -1e9) > self.booking_s:
                break
            n += 1
        return n

    def pick(self, ids: Sequence[int]) -> int:
        hashes = page_hashes(ids, self.page_size)
        now = time.monotonic()
        held = [self._held(w, hashes, now) for w in range(len(self.watches))]
        best = max(held)
        candidates = [i for i, h in enumerate(held) if h == best]
        chosen = min(candidates, key=lambda i: (self.in_flight[i], i))
        for h in hashes:
            self.booked[chosen][h] = now
        return chosen


async def _run_arm(
    spec: RoutingSpec,
    requests: Sequence[Request],
    model: str,
    urls: Sequence[str],
    workers: Sequence[ServerProcess],
    oracle: _Oracle | None,
) -> tuple[list[RequestResult], float]:
    """Send every request (``--concurrency`` at a time, in order) to the routers ``urls``
    (request ``i`` to ``urls[i % len(urls)]``), or each to the oracle's pick; returns the
    results and the wall time."""
    results = [RequestResult() for _ in requests]
    queue: deque[int] = deque(range(len(requests)))
    limits = httpx.Limits(max_connections=spec.concurrency + 4)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue:
            i = queue.popleft()
            body: dict[str, Any] = {
                "model": model,
                "input_ids": list(requests[i].ids),
                "sampling_params": {
                    "max_new_tokens": spec.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
                "stream": True,
            }
            direct = requests[i].direct
            if direct is not None:
                results[i].worker, results[i].direct = direct, True
                await _send(client, workers[direct].url, body, results[i])
                continue
            if oracle is None:
                await _send(client, urls[i % len(urls)], body, results[i])
                continue
            w = oracle.pick(requests[i].ids)
            results[i].worker = w
            oracle.in_flight[w] += 1
            try:
                await _send(client, workers[w].url, body, results[i])
            finally:
                oracle.in_flight[w] -= 1

    async with httpx.AsyncClient(timeout=spec.request_timeout_s, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(spec.concurrency)))
        return results, time.perf_counter() - start


def _smg_for(
    spec: RoutingSpec, arm: str, workers: Sequence[ServerProcess], mesh: Sequence[int], index: int
) -> Smg:
    """Router ``index`` of an arm; ``mesh``: every router's mesh port when ``--smg-mesh``
    (router 0 is the seed the others join), else empty."""
    grpc = arm.startswith("grpc_")
    extra = [] if spec.smg_warmup else ["--worker-warmup-secs", "0"]
    if mesh:
        extra += ["--enable-mesh", "--mesh-host", LOOPBACK, "--mesh-port", str(mesh[index])]
        extra += [] if index == 0 else ["--mesh-peer-urls", f"{LOOPBACK}:{mesh[0]}"]
    extra += [] if spec.smg_warmup else ["--worker-warmup-divert-every", "0"]
    if spec.smg_booking_ms and arm.endswith("cache_aware"):
        extra += ["--selection-accounting-ttl-ms", str(spec.smg_booking_ms)]
    return Smg(
        worker_urls=[w.grpc_url if grpc else w.url for w in workers],
        policy=arm.split("_", 1)[1],
        log_level="debug" if arm == "grpc_cache_aware" else "info",
        startup_timeout_s=spec.startup_timeout_s,
        extra_args=extra,
    )


def _wait_smg_grpc(
    smg: Smg, model: str, workers: Sequence[ServerProcess], subscribed: bool
) -> None:
    """Until smg has the tokenizer and (``subscribed``) a KV event subscription to every
    worker."""
    smg.wait_log(f"Successfully loaded tokenizer '{model}'", 60)
    if not subscribed:
        return
    end = time.monotonic() + 60
    while True:
        lines = [ln for ln in smg.log_text().splitlines() if "KV event stream connected" in ln]
        if all(any(w.grpc_url in ln for ln in lines) for w in workers):
            return
        if time.monotonic() > end:
            raise RuntimeError(f"smg did not subscribe to every worker\n{smg.describe_log()}")
        time.sleep(0.1)


def run(spec: RoutingSpec, *, log: Any = sys.stderr) -> list[ArmRun]:
    """Start the workers, run every arm of every round, stop everything."""
    requests = workload(spec)
    runs: list[ArmRun] = []
    with ExitStack() as stack:
        workers: list[ServerProcess] = []
        for _ in range(spec.instances):
            w = ServerProcess(
                spec.worker_flags(), startup_timeout_s=spec.startup_timeout_s, grpc=True
            )
            stack.callback(w.close)
            workers.append(w.start())
        model = httpx.get(f"{workers[0].url}/v1/models", timeout=10).json()["data"][0]["id"]
        for rnd in range(spec.rounds):
            k = rnd % len(spec.arms)
            for arm in (*spec.arms[k:], *spec.arms[:k]):
                print(f"routing: round {rnd + 1}, {arm}", file=log)
                _flush(workers)
                before = _counters(workers)
                with ExitStack() as arm_stack:
                    urls: list[str] = []
                    routers: list[Smg] = []
                    oracle: _Oracle | None = None
                    if arm == "oracle":  # its streams only now: smg is forked without them
                        watches = [
                            arm_stack.enter_context(ResidencyWatch(w.grpc_url)) for w in workers
                        ]
                        oracle = _Oracle(watches, spec.page_size)
                    else:
                        mesh = (
                            free_ports(spec.routers) if spec.smg_mesh and spec.routers > 1 else []
                        )
                        for r in range(spec.routers):
                            smg = arm_stack.enter_context(_smg_for(spec, arm, workers, mesh, r))
                            if arm.startswith("grpc_"):
                                _wait_smg_grpc(smg, model, workers, arm.endswith("cache_aware"))
                            urls.append(smg.url)
                            routers.append(smg)
                    results, wall = asyncio.run(
                        _run_arm(spec, requests, model, urls, workers, oracle)
                    )
                    branches = Counter(b for r in routers for b in _BRANCH.findall(r.log_text()))
                after = _counters_after(workers, time.perf_counter())
                run_ = ArmRun(arm, rnd, results, wall, router_branches=dict(branches))
                for b, a in zip(before, after, strict=True):
                    run_.worker_requests.append(
                        round(
                            a.get("hicache_requests_total", 0) - b.get("hicache_requests_total", 0)
                        )
                    )
                    run_.worker_hit_tokens.append(
                        sum(a.get(c, 0) - b.get(c, 0) for c in _CACHE_COUNTERS)
                    )
                    run_.worker_query_tokens.append(
                        a.get("hicache_query_tokens_total", 0)
                        - b.get("hicache_query_tokens_total", 0)
                    )
                runs.append(run_)
    return runs


# ------------------------------------------------------------------ figures


def summarize(runs: Sequence[ArmRun]) -> dict[str, dict[str, Any]]:
    """Per arm, pooled over its rounds: ``cached_share`` (the routed answers' cached over
    prompt tokens; None when no answer had them), ``direct_cached_share`` (the same over
    the requests sent straight to a worker; None without any), ``worker_cached_share``
    (workers' hit over looked-up tokens, every request), ``ttft_p50_s``, ``ttft_p99_s``
    (routed requests), ``requests_per_s`` (all requests over the arm's summed wall time),
    ``ok``, ``errors``, ``worker_requests``, ``router_branches`` (summed)."""
    out: dict[str, dict[str, Any]] = {}
    for arm in dict.fromkeys(r.arm for r in runs):
        mine = [r for r in runs if r.arm == arm]
        results = [x for r in mine for x in r.results]
        ok = [x for x in results if x.status == "200"]
        routed = [x for x in ok if not x.direct]
        ttfts = [x.ttft_s for x in routed if x.ttft_s is not None]
        query = sum(sum(r.worker_query_tokens) for r in mine)
        out[arm] = {
            "cached_share": _cached_share(routed),
            "direct_cached_share": _cached_share([x for x in ok if x.direct]),
            "worker_cached_share": (
                sum(sum(r.worker_hit_tokens) for r in mine) / query if query else None
            ),
            "ttft_p50_s": quantile(ttfts, 0.5) if ttfts else None,
            "ttft_p99_s": quantile(ttfts, 0.99) if ttfts else None,
            "requests_per_s": len(results) / sum(r.wall_s for r in mine),
            "ok": len(ok),
            "errors": len(results) - len(ok),
            "first_errors": [x.error for x in results if x.error][:3],
            "worker_requests": [
                sum(c) for c in zip(*(r.worker_requests for r in mine), strict=True)
            ],
            "router_branches": dict(sum((Counter(r.router_branches) for r in mine), Counter())),
        }
    return out


def _cached_share(results: Sequence[RequestResult]) -> float | None:
    """Cached over prompt tokens of the answers that report both; None without any."""
    counted = [x for x in results if x.cached_tokens is not None and x.prompt_tokens]
    prompt = sum(x.prompt_tokens or 0 for x in counted)
    return sum(x.cached_tokens or 0 for x in counted) / prompt if prompt else None


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{1e3 * x:.1f}"


def print_report(spec: RoutingSpec, summary: dict[str, dict[str, Any]]) -> None:
    title = (
        f"routing: {spec.instances} x {spec.model_path} on {spec.device}, L1 {spec.l1_tokens}"
        f" + L2 {spec.l2_ratio:g}x tokens each; {spec.tenants} tenants ({spec.active_tenants}"
        f" active, one more every {spec.shift_every}) x {spec.system_tokens}-token prompts,"
        f" {spec.requests} requests x {spec.rounds} rounds, concurrency {spec.concurrency},"
        f" {spec.routers} router(s) per arm, {100 * spec.direct_share:g}% sent direct;"
        f" smg warm-up {'on' if spec.smg_warmup else 'off'},"
        f" bookings {spec.smg_booking_ms} ms, mesh {'on' if spec.smg_mesh else 'off'}"
    )
    rows = [
        [
            arm,
            _pct(s["cached_share"]),
            _pct(s["direct_cached_share"]),
            _pct(s["worker_cached_share"]),
            _ms(s["ttft_p50_s"]),
            _ms(s["ttft_p99_s"]),
            f"{s['requests_per_s']:.2f}",
            str(s["errors"]),
            "/".join(str(n) for n in s["worker_requests"]),
        ]
        for arm, s in summary.items()
    ]
    columns = ["arm", "cached %", "direct cached %", "cached % (workers)"]
    columns += ["TTFT p50 ms", "TTFT p99 ms"]
    print_table(title, [*columns, "req/s", "errors", "per worker"], rows)
    for arm, s in summary.items():
        if s["router_branches"]:
            counts = ", ".join(f"{b} {n}" for b, n in sorted(s["router_branches"].items()))
            print(f"{arm}: smg's routing branches: {counts}")
        for e in s["first_errors"]:
            print(f"{arm} error: {e}")


def _parser() -> argparse.ArgumentParser:
    d = RoutingSpec()
    p = argparse.ArgumentParser(
        prog="hicache bench routing",
        description="Routing policies behind smg (event-driven gRPC, approximate HTTP,"
        " round robin) against a residency oracle, on a multi-tenant churn workload.",
    )
    p.add_argument("--model-path", default=d.model_path)
    p.add_argument("--device", default=d.device)
    p.add_argument("--instances", type=int, default=d.instances, help="2 to 4 workers")
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--l1-tokens", type=int, default=d.l1_tokens, help="--max-total-tokens")
    p.add_argument("--l2-ratio", type=float, default=d.l2_ratio, help="--hicache-ratio")
    p.add_argument("--tenants", type=int, default=d.tenants)
    p.add_argument("--active-tenants", type=int, default=d.active_tenants)
    p.add_argument("--shift-every", type=int, default=d.shift_every, help="requests per arrival")
    p.add_argument("--system-tokens", type=int, default=d.system_tokens)
    p.add_argument("--question-tokens", type=int, default=d.question_tokens)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--requests", type=int, default=d.requests, help="per arm and round")
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--rounds", type=int, default=d.rounds, help="alternations of the arms")
    p.add_argument(
        "--routers",
        type=int,
        default=d.routers,
        help="smg replicas per arm, requests alternated between them (1 to 4)",
    )
    p.add_argument("--arms", default=",".join(d.arms), help=f"comma list from {','.join(ARMS)}")
    p.add_argument("--smg-warmup", action="store_true", help="keep smg's warm-up slice on")
    p.add_argument(
        "--smg-booking-ms",
        type=int,
        default=d.smg_booking_ms,
        help="smg's --selection-accounting-ttl-ms for cache_aware (0: its default, off)",
    )
    p.add_argument(
        "--smg-mesh",
        action=argparse.BooleanOptionalAction,
        default=d.smg_mesh,
        help="join an arm's routers in smg's HA mesh (--enable-mesh), which shares their trees",
    )
    p.add_argument(
        "--direct-share",
        type=float,
        default=d.direct_share,
        help="share of the requests sent straight to a random worker, not routed (0 to <1)",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", default=None, help="write the runs and the summary here")
    p.add_argument("--plot", default=None, help="write a PNG of the summary here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    try:
        spec = RoutingSpec(
            model_path=args.model_path,
            device=args.device,
            instances=args.instances,
            page_size=args.page_size,
            l1_tokens=args.l1_tokens,
            l2_ratio=args.l2_ratio,
            tenants=args.tenants,
            active_tenants=args.active_tenants,
            shift_every=args.shift_every,
            system_tokens=args.system_tokens,
            question_tokens=args.question_tokens,
            max_tokens=args.max_tokens,
            requests=args.requests,
            concurrency=args.concurrency,
            rounds=args.rounds,
            routers=args.routers,
            arms=tuple(a.strip() for a in args.arms.split(",") if a.strip()),
            smg_warmup=args.smg_warmup,
            smg_booking_ms=args.smg_booking_ms,
            smg_mesh=args.smg_mesh,
            direct_share=args.direct_share,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"hicache bench routing: {exc}", file=sys.stderr)
        return 2
    runs = run(spec)
    summary = summarize(runs)
    print_report(spec, summary)
    if args.json:
        write_json(
            args.json,
            {"spec": asdict(spec), "summary": summary, "runs": [asdict(r) for r in runs]},
        )
    if args.plot:
        plot_setups(
            args.plot,
            title=f"hicache bench routing: {spec.instances} instances, {spec.tenants} tenants",
            panels={
                "cached share (%)": {
                    a: None if s["cached_share"] is None else 100 * s["cached_share"]
                    for a, s in summary.items()
                },
                "TTFT p50 (ms)": {
                    a: None if s["ttft_p50_s"] is None else 1e3 * s["ttft_p50_s"]
                    for a, s in summary.items()
                },
                "TTFT p99 (ms)": {
                    a: None if s["ttft_p99_s"] is None else 1e3 * s["ttft_p99_s"]
                    for a, s in summary.items()
                },
                "requests/s": {a: s["requests_per_s"] for a, s in summary.items()},
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
