"""``make demo``: two multi-turn chats on the default model, without and with HiCache.

Two users take turns with the engine (SmolLM2-135M-Instruct unless ``--model-path`` says
otherwise). Each turn sends the whole conversation so far. The run is done twice:

1. radix cache off: every turn prefills the whole conversation again;
2. hierarchical cache on, with L1 sized for about one conversation: while user A talks,
   user B's prefix is demoted to L2, and B's next turn loads it back instead of
   recomputing it.

Each turn prints its time to first token and the prompt tokens served from each tier.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from hicache.cache.report import cache_stats
from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.sampling import SamplingParams
from hicache.engine.step.scheduler import SchedulerConfig
from hicache.runner.loader import load_model

console = Console()

SYSTEM = (
    "You are a patient tutor. Answer in two or three short sentences, plainly, and end "
    "each answer with one question that checks the student's understanding."
)
QUESTIONS = {
    "ana": [
        "Why does a key-value cache make decoding faster in a transformer?",
        "And why can two requests share the cache of a common prefix?",
        "What happens when the GPU memory for that cache runs out?",
        "So is host memory too slow to help at all?",
    ],
    "ben": [
        "What is a radix tree, in one paragraph?",
        "How would you use one to find the longest shared prefix of two prompts?",
        "Why split a node when a match ends inside it?",
        "How does that relate to caching pages of tokens?",
    ],
}


def run(engine: Engine, title: str) -> list[tuple[int, str, int, float, int, int]]:
    """Play the conversations; returns per-turn (round, user, prompt, ttft, device, host)."""
    tok = engine.model.tokenizer
    params = SamplingParams(temperature=0, max_tokens=48)
    history = {u: [{"role": "system", "content": SYSTEM}] for u in QUESTIONS}
    rows = []
    for rnd in range(len(QUESTIONS["ana"])):
        for user, qs in QUESTIONS.items():
            history[user].append({"role": "user", "content": qs[rnd]})
            got: Any = tok.apply_chat_template(
                history[user], add_generation_prompt=True, tokenize=True
            )
            ids = [int(t) for t in (got["input_ids"] if hasattr(got, "keys") else got)]
            out = engine.generate(ids, params, timeout=600)
            if out.error:
                console.print(f"[red]{user}, round {rnd + 1}: {out.error}")
            history[user].append({"role": "assistant", "content": out.text})
            rows.append(
                (rnd + 1, user, len(ids), out.ttft_s or 0.0, out.cached.device, out.cached.host)
            )
    table = Table(title=title, title_justify="left")
    for col in ("round", "user", "prompt tokens", "TTFT ms", "cached L1", "cached L2"):
        table.add_column(col, justify="right")
    for rnd, user, n, ttft, dev, host in rows:
        table.add_row(str(rnd), user, str(n), f"{ttft * 1e3:.0f}", str(dev), str(host))
    console.print(table)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hicache-demo", description=__doc__)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--l1-tokens", type=int, default=384, help="L1 size of the HiCache run")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    loaded = load_model(args.model_path)
    console.print(
        f"model {loaded.name} ({loaded.dtype}) loaded in {time.perf_counter() - t0:.1f} s"
    )
    sched = SchedulerConfig(max_running_requests=4, chunked_prefill_size=1024)
    off = EngineConfig(
        model_path=args.model_path,
        cache=CacheConfig(page_size=16, device_tokens=8192, enable_hierarchical_cache=False),
        scheduler=SchedulerConfig(
            max_running_requests=4, chunked_prefill_size=1024, disable_radix_cache=True
        ),
    )
    on = EngineConfig(
        model_path=args.model_path,
        cache=CacheConfig(
            page_size=16,
            device_tokens=args.l1_tokens,
            enable_hierarchical_cache=True,
            hicache_ratio=8.0,
            load_back_threshold=16,
        ),
        scheduler=sched,
    )
    with Engine(off, loaded=loaded) as engine:
        cold = run(engine, "1. radix cache off: every turn prefills everything")
    with Engine(on, loaded=loaded) as engine:
        hot = run(engine, f"2. HiCache on: L1 = {args.l1_tokens} tokens, L2 = 8 x L1")
        stats = engine.call(lambda: cache_stats(engine.core.cache)).result()
    later = [i for i, r in enumerate(cold) if r[0] > 1]
    mean_cold = sum(cold[i][3] for i in later) / len(later)
    mean_hot = sum(hot[i][3] for i in later) / len(later)
    host = sum(hot[i][5] for i in later)
    console.print(
        f"rounds 2+: mean TTFT {mean_cold * 1e3:.0f} ms without cache, {mean_hot * 1e3:.0f} ms"
        f" with HiCache ({100 * (1 - mean_hot / mean_cold):.0f}% lower); {host} prompt tokens"
        f" came back from L2; {stats.counters['device_demoted_tokens_total']} tokens were"
        " demoted L1 -> L2"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
