"""``hicache bench full-hit``: TTFT of a prompt wholly cached in L2 or L3, against an ideal.

In process: one :class:`~hicache.engine.front.engine.Engine` with L1, L2 and the ``file``
L3 (prefetch ``wait_complete``). Each of ``--repeat`` fresh prompts of ``--tokens`` ids
(``max_tokens=1``, greedy) runs cold, then as an L1 hit, an L2 hit (L1 evicted) and an L3
hit (L1 and L2 flushed). Units: TTFT in s (the engine's: submitted -> first token), the
median over the repeats. Ideals, measured in the same run: ``KV bytes / bandwidth +
TTFT(L1 hit)``, the bandwidth that of one contiguous ``copy_`` (L2) or of plain ``open`` /
``readinto`` of the same bytes in the same file system (L3); ``ratio = measured / ideal``
(target for L2: <= 1.5). After the run, the break-even per tier as the engine measured
it (what ``/metrics`` exports, :mod:`hicache.rates`): restore tokens/s of L2 -> L1 loads
and L3 -> L2 reads against prefill tokens/s. The method in full:
``docs/benchmarks/full-hit.md``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hicache.bench.plot import print_table
from hicache.bench.report import write_json
from hicache.bench.runner import TOKEN_HI, TOKEN_LO, round_to_pages
from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.request import RequestOutput
from hicache.engine.sampling import SamplingParams
from hicache.rates import RateFit, RestoreRates, break_even

__all__ = ["FullHitResult", "copy_gbps", "file_read_gbps", "main"]

STAGES = ("cold", "l1", "l2", "l3")


@dataclass
class FullHitResult:
    """Samples of every stage (TTFT s, hit tokens) and the bandwidths (GB/s = 1e9 B/s)."""

    ttft_s: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STAGES})
    hit_tokens: dict[str, list[int]] = field(default_factory=lambda: {s: [] for s in STAGES})
    copy_gbps: list[float] = field(default_factory=list)
    file_read_gbps: list[float] = field(default_factory=list)
    restores: RestoreRates | None = None
    """The engine's restore rates per tier after the run."""
    prefill: RateFit | None = None
    """The engine's prefill rate after the run."""


def _median_time(fn: Any, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_gbps(nbytes: int, device: torch.device, repeat: int = 5) -> float:
    """GB/s of one contiguous ``copy_`` of ``nbytes`` from host memory to ``device``
    (pinned source on CUDA), median of ``repeat`` timed copies after a warm-up."""
    cuda = device.type == "cuda"
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    if cuda:
        src = src.pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def run() -> None:
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(device)

    return nbytes / _median_time(run, repeat) / 1e9


def file_read_gbps(root: Path, pages: int, page_bytes: int, repeat: int = 5) -> float:
    """GB/s of reading ``pages`` files of ``page_bytes`` each (plain ``open`` + ``readinto``,
    unbuffered) under ``root``, written just before (so, like the backend's, hot in the
    page cache); median of ``repeat`` timed passes after a warm-up."""
    root.mkdir(parents=True, exist_ok=True)
    data = os.urandom(page_bytes)
    paths = [root / f"raw-{i}" for i in range(pages)]
    for p in paths:
        p.write_bytes(data)
    buf = bytearray(pages * page_bytes)
    view = memoryview(buf)

    def run() -> None:
        for i, p in enumerate(paths):
            with open(p, "rb", buffering=0) as f:
                f.readinto(view[i * page_bytes : (i + 1) * page_bytes])

    try:
        return pages * page_bytes / _median_time(run, repeat) / 1e9
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _hits(out: RequestOutput) -> dict[str, int]:
    c = out.cached
    return {"cold": c.total, "l1": c.device, "l2": c.host, "l3": c.storage}


def run(args: argparse.Namespace, l3_dir: Path) -> tuple[FullHitResult, int, torch.device]:
    """Run every stage ``args.repeat`` times; returns the samples, the KV bytes per token
    and the engine's device."""
    ps = args.page_size
    cache = CacheConfig(
        page_size=ps,
        device_tokens=round_to_pages(2 * args.tokens + 2 * ps, ps),
        enable_hierarchical_cache=True,
        hicache_ratio=4.0,
    )
    extra = {"file_path": str(l3_dir / "hicache"), "prefetch_threshold": ps}
    kwargs = {} if args.device is None else {"device": args.device}
    config = EngineConfig(
        model_path=args.model_path,
        dtype=args.dtype,
        cache=cache,
        storage_backend="file",
        storage_prefetch_policy="wait_complete",
        storage_extra_config=extra,
        storage_tp_lcm=args.storage_tp_lcm,
        **kwargs,
    )
    params = SamplingParams(temperature=0.0, max_tokens=1)
    res = FullHitResult()
    rng = random.Random(args.seed)
    with Engine(config) as engine:
        token_bytes = engine.core.cache.context.spec.token_bytes
        device = torch.device(engine.config.device)

        def gen(prompt: list[int], stage: str) -> None:
            out = engine.generate(prompt, params, timeout=600)
            if out.error:
                raise RuntimeError(f"{stage}: {out.error}")
            assert out.ttft_s is not None
            res.ttft_s[stage].append(out.ttft_s)
            res.hit_tokens[stage].append(_hits(out)[stage])

        def demote_all() -> int:
            """Wait for the copies, then evict every L1 page (backed-up ones stay in L2)."""
            engine.core.cache.sync(wait=True)
            return engine.core.cache.full.pages.evict_device(10**9)

        gen([rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(32)], "cold")  # warm-up
        res.ttft_s["cold"].clear()
        res.hit_tokens["cold"].clear()
        for _ in tqdm(range(args.repeat), desc="full-hit", unit="prompt", file=sys.stderr):
            prompt = [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(args.tokens)]
            gen(prompt, "cold")
            # Let the L1 -> L2 -> L3 copies land first: the L1-hit request splits the
            # prompt's node (it matches all but the last page), and a split while the
            # node's L2 backup is in flight leaves the head pages out of L3.
            engine.call(lambda: engine.core.cache.sync(wait=True)).result(timeout=120)
            gen(prompt, "l1")
            engine.call(demote_all).result(timeout=120)
            gen(prompt, "l2")
            engine.call(lambda: engine.core.cache.sync(wait=True)).result(timeout=120)
            if not engine.flush_cache():
                raise RuntimeError("flush_cache refused: a request is still in flight")
            gen(prompt, "l3")
            nbytes = res.hit_tokens["l2"][-1] * token_bytes
            res.copy_gbps.append(copy_gbps(nbytes, device))
            pages = res.hit_tokens["l3"][-1] // ps
            res.file_read_gbps.append(
                file_read_gbps(l3_dir / "raw", max(1, pages), ps * token_bytes)
            )
        engine.call(lambda: engine.core.cache.sync(wait=True)).result(timeout=120)
        stats = engine.stats()
        res.restores, res.prefill = stats.cache.restores, stats.prefill
    return res, token_bytes, device


def break_even_rows(res: FullHitResult) -> dict[str, dict[str, float]]:
    """Per measured tier (``host``: L2 -> L1, ``storage``: L3 -> L2): restore bytes/s and
    tokens/s, prefill tokens/s and their ratio (above 1: loading beats recomputing)."""
    rates, prefill = res.restores, res.prefill
    if rates is None or prefill is None:
        return {}
    fits = dict(rates.tiers())
    return {
        b.tier: {
            "restore_bytes_per_s": fits[b.tier].per_second,
            "restore_tokens_per_s": b.restore_tokens_per_second,
            "prefill_tokens_per_s": b.prefill_tokens_per_second,
            "ratio": b.ratio,
        }
        for b in break_even(rates, prefill)
    }


def summarize(res: FullHitResult, token_bytes: int) -> dict[str, Any]:
    """Medians, ideals and ratios (see the module docstring); times in s, GB/s = 1e9 B/s."""
    med = statistics.median
    ttft = {s: med(v) for s, v in res.ttft_s.items()}
    hits = {s: int(med(v)) for s, v in res.hit_tokens.items()}
    copy, read = med(res.copy_gbps), med(res.file_read_gbps)
    kv_l2, kv_l3 = hits["l2"] * token_bytes, hits["l3"] * token_bytes
    ideal_l2 = kv_l2 / (copy * 1e9) + ttft["l1"]
    ideal_l3 = kv_l3 / (read * 1e9) + ttft["l1"]
    return {
        "ttft_cold_s": ttft["cold"],
        "ttft_l1_s": ttft["l1"],
        "ttft_l2_s": ttft["l2"],
        "ttft_l3_s": ttft["l3"],
        "hit_tokens": {"l1": hits["l1"], "l2": hits["l2"], "l3": hits["l3"]},
        "token_bytes": token_bytes,
        "kv_bytes_l2": kv_l2,
        "kv_bytes_l3": kv_l3,
        "copy_gbps": copy,
        "file_read_gbps": read,
        "ideal_l2_s": ideal_l2,
        "ideal_l3_s": ideal_l3,
        "ratio_l2": ttft["l2"] / ideal_l2,
        "ratio_l3": ttft["l3"] / ideal_l3,
        "break_even": break_even_rows(res),
        "samples": {"ttft_s": res.ttft_s, "hit_tokens": res.hit_tokens,
                    "copy_gbps": res.copy_gbps, "file_read_gbps": res.file_read_gbps},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 on success, 1 when a stage missed its tier, 2 on bad flags."""
    p = argparse.ArgumentParser(
        prog="hicache bench full-hit",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model-path", default="tiny-random-llama")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--tokens", type=int, default=2000, help="prompt length")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--repeat", type=int, default=5, help="prompts; medians are reported")
    p.add_argument("--dir", default=None, help="L3 directory (default: a temp dir, removed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--storage-tp-lcm",
        type=int,
        default=None,
        metavar="N",
        help="the engine's storage_tp_lcm: a multiple of the K/V heads stores one L3 record"
        " per head (default: one per page, the rank's heads)",
    )
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")
    args = p.parse_args(argv)
    if args.tokens < 2 * args.page_size or args.repeat < 1:
        p.error(f"--tokens must be >= 2 pages ({2 * args.page_size}) and --repeat >= 1")
    scratch = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="hicache-fullhit-"))
    try:
        res, token_bytes, device = run(args, scratch)
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)
    doc: dict[str, Any] = {
        "model_path": args.model_path,
        "device": str(device),
        "tokens": args.tokens,
        "page_size": args.page_size,
        "repeat": args.repeat,
        **summarize(res, token_bytes),
    }
    h = doc["hit_tokens"]
    ms = 1e3
    print_table(
        f"full hit: {args.tokens}-token prompt, {args.model_path} on {device}, KV"
        f" {doc['kv_bytes_l2'] / 1e6:.2f} MB; copy {doc['copy_gbps']:.2f} GB/s, raw file read"
        f" {doc['file_read_gbps']:.2f} GB/s (medians of {args.repeat})",
        ["stage", "hit tokens", "TTFT ms", "ideal ms", "measured / ideal"],
        [
            ["cold", "0", f"{doc['ttft_cold_s'] * ms:.2f}", "-", "-"],
            ["L1 hit", str(h["l1"]), f"{doc['ttft_l1_s'] * ms:.2f}", "-", "-"],
            ["L2 hit", str(h["l2"]), f"{doc['ttft_l2_s'] * ms:.2f}",
             f"{doc['ideal_l2_s'] * ms:.2f}", f"{doc['ratio_l2']:.2f}"],
            ["L3 hit (file)", str(h["l3"]), f"{doc['ttft_l3_s'] * ms:.2f}",
             f"{doc['ideal_l3_s'] * ms:.2f}", f"{doc['ratio_l3']:.2f}"],
        ],
    )  # fmt: skip
    tiers = {"host": "L2 -> L1 load", "storage": "L3 -> L2 read"}
    print_table(
        "break-even, as the engine measured it (restore tokens/s over prefill tokens/s;"
        " above 1, loading wins)",
        ["tier", "restore MB/s", "restore tok/s", "prefill tok/s", "break-even"],
        [
            [tiers[t], f"{b['restore_bytes_per_s'] / 1e6:.1f}",
             f"{b['restore_tokens_per_s']:.0f}", f"{b['prefill_tokens_per_s']:.0f}",
             f"{b['ratio']:.2f}"]
            for t, b in doc["break_even"].items()
        ],
    )  # fmt: skip
    if args.json:
        write_json(args.json, doc)
    if args.plot:
        from hicache.bench.plot import plot_bars

        plot_bars(
            args.plot,
            title=f"full hit, {args.tokens} tokens, {args.model_path} on {device}",
            labels=["cold", "L1 hit", "L2 hit", "L3 hit (file)"],
            series={
                "measured TTFT (ms)": [doc[f"ttft_{s}_s"] * ms for s in STAGES],
                "ideal (ms)": [None, None, doc["ideal_l2_s"] * ms, doc["ideal_l3_s"] * ms],
            },
            y_label="ms",
        )
    full = args.tokens // args.page_size * args.page_size
    low = [t for t in ("l1", "l2", "l3") if h[t] < full - args.page_size]
    if low:
        print(
            f"warning: stages {low} hit fewer than {full - args.page_size} tokens", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
