"""``hicache bench agreement``: what one per-step agreement of tensor-parallel ranks costs.

N real rank processes (gloo, CPU, one torch thread each) each build a cache of the same
tiny shape with an L3 backend whose lookups stay in flight (a slow ``memory`` store), open
``ops`` requests so that many prefetches are in flight, and time ``HiCache.sync()`` (the
one all-reduce(min) of the fixed-shape agreement tensor, plus building and applying it)
``--iters`` times; for reference, a bare all-reduce(min) of the same tensor shape and of
one int. Medians in µs, printed as a table and written as JSON (``--json``).

This is the agreement's own cost per engine step (the engine adds the step-input and the
token broadcasts, ``docs/benchmarks/tp.md``); every rank calls the collectives back to back,
so little of it is one rank waiting for another's forward.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hicache.config import CacheConfig, PrefetchConfig, PrefetchPolicy
from hicache.keys import Namespace
from hicache.services.process import free_port
from hicache.spec import KVSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
PAGE = 2
LOOKUP_DELAY_S = 120.0
"""How long each L3 lookup of the slow store takes: the ops stay in flight while timed."""


def _time_us(fn: Any, iters: int) -> float:
    for _ in range(min(50, iters)):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1000


def _rank(rank: int, n: int, port: int, out: str, ops_list: list[int], iters: int) -> None:
    from hicache.cache import HiCache
    from hicache.controller.agreement import CAPACITY
    from hicache.controller.rank_group import RankGroup
    from hicache.storage.registry import create_storage

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=n,
        timeout=datetime.timedelta(seconds=120),
    )
    torch.set_num_threads(1)
    cfg = CacheConfig(page_size=PAGE, device_tokens=4096, hicache_ratio=2.0, load_back_threshold=0)
    cache = HiCache(cfg, SPEC, ranks=RankGroup()).start()
    ns = Namespace.for_spec(
        SPEC,
        model="bench",
        weights_fingerprint="w",
        layout=cfg.mem_layout,
        page_size=PAGE,
        tp_size=n,
        tp_rank=rank,
    )
    store = f"agreement-bench-{os.getpid()}"
    extra = {"store": store, "delay_s": LOOKUP_DELAY_S, "timeout_s": LOOKUP_DELAY_S * 2}
    storage = create_storage("memory", namespace=ns, extra_config=extra)
    cache.l3.attach(
        storage, ns, PrefetchConfig(policy=PrefetchPolicy.WAIT_COMPLETE, prefetch_threshold=0)
    )
    rows: list[dict[str, Any]] = []
    opened = 0
    for ops in sorted(ops_list):
        for i in range(opened, ops):  # distinct prompts: one lookup in flight each
            cache.open([i * 1000 + j for j in range(8)])
        opened = max(opened, ops)
        rows.append({"ops": ops, "sync_us": _time_us(cache.sync, iters)})
    for label, shape in (("all_reduce_tensor_us", (1 + CAPACITY, 7)), ("all_reduce_int_us", (1,))):
        t = torch.zeros(shape, dtype=torch.int64)
        us = _time_us(lambda t=t: dist.all_reduce(t, op=dist.ReduceOp.MIN), iters)
        for row in rows:
            row[label] = us
    Path(out, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    os._exit(0)  # the slow store's lookups are still sleeping: nothing to wait for


def run(ranks: int, ops: list[int], iters: int) -> list[dict[str, Any]]:
    """Rank 0's rows (one per ``ops``), each with every rank's sync median."""
    with tempfile.TemporaryDirectory(prefix="hicache-agreement-bench-") as out:
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [
            ctx.Process(target=_rank, args=(r, ranks, port, out, ops, iters)) for r in range(ranks)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        results = []
        for r in range(ranks):
            path = Path(out, f"rank{r}.json")
            if not path.is_file():
                raise RuntimeError(f"rank {r} did not report (exit code {procs[r].exitcode})")
            results.append(json.loads(path.read_text()))
    rows = results[0]
    for i, row in enumerate(rows):
        row["sync_us_by_rank"] = [res[i]["sync_us"] for res in results]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hicache bench agreement", description=__doc__)
    p.add_argument("--ranks", type=int, default=2, help="rank processes (>= 2)")
    p.add_argument("--ops", default="0,16,64,256", help="comma list: prefetches in flight")
    p.add_argument("--iters", type=int, default=1000, help="timed calls per figure")
    p.add_argument("--json", default=None, help="write the rows to this path")
    a = p.parse_args(argv)
    if a.ranks < 2:
        p.error(f"--ranks {a.ranks}: the agreement needs at least 2 ranks")
    if a.iters < 1:
        p.error(f"--iters {a.iters}: must be >= 1")
    try:
        ops = [int(x) for x in a.ops.split(",") if x.strip()]
    except ValueError:
        p.error(f"--ops {a.ops!r}: a comma list of whole numbers")
    if not ops or min(ops) < 0:
        p.error(f"--ops {a.ops!r}: a comma list of whole numbers >= 0")
    rows = run(a.ranks, ops, a.iters)
    print(f"agreement of {a.ranks} gloo ranks on CPU (medians of {a.iters} calls, µs)")
    print(
        f"{'ops in flight':>14} {'sync() by rank':>24} {'all-reduce tensor':>18} {'all-reduce 1 int':>17}"
    )
    for row in rows:
        by_rank = " / ".join(f"{v:.0f}" for v in row["sync_us_by_rank"])
        print(
            f"{row['ops']:>14} {by_rank:>24} {row['all_reduce_tensor_us']:>18.0f}"
            f" {row['all_reduce_int_us']:>17.0f}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps({"ranks": a.ranks, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
