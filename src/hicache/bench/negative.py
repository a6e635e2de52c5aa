"""``hicache bench negative``: L3 lookups per request with and without the negative
lookup cache, on a mostly-new-prompt workload (issue 27).

In process, CPU, fp32, the ``file`` L3 in a fresh temp dir per run. ``--requests`` requests,
request ``k`` the system prompt of group ``k % --groups`` plus a fresh suffix, at most
``--max-parallel`` in flight. Setups: each ``--write-policies`` entry with the negative
cache off (TTL 0) and on (``--ttl`` s), alternating for ``--repeats`` pairs, each run on a
fresh engine. Per run: store lookups (``batch_exists`` calls) and keys asked per request,
lookups the negative cache answered whole, TTFT mean and p50 (ms, the engine's), wall
time. Outputs under ``--out``: ``negative.json`` and ``negative.png``. The method and why
``write_back`` is where it saves: ``docs/benchmarks/negative.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hicache.bench.plot import plot_setups, print_table
from hicache.bench.results import percentile
from hicache.bench.runner import TOKEN_HI, TOKEN_LO
from hicache.bench.shared_prefix import send_all
from hicache.cache.report import cache_stats
from hicache.config import CacheConfig, WritePolicy
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.sampling import SamplingParams
from hicache.runner.loader import LoadedModel, load_model
from hicache.validate import int_at_least

__all__ = ["NegativeRun", "NegativeWorkload", "main", "run_once"]


@dataclass(frozen=True, kw_only=True)
class NegativeWorkload:
    """The workload's shape (token counts in tokens; see the module docstring)."""

    requests: int = 48
    groups: int = 4
    system_tokens: int = 256
    suffix_tokens: int = 32
    output_tokens: int = 1
    max_parallel: int = 4
    page_size: int = 16
    l1_tokens: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("requests", "groups", "system_tokens", "suffix_tokens", "output_tokens",
                     "max_parallel", "page_size", "l1_tokens"):  # fmt: skip
            int_at_least(name, getattr(self, name), 1)

    def prompts(self, vocab: int) -> list[list[int]]:
        """Every request's prompt, in sending order (the same for every run)."""
        rng = random.Random(self.seed)
        hi = min(TOKEN_HI, vocab)

        def ids(n: int) -> list[int]:
            return [rng.randrange(TOKEN_LO, hi) for _ in range(n)]

        systems = [ids(self.system_tokens) for _ in range(self.groups)]
        return [systems[k % self.groups] + ids(self.suffix_tokens) for k in range(self.requests)]


@dataclass(frozen=True, slots=True)
class NegativeRun:
    """One run's figures: per request, store lookups and keys asked; lookups the negative
    cache answered whole (no store call); TTFT in ms; wall seconds."""

    write_policy: str
    ttl_s: float
    lookups_per_request: float
    keys_per_request: float
    lookups_saved: int
    ttft_mean_ms: float
    ttft_p50_ms: float
    wall_s: float


def run_once(lm: LoadedModel, w: NegativeWorkload, write_policy: str, ttl_s: float) -> NegativeRun:
    """The workload on a fresh engine over ``lm`` and a fresh L3 dir."""
    l3_dir = Path(tempfile.mkdtemp(prefix="hicache-negative-"))
    try:
        cfg = EngineConfig(
            model_path=lm.name,
            dtype="float32",
            device="cpu",
            cache=CacheConfig(
                page_size=w.page_size,
                device_tokens=w.l1_tokens,
                enable_hierarchical_cache=True,
                hicache_ratio=2.0,
                write_policy=WritePolicy(write_policy),
            ),
            context_length=w.system_tokens + w.suffix_tokens + w.output_tokens + w.page_size,
            storage_backend="file",
            storage_extra_config={"file_path": str(l3_dir), "prefetch_threshold": w.page_size},
            storage_negative_ttl_s=ttl_s,
        )
        params = SamplingParams(temperature=0.0, max_tokens=w.output_tokens, ignore_eos=True)
        prompts = w.prompts(int(lm.hf_config.vocab_size))
        with Engine(cfg, loaded=lm) as engine:
            warm = random.Random(-1)
            send_all(engine, [[warm.randrange(TOKEN_LO, TOKEN_HI) for _ in range(64)]], params, 1)
            engine.call(lambda: engine.core.cache.sync(wait=True)).result(timeout=120)
            before = engine.call(lambda: cache_stats(engine.core.cache)).result(timeout=60)
            t0 = time.perf_counter()
            outs = send_all(engine, prompts, params, w.max_parallel)
            wall = time.perf_counter() - t0
            after = engine.call(lambda: cache_stats(engine.core.cache)).result(timeout=60)
        errors = [o.error for o in outs if o.error]
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed; first: {errors[0]}")
        ttfts = [o.ttft_s * 1e3 for o in outs if o.ttft_s is not None]
        n = len(prompts)
        saved = "l3_negative_lookups_saved_total"
        return NegativeRun(
            write_policy=write_policy,
            ttl_s=ttl_s,
            lookups_per_request=(after.storage.exists_calls - before.storage.exists_calls) / n,
            keys_per_request=(after.storage.exists_keys - before.storage.exists_keys) / n,
            lookups_saved=after.counters[saved] - before.counters[saved],
            ttft_mean_ms=statistics.fmean(ttfts),
            ttft_p50_ms=percentile(ttfts, 50),
            wall_s=wall,
        )
    finally:
        shutil.rmtree(l3_dir, ignore_errors=True)


COLUMNS = ("write policy", "ttl s", "lookups/req", "keys/req", "saved", "TTFT mean ms",
           "TTFT p50 ms", "wall s")  # fmt: skip


def _label(policy: str, ttl: float) -> str:
    return f"{policy} ttl={ttl:g}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="hicache bench negative",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = NegativeWorkload()
    p.add_argument("--model", default="tiny-random-llama")
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--groups", type=int, default=d.groups, help="distinct system prompts")
    p.add_argument("--system-tokens", type=int, default=d.system_tokens, help="whole pages")
    p.add_argument("--suffix-tokens", type=int, default=d.suffix_tokens)
    p.add_argument("--output-tokens", type=int, default=d.output_tokens)
    p.add_argument("--max-parallel", type=int, default=d.max_parallel)
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--l1-tokens", type=int, default=d.l1_tokens)
    p.add_argument("--ttl", type=float, default=2.0, help="the negative TTL of the 'on' runs")
    p.add_argument("--write-policies", default="write_through,write_back", help="comma list")
    p.add_argument("--repeats", type=int, default=2, help="off/on pairs, alternating order")
    p.add_argument("--out", default="bench-out/negative")
    args = p.parse_args(argv)
    try:
        w = NegativeWorkload(
            requests=args.requests,
            groups=args.groups,
            system_tokens=args.system_tokens,
            suffix_tokens=args.suffix_tokens,
            output_tokens=args.output_tokens,
            max_parallel=args.max_parallel,
            page_size=args.page_size,
            l1_tokens=args.l1_tokens,
        )
    except ValueError as exc:
        field, _, rest = str(exc).partition("=")
        p.error(f"--{field.replace('_', '-')} {rest}")
    if not args.ttl > 0:
        p.error(f"--ttl {args.ttl} is invalid; the 'on' runs need a TTL > 0")
    policies = args.write_policies.split(",")
    lm = load_model(args.model, dtype="float32", device="cpu")
    load0 = os.getloadavg()[0]
    runs: list[NegativeRun] = []
    for policy in policies:
        for rep in range(args.repeats):
            order = (0.0, args.ttl) if rep % 2 == 0 else (args.ttl, 0.0)
            for ttl in order:
                print(f"{_label(policy, ttl)} (repeat {rep + 1}) ...", file=sys.stderr)
                runs.append(run_once(lm, w, policy, ttl))
    load1 = os.getloadavg()[0]
    rows = [
        [
            r.write_policy,
            f"{r.ttl_s:g}",
            f"{r.lookups_per_request:.3f}",
            f"{r.keys_per_request:.2f}",
            str(r.lookups_saved),
            f"{r.ttft_mean_ms:.1f}",
            f"{r.ttft_p50_ms:.1f}",
            f"{r.wall_s:.2f}",
        ]
        for r in runs
    ]
    print_table(
        f"negative lookup cache: {w.requests} requests, {w.groups} system prompts of"
        f" {w.system_tokens} + {w.suffix_tokens} new tokens (load {load0:.1f} -> {load1:.1f})",
        COLUMNS,
        rows,
    )
    doc: dict[str, Any] = {
        "workload": asdict(w),
        "model": args.model,
        "ttl_s": args.ttl,
        "loadavg_1m": [load0, load1],
        "runs": [asdict(r) for r in runs],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "negative.json").write_text(json.dumps(doc, indent=2))
    labels = list(dict.fromkeys(_label(r.write_policy, r.ttl_s) for r in runs))

    def mean_of(field: str) -> dict[str, float | None]:
        return {
            lab: statistics.fmean(
                getattr(r, field) for r in runs if _label(r.write_policy, r.ttl_s) == lab
            )
            for lab in labels
        }

    plot_setups(
        str(out / "negative.png"),
        title="negative lookup cache (mean over repeats)",
        panels={
            "store lookups per request": mean_of("lookups_per_request"),
            "TTFT mean (ms)": mean_of("ttft_mean_ms"),
        },
    )
    print(f"wrote {out / 'negative.json'} and {out / 'negative.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
