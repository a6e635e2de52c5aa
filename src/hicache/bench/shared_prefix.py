"""``hicache bench shared-prefix``: groups of requests sharing a long system prompt, in rounds.

In process (no server): one :class:`~hicache.engine.front.engine.Engine` per model and
config (``l1``, ``l1_l2``, ``l1_l2_l3``; ``CONFIG@tpN`` with ``--tp-size``), the same L1 in
all: about half the system prompts (at least ``--max-parallel`` requests plus a page);
L2 holds them all with 50% to spare. ``--groups`` groups, each with a system prompt of
``--system-tokens`` ids (whole pages), send ``--requests-per-group`` requests per round
(system prompt + a fresh suffix) round-robin over the groups, ``--rounds`` rounds.
Invariant: only the system prompts are shared; for recurrent models
``mamba_track_interval = --system-tokens``, so a snapshot ends every system prompt.
Per round: TTFT (s, the engine's) mean / p50 / p90, hit rate per tier, resumed
admissions, evictions, and per component pool usage and bytes per cached token
(:mod:`hicache.bench.components`). Outputs: ``shared_prefix.json`` and ``.png`` under
``--out``. The method in full: ``docs/benchmarks/shared-prefix.md``.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hicache.bench.components import (
    ComponentFigures,
    ComponentHitProbe,
    ComponentHits,
    component_figures,
)
from hicache.bench.results import percentile
from hicache.bench.runner import TOKEN_HI, TOKEN_LO, round_to_pages
from hicache.bench.serverproc import TP_SUFFIX, parse_tp_sizes
from hicache.bench.shared_prefix_report import print_report, write_outputs
from hicache.bench.tp_stress import wait_quiet
from hicache.cache.components.swa import request_pages
from hicache.cache.report import cache_stats
from hicache.cache.request import CachedTokens
from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.request import RequestOutput
from hicache.engine.sampling import SamplingParams
from hicache.engine.step.scheduler import SchedulerConfig
from hicache.runner.loader import LoadedModel, load_model
from hicache.runner.models.hybrid import HybridLM
from hicache.validate import int_at_least, require

__all__ = [
    "CONFIGS",
    "MODELS",
    "RequestResult",
    "RoundResult",
    "SharedPrefixWorkload",
    "Sizes",
    "Workload",
    "main",
    "run_config",
    "send_all",
    "swa_ratio",
    "tier_sizes",
]

CONFIGS: tuple[str, ...] = ("l1", "l1_l2", "l1_l2_l3")
MODELS: tuple[str, ...] = ("tiny-random-qwen3-next", "tiny-random-gemma3")
COUNTERS: tuple[str, ...] = (
    "device_evicted_tokens_total",
    "device_demoted_tokens_total",
    "host_evicted_tokens_total",
    "load_tokens_total",
    "backup_tokens_total",
    "l3_backup_tokens_total",
)
"""Cache counters reported per round (their increase over the round, tokens)."""
REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True, kw_only=True)
class SharedPrefixWorkload:
    """The workload's shape (token counts are tokens; see the module docstring)."""

    groups: int = 8
    requests_per_group: int = 4
    system_tokens: int = 1024
    suffix_tokens: int = 32
    output_tokens: int = 4
    rounds: int = 3
    max_parallel: int = 4
    page_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("groups", "requests_per_group", "system_tokens", "suffix_tokens",
                     "output_tokens", "rounds", "max_parallel", "page_size"):  # fmt: skip
            int_at_least(name, getattr(self, name), 1)
        require(
            self.system_tokens % self.page_size == 0,
            "system_tokens",
            self.system_tokens,
            f"must be a whole number of pages (page_size {self.page_size})",
        )

    @property
    def request_tokens(self) -> int:
        """Positions one request needs at its end: prompt + output."""
        return self.system_tokens + self.suffix_tokens + self.output_tokens

    @property
    def working_set_tokens(self) -> int:
        """Tokens of all system prompts (what every round after the first can reuse)."""
        return self.groups * self.system_tokens


QUICK = SharedPrefixWorkload(
    groups=3, requests_per_group=2, system_tokens=128, suffix_tokens=24, output_tokens=2,
    max_parallel=2,
)  # fmt: skip
"""``--quick``: 3 groups x 2 requests of 128 + 24 tokens. The prompt's last page boundary
(144) lies past the system prompt's end (128, the interval snapshot), so one prefill
forward keeps the state at both: a mark and its end, committed together."""


@dataclass(frozen=True)
class Workload:
    """Token ids: ``system[g]`` per group, ``suffix[r][g][i]`` per round, group, request."""

    system: list[list[int]]
    suffix: list[list[list[list[int]]]]

    @classmethod
    def make(cls, w: SharedPrefixWorkload, vocab_size: int) -> Workload:
        rng = random.Random(w.seed)
        hi = min(TOKEN_HI, vocab_size)

        def ids(n: int) -> list[int]:
            return [rng.randrange(TOKEN_LO, hi) for _ in range(n)]

        system = [ids(w.system_tokens) for _ in range(w.groups)]
        suffix = [
            [[ids(w.suffix_tokens) for _ in range(w.requests_per_group)] for _ in range(w.groups)]
            for _ in range(w.rounds)
        ]
        return cls(system, suffix)

    def prompt(self, rnd: int, group: int, index: int) -> list[int]:
        return self.system[group] + self.suffix[rnd][group][index]

    def order(self) -> list[tuple[int, int]]:
        """(group, request) in sending order: round-robin over the groups."""
        groups, per = len(self.system), len(self.suffix[0][0])
        return [(g, i) for i in range(per) for g in range(groups)]


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One request: TTFT (s), prompt tokens and the tokens each tier served."""

    group: int
    index: int
    prompt_tokens: int
    cached: CachedTokens
    ttft_s: float
    error: str | None


@dataclass(frozen=True)
class RoundResult:
    """One round of one config: its requests, the counters' increase over it (tokens),
    the components' figures at its end and their hits over it (admissions)."""

    round: int
    requests: list[RequestResult]
    counters: dict[str, int]
    components: list[ComponentFigures]
    component_hits: list[ComponentHits]
    wall_s: float
    tp: int = 1
    """The engine's tensor-parallel size."""
    agreement_us_per_step: float | None = None
    """Rank 0's mean time per engine step in the ranks' agreement collectives over the
    round (µs; None at TP 1)."""

    def summary(self) -> dict[str, Any]:
        """TTFT stats (s), hit rate in total and per tier, resumed admissions."""
        ok = [r for r in self.requests if r.error is None]
        ttfts = [r.ttft_s for r in ok]
        prompt = sum(r.prompt_tokens for r in ok)
        hits = {
            "device": sum(r.cached.device for r in ok),
            "host": sum(r.cached.host for r in ok),
            "storage": sum(r.cached.storage for r in ok),
        }
        return {
            "round": self.round,
            "requests": len(self.requests),
            "errors": len(self.requests) - len(ok),
            "ttft_mean_s": _mean(ttfts),
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p90_s": percentile(ttfts, 90),
            "ttft_hit_mean_s": _mean([r.ttft_s for r in ok if r.cached.total > 0]),
            "ttft_miss_mean_s": _mean([r.ttft_s for r in ok if r.cached.total == 0]),
            "prompt_tokens": prompt,
            "hit_tokens": hits,
            "hit_rate": sum(hits.values()) / prompt if prompt else 0.0,
            "hit_rate_per_tier": {t: v / prompt if prompt else 0.0 for t, v in hits.items()},
            "resumed_requests": sum(r.cached.total > 0 for r in ok),
            "counters": self.counters,
            "components": [asdict(c) for c in self.components],
            "component_hits": [asdict(h) for h in self.component_hits],
            "wall_s": self.wall_s,
            "tp": self.tp,
            "agreement_us_per_step": self.agreement_us_per_step,
        }


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


@dataclass(frozen=True, slots=True)
class Sizes:
    """L1 tokens and the L2 ratio every config of a run gets."""

    l1_tokens: int
    hicache_ratio: float


def tier_sizes(w: SharedPrefixWorkload, l1: int | None, ratio: float | None) -> Sizes:
    """L1 ~ half the system prompts (at least ``max_parallel`` whole requests + a page);
    L2 = 1.5 x the system prompts (ratio at least 2); explicit values win."""
    ps = w.page_size
    need = w.max_parallel * round_to_pages(w.request_tokens, ps) + ps
    l1_tokens = l1 or max(round_to_pages(w.working_set_tokens / 2, ps), need)
    r = ratio or max(2.0, float(math.ceil(1.5 * w.working_set_tokens / l1_tokens)))
    return Sizes(l1_tokens, r)


def swa_ratio(w: SharedPrefixWorkload, sizes: Sizes, window: int | None) -> float:
    """``swa_full_tokens_ratio`` of the run: the default, raised where the L1 SWA pool
    would hold fewer than ``max_parallel`` requests' windows and prefill chunks
    (:func:`~hicache.cache.components.swa.request_pages`; small ``--quick`` L1s)."""
    default = CacheConfig.swa_full_tokens_ratio
    if window is None:
        return default
    chunk = max(SchedulerConfig.chunked_prefill_size, w.page_size)
    need = w.max_parallel * request_pages(window, chunk, w.page_size)
    l1_pages = sizes.l1_tokens // w.page_size
    return max(default, math.ceil(need / l1_pages * 100) / 100)


def engine_config(
    model: str,
    config: str,
    w: SharedPrefixWorkload,
    sizes: Sizes,
    l3_dir: Path,
    swa_window: int | None = None,
    tp_size: int = 1,
) -> EngineConfig:
    """The engine of ``config`` (see :data:`CONFIGS`) on CPU, fp32; ``swa_window``
    (tokens): the model's sliding window, if it has one (sizes its SWA pools)."""
    if config not in CONFIGS:
        raise ValueError(f"config {config!r} is unknown; choose from {CONFIGS}")
    cache = CacheConfig(
        page_size=w.page_size,
        device_tokens=sizes.l1_tokens,
        enable_hierarchical_cache=config != "l1",
        hicache_ratio=sizes.hicache_ratio,
        mamba_track_interval=w.system_tokens,
        swa_full_tokens_ratio=swa_ratio(w, sizes, swa_window),
    )
    l3 = config == "l1_l2_l3"
    return EngineConfig(
        model_path=model,
        dtype="float32",
        device="cpu",
        cache=cache,
        context_length=w.request_tokens + w.page_size,
        storage_backend="file" if l3 else None,
        storage_extra_config=(
            {"file_path": str(l3_dir), "prefetch_threshold": w.page_size} if l3 else {}
        ),
        tp_size=tp_size,
    )


def send_all(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, max_parallel: int
) -> list[RequestOutput]:
    """Send ``prompts`` in order, at most ``max_parallel`` in flight; their final outputs
    in the same order once all are done (TimeoutError after :data:`REQUEST_TIMEOUT_S`)."""
    slots = threading.BoundedSemaphore(max_parallel)
    done = threading.Event()
    results: dict[int, RequestOutput] = {}
    lock = threading.Lock()

    def callback(k: int) -> Callable[[RequestOutput], None]:
        def on(out: RequestOutput) -> None:
            if not out.finished:
                return
            with lock:
                results[k] = out
                if len(results) == len(prompts):
                    done.set()
            slots.release()

        return on

    for k, ids in enumerate(prompts):
        if not slots.acquire(timeout=REQUEST_TIMEOUT_S):
            raise TimeoutError(f"no request finished within {REQUEST_TIMEOUT_S} s")
        engine.submit(ids, params, callback(k))
    if not done.wait(REQUEST_TIMEOUT_S):
        raise TimeoutError(f"requests still running after {REQUEST_TIMEOUT_S} s")
    return [results[k] for k in range(len(prompts))]


def _run_round(
    engine: Engine, wl: Workload, rnd: int, params: SamplingParams, max_parallel: int
) -> list[RequestResult]:
    """Every request of round ``rnd`` (0-based), in sending order."""
    order = wl.order()
    outs = send_all(engine, [wl.prompt(rnd, g, i) for g, i in order], params, max_parallel)
    return [
        RequestResult(
            group=g,
            index=i,
            prompt_tokens=out.prompt_tokens,
            cached=out.cached,
            ttft_s=out.ttft_s if out.ttft_s is not None else math.nan,
            error=out.error,
        )
        for (g, i), out in zip(order, outs, strict=True)
    ]


def _drain(engine: Engine) -> None:
    """Let the cache's copies and L3 writes in flight land. With one rank the cache is
    flushed on the engine thread; under TP nothing may touch the cache on rank 0 alone
    (its collectives would not be the followers'), so this waits for the ranks to agree
    on them step by step."""
    if engine.config.tp_size == 1:
        engine.call(lambda: engine.core.cache.sync(wait=True)).result(timeout=120)
    else:
        wait_quiet(engine, time.monotonic() + 120)


def run_config(
    lm: LoadedModel, config: str, w: SharedPrefixWorkload, sizes: Sizes, tp_size: int = 1
) -> list[RoundResult]:
    """Every round of ``config`` on a fresh engine over ``lm`` (after one warm-up request
    and an emptied cache). With ``tp_size`` > 1 every rank loads its own shard (``lm``
    is then only rank 0's reference for sizes); each round's ``agreement_us_per_step``
    is the engine's agreement overhead per step over that round."""
    wl = Workload.make(w, int(lm.hf_config.vocab_size))
    params = SamplingParams(temperature=0.0, max_tokens=w.output_tokens, ignore_eos=True)
    l3_dir = Path(tempfile.mkdtemp(prefix="hicache-shared-prefix-"))
    try:
        model = lm.model
        swa = model.config.swa_spec(lm.dtype) if isinstance(model, HybridLM) else None
        window = None if swa is None else swa.window
        ecfg = engine_config(lm.name, config, w, sizes, l3_dir, window, tp_size)
        with Engine(ecfg, loaded=lm if tp_size == 1 else None) as engine:
            # warm-up: as many unrelated full-length requests as run at once, so first-call
            # costs (allocations at these sizes) stay out of round 1
            warm = random.Random(-1)
            hi = min(TOKEN_HI, int(lm.hf_config.vocab_size))
            n = w.system_tokens + w.suffix_tokens
            prompts = [
                [warm.randrange(TOKEN_LO, hi) for _ in range(n)] for _ in range(w.max_parallel)
            ]
            send_all(engine, prompts, params, w.max_parallel)
            _drain(engine)
            if not engine.flush_cache():
                raise RuntimeError("flush_cache refused after the warm-up")
            probe = engine.call(lambda: ComponentHitProbe(engine.core.cache)).result(timeout=60)
            rounds: list[RoundResult] = []
            before = engine.call(lambda: cache_stats(engine.core.cache)).result(timeout=60).counters
            for rnd in range(w.rounds):
                agree0 = engine.agreement
                t0 = time.perf_counter()
                reqs = _run_round(engine, wl, rnd, params, w.max_parallel)
                wall = time.perf_counter() - t0
                agree1 = engine.agreement
                steps = agree1.steps - agree0.steps
                agree_s = agree1.seconds - agree0.seconds
                stats = engine.call(lambda: cache_stats(engine.core.cache)).result(timeout=60)
                comps = engine.call(lambda: component_figures(engine)).result(timeout=60)
                hits = engine.call(probe.take).result(timeout=60)
                delta = {k: stats.counters[k] - before[k] for k in COUNTERS}
                before = stats.counters
                rounds.append(
                    RoundResult(
                        rnd + 1, reqs, delta, comps, hits, wall,
                        tp=tp_size,
                        agreement_us_per_step=agree_s / steps * 1e6 if steps else None,
                    )
                )  # fmt: skip
            return rounds
    finally:
        shutil.rmtree(l3_dir, ignore_errors=True)


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, SharedPrefixWorkload]:
    p = argparse.ArgumentParser(
        prog="hicache bench shared-prefix",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = SharedPrefixWorkload()
    p.add_argument("--model", action="append", help=f"repeatable (default: {', '.join(MODELS)})")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma list of configs")
    p.add_argument("--groups", type=int, default=d.groups, help="distinct system prompts")
    p.add_argument("--requests-per-group", type=int, default=d.requests_per_group)
    p.add_argument("--system-tokens", type=int, default=d.system_tokens, help="whole pages")
    p.add_argument("--suffix-tokens", type=int, default=d.suffix_tokens)
    p.add_argument("--output-tokens", type=int, default=d.output_tokens, help="max_tokens")
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--max-parallel", type=int, default=d.max_parallel, help="in flight")
    p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
    p.add_argument("--l1-tokens", type=int, default=None, help="L1 size (default: see doc)")
    p.add_argument("--hicache-ratio", type=float, default=None, help="L2 = ratio x L1")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default="bench-out/shared-prefix", help="JSON and PNG go here")
    p.add_argument("--quick", action="store_true", help="a small workload (for tests)")
    p.add_argument(
        "--tp-size", default="1", help="comma list of tensor-parallel sizes (each config at each)"
    )
    args = p.parse_args(argv)
    try:
        args.tp_sizes = parse_tp_sizes(args.tp_size)
    except ValueError as exc:
        p.error(str(exc))
    bad = sorted(set(args.configs.split(",")) - set(CONFIGS))
    if bad:
        p.error(f"--configs: unknown {bad}; choose from {list(CONFIGS)}")
    if args.quick:
        return args, QUICK
    try:
        w = SharedPrefixWorkload(
            groups=args.groups,
            requests_per_group=args.requests_per_group,
            system_tokens=args.system_tokens,
            suffix_tokens=args.suffix_tokens,
            output_tokens=args.output_tokens,
            rounds=args.rounds,
            max_parallel=args.max_parallel,
            page_size=args.page_size,
            seed=args.seed,
        )
    except ValueError as exc:
        field, _, rest = str(exc).partition("=")
        p.error(f"--{field.replace('_', '-')} {rest}")
    return args, w


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every request of every config succeeded, else 1."""
    args, w = _parse(argv)
    sizes = tier_sizes(w, args.l1_tokens, args.hicache_ratio)
    models = args.model or list(MODELS)
    configs = args.configs.split(",")
    print(
        f"shared-prefix: {w.groups} groups x {w.requests_per_group} requests x {w.rounds}"
        f" rounds, system prompt {w.system_tokens} + suffix {w.suffix_tokens} tokens;"
        f" L1 {sizes.l1_tokens} tokens, L2 = {sizes.hicache_ratio:g} x L1",
        file=sys.stderr,
    )
    results: dict[str, dict[str, list[RoundResult]]] = {}
    for model in models:
        lm = load_model(model, dtype="float32", device="cpu")
        results[model] = {}
        for config in configs:
            for tp in args.tp_sizes:
                label = config if args.tp_sizes == [1] else f"{config}{TP_SUFFIX}{tp}"
                print(f"{model} / {label} ...", file=sys.stderr)
                results[model][label] = run_config(lm, config, w, sizes, tp)
    doc: dict[str, Any] = {
        "workload": asdict(w),
        "l1_tokens": sizes.l1_tokens,
        "hicache_ratio": sizes.hicache_ratio,
        "working_set_tokens": w.working_set_tokens,
        "mamba_track_interval": w.system_tokens,
        "models": {
            m: {c: [r.summary() for r in rounds] for c, rounds in per.items()}
            for m, per in results.items()
        },
    }
    print_report(doc)
    out = Path(args.out)
    write_outputs(doc, out)
    print(f"wrote {out / 'shared_prefix.json'} and {out / 'shared_prefix.png'}", file=sys.stderr)
    errors = sum(r["errors"] for per in doc["models"].values() for rs in per.values() for r in rs)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
