"""``hicache bench fairness``: small requests beside one wide, long request.

One engine in this process (the server's default batching): one request of ``--wide-n``
copies of a ``--wide-prompt``-token prompt, ``--wide-tokens`` tokens each, sent as the
server sends ``n`` copies (one group), then ``--num-small`` small requests (each its own
group) one every ``--small-interval`` s. Configs: ``off`` (no group rule), ``on`` (the
default: a group's cap is half the running slots, idle slots lent), ``lpm`` and ``strict``
(a cap that does not lend); ``--repeats`` runs per config in alternating order, ratios
against ``off`` in the same repetition. Figures per run: the small requests' TTFT p50 /
p99 (s, the engine's) and wait in engine steps, the wide request's output throughput
(tokens/s) and span in steps, and the copies retracted to give a lent slot back. The
method in full: ``docs/benchmarks/fairness.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hicache.bench.pairs import Spread, alternating_order, pair_ratios, quantile
from hicache.bench.report import print_table, write_json

CONFIGS = ("off", "on", "lpm", "strict")
COLUMNS = ("config", "small TTFT p50 s", "p99 s", "wait p99 steps", "wide tok/s",
           "wide steps", "reclaimed", "p50/off", "p99/off", "wide/off")  # fmt: skip
TIMEOUT_S = 600.0


@dataclass(frozen=True)
class FairnessRun:
    """One run of the workload under ``config`` in repetition ``repeat``: the small
    requests' TTFTs (s) and waits (wide steps), in arrival order; the wide request's
    tokens and the seconds from its first copy's arrival to its last copy's end."""

    config: str
    repeat: int
    small_ttft_s: tuple[float, ...]
    small_wait_steps: tuple[int, ...]
    small_arrival_steps: tuple[int, ...]
    """The engine's forwards so far when each small request arrived (its first: 0)."""
    wide_tokens: int
    wall_s: float
    reclaimed: int = 0
    """Wide copies retracted to give a lent slot back during the run."""
    wide_steps: int = 0
    """The engine's forwards from the wide request's arrival to its last copy's end."""

    @property
    def ttft_p50(self) -> float:
        return quantile(self.small_ttft_s, 0.5)

    @property
    def ttft_p99(self) -> float:
        return quantile(self.small_ttft_s, 0.99)

    @property
    def wait_p99(self) -> float:
        return quantile([float(w) for w in self.small_wait_steps], 0.99)

    @property
    def wide_tok_s(self) -> float:
        return self.wide_tokens / self.wall_s

    def figures(self) -> dict[str, float]:
        return {
            "ttft_p50_s": self.ttft_p50,
            "ttft_p99_s": self.ttft_p99,
            "wait_p99_steps": self.wait_p99,
            "wide_tok_s": self.wide_tok_s,
            "wide_steps": float(self.wide_steps),
            "reclaimed": float(self.reclaimed),
        }


def scheduler_fields(config: str) -> dict[str, Any]:
    """The :class:`~hicache.engine.step.scheduler.SchedulerConfig` fields of ``config``."""
    if config == "off":
        return {"schedule_policy": "fcfs", "max_running_requests_per_group": 0}
    if config == "on":
        return {"schedule_policy": "fcfs", "max_running_requests_per_group": None}
    if config == "lpm":
        return {"schedule_policy": "lpm", "max_running_requests_per_group": None}
    if config == "strict":
        return {
            "schedule_policy": "fcfs",
            "max_running_requests_per_group": None,
            "lend_idle_slots": False,
        }
    raise ValueError(f"config {config!r} is unknown; choose from {', '.join(CONFIGS)}")


def run_once(engine: Any, args: argparse.Namespace, config: str, repeat: int) -> FairnessRun:
    """One run of the workload on ``engine`` (started, idle); leaves it idle and flushed."""
    from hicache.engine.request import RequestOutput
    from hicache.engine.sampling import SamplingParams

    rng = random.Random(f"fairness/{args.seed}/{repeat}")

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, 30000) for _ in range(n)]

    wide_prompt = ids(args.wide_prompt)
    small_prompts = [ids(args.small_prompt) for _ in range(args.num_small)]
    wide_params = SamplingParams(temperature=0.0, max_tokens=args.wide_tokens, ignore_eos=True)
    small_params = SamplingParams(temperature=0.0, max_tokens=2)
    lock = threading.Lock()
    progress: dict[str, int] = {}  # wide rid -> tokens so far
    wide_done = threading.Event()
    wide_end: list[float] = []
    wide_steps: list[int] = []
    wide_started = threading.Event()
    ttfts: dict[int, float] = {}
    waits: dict[int, int] = {}
    arrived_at: dict[int, int] = {}
    done = threading.Event()

    base = engine.core.scheduler.forwards
    reclaimed_before = engine.core.scheduler.reclaimed

    def clock() -> int:  # engine thread
        return int(engine.core.scheduler.forwards) - base

    def on_wide(out: RequestOutput) -> None:  # engine thread
        with lock:
            progress[out.rid] = len(out.output_ids)
            if out.finished:
                wide_end.append(time.perf_counter())
                if len(wide_end) == args.wide_n:
                    wide_steps.append(clock())
                    wide_done.set()
        if out.output_ids and not wide_started.is_set():
            wide_started.set()
            for _ in range(args.wide_n - 1):  # the copies, as the server's fan-out sends them
                engine.submit(wide_prompt, wide_params, on_wide, group=f"wide-{repeat}")

    def on_small(k: int) -> Any:
        def on(out: RequestOutput) -> None:  # engine thread
            with lock:
                if out.output_ids and k not in waits:
                    waits[k] = clock() - arrived_at[k]
                if out.finished:
                    ttfts[k] = out.ttft_s if out.ttft_s is not None else float("nan")
                    if len(ttfts) == args.num_small:
                        done.set()

        return on

    t0 = time.perf_counter()
    engine.submit(wide_prompt, wide_params, on_wide, group=f"wide-{repeat}")
    if not wide_started.wait(TIMEOUT_S):
        raise TimeoutError("the wide request produced no token")
    for k in range(args.num_small):

        def arrive(k: int = k) -> None:  # on the engine thread, before its next step
            with lock:
                arrived_at[k] = clock()
            engine.submit(small_prompts[k], small_params, on_small(k))

        engine.call(arrive).result(TIMEOUT_S)
        time.sleep(args.small_interval)
    if not done.wait(TIMEOUT_S):
        raise TimeoutError("the small requests did not finish")
    if not wide_done.wait(TIMEOUT_S):
        raise TimeoutError("the wide request did not finish")
    with lock:
        generated = sum(progress.values())
        wall = max(wide_end) - t0
    _wait_idle(engine)
    reclaimed = engine.call(lambda: engine.core.scheduler.reclaimed).result(TIMEOUT_S)
    if not engine.flush_cache():
        raise RuntimeError("the engine did not go idle for the flush")
    return FairnessRun(
        config=config,
        repeat=repeat,
        small_ttft_s=tuple(ttfts[k] for k in range(args.num_small)),
        small_wait_steps=tuple(waits[k] for k in range(args.num_small)),
        small_arrival_steps=tuple(arrived_at[k] for k in range(args.num_small)),
        wide_tokens=generated,
        wall_s=wall,
        reclaimed=int(reclaimed) - int(reclaimed_before),
        wide_steps=wide_steps[0],
    )


def _wait_idle(engine: Any) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not engine.call(lambda: engine.core.scheduler.idle).result(TIMEOUT_S):
        if time.monotonic() > deadline:
            raise TimeoutError("the engine did not go idle")
        time.sleep(0.01)


def make_engine(args: argparse.Namespace, config: str, loaded: Any) -> Any:
    """A started engine for ``config`` over the model ``loaded`` (shared by the configs'
    engines: only one runs at a time)."""
    from hicache.config import CacheConfig
    from hicache.engine.front.engine import Engine, EngineConfig
    from hicache.engine.step.scheduler import SchedulerConfig

    per_seq = args.wide_prompt + args.wide_tokens + 2 * args.page_size
    tokens = max(args.wide_n * per_seq + args.num_small * 64, 4096)
    cfg = EngineConfig(
        model_path=args.model_path,
        dtype=loaded.dtype,
        device=args.device,
        cache=CacheConfig(page_size=args.page_size, device_tokens=tokens),
        scheduler=SchedulerConfig(
            max_running_requests=args.max_running_requests, **scheduler_fields(config)
        ),
        max_queued_requests=None,
    )
    return Engine(cfg, loaded=loaded).start()


def spreads(runs: Sequence[FairnessRun], configs: Sequence[str]) -> dict[str, Any]:
    """Per config: the spread of each figure over its runs; per config other than ``off``
    (when it ran): the spread of its pair ratios to ``off`` per figure."""
    out: dict[str, Any] = {"per_config": {}, "pairs": {}}
    repeats = sorted({r.repeat for r in runs})
    by = {(r.config, r.repeat): r.figures() for r in runs}
    for c in configs:
        figs = [by[(c, rep)] for rep in repeats if (c, rep) in by]
        out["per_config"][c] = {
            m: Spread.of([f[m] for f in figs]).to_json() for m in (figs[0] if figs else {})
        }
        if c == "off" or "off" not in configs:
            continue
        ratios = {}
        for m in ("ttft_p50_s", "ttft_p99_s", "wide_tok_s"):
            col = [by[(c, rep)][m] if (c, rep) in by else None for rep in repeats]
            base = [by[("off", rep)][m] if ("off", rep) in by else None for rep in repeats]
            s = pair_ratios(col, base)
            if s is not None:
                ratios[m] = s.to_json()
        out["pairs"][c] = ratios
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every run finished, 2 on bad flags."""
    p = argparse.ArgumentParser(
        prog="hicache bench fairness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model-path", default="tiny-random-llama")
    p.add_argument("--device", default="cpu")
    p.add_argument("--configs", default="off,on", help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--wide-n", type=int, default=64, help="copies of the wide request")
    p.add_argument("--wide-prompt", type=int, default=32, help="its prompt, tokens")
    p.add_argument("--wide-tokens", type=int, default=128, help="tokens each copy generates")
    p.add_argument("--num-small", type=int, default=16, help="small requests")
    p.add_argument("--small-prompt", type=int, default=16, help="their prompts, tokens")
    p.add_argument("--small-interval", type=float, default=0.05, help="seconds between them")
    p.add_argument("--repeats", type=int, default=4, help="repetitions per config (>= 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the runs and ratios as JSON")
    args = p.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs or len(set(configs)) != len(configs):
        p.error(f"--configs={args.configs!r}: give distinct names from {', '.join(CONFIGS)}")
    if min(args.wide_n, args.wide_prompt, args.wide_tokens, args.num_small) < 1:
        p.error("--wide-n, --wide-prompt, --wide-tokens and --num-small must be >= 1")
    if args.small_prompt < 1 or args.small_interval < 0 or args.repeats < 1:
        p.error("--small-prompt and --repeats must be >= 1, --small-interval >= 0")
    from hicache.runner.loader import default_dtype, load_model

    dtype = "float32" if args.device == "cpu" else default_dtype(args.device)
    loaded = load_model(args.model_path, dtype=dtype, device=args.device)
    engines = {c: make_engine(args, c, loaded) for c in configs}
    runs: list[FairnessRun] = []
    try:
        for rep, order in enumerate(alternating_order(configs, args.repeats)):
            for c in order:
                runs.append(run_once(engines[c], args, c, rep))
    finally:
        for e in engines.values():
            e.close()
    doc = spreads(runs, configs)
    rows = []
    for c in configs:
        per = doc["per_config"][c]
        pair = doc["pairs"].get(c, {})

        def ratio(m: str, pair: dict[str, Any] = pair) -> str:
            return f"{pair[m]['median']:.2g}x" if m in pair else "-"

        rows.append(
            [
                c,
                f"{per['ttft_p50_s']['median']:.3f}",
                f"{per['ttft_p99_s']['median']:.3f}",
                f"{per['wait_p99_steps']['median']:.0f}",
                f"{per['wide_tok_s']['median']:.0f}",
                f"{per['wide_steps']['median']:.0f}",
                f"{per['reclaimed']['median']:.0f}",
                ratio("ttft_p50_s"),
                ratio("ttft_p99_s"),
                ratio("wide_tok_s"),
            ]
        )
    print_table(
        f"fairness: 1 x n={args.wide_n} ({args.wide_prompt}+{args.wide_tokens} tokens) beside"
        f" {args.num_small} small requests, {args.max_running_requests} running slots,"
        f" {args.repeats} repetitions (medians; ratios to off, pair by pair)",
        COLUMNS,
        rows,
    )
    if args.json:
        doc["runs"] = [dataclasses.asdict(r) | r.figures() for r in runs]
        doc["meta"] = {k: v for k, v in vars(args).items() if k != "json"}
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
