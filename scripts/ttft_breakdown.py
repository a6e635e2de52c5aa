"""Where a multi-turn request's TTFT goes, measured inside one process (no HTTP).

Runs the multiturn workload of ``hicache bench multiturn`` (same conversations, same tier
sizes, clients served first come first served, ``--max-parallel`` in flight) against an
in-process :class:`~hicache.engine.front.engine.Engine` per config, and splits each request's
engine-side TTFT into

* **queue**: arrival to first admission (:attr:`RequestOutput.queue_s`): the wait for the
  step in progress (a forward is never interrupted) and for room in the batch. A cache
  hit does not shorten it.
* **own work**: admission to first token: matching, loading back from L2, and the forward
  steps that compute the prompt's uncached tokens (mixed with the other requests' decode
  tokens). This is what a hit shortens.

    python scripts/ttft_breakdown.py                       # tiny preset, l1 and l1_l2
    python scripts/ttft_breakdown.py --preset default-model
    python scripts/ttft_breakdown.py --preset sglang-headline --num-rounds 5 \
        --profile /tmp/prof                                # + cProfile of the engine thread

Figures are milliseconds, means over every request; then the input throughput (prompt
tokens over the wall time), the prompt tokens computed (prompt - cached) and, for
``l1_l2`` against ``l1``, the work-saved bound (``l1``'s computed tokens over
``l1_l2``'s) and the throughput gain as a fraction of it. With ``--real-output`` (on in
the ``sglang-headline`` preset) the history gets the model's own output ids, as in
``hicache bench multiturn``. ``--profile PREFIX``: cProfile of the engine thread per
config, written to ``PREFIX.CONFIG.pstats``.
"""

from __future__ import annotations

import argparse
import cProfile
import statistics
import threading
import time
from dataclasses import dataclass

from hicache.bench.multiturn import PRESETS, Conversations
from hicache.bench.runner import tier_sizes
from hicache.config import CacheConfig
from hicache.engine.drivers.leader import Leader
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.request import RequestOutput
from hicache.engine.sampling import SamplingParams


@dataclass(frozen=True)
class Breakdown:
    """Means over a config's requests, in ms, and its hit rate (cached / prompt tokens)."""

    ttft_ms: float
    queue_ms: float
    own_ms: float
    hit_rate: float
    input_tok_s: float
    computed: int
    """Prompt tokens computed: prompt - cached, over every request."""
    cpu_s: float
    """CPU seconds of this process (every thread) while the requests ran."""


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
    prof = cProfile.Profile() if args.profile else None
    if prof is not None:
        plain_run = Leader.run
        Leader.run = lambda self: prof.runcall(plain_run, self)  # type: ignore[method-assign]
    try:
        engine = Engine(EngineConfig(model_path=args.model_path, cache=cache)).start()
    finally:
        if prof is not None:
            Leader.run = plain_run  # type: ignore[method-assign]
    params = SamplingParams(
        temperature=0.0, max_tokens=args.output_length, ignore_eos=not args.real_output
    )
    outs: list[tuple[int, RequestOutput]] = []
    turn = threading.Condition()
    queue = [(c, 0) for c in range(args.num_clients)]  # first come, first served
    history: list[list[int]] = [[] for _ in range(args.num_clients)]

    def worker() -> None:
        while True:
            with turn:
                if not queue:
                    return
                client, rnd = queue.pop(0)
            if args.real_output:
                prompt = history[client] + conv.user[client][rnd]
            else:
                prompt = conv.prompt(client, rnd)
            out = engine.generate(prompt, params)
            history[client] = prompt + list(out.output_ids)
            with turn:
                outs.append((len(prompt), out))
                if rnd + 1 < args.num_rounds:
                    queue.append((client, rnd + 1))
                    turn.notify()

    t0, c0 = time.perf_counter(), time.process_time()
    try:
        threads = [threading.Thread(target=worker) for _ in range(args.max_parallel)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        engine.close()
    if prof is not None:
        prof.dump_stats(f"{args.profile}.{name}.pstats")
    ttft = [o.ttft_s or 0.0 for _, o in outs]
    wait = [o.queue_s or 0.0 for _, o in outs]
    return Breakdown(
        ttft_ms=1e3 * statistics.mean(ttft),
        queue_ms=1e3 * statistics.mean(wait),
        own_ms=1e3 * statistics.mean(t - q for t, q in zip(ttft, wait, strict=True)),
        hit_rate=sum(o.cached.total for _, o in outs) / sum(n for n, _ in outs),
        input_tok_s=sum(n for n, _ in outs) / wall,
        computed=sum(n - o.cached.total for n, o in outs),
        cpu_s=cpu,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--configs", default="l1,l1_l2")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--l1-tokens", type=int, default=None, help="L1 size (default: the bench's)")
    p.add_argument("--hicache-ratio", type=float, default=None, help="L2 = ratio x L1")
    p.add_argument("--real-output", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--profile", metavar="PREFIX", help="cProfile the engine thread")
    known, _ = p.parse_known_args()
    p.set_defaults(**PRESETS[known.preset])
    for flag in ("num_clients", "num_rounds", "request_length", "output_length", "max_parallel"):
        p.add_argument("--" + flag.replace("_", "-"), type=int)
    p.add_argument("--model-path")
    args = p.parse_args()
    results = {}
    print(f"{'config':>6} {'TTFT ms':>8} {'queue ms':>9} {'own ms':>7} {'hit rate':>9}"
          f" {'in tok/s':>9} {'computed':>9} {'CPU s':>7}")  # fmt: skip
    for name in args.configs.split(","):
        got = run_config(name, args)
        results[name] = got
        print(
            f"{name:>6} {got.ttft_ms:8.1f} {got.queue_ms:9.1f} {got.own_ms:7.1f}"
            f" {got.hit_rate:9.1%} {got.input_tok_s:9.0f} {got.computed:9d} {got.cpu_s:7.1f}",
            flush=True,
        )
    if {"l1", "l1_l2"} <= results.keys():
        a, b = results["l1"], results["l1_l2"]
        print(
            f"l1_l2 vs l1: TTFT {b.ttft_ms / a.ttft_ms - 1:+.0%}, own work"
            f" {b.own_ms / a.own_ms - 1:+.0%}, queue {b.queue_ms / a.queue_ms - 1:+.0%};"
            f" input tok/s {b.input_tok_s / a.input_tok_s:.2f}x, bound"
            f" {a.computed / b.computed:.2f}x, gain / bound"
            f" {b.input_tok_s / a.input_tok_s / (a.computed / b.computed):.2f}; CPU"
            f" {a.cpu_s / b.cpu_s:.2f}x less"
        )


if __name__ == "__main__":
    main()
