"""``hicache bench pd-load``: a prefill/decode pair under memory pressure behind SGLang's
router, against one plain server with the same memory.

Three ``hicache serve`` processes, each with ``--max-total-tokens`` (default 2048): a plain
instance, and a prefill and a decode instance behind ``smg launch --pd-disaggregation``.
``--requests`` distinct prompts of ``--prompt-tokens`` ids go all at once through ``POST
/generate`` (greedy, not streamed), first to the plain instance, then to smg. Figures per
setup (client side, send to whole answer): answers 200, errors by status (``timeout`` past
``--request-timeout``), p50 / p99 / max latency and wall time (s); for the pair, answers
equal to the plain instance's and whether both end idle. A benchmark, not a test: it
asserts nothing. The method in full: ``docs/benchmarks/pd.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from hicache.bench.httpclient import parse_metrics
from hicache.bench.runner import TOKEN_HI, TOKEN_LO
from hicache.bench.serverproc import ADMIN_KEY, ServerProcess
from hicache.bench.smgproc import Smg
from hicache.services.process import free_port

__all__ = ["LoadResult", "PdLoadSpec", "held", "idle", "main", "prompts", "run", "send_all"]


@dataclass(frozen=True, kw_only=True)
class PdLoadSpec:
    """The bench's sizes (tokens, requests, seconds) and its servers; validated."""

    model_path: str = "tiny-random-llama"
    device: str = "cpu"
    max_total_tokens: int = 2048
    requests: int = 64
    prompt_tokens: int = 870
    max_tokens: int = 16
    transfer: str = "mooncake"
    seed: int = 0
    startup_timeout_s: float = 120.0
    request_timeout_s: float = 300.0
    idle_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_total_tokens", "requests", "prompt_tokens", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid; must be an int >= 1")
        if self.prompt_tokens + self.max_tokens > self.max_total_tokens:
            raise ValueError(
                f"prompt_tokens + max_tokens = {self.prompt_tokens + self.max_tokens} is more"
                f" than max_total_tokens={self.max_total_tokens}: no request would ever fit"
            )
        if self.transfer not in ("mooncake", "nixl"):
            raise ValueError(f"transfer={self.transfer!r} is invalid; mooncake or nixl")
        for name in ("startup_timeout_s", "request_timeout_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid; must be > 0")

    def base_flags(self) -> list[str]:
        return [
            "--model-path",
            self.model_path,
            "--device",
            self.device,
            "--max-total-tokens",
            str(self.max_total_tokens),
        ]


@dataclass
class LoadResult:
    """One setup's run: each request's ``status`` (HTTP code, or ``timeout`` /
    ``error``), ``latency_s`` and ``output_ids`` (None unless 200), in request order."""

    setup: str
    status: list[str] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    output_ids: list[list[int] | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """The first few error bodies, for the reader."""
    wall_s: float = 0.0
    same_as_plain: int | None = None
    idle_after: bool | None = None

    @property
    def ok(self) -> int:
        return self.status.count("200")

    def percentile(self, q: float) -> float:
        xs = sorted(self.latency_s)
        if not xs:
            return float("nan")
        return xs[min(len(xs) - 1, max(0, round(q * len(xs) + 0.5) - 1))]


def prompts(spec: PdLoadSpec) -> list[list[int]]:
    rng = random.Random(spec.seed)
    return [
        [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(spec.prompt_tokens)]
        for _ in range(spec.requests)
    ]


async def _one(
    client: httpx.AsyncClient, url: str, ids: list[int], spec: PdLoadSpec, out: LoadResult, i: int
) -> None:
    body = {
        "input_ids": ids,
        "sampling_params": {
            "max_new_tokens": spec.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
    }
    t = time.perf_counter()
    try:
        r = await client.post(f"{url}/generate", json=body)
        status = str(r.status_code)
        if r.status_code == 200:
            out.output_ids[i] = list(r.json()["output_ids"])
        elif len(out.errors) < 5:
            out.errors.append(f"{r.status_code}: {r.text[:300]}")
    except httpx.TimeoutException:
        status = "timeout"
    except httpx.HTTPError as exc:
        status = "error"
        if len(out.errors) < 5:
            out.errors.append(f"{type(exc).__name__}: {exc}")
    out.status[i] = status
    out.latency_s[i] = time.perf_counter() - t


async def send_all(
    url: str, spec: PdLoadSpec, setup: str, headers: dict[str, str] | None = None
) -> LoadResult:
    """Every prompt of ``spec`` to ``url`` at once (``headers``: the admin key's by
    default, which smg here wants of its clients)."""
    batch = prompts(spec)
    out = LoadResult(setup)
    out.status = ["none"] * len(batch)
    out.latency_s = [0.0] * len(batch)
    out.output_ids = [None] * len(batch)
    limits = httpx.Limits(max_connections=len(batch) + 4, max_keepalive_connections=len(batch))
    if headers is None:
        headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    async with httpx.AsyncClient(
        timeout=spec.request_timeout_s, limits=limits, headers=headers
    ) as client:
        t = time.perf_counter()
        await asyncio.gather(*(_one(client, url, ids, spec, out, i) for i, ids in enumerate(batch)))
        out.wall_s = time.perf_counter() - t
    return out


_HELD = (
    "hicache_num_admitted_reqs",
    "hicache_num_parked_reqs",
    "hicache_num_queue_reqs",
    "hicache_num_open_rooms",
    'hicache_device_tokens{holder="requests"}',
)


def held(url: str) -> float:
    """Queued, admitted and parked requests, open rooms and L1 tokens held by requests,
    from ``/metrics`` (0: idle)."""
    samples = parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text, labels=True)
    return sum(samples.get(name, 0.0) for name in _HELD)


def idle(urls: list[str], timeout_s: float) -> bool:
    """Whether every one of ``urls`` is idle (:func:`held`) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if all(held(u) == 0 for u in urls):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def run(spec: PdLoadSpec) -> list[LoadResult]:
    """The plain instance's run, then the pair's; every process stopped at the end."""
    results: list[LoadResult] = []
    with ExitStack() as stack:
        plain = stack.enter_context(
            ServerProcess(spec.base_flags(), startup_timeout_s=spec.startup_timeout_s)
        )
        print(f"pd-load: {spec.requests} requests to the plain instance", file=sys.stderr)
        base = asyncio.run(send_all(plain.url, spec, "plain"))
        base.idle_after = idle([plain.url], spec.idle_timeout_s)
        results.append(base)
    with ExitStack() as stack:
        bootstrap = free_port()
        transfer = ["--disaggregation-transfer-backend", spec.transfer]
        prefill_flags = [*spec.base_flags(), *transfer, "--disaggregation-mode", "prefill"]
        prefill_flags += ["--disaggregation-bootstrap-port", str(bootstrap)]
        decode_flags = [*spec.base_flags(), *transfer, "--disaggregation-mode", "decode"]
        prefill = ServerProcess(prefill_flags, startup_timeout_s=spec.startup_timeout_s)
        decode = ServerProcess(decode_flags, startup_timeout_s=spec.startup_timeout_s)
        stack.callback(prefill.close)
        stack.callback(decode.close)
        prefill.start()
        decode.start()
        smg = stack.enter_context(
            Smg(
                prefill=[(prefill.url, bootstrap)],
                decode=[decode.url],
                policy="round_robin",
                api_key=ADMIN_KEY,
                log_level="info",
                startup_timeout_s=spec.startup_timeout_s,
            )
        )
        print(f"pd-load: {spec.requests} requests through smg to the pair", file=sys.stderr)
        pd = asyncio.run(send_all(smg.url, spec, "pd"))
        pd.same_as_plain = sum(
            1
            for a, b in zip(pd.output_ids, base.output_ids, strict=True)
            if a is not None and a == b
        )
        pd.idle_after = idle([prefill.url, decode.url], spec.idle_timeout_s)
        results.append(pd)
    return results


def print_report(spec: PdLoadSpec, results: list[LoadResult]) -> None:
    print(
        f"pd-load: {spec.requests} concurrent requests of {spec.prompt_tokens} prompt tokens,"
        f" {spec.max_tokens} generated, --max-total-tokens {spec.max_total_tokens} per instance,"
        f" {spec.model_path} on {spec.device}, PD over {spec.transfer} behind smg (defaults)"
    )
    head = ("setup", "ok", "errors", "p50 s", "p99 s", "max s", "wall s", "same", "idle after")
    rows = []
    for r in results:
        errors = Counter(s for s in r.status if s != "200")
        rows.append(
            (
                r.setup,
                str(r.ok),
                ", ".join(f"{n}x{s}" for s, n in sorted(errors.items())) or "0",
                f"{r.percentile(0.5):.2f}",
                f"{r.percentile(0.99):.2f}",
                f"{max(r.latency_s, default=float('nan')):.2f}",
                f"{r.wall_s:.2f}",
                "-" if r.same_as_plain is None else f"{r.same_as_plain}/{len(r.status)}",
                str(r.idle_after),
            )
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    for r in results:
        for e in r.errors:
            print(f"{r.setup} error: {e}")


def _parser() -> argparse.ArgumentParser:
    d = PdLoadSpec()
    p = argparse.ArgumentParser(
        prog="hicache bench pd-load",
        description="A prefill/decode pair under memory pressure behind smg vs a plain server.",
    )
    p.add_argument("--model-path", default=d.model_path)
    p.add_argument("--device", default=d.device)
    p.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens)
    p.add_argument("--requests", type=int, default=d.requests, help="sent all at once")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--transfer", choices=("mooncake", "nixl"), default=d.transfer)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s)
    p.add_argument("--idle-timeout", type=float, default=d.idle_timeout_s)
    p.add_argument("--json", default=None, help="write the report as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        spec = PdLoadSpec(
            model_path=args.model_path,
            device=args.device,
            max_total_tokens=args.max_total_tokens,
            requests=args.requests,
            prompt_tokens=args.prompt_tokens,
            max_tokens=args.max_tokens,
            transfer=args.transfer,
            seed=args.seed,
            request_timeout_s=args.request_timeout,
            idle_timeout_s=args.idle_timeout,
        )
    except ValueError as exc:
        print(f"hicache bench pd-load: {exc}", file=sys.stderr)
        return 2
    results = run(spec)
    print_report(spec, results)
    report: dict[str, Any] = {"spec": asdict(spec), "results": []}
    for r in results:
        d = asdict(r)
        d.update(ok=r.ok, p50_s=r.percentile(0.5), p99_s=r.percentile(0.99))
        report["results"].append(d)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
