"""``hicache bench tree``: insert and match cost of the HiRadixTree, in µs per sequence.

Workloads (both with token ids uniform in [0, 32000)):

* ``random``: 10,000 sequences of 512 random tokens;
* ``shared_prefix``: 100 prefixes of 384 tokens; sequence i = prefix (i mod 100) + 128
  random tokens.

Each run inserts every sequence (timing the loop), then matches every sequence. Inputs
are plain ``list[int]``, as an engine would pass them. The workload lists are moved out of
the garbage collector's sight (``gc.freeze``) before timing; the tree's own objects are
not.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from dataclasses import asdict, dataclass

from hicache.bench.report import print_table, write_json
from hicache.tree import HiRadixTree
from hicache.tree.node import page_ids

VOCAB = 32000


@dataclass(frozen=True)
class TreeRun:
    page_size: int
    workload: str
    insert_us: float
    match_us: float


def make_workload(name: str, n: int, seed: int) -> list[list[int]]:
    """Token sequences of the named workload (see module docstring)."""
    rng = random.Random(seed)
    if name == "random":
        return [[rng.randrange(VOCAB) for _ in range(512)] for _ in range(n)]
    if name == "shared_prefix":
        prefixes = [[rng.randrange(VOCAB) for _ in range(384)] for _ in range(100)]
        return [prefixes[i % 100] + [rng.randrange(VOCAB) for _ in range(128)] for i in range(n)]
    raise ValueError(f"workload={name!r} is unknown; choose 'random' or 'shared_prefix'")


def run_one(page_size: int, workload: str, seqs: list[list[int]]) -> TreeRun:
    """Insert then match every sequence in a fresh tree; µs per sequence for each phase."""
    tree = HiRadixTree(page_size)
    pages = [page_ids(range(len(s) // page_size)) for s in seqs]
    t0 = time.perf_counter()
    for seq, pg in zip(seqs, pages, strict=True):
        tree.insert(seq, pg)
    t1 = time.perf_counter()
    for seq in seqs:
        tree.match_prefix(seq)
    t2 = time.perf_counter()
    n = len(seqs)
    return TreeRun(page_size, workload, (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicache bench tree", description=__doc__)
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--num-seqs", type=int, default=10_000)
    parser.add_argument("--page-sizes", default="1,64")
    parser.add_argument("--repeat", type=int, default=3, help="keep the fastest of N runs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    runs: list[TreeRun] = []
    for workload in ("random", "shared_prefix"):
        seqs = make_workload(workload, args.num_seqs, args.seed)
        # The workload's 10,000 token lists are the harness's, not the tree's: keep the
        # garbage collector from re-scanning them during the timed loops.
        gc.collect()
        gc.freeze()
        for ps in (int(p) for p in args.page_sizes.split(",")):
            trials = [run_one(ps, workload, seqs) for _ in range(max(1, args.repeat))]
            runs.append(
                TreeRun(
                    ps,
                    workload,
                    min(t.insert_us for t in trials),
                    min(t.match_us for t in trials),
                )
            )
    print_table(
        "HiRadixTree, µs per sequence (best of repeats)",
        ["workload", "page_size", "insert µs", "match µs"],
        [[r.workload, str(r.page_size), f"{r.insert_us:.2f}", f"{r.match_us:.2f}"] for r in runs],
    )
    if args.json:
        write_json(args.json, {"runs": [asdict(r) for r in runs]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
