"""``hicache bench slow-l3``: a request whose prompt is in a slow L3, against recomputing it.

One engine in process over the ``memory`` backend (``prefetch_threshold`` unset: the
rates decide): a prompt of ``--tokens`` is written to L3 and read back twice while the
store is fast (the first read measures it, the rates decide the second), then every
store operation is slowed by ``--delay-s`` (the backend's fault injection). Each of
``--turns`` turns then sends that prompt again with only L3 holding it (L1 and L2
flushed) and a fresh prompt of the same length that nothing holds (the recompute it is
compared with), one after the other, alternating which goes first. The first slow turn waits as a request always did before
the rates decided (nothing has measured the store slow yet); the later ones go on by the
measured rates (:mod:`hicache.cache.l3.worth`). Printed per turn: TTFT of both (the
engine's, arrival to first token, ms), their ratio and the tokens the replay got from L3;
then the median ratio of the turns after the first and the decision counters. A
benchmark: it asserts nothing. Results: ``docs/benchmarks/full-hit.md``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from hicache.bench.report import write_json
from hicache.bench.runner import TOKEN_HI, TOKEN_LO
from hicache.cache.report import cache_stats
from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.sampling import SamplingParams
from hicache.engine.step.scheduler import SchedulerConfig
from hicache.storage.backends.memory import MemoryFaults, MemoryStorage

__all__ = ["Turn", "main", "run"]

_COUNTERS = (
    "l3_unwaited_prefetches_total",
    "l3_decided_read_tokens_total",
    "l3_decided_recompute_tokens_total",
    "prefetch_timeouts_total",
)


@dataclass(frozen=True, slots=True)
class Turn:
    """One turn: TTFT (s) of the replay from the slow L3 and of a fresh prompt, and the
    prompt tokens the replay got from L3."""

    replay_ttft_s: float
    recompute_ttft_s: float
    storage_tokens: int

    @property
    def ratio(self) -> float:
        return self.replay_ttft_s / self.recompute_ttft_s


def _only_in_l3(engine: Engine) -> None:
    """Every backup in L3, then L1 and L2 emptied."""
    engine.call(lambda: engine.core.cache.sync(wait=True)).result(timeout=300)
    if not engine.flush_cache():
        raise RuntimeError("flush_cache refused")


def run(args: argparse.Namespace) -> tuple[list[Turn], dict[str, int]]:
    """The turns and the cache counters after them (see the module docstring)."""
    config = EngineConfig(
        model_path=args.model_path,
        dtype="float32",
        device=args.device,
        cache=CacheConfig(
            page_size=args.page_size, device_tokens=4 * args.tokens + 256, hicache_ratio=2.0
        ),
        scheduler=SchedulerConfig(max_running_requests=4, chunked_prefill_size=args.tokens + 1),
        context_length=args.tokens + 64,
        storage_backend="memory",
        storage_extra_config={"store": f"slow-l3-{time.monotonic_ns()}"},  # rates decide
    )
    rng = random.Random(args.seed)
    one = SamplingParams(temperature=0, max_tokens=1)

    def prompt() -> list[int]:
        return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(args.tokens + 1)]

    turns: list[Turn] = []
    with Engine(config).start() as engine:
        for _ in range(3):  # warm up; the prefill is measured
            engine.generate(prompt(), one, timeout=300)
        held = prompt()
        engine.generate(held, one, timeout=300)
        _only_in_l3(engine)
        for _ in range(2):  # read from a fast L3: to measure it, then as the rates say
            engine.generate(held, one, timeout=300)
            _only_in_l3(engine)
        tier = engine.core.cache.l3.attached
        assert tier is not None and isinstance(tier.controller.storage, MemoryStorage)
        tier.controller.storage.set_faults(MemoryFaults(delay_s=args.delay_s))
        try:
            for i in range(args.turns):
                if i % 2:  # alternate which goes first
                    fresh = engine.generate(prompt(), one, timeout=300)
                    replay = engine.generate(held, one, timeout=300)
                else:
                    replay = engine.generate(held, one, timeout=300)
                    fresh = engine.generate(prompt(), one, timeout=300)
                if replay.ttft_s is None or fresh.ttft_s is None:
                    raise RuntimeError(f"a request failed: {replay.error or fresh.error}")
                turns.append(Turn(replay.ttft_s, fresh.ttft_s, replay.cached.storage))
                _only_in_l3(engine)
        finally:
            tier.controller.storage.set_faults(MemoryFaults())
        counters = engine.call(lambda: cache_stats(engine.core.cache)).result().counters
    return turns, {name: int(counters[name]) for name in _COUNTERS}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="hicache bench slow-l3",
        description="TTFT of a prompt held by a slow L3 against recomputing it.",
    )
    p.add_argument("--model-path", default="tiny-random-llama")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=2000, help="prompt length")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--delay-s", type=float, default=0.5, help="every slowed store op, s")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = p.parse_args(argv)
    for name in ("tokens", "page_size", "turns"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.delay_s > 0:
        p.error("--delay-s must be > 0")
    turns, counters = run(args)
    for i, t in enumerate(turns):
        print(
            f"turn {i}: replay from the slow L3 {1e3 * t.replay_ttft_s:.1f} ms, recompute"
            f" {1e3 * t.recompute_ttft_s:.1f} ms, ratio {t.ratio:.2f},"
            f" L3 tokens {t.storage_tokens}"
        )
    later = [t.ratio for t in turns[1:]]
    median = statistics.median(later) if later else None
    print(f"median ratio after the first turn: {'n/a' if median is None else f'{median:.3f}'}")
    print(", ".join(f"{k} {v}" for k, v in counters.items()))
    if args.json:
        write_json(
            args.json,
            {
                "args": vars(args),
                "turns": [{**asdict(t), "ratio": t.ratio} for t in turns],
                "median_ratio_after_first": median,
                "counters": counters,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
