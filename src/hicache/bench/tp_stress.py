"""``hicache bench tp-stress``: N tensor-parallel ranks through a shared-prefix workload
with every cache tier too small, then a check that nothing leaked, hung or diverged.

Per config (one model at one rank count), in a fresh process: an
:class:`~hicache.engine.front.engine.Engine` with ``tp_size = --ranks`` on CPU, L1 and L2 a
few requests large (every component is evicted) and a ``file`` L3 in a temp dir; ``--prompts``
requests over ``--rounds`` rounds of the same (system prompt, suffix) pairs, shuffled per
round, at most ``--parallel`` in flight; with ``--nnodes N`` the ranks span N "nodes" on
loopback, node 0 in this process and each other node a process of its own running what
``hicache serve --node-rank R`` runs (:func:`~hicache.engine.drivers.node.run_node`). Checks, before the engine closes: no hang (all
finished within ``--timeout-s``, none failed), peak RSS per rank (MiB, ``VmHWM``), idle
(rank 0's pools hold only cached pages once in-flight copies landed) and equal (every
rank's ``Engine.rank_digests`` is rank 0's). Units: wall s, tokens/s = (prompt + output
tokens) / wall. Exit status 1 when a check failed. The method in full:
``docs/benchmarks/tp.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from hicache.bench.report import print_table, write_json
from hicache.bench.runner import TOKEN_HI, TOKEN_LO
from hicache.config import CacheConfig
from hicache.engine.drivers.node import run_node
from hicache.engine.front.engine import Engine, EngineConfig, EngineStats
from hicache.engine.nodes import NodeConfig
from hicache.engine.request import RequestOutput
from hicache.engine.roles.role_setup import follower_roles
from hicache.engine.sampling import SamplingParams
from hicache.engine.step.scheduler import SchedulerConfig
from hicache.services.process import LOOPBACK, free_port
from hicache.validate import int_at_least, require

__all__ = [
    "StressConfig",
    "StressResult",
    "check_idle",
    "main",
    "peak_rss_mib",
    "run_stress",
    "wait_quiet",
]

DEFAULT_MODELS = ("tiny-random-deepseek-v32", "tiny-random-llama")
"""MLA latent + the DSA indexer, and MHA (the tiny Llama's 2 K/V heads split over 2 ranks,
replicated over 4). For 16 ranks: the ``tiny-random-*-wide`` models
(:data:`~hicache.runner.checkpoints.TINY_WIDE_MODELS`)."""


@dataclass(frozen=True, kw_only=True)
class StressConfig:
    """One stress run. Token counts are tokens; ``page_size`` divides ``system_tokens``.

    ``l1_tokens`` / ``hicache_ratio``: L1 and L2 (``ratio x l1``) sizes, both far below the
    workload's distinct tokens so that each tier evicts. ``timeout_s``: the wall-clock
    bound of the whole run (requests and checks)."""

    model: str = "tiny-random-deepseek-v32"
    ranks: int = 4
    nnodes: int = 1
    """The "nodes" (process trees on loopback) the ranks span; divides ``ranks``."""
    prompts: int = 512
    systems: int = 4
    rounds: int = 2
    system_tokens: int = 32
    suffix_tokens: tuple[int, int] = (5, 14)
    """Each user suffix's length is drawn from ``[lo, hi]``."""
    output_tokens: int = 4
    parallel: int = 16
    max_running: int = 8
    page_size: int = 4
    l1_tokens: int = 256
    hicache_ratio: float = 2.0
    prefetch_policy: str = "timeout"
    timeout_s: float = 1800.0
    seed: int = 0
    l3_dir: str | None = None
    """The file L3's directory (None: a fresh temp dir, removed after)."""

    def __post_init__(self) -> None:
        for name in ("ranks", "prompts", "systems", "rounds", "system_tokens", "output_tokens"):
            int_at_least(name, getattr(self, name), 1)
        int_at_least("nnodes", self.nnodes, 1)
        require(
            self.ranks % self.nnodes == 0,
            "nnodes",
            self.nnodes,
            f"must divide ranks ({self.ranks})",
        )
        for name in ("parallel", "max_running", "page_size"):
            int_at_least(name, getattr(self, name), 1)
        lo, hi = self.suffix_tokens
        require(
            1 <= lo <= hi, "suffix_tokens", self.suffix_tokens, "must be (lo, hi), 1 <= lo <= hi"
        )
        require(
            self.prompts % self.rounds == 0,
            "prompts",
            self.prompts,
            f"must be a multiple of rounds ({self.rounds})",
        )
        require(
            self.system_tokens % self.page_size == 0,
            "system_tokens",
            self.system_tokens,
            f"must be a multiple of page_size ({self.page_size})",
        )
        require(self.timeout_s > 0, "timeout_s", self.timeout_s, "must be > 0 seconds")

    @property
    def context_length(self) -> int:
        return self.system_tokens + self.suffix_tokens[1] + self.output_tokens + self.page_size


@dataclass(frozen=True)
class StressResult:
    """What one run found. ``peak_rss_mib``: by rank (0 = this process). ``hung``: some
    request did not finish within the bound; ``failed``: requests that ended with an
    error. ``idle_problems``: what :func:`check_idle` found (empty: idle)."""

    model: str
    ranks: int
    prompts: int
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    peak_rss_mib: list[float]
    digests: list[str]
    hung: bool
    failed: int
    idle_problems: list[str]
    l3_hit_tokens: int
    l1_hit_tokens: int
    l2_hit_tokens: int
    l1_evicted_tokens: int
    """Tokens evicted from L1: dropped or demoted (kept in L2)."""
    l2_evicted_tokens: int
    l3_backup_tokens: int
    l3_backup_indexer_pages: int
    components: list[str]
    agreement_us_per_step: float | None = None
    """Rank 0's mean time per step in the ranks' agreement collectives (µs), when the
    engine reports it."""
    nnodes: int = 1
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s if self.wall_s else 0.0

    @property
    def digests_equal(self) -> bool:
        return len(set(self.digests)) == 1 and len(self.digests) == self.ranks

    @property
    def ok(self) -> bool:
        return not self.hung and not self.failed and not self.idle_problems and self.digests_equal

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "tokens_per_s": self.tokens_per_s,
            "digests_equal": self.digests_equal,
            "ok": self.ok,
        }


def peak_rss_mib(pid: int) -> float:
    """Peak resident set of process ``pid`` in MiB: ``VmHWM`` from ``/proc/<pid>/status``,
    else psutil's current RSS (no peak is kept there), else NaN."""
    status = Path(f"/proc/{pid}/status")
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    try:
        import psutil

        return float(psutil.Process(pid).memory_info().rss) / 2**20
    except Exception:
        return float("nan")


def check_idle(stats: EngineStats) -> list[str]:
    """What keeps the engine from idle: requests admitted, running or waiting; L1 request
    pages; per component, pages held by requests or by copies / L3 operations in flight
    (used but not cached). Empty when only cached pages are held."""
    problems = []
    if stats.running or stats.waiting or stats.admitted:
        problems.append(
            f"requests: running={stats.running} waiting={stats.waiting} admitted={stats.admitted}"
        )
    if stats.cache.device_request_tokens:
        problems.append(f"L1 request tokens={stats.cache.device_request_tokens}")
    for c in stats.cache.components:
        if c.device_requests:
            problems.append(f"{c.name}: L1 request pages={c.device_requests}")
        if c.device_used != c.device_requests + c.device_cached:
            problems.append(
                f"{c.name}: L1 pages in flight={c.device_used - c.device_requests - c.device_cached}"
            )
        if c.host_used != c.host_cached:
            problems.append(f"{c.name}: L2 pages in flight={c.host_used - c.host_cached}")
    return problems


def workload(cfg: StressConfig, vocab_lo: int, vocab_hi: int) -> list[list[int]]:
    """The ``prompts`` prompts in submission order: ``rounds`` shuffled passes over the
    same pairs (system prompt ``i % systems``, suffix ``i``)."""
    rng = random.Random(cfg.seed)
    systems = [
        [rng.randrange(vocab_lo, vocab_hi) for _ in range(cfg.system_tokens)]
        for _ in range(cfg.systems)
    ]
    pairs = [
        systems[i % cfg.systems]
        + [rng.randrange(vocab_lo, vocab_hi) for _ in range(rng.randint(*cfg.suffix_tokens))]
        for i in range(cfg.prompts // cfg.rounds)
    ]
    out: list[list[int]] = []
    for _ in range(cfg.rounds):
        order = list(range(len(pairs)))
        rng.shuffle(order)
        out.extend(pairs[i] for i in order)
    return out


def engine_config(cfg: StressConfig, l3_dir: str, rendezvous_port: int = 0) -> EngineConfig:
    """Node 0's engine config; ``rendezvous_port``: node 0's TCP store on loopback (used
    when ``cfg.nnodes`` > 1)."""
    nodes = (
        NodeConfig(nnodes=cfg.nnodes, dist_init_addr=f"{LOOPBACK}:{rendezvous_port}")
        if cfg.nnodes > 1
        else NodeConfig()
    )
    return EngineConfig(
        model_path=cfg.model,
        dtype="float32",
        device="cpu",
        cache=CacheConfig(
            page_size=cfg.page_size,
            device_tokens=cfg.l1_tokens,
            hicache_ratio=cfg.hicache_ratio,
            load_back_threshold=0,
        ),
        scheduler=SchedulerConfig(max_running_requests=cfg.max_running, chunked_prefill_size=64),
        context_length=cfg.context_length,
        storage_backend="file",
        storage_prefetch_policy=cfg.prefetch_policy,
        storage_extra_config={"file_path": l3_dir, "prefetch_threshold": cfg.page_size},
        tp_size=cfg.ranks,
        nodes=nodes,
        dist_init_timeout_s=min(300.0, cfg.timeout_s),
    )


def _node_main(config: EngineConfig) -> None:
    """A node other than node 0, in its own process: its ranks until rank 0 stops them."""
    run_node(config, follower_roles(config))


@contextlib.contextmanager
def other_nodes(config: EngineConfig) -> Iterator[list[int]]:
    """Start nodes 1 .. nnodes-1 of ``config`` (node 0's), each a spawned process that
    joins node 0's rendezvous; yields their pids. On exit each is joined (rank 0 stops
    their ranks when its engine closes), and killed if it has not ended in 60 s."""
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(
            target=_node_main,
            args=(replace(config, nodes=replace(config.nodes, node_rank=r)),),
            name=f"hicache-node-{r}",
        )
        for r in range(1, config.nodes.nnodes)
    ]
    try:
        for p in procs:
            p.start()
        yield [p.pid for p in procs if p.pid is not None]
    finally:
        for p in procs:
            p.join(timeout=60.0)
            if p.is_alive():
                p.kill()
                p.join()


def node_rank_pids(node_pid: int) -> list[int]:
    """The rank processes of the node process ``node_pid``: its spawned children, in pid
    order (the order it started them; not its resource tracker)."""
    import psutil

    kids = psutil.Process(node_pid).children()
    return sorted(k.pid for k in kids if "spawn_main" in " ".join(k.cmdline()))


def _drive(
    engine: Engine, prompts: Sequence[list[int]], cfg: StressConfig, deadline: float
) -> tuple[bool, list[RequestOutput]]:
    """Submit ``prompts`` with at most ``cfg.parallel`` in flight; (hung, final outputs)."""
    params = SamplingParams(temperature=0, max_tokens=cfg.output_tokens, ignore_eos=True)
    slots = threading.Semaphore(cfg.parallel)
    done = threading.Condition()
    finals: list[RequestOutput] = []

    def on_output(out: RequestOutput) -> None:
        if out.finished:
            with done:
                finals.append(out)
                done.notify_all()
            slots.release()

    for ids in prompts:
        if not slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return True, finals
        engine.submit(ids, params, on_output)
    with done:
        while len(finals) < len(prompts):
            left = deadline - time.monotonic()
            if left <= 0:
                return True, finals
            done.wait(timeout=min(left, 1.0))
    return False, finals


def run_stress(cfg: StressConfig) -> StressResult:
    """Run one stress config in this process (one TP engine at a time per process)."""
    tmp = None
    l3_dir = cfg.l3_dir
    if l3_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="hicache-tp-stress-")
        l3_dir = tmp.name
    try:
        return _run(cfg, l3_dir)
    finally:
        if tmp is not None:
            tmp.cleanup()


def agreement_us(engine: Engine) -> float | None:
    """The engine's mean agreement overhead per step so far (µs); None at TP 1."""
    totals = engine.agreement
    return totals.seconds / totals.steps * 1e6 if totals.steps else None


def wait_quiet(engine: Engine, deadline: float, timeout_s: float = 60.0) -> EngineStats:
    """The engine's stats once the cache's copies and L3 operations in flight have landed
    (the loop agrees on them step by step), or the last stats read after ``timeout_s``
    seconds (or at ``deadline``). Under TP nothing may drain the cache on rank 0 alone
    (``HiCache.sync(wait=True)`` would make collectives the followers do not): this only waits."""
    end = min(deadline, time.monotonic() + timeout_s)
    while True:
        stats = engine.stats(timeout=max(1.0, deadline - time.monotonic()))
        if not check_idle(stats) or time.monotonic() >= end:
            return stats
        time.sleep(0.1)


def _run(cfg: StressConfig, l3_dir: str) -> StressResult:
    started = time.monotonic()
    deadline = started + cfg.timeout_s
    config = engine_config(cfg, l3_dir, free_port() if cfg.nnodes > 1 else 0)
    with other_nodes(config) as nodes, Engine(config) as engine:
        vocab = int(engine.model.hf_config.vocab_size)
        prompts = workload(cfg, min(TOKEN_LO, vocab // 2), min(TOKEN_HI, vocab))
        t0 = time.monotonic()
        hung, finals = _drive(engine, prompts, cfg, deadline)
        wall = time.monotonic() - t0
        stats = wait_quiet(engine, deadline)
        left = max(1.0, deadline - time.monotonic())
        digests = engine.rank_digests(timeout=left)
        pids = {0: os.getpid(), **(engine.ranks.pids if engine.ranks is not None else {})}
        remote = [pid for node in nodes for pid in node_rank_pids(node)]
        rss = [peak_rss_mib(pids[r]) for r in sorted(pids)] + [peak_rss_mib(p) for p in remote]
        agreement = agreement_us(engine)
    c = stats.cache.counters
    return StressResult(
        model=cfg.model,
        ranks=cfg.ranks,
        prompts=len(prompts),
        wall_s=wall,
        prompt_tokens=sum(len(p) for p in prompts),
        output_tokens=sum(len(f.output_ids) for f in finals),
        peak_rss_mib=rss,
        digests=digests,
        hung=hung,
        failed=sum(1 for f in finals if f.error is not None),
        idle_problems=[] if hung else check_idle(stats),
        l3_hit_tokens=c["storage_hit_tokens_total"],
        l1_hit_tokens=c["device_hit_tokens_total"],
        l2_hit_tokens=c["host_hit_tokens_total"],
        l1_evicted_tokens=c["device_evicted_tokens_total"] + c["device_demoted_tokens_total"],
        l2_evicted_tokens=c["host_evicted_tokens_total"],
        l3_backup_tokens=c["l3_backup_tokens_total"],
        l3_backup_indexer_pages=c.get("l3_backup_indexer_pages_total", 0),
        components=[comp.name for comp in stats.cache.components],
        agreement_us_per_step=agreement,
        nnodes=cfg.nnodes,
        config={k: v for k, v in asdict(cfg).items() if k != "l3_dir"},
    )


def print_results(results: Sequence[StressResult]) -> None:
    print_table(
        "tp-stress: shared-prefix workload, CPU, every tier evicting",
        ["model", "ranks", "prompts", "wall s", "tokens/s", "peak RSS MiB by rank",
         "digests equal", "idle", "L3 hit tokens", "evicted L1/L2 tokens", "agree µs/step"],
        [
            [
                r.model, str(r.ranks) if r.nnodes == 1 else f"{r.ranks} ({r.nnodes} nodes)",
                str(r.prompts), f"{r.wall_s:.1f}",
                f"{r.tokens_per_s:.0f}", " ".join(f"{m:.0f}" for m in r.peak_rss_mib),
                "yes" if r.digests_equal else "NO",
                "yes" if not r.idle_problems and not r.hung else "NO",
                str(r.l3_hit_tokens), f"{r.l1_evicted_tokens}/{r.l2_evicted_tokens}",
                "-" if r.agreement_us_per_step is None else f"{r.agreement_us_per_step:.0f}",
            ]
            for r in results
        ],
    )  # fmt: skip
    for r in results:
        if r.hung:
            print(f"{r.model} x{r.ranks}: HUNG (not every request finished in time)")
        if r.failed:
            print(f"{r.model} x{r.ranks}: {r.failed} requests failed")
        for p in r.idle_problems:
            print(f"{r.model} x{r.ranks}: not idle: {p}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hicache bench tp-stress", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma list")
    p.add_argument("--ranks", default="4", help="comma list of rank counts, e.g. 4,2")
    p.add_argument(
        "--nnodes", type=int, default=1, help="nodes (process trees on loopback) the ranks span"
    )
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--systems", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--system-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=4)
    p.add_argument("--parallel", type=int, default=16)
    p.add_argument("--l1-tokens", type=int, default=256)
    p.add_argument("--hicache-ratio", type=float, default=2.0)
    p.add_argument("--prefetch-policy", default="timeout")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--json", default=None, help="write every figure to this path")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child run
    return p  # fmt: skip


def _config(a: argparse.Namespace, model: str, ranks: int) -> StressConfig:
    return StressConfig(
        model=model,
        ranks=ranks,
        nnodes=a.nnodes,
        prompts=a.prompts,
        systems=a.systems,
        rounds=a.rounds,
        system_tokens=a.system_tokens,
        output_tokens=a.output_tokens,
        parallel=a.parallel,
        l1_tokens=a.l1_tokens,
        hicache_ratio=a.hicache_ratio,
        prefetch_policy=a.prefetch_policy,
        timeout_s=a.timeout_s,
    )


def _child(a: argparse.Namespace) -> int:
    model, ranks = a.models, int(a.ranks)
    result = run_stress(_config(a, model, ranks))
    write_json(a.json, result.to_json())
    return 0


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.one:
        return _child(a)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    rank_counts = [int(r) for r in a.ranks.split(",") if r.strip()]
    results: list[StressResult] = []
    refused: list[str] = []
    for ranks in rank_counts:
        for model in models:
            _config(a, model, ranks)  # bad values fail here, before any process starts
            with tempfile.TemporaryDirectory(prefix="hicache-tp-stress-out-") as out:
                path = Path(out) / "result.json"
                argv_child = [
                    sys.executable, "-m", "hicache.bench.tp_stress", "--one",
                    "--models", model, "--ranks", str(ranks), "--json", str(path),
                    "--nnodes", str(a.nnodes),
                    "--prompts", str(a.prompts), "--systems", str(a.systems),
                    "--rounds", str(a.rounds), "--system-tokens", str(a.system_tokens),
                    "--output-tokens", str(a.output_tokens), "--parallel", str(a.parallel),
                    "--l1-tokens", str(a.l1_tokens), "--hicache-ratio", str(a.hicache_ratio),
                    "--prefetch-policy", a.prefetch_policy, "--timeout-s", str(a.timeout_s),
                ]  # fmt: skip
                on = f" on {a.nnodes} nodes" if a.nnodes > 1 else ""
                print(f"tp-stress: {model} at {ranks} ranks{on} ...", flush=True)
                proc = subprocess.run(argv_child, check=False)
                if proc.returncode != 0 or not path.is_file():
                    refused.append(f"{model} x{ranks}: the run failed (exit {proc.returncode})")
                    continue
                doc = json.loads(path.read_text())
            doc = {k: v for k, v in doc.items() if k not in ("tokens_per_s", "digests_equal", "ok")}
            results.append(StressResult(**doc))
    print_results(results)
    for line in refused:
        print(line)
    if a.json:
        write_json(a.json, {"runs": [r.to_json() for r in results], "failed": refused})
    return 0 if not refused and all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
