"""``hicache bench multiturn``: multi-turn conversations over HTTP, under each cache config.

Workload: ``--num-clients`` clients each hold a conversation of ``--num-rounds`` rounds.
Round r sends the conversation so far plus a new user turn of ``--request-length`` token
ids, through ``POST /v1/completions`` with ``prompt`` as a list of ids (so lengths are
exact), greedy, streamed, ``max_tokens = --output-length``. The history then gets a
**synthetic assistant turn** of ``--output-length`` deterministic token ids instead of the
model's real output, so every config (and every run with the same ``--seed``) sends
identical prompts whatever the model generated or whether it stopped early at EOS. Token
ids are uniform in ``[1000, 30000)``, inside every supported tokenizer's vocabulary; no
two clients share a prefix.

Clients run their rounds back to back (a client's next round starts when its previous
answer is complete); ``--barrier`` makes every client wait for all others at the end of
each round; ``--flush-between-rounds`` (implies ``--barrier``) also ``POST /flush_cache``
after each round, emptying L1 and L2 so that the next round can only hit in L3.
``--request-rate`` spaces request starts by exponential gaps (a Poisson process, req/s;
default inf = no pacing) and ``--max-parallel`` caps the requests in flight.

Measured per request (client side, ``time.perf_counter``): **TTFT** = from sending the
request (after pacing and the ``--max-parallel`` slot) to the first SSE ``data:`` event.
The server sends an event as soon as a token adds text, so this is the first token's
arrival unless that token decodes to no text (rare; then a later token's). The server's
own TTFT mean (``hicache_ttft_seconds`` from ``/metrics``) is reported next to it.
Per config and per round: TTFT mean/p50/p90/p99 (s), input and output throughput (prompt
and completion tokens over the wall time from the first request sent to the last answer
done, flushes excluded; tokens/s) and the cache hit rate per tier (``usage
.cached_tokens_details`` summed over prompt tokens).

Configs (``--configs``, each its own ``hicache serve`` subprocess, same L1 size):
``no_cache``, ``l1``, ``l1_l2``, ``l1_l2_l3_file``, ``l1_l2_l3_mooncake`` (see
:func:`hicache.bench.serverproc.config_server`). L1 (``--max-total-tokens``) holds about a
quarter of the working set: clients x final conversation length / 4, in whole pages, but
at least one final conversation plus a page. L2 (``--hicache-ratio``) holds the whole
working set with 50% to spare, so without flushes L3 is written but not read.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import shlex
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from hicache.bench.plot import print_results, write_outputs
from hicache.bench.serverproc import (
    CONFIG_NAMES,
    TIERS,
    ConfigSkippedError,
    RequestRecord,
    ServerError,
    ServerSpec,
    config_server,
    flush_cache,
    parse_configs,
    round_to_pages,
    server_ttft,
    stream_completion,
)

__all__ = [
    "ConfigRun",
    "RequestRecord",
    "Session",
    "main",
    "run_configs",
    "stream_completion",
    "summarize",
]

TOKEN_LO, TOKEN_HI = 1000, 30000
"""Synthetic token ids are drawn from ``[TOKEN_LO, TOKEN_HI)``."""
CONFIG_KEYS = ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "input_tok_s",
               "output_tok_s", "hit_rate", "hit_tokens")  # fmt: skip

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        model_path="tiny-random-llama", num_clients=32, num_rounds=8, request_length=192,
        output_length=16, max_parallel=4,
    ),
    "default-model": dict(
        model_path="SmolLM2-135M-Instruct", num_clients=8, num_rounds=4, request_length=256,
        output_length=16, max_parallel=2,
    ),
    "gpu": dict(
        model_path="SmolLM2-135M-Instruct", num_clients=128, num_rounds=6, request_length=512,
        output_length=64, max_parallel=32,
    ),
}  # fmt: skip
"""``--preset`` defaults (explicit flags win). ``tiny`` is the default."""


# ---------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between ranks (numpy's)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(records: Sequence[RequestRecord], wall_s: float | None = None) -> dict[str, Any]:
    """TTFT stats (s), throughput (tokens/s over ``wall_s``, default first start to last
    end) and hit tokens per tier of ``records``; ``hit_rate`` = cached / prompt tokens."""
    if wall_s is None:
        wall_s = max(r.end_s for r in records) - min(r.start_s for r in records)
    ttfts = [r.ttft_s for r in records]
    prompt = sum(r.prompt_tokens for r in records)
    output = sum(r.output_tokens for r in records)
    hits = {t: sum(r.cached[t] for r in records) for t in TIERS}
    return {
        "ttft_mean_s": sum(ttfts) / len(ttfts),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "input_tok_s": prompt / wall_s if wall_s > 0 else 0.0,
        "output_tok_s": output / wall_s if wall_s > 0 else 0.0,
        "hit_rate": sum(hits.values()) / prompt if prompt else 0.0,
        "hit_tokens": hits,
        "requests": len(records),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "wall_s": wall_s,
    }


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


async def _run_session(
    name: str, url: str, workload: Workload, total: int, parallel: int, timeout_s: float
) -> ConfigRun:
    limits = httpx.Limits(max_connections=parallel + 4, max_keepalive_connections=parallel + 4)
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        warm = random.Random(-1)  # one short unrelated request: first-call costs out of the way
        ids = [warm.randrange(TOKEN_LO, TOKEN_HI) for _ in range(32)]
        await stream_completion(client, url, ids, 2, group=-1, client_id=-1)
        await flush_cache(client, url)
        ttft0 = await server_ttft(client, url)
        with tqdm(total=total, desc=name, unit="req", file=sys.stderr, leave=False) as bar:
            session = Session(client, url, bar)
            t0 = time.perf_counter()
            groups = await workload(session)
            wall = time.perf_counter() - t0 - session.flush_s
        ttft1 = await server_ttft(client, url)
    n = ttft1[1] - ttft0[1]
    return ConfigRun(name, groups, wall, (ttft1[0] - ttft0[0]) / n if n else None)


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
            problems[name] = f"skipped: {exc}"
            print(f"{name}: skipped: {exc}", file=sys.stderr)
        except (ServerError, httpx.HTTPError) as exc:
            problems[name] = f"failed: {type(exc).__name__}: {exc}"
            print(f"{name}: failed: {exc}", file=sys.stderr)
    return runs, problems


def config_json(run: ConfigRun, group_key: str) -> dict[str, Any]:
    """The per-config JSON entry: :data:`CONFIG_KEYS` over all requests plus one summary
    per group (``group_key`` = ``"rounds"`` or ``"phases"``) with its index (from 1)."""
    every = [r for g in run.groups for r in g]
    whole = summarize(every, run.wall_s)
    entry: dict[str, Any] = {k: whole[k] for k in CONFIG_KEYS}
    index = group_key[:-1]  # "round" / "phase"
    entry[group_key] = [{index: i + 1, **summarize(g)} for i, g in enumerate(run.groups) if g]
    return entry


# ---------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Conversations:
    """Every client's user turns and synthetic assistant turns (token ids)."""

    user: list[list[list[int]]]
    """``user[client][round]``: ``request_length`` ids."""
    assistant: list[list[list[int]]]
    """``assistant[client][round]``: ``output_length`` ids appended to the history."""

    @classmethod
    def make(
        cls, clients: int, rounds: int, request_len: int, output_len: int, seed: int
    ) -> Conversations:
        rng = random.Random(seed)

        def ids(n: int) -> list[int]:
            return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]

        user = [[ids(request_len) for _ in range(rounds)] for _ in range(clients)]
        assistant = [[ids(output_len) for _ in range(rounds)] for _ in range(clients)]
        return cls(user, assistant)

    def prompt(self, client: int, rnd: int) -> list[int]:
        """History of rounds ``< rnd`` (user + synthetic assistant) + user turn ``rnd``."""
        out: list[int] = []
        for i in range(rnd):
            out += self.user[client][i] + self.assistant[client][i]
        return out + self.user[client][rnd]


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


def multiturn_workload(conv: Conversations, args: argparse.Namespace) -> Workload:
    """The rounds of every client (see the module docstring for the schedule)."""
    clients, rounds = len(conv.user), len(conv.user[0])
    barrier = bool(args.barrier or args.flush_between_rounds)

    async def run(s: Session) -> list[list[RequestRecord]]:
        sem = asyncio.Semaphore(args.max_parallel or clients)
        pacer = Pacer(args.request_rate, args.seed + 1)
        groups: list[list[RequestRecord]] = [[] for _ in range(rounds)]

        async def one(c: int, r: int) -> None:
            await pacer.wait()
            async with sem:
                rec = await stream_completion(
                    s.client, s.url, conv.prompt(c, r), args.output_length, group=r, client_id=c
                )
            groups[r].append(rec)
            s.progress.update()

        if barrier:
            for r in range(rounds):
                await asyncio.gather(*(one(c, r) for c in range(clients)))
                if args.flush_between_rounds and r < rounds - 1:
                    await s.flush()
        else:

            async def client_loop(c: int) -> None:
                for r in range(rounds):
                    await one(c, r)

            await asyncio.gather(*(client_loop(c) for c in range(clients)))
        return groups

    return run


def tier_sizes(args: argparse.Namespace, working_set: int, min_l1: int) -> tuple[int, float]:
    """(L1 tokens, L2 ratio): L1 ~ a quarter of ``working_set`` tokens (>= ``min_l1``),
    L2 = 1.5 x the working set unless given."""
    ps = args.page_size
    l1 = args.l1_tokens or max(round_to_pages(working_set / 4, ps), round_to_pages(min_l1, ps))
    ratio = args.hicache_ratio or max(2.0, float(math.ceil(1.5 * working_set / l1)))
    return l1, ratio


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by the serving benchmarks (server, configs, pacing, outputs)."""
    p.add_argument(
        "--preset", choices=("tiny", "default-model", "gpu"), default="tiny", help="sizes, model"
    )
    p.add_argument("--model-path", help="model of the servers (preset default)")
    p.add_argument("--configs", default=",".join(CONFIG_NAMES), help="comma list of configs")
    p.add_argument("--url", default=None, help="use this running server (one config) instead")
    p.add_argument("--output-length", type=int, help="max_tokens per request")
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s (Poisson)")
    p.add_argument("--max-parallel", type=int, default=None, help="requests in flight at most")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--l1-tokens", type=int, default=None, help="L1 size (default: see doc)")
    p.add_argument("--hicache-ratio", type=float, default=None, help="L2 = ratio x L1")
    p.add_argument("--server-args", default="", help="more `hicache serve` flags, quoted")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="server start, s")
    p.add_argument("--request-timeout", type=float, default=600.0, help="per request, s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")


def parse_with_preset(
    p: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    presets: Mapping[str, Mapping[str, Any]] = PRESETS,
) -> argparse.Namespace:
    """Parse ``argv`` with the chosen preset's values (from ``presets``) as defaults."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=sorted(presets), default="tiny")
    known, _ = pre.parse_known_args(argv)
    p.set_defaults(**presets[known.preset])
    return p.parse_args(argv)


def meta_doc(
    args: argparse.Namespace,
    workload_keys: Sequence[str],
    l1: int,
    ratio: float,
    working_set: int,
    runs: Sequence[ConfigRun],
    problems: Mapping[str, str],
) -> dict[str, Any]:
    """The JSON ``meta`` entry: workload flags, tier sizes (tokens), and per config the
    server-side TTFT mean (s), the wall time (s), the server flags and any problem."""
    keys = [*workload_keys, "model_path", "max_parallel", "page_size", "seed"]
    rate = None if math.isinf(args.request_rate) else args.request_rate
    return {
        "workload": {k: getattr(args, k) for k in keys} | {"request_rate": rate},
        "l1_tokens": l1,
        "l2_ratio": ratio,
        "working_set_tokens": working_set,
        "server_ttft_mean_s": {r.name: r.server_ttft_mean_s for r in runs},
        "wall_s": {r.name: r.wall_s for r in runs},
        "server_flags": {r.name: r.flags for r in runs},
        "problems": dict(problems),
    }


def server_spec(args: argparse.Namespace, l1: int, ratio: float) -> ServerSpec:
    return ServerSpec(
        model_path=args.model_path,
        page_size=args.page_size,
        l1_tokens=l1,
        l2_ratio=ratio,
        extra_flags=tuple(shlex.split(args.server_args)),
        startup_timeout_s=args.startup_timeout,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every config ran, 1 when one failed, 2 on bad flags."""
    p = argparse.ArgumentParser(
        prog="hicache bench multiturn",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_args(p)
    p.add_argument("--num-clients", type=int, help="concurrent conversations")
    p.add_argument("--num-rounds", type=int, help="rounds per conversation")
    p.add_argument("--request-length", type=int, help="new user tokens per round")
    p.add_argument("--barrier", action="store_true", help="all clients finish a round first")
    p.add_argument("--flush-between-rounds", action="store_true", help="POST /flush_cache")
    args = parse_with_preset(p, argv)
    try:
        configs = parse_configs(args.configs)
    except ValueError as exc:
        p.error(str(exc))
    if min(args.num_clients, args.num_rounds, args.request_length, args.output_length) < 1:
        p.error("--num-clients, --num-rounds, --request-length and --output-length must be >= 1")
    if args.url and len(configs) != 1:
        configs = ["external"]
    final_len = args.num_rounds * (args.request_length + args.output_length)
    working_set = args.num_clients * final_len
    l1, ratio = tier_sizes(args, working_set, final_len + args.page_size)
    conv = Conversations.make(
        args.num_clients, args.num_rounds, args.request_length, args.output_length, args.seed
    )
    spec = server_spec(args, l1, ratio)
    print(
        f"multiturn: {args.num_clients} clients x {args.num_rounds} rounds, final conversation"
        f" {final_len} tokens, working set {working_set} tokens; L1 {l1} tokens, L2 = {ratio:g}"
        f" x L1; model {args.model_path}",
        file=sys.stderr,
    )
    runs, problems = run_configs(
        configs,
        spec,
        multiturn_workload(conv, args),
        total_requests=args.num_clients * args.num_rounds,
        parallel=args.max_parallel or args.num_clients,
        url=args.url,
        timeout_s=args.request_timeout,
    )
    doc: dict[str, Any] = {"configs": {r.name: config_json(r, "rounds") for r in runs}}
    keys = "num_clients num_rounds request_length output_length barrier flush_between_rounds"
    doc["meta"] = meta_doc(args, keys.split(), l1, ratio, working_set, runs, problems)
    title = (
        f"multiturn: {args.num_clients} clients x {args.num_rounds} rounds,"
        f" {args.request_length}+{args.output_length} tokens/round, L1 {l1} tokens"
    )
    if runs:
        print_results(title, doc, "rounds")
    write_outputs(doc, "rounds", title, args.json, args.plot)
    return 1 if problems and any(v.startswith("failed") for v in problems.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
