"""Where a multi-turn request's TTFT goes, measured inside one process (no HTTP).

Runs the multiturn workload of ``hicache bench multiturn`` (same conversations, same tier
sizes, clients served first come first served, ``--max-parallel`` in flight) against an
in-process :class:`~hicache.engine.engine.Engine` per config, and splits each request's
engine-side TTFT into

* **queue**: arrival to first admission (:attr:`RequestOutput.queue_s`): the wait for the
  step in progress (a forward is never interrupted) and for room in the batch. A cache
  hit does not shorten it.
* **own work**: admission to first token: matching, loading back from L2, and the forward
  steps that compute the prompt's uncached tokens (mixed with the other requests' decode
  tokens). This is what a hit shortens.

    python scripts/ttft_breakdown.py                       # tiny preset, l1 and l1_l2
    python scripts/ttft_breakdown.py --preset default-model

Figures are milliseconds, means over every request.
"""

from __future__ import annotations

import argparse
import statistics
import threading
from dataclasses import dataclass

from hicache.bench.multiturn import PRESETS, Conversations
from hicache.bench.runner import tier_sizes
from hicache.config import CacheConfig
from hicache.engine.engine import Engine, EngineConfig
from hicache.engine.request import RequestOutput
from hicache.engine.sampling import SamplingParams


@dataclass(frozen=True)
class Breakdown:
    """Means over a config's requests, in ms, and its hit rate (cached / prompt tokens)."""

    ttft_ms: float
    queue_ms: float
    own_ms: float
    hit_rate: float


def run_config(name: str, args: argparse.Namespace) -> Breakdown:
    """Serve every conversation on a fresh engine of config ``name`` (``l1`` / ``l1_l2``)."""
    conv = Conversations.make(
        args.num_clients, args.num_rounds, args.request_length, args.output_length, args.seed
    )
    final_len = args.num_rounds * (args.request_length + args.output_length)
    working_set = args.num_clients * final_len
    l1, ratio = tier_sizes(args, working_set, final_len + args.page_size)  # as the bench's
    cache = CacheConfig(
        page_size=args.page_size,
        device_tokens=l1,
        enable_hierarchical_cache=name == "l1_l2",
        hicache_ratio=ratio,
    )
    engine = Engine(EngineConfig(model_path=args.model_path, cache=cache)).start()
    params = SamplingParams(temperature=0.0, max_tokens=args.output_length, ignore_eos=True)
    outs: list[tuple[int, RequestOutput]] = []
    turn = threading.Condition()
    queue = [(c, 0) for c in range(args.num_clients)]  # first come, first served

    def worker() -> None:
        while True:
            with turn:
                if not queue:
                    return
                client, rnd = queue.pop(0)
            prompt = conv.prompt(client, rnd)
            out = engine.generate(prompt, params)
            with turn:
                outs.append((len(prompt), out))
                if rnd + 1 < args.num_rounds:
                    queue.append((client, rnd + 1))
                    turn.notify()

    try:
        threads = [threading.Thread(target=worker) for _ in range(args.max_parallel)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        engine.close()
    ttft = [o.ttft_s or 0.0 for _, o in outs]
    wait = [o.queue_s or 0.0 for _, o in outs]
    return Breakdown(
        ttft_ms=1e3 * statistics.mean(ttft),
        queue_ms=1e3 * statistics.mean(wait),
        own_ms=1e3 * statistics.mean(t - q for t, q in zip(ttft, wait, strict=True)),
        hit_rate=sum(o.cached.total for _, o in outs) / sum(n for n, _ in outs),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--configs", default="l1,l1_l2")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--l1-tokens", type=int, default=None, help="L1 size (default: the bench's)")
    p.add_argument("--hicache-ratio", type=float, default=None, help="L2 = ratio x L1")
    known, _ = p.parse_known_args()
    p.set_defaults(**PRESETS[known.preset])
    for flag in ("num_clients", "num_rounds", "request_length", "output_length", "max_parallel"):
        p.add_argument("--" + flag.replace("_", "-"), type=int)
    p.add_argument("--model-path")
    args = p.parse_args()
    results = {}
    print(f"{'config':>6} {'TTFT ms':>8} {'queue ms':>9} {'own ms':>7} {'hit rate':>9}")
    for name in args.configs.split(","):
        got = run_config(name, args)
        results[name] = got
        print(
            f"{name:>6} {got.ttft_ms:8.1f} {got.queue_ms:9.1f} {got.own_ms:7.1f}"
            f" {got.hit_rate:9.1%}"
        )
    if {"l1", "l1_l2"} <= results.keys():
        a, b = results["l1"], results["l1_l2"]
        print(
            f"l1_l2 vs l1: TTFT {b.ttft_ms / a.ttft_ms - 1:+.0%}, own work"
            f" {b.own_ms / a.own_ms - 1:+.0%}, queue {b.queue_ms / a.queue_ms - 1:+.0%}"
        )


if __name__ == "__main__":
    main()
