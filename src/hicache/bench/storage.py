"""L3 microbenchmark: each backend's batch put/get GB/s next to its raw client in the same run.

For every backend (``file``, ``redis``, ``mooncake``, ``aibrix-shfs``, ``aibrix-rocksdb``,
``nixl``) the same pages (``--objects`` of ``--object-mib`` MiB, one page each, in a
``page_first`` host pool) go through the HiCache backend (``batch_set`` / ``batch_get``) and
through the bare client it wraps. ``--records page,head,head:G`` runs the HiCache side per
record split (``head:G``: records of ``G`` K/V heads, ``Namespace.head_group``); ``--spec L,H,D[,dtype]`` and ``--page-tokens`` set the page (each rate is also
given in tokens/s of that KV shape: what restoring a hit from the backend would give, to
set beside a model's prefill tokens/s, :mod:`hicache.rates`). Services start locally
unless ``--redis-url`` / ``--mooncake-master`` name running ones. Units: GB/s of payload
bytes (10**9 B/s), the median of ``--repeat`` rounds after one untimed warm-up, each round
under fresh keys; ``paired`` is the median of the rounds' HiCache / raw ratios. Usage:
``python -m hicache.bench.storage --backends file,redis,mooncake --json out.json``. What
each raw client does: ``docs/benchmarks/l3.md``.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hicache.bench.raw_clients import (
    RawAibrix,
    RawClient,
    RawFile,
    RawMooncake,
    RawNixl,
    RawRedis,
)
from hicache.bench.report import write_json
from hicache.config import MemLayout
from hicache.heads import HeadSplit
from hicache.keys import HEAD_RECORDS, PAGE_RECORDS, RECORDS, Namespace, page_keys
from hicache.memory import HostPool
from hicache.services.mooncake_process import MooncakeProcess
from hicache.services.redis import RedisServer
from hicache.spec import DTYPES, KVSpec
from hicache.storage.backends.aibrix_config import AibrixConfig
from hicache.storage.base import HiCacheStorage, StorageOptions
from hicache.storage.registry import create_storage

__all__ = ["BACKENDS", "BenchResult", "main"]

BACKENDS = ("file", "redis", "mooncake", "aibrix-shfs", "aibrix-rocksdb", "nixl")
"""What ``--backends`` accepts."""

TOKEN_BYTES = 32 << 10
"""Bytes per token of the benchmark's KV shape: 8 layers x K,V x 8 heads x 128 dims x bf16."""
SPEC = KVSpec(num_layers=8, num_kv_heads=8, head_dim=128, dtype="bfloat16")
assert SPEC.token_bytes == TOKEN_BYTES


@dataclass(frozen=True)
class BenchResult:
    """Median GB/s of one backend and operation, HiCache next to the raw client."""

    backend: str
    op: str
    hicache_gbps: float
    raw_gbps: float
    records: str = "page"
    """The HiCache side's record split (``page``, ``head``, or ``head:G``)."""
    records_per_page: int = 1
    paired_ratio: float = 0.0
    """Median over the rounds of each round's HiCache / raw (the two sides of one round
    run back to back, so this ratio drifts less with the machine's load than
    :attr:`ratio`, the ratio of the two medians)."""
    vs_page: float = 0.0
    """Median over the rounds of each round's GB/s under this split / under page records
    (0 when ``page`` was not run)."""

    @property
    def ratio(self) -> float:
        return self.hicache_gbps / self.raw_gbps if self.raw_gbps else 0.0


def _gbps(nbytes: int, fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - t) / 1e9


class _Case:
    """One backend: HiCache put/get and raw put/get over the same pages."""

    def __init__(
        self, name: str, st_factory: Callable[[Namespace], HiCacheStorage], raw: RawClient
    ) -> None:
        self.name = name
        self.st_factory = st_factory
        self.raw = raw


def _split(records: str) -> tuple[str, int]:
    """``page`` / ``head`` / ``head:G`` as ``(records, head_group)``; ValueError otherwise."""
    kind, _, group = records.partition(":")
    if kind not in RECORDS or (group and (kind != HEAD_RECORDS or not group.isdigit())):
        raise ValueError(f"record split {records!r}: choose page, head or head:G")
    return kind, int(group or 1)


def _valid_split(records: str, heads: int) -> bool:
    try:
        _, group = _split(records)
    except ValueError:
        return False
    return group >= 1 and heads % group == 0


def _run_case(
    case: _Case, src: HostPool, dst: HostPool, repeat: int, splits: Sequence[str] = ("page",)
) -> list[BenchResult]:
    """Time ``repeat`` rounds of put then get through the raw client and through HiCache
    under each record split of ``splits``, the order rotating each round (so the sides
    share the machine's drift). Every side runs in steady state: one backend instance per
    split and one raw client for the whole case, each warmed by an untimed round first
    (connections, buffer registrations, staging arenas, folders), and every round writes
    fresh keys (new tokens, new raw names), so no put finds its key present."""
    n = src.num_pages
    nbytes = n * src.page_bytes
    pages = list(range(n))
    src_bufs = case.raw.buffers(n, src.page_bytes)
    dst_bufs = case.raw.buffers(n, src.page_bytes)
    for p, buf in zip(pages, src_bufs, strict=True):
        buf.copy_(torch.cat([v.reshape(-1).view(torch.uint8) for v in src.page_view(p)]))
    fingerprint = uuid.uuid4().hex
    times: dict[str, tuple[list[float], list[float]]] = {"raw": ([], [])}
    with ExitStack() as stack:
        sides: dict[str, Callable[[int], None]] = {}
        for records in splits:
            kind, group = _split(records)
            ns = Namespace.for_spec(
                src.spec,
                model="bench",
                weights_fingerprint=fingerprint,
                layout=src.layout,
                page_size=src.page_size,
                head_records=kind == HEAD_RECORDS,
                head_group=group,
            )
            st = stack.enter_context(case.st_factory(ns))
            if kind == HEAD_RECORDS:
                st.use_heads(HeadSplit(src.spec.heads, src.spec.heads))
            times[records] = ([], [])
            sides[records] = functools.partial(
                _hicache_round, st, ns, src, dst, n * src.page_size, times[records]
            )

        def raw(i: int) -> None:
            put, get = times["raw"]
            names = [f"raw-{uuid.uuid4().hex}" for _ in pages]
            put.append(_gbps(nbytes, lambda: case.raw.put(names, src_bufs)))
            get.append(_gbps(nbytes, lambda: case.raw.get(names, dst_bufs)))

        steps = [raw, *sides.values()]
        for i in range(-1, repeat):  # round -1 warms every side up, untimed
            k = i % len(steps)
            for step in steps[k:] + steps[:k]:
                step(i)
            if i < 0:
                for put, get in times.values():
                    put.clear()
                    get.clear()
    med = statistics.median

    def paired(h: list[float], r: list[float]) -> float:
        return med(a / b for a, b in zip(h, r, strict=True))

    out: list[BenchResult] = []
    page = times.get(PAGE_RECORDS)
    for records in splits:
        kind, group = _split(records)
        per_page = src.spec.heads // group if kind == HEAD_RECORDS else 1
        for op in (0, 1):
            h, r = times[records][op], times["raw"][op]
            out.append(
                BenchResult(
                    case.name,
                    ("put", "get")[op],
                    med(h),
                    med(r),
                    records,
                    per_page,
                    paired(h, r),
                    paired(h, page[op]) if page is not None else 0.0,
                )
            )
    return out


def _hicache_round(
    st: HiCacheStorage,
    ns: Namespace,
    src: HostPool,
    dst: HostPool,
    tokens: int,
    times: tuple[list[float], list[float]],
    i: int,
) -> None:
    """One round's batch put then get of every page of ``src`` under fresh keys (tokens
    ``[(i + 1) * tokens, (i + 2) * tokens)``), their GB/s appended to ``times``."""
    nbytes = src.num_pages * src.page_bytes
    pages = list(range(src.num_pages))
    keys = page_keys(ns, list(range((i + 1) * tokens, (i + 2) * tokens)))
    times[0].append(_gbps(nbytes, lambda: _check(st.batch_set(keys, src, pages).ok, "put")))
    times[1].append(_gbps(nbytes, lambda: _check(st.batch_get(keys, dst, pages), "get")))


def _check(ok: list[bool], op: str) -> None:
    if not all(ok):
        raise RuntimeError(f"{op}: {ok.count(False)} of {len(ok)} pages failed")


def _print_table(
    results: Sequence[BenchResult], object_bytes: int, objects: int, token_bytes: int
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"L3 storage: {objects} objects x {object_bytes / 2**10:g} KiB (GB/s, median;"
        f" tokens of {token_bytes} B)"
    )
    cols = (
        "backend",
        "records",
        "per page",
        "op",
        "hicache ktok/s",
        "hicache GB/s",
        "raw GB/s",
        "hicache / raw",
        "paired",
        "vs page",
    )
    for col in cols:
        table.add_column(col, justify="left" if col in ("backend", "op", "records") else "right")
    for r in results:
        table.add_row(
            r.backend,
            r.records,
            str(r.records_per_page),
            r.op,
            f"{r.hicache_gbps * 1e9 / token_bytes / 1e3:.4g}",
            f"{r.hicache_gbps:.3g}",
            f"{r.raw_gbps:.3g}",
            f"{r.ratio:.2f}",
            f"{r.paired_ratio:.2f}",
            f"{r.vs_page:.2f}" if r.vs_page else "-",
        )
    Console(width=120).print(table)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns 0, or 2 for bad arguments, 1 when a backend fails."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--sglang" in argv:  # the SGLang path has its own module and flags
        from hicache.bench.storage_sglang import main as sglang_main

        return sglang_main([a for a in argv if a != "--sglang"])
    p = argparse.ArgumentParser(
        prog="python -m hicache.bench.storage", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--backends", default="file,redis,mooncake", help=f"comma list of {', '.join(BACKENDS)}"
    )
    p.add_argument(
        "--object-mib", type=float, default=1.0, help="object (page) size in MiB (default 1)"
    )
    p.add_argument("--objects", type=int, default=64, help="objects per batch (default 64)")
    p.add_argument(
        "--repeat", type=int, default=3, help="runs per figure; the median is shown (default 3)"
    )
    p.add_argument(
        "--dir", default=None, help="file backend directory (default: a temp dir, removed)"
    )
    p.add_argument(
        "--redis-url", default=None, help="use this Redis instead of starting redis-server"
    )
    p.add_argument(
        "--mooncake-master", default=None, help="use this master instead of starting one"
    )
    p.add_argument(
        "--records",
        default="page",
        help="comma list of record splits to run: page (one record per page), head (one per "
        "page and K/V head), head:G (one per page and group of G K/V heads) (default page)",
    )
    p.add_argument(
        "--spec",
        default="8,8,128,bfloat16",
        help="KV shape: layers,kv_heads,head_dim[,dtype] (default 8,8,128,bfloat16)",
    )
    p.add_argument(
        "--page-tokens", type=int, default=None, help="page size in tokens (overrides --object-mib)"
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    p.add_argument(
        "--sglang",
        action="store_true",
        help="instead: HiCacheL3 beside SGLang's own backends on an SGLang host pool "
        "(hicache.bench.storage_sglang; --sglang --help for its flags)",
    )
    args = p.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = sorted(set(backends) - set(BACKENDS))
    splits = [r.strip() for r in args.records.split(",") if r.strip()]
    try:
        spec = _spec(args.spec)
    except ValueError as e:
        print(f"error: --spec {args.spec!r}: {e}", file=sys.stderr)
        return 2
    if args.page_tokens is not None:
        object_bytes = args.page_tokens * spec.token_bytes
    else:
        object_bytes = int(args.object_mib * 2**20)
    if (
        bad
        or not splits
        or len(set(splits)) != len(splits)
        or not all(_valid_split(r, spec.heads) for r in splits)
        or object_bytes % spec.token_bytes
        or object_bytes <= 0
        or args.objects < 1
        or args.repeat < 1
    ):
        print(
            f"error: backends must be among {','.join(BACKENDS)} (got {bad or backends});"
            f" records among page, head, head:G with G dividing {spec.heads}, each once (got"
            f" {splits});"
            f" object size must be a"
            f" positive multiple of {spec.token_bytes} B (a token); objects and repeat >= 1",
            file=sys.stderr,
        )
        return 2
    page_size = object_bytes // spec.token_bytes
    src = HostPool(spec, args.objects, page_size, MemLayout.PAGE_FIRST, pin_memory=False)
    dst = HostPool(spec, args.objects, page_size, MemLayout.PAGE_FIRST, pin_memory=False)
    src.buffer.copy_(torch.randn(src.buffer.shape).to(src.dtype))
    opts = StorageOptions(timeout_s=120.0, max_batch_pages=args.objects)
    results: list[BenchResult] = []
    with ExitStack() as stack:
        scratch = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="hicache-bench-"))
        if not args.dir:
            stack.callback(shutil.rmtree, scratch, True)
        for backend in backends:
            try:
                case = _make_case(backend, args, scratch, opts, stack, src.page_bytes)
                results += _run_case(case, src, dst, args.repeat, splits)
            except Exception as e:  # report and go on with the other backends
                print(f"{backend}: skipped: {e}", file=sys.stderr)
    if not results:
        return 1
    tb = spec.token_bytes
    _print_table(results, object_bytes, args.objects, tb)
    if args.json:
        doc: dict[str, Any] = {
            "object_bytes": object_bytes,
            "objects": args.objects,
            "repeat": args.repeat,
            "token_bytes": tb,
        }
        doc["results"] = [
            asdict(r) | {"ratio": r.ratio, "hicache_tokens_per_s": r.hicache_gbps * 1e9 / tb}
            for r in results
        ]
        write_json(args.json, doc)
    return 0 if len(results) == 2 * len(backends) * len(splits) else 1


def _spec(text: str) -> KVSpec:
    """``layers,kv_heads,head_dim[,dtype]`` as a KVSpec (ValueError naming the part)."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (3, 4) or not all(p.isdigit() and int(p) > 0 for p in parts[:3]):
        raise ValueError("expected layers,kv_heads,head_dim[,dtype] with positive ints")
    dtype = parts[3] if len(parts) == 4 else "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {DTYPES}")
    layers, heads, dim = (int(p) for p in parts[:3])
    return KVSpec(num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype=dtype)


def _make_case(
    backend: str,
    args: argparse.Namespace,
    scratch: Path,
    opts: StorageOptions,
    stack: ExitStack,
    page_bytes: int,
) -> _Case:
    if backend.startswith("aibrix-"):
        extra = {"connector": backend.removeprefix("aibrix-"), "root": str(scratch / backend)}
        raw_ab = RawAibrix(
            AibrixConfig.from_extra({**extra, "aibrix_namespace": "raw"}), page_bytes, args.objects
        )
        stack.callback(raw_ab.close)
        return _Case(
            backend,
            lambda ns: create_storage("aibrix", namespace=ns, extra_config=extra, options=opts),
            raw_ab,
        )
    if backend == "nixl":
        nixl_root = scratch / "hicache-nixl"
        raw_nixl = RawNixl(scratch / "raw-nixl")
        stack.callback(raw_nixl.close)
        return _Case(
            "nixl",
            lambda ns: create_storage(
                "nixl", namespace=ns, extra_config={"file_path": str(nixl_root)}, options=opts
            ),
            raw_nixl,
        )
    if backend == "file":
        root = scratch / "hicache"
        return _Case(
            "file",
            lambda ns: create_storage(
                "file", namespace=ns, extra_config={"file_path": str(root)}, options=opts
            ),
            RawFile(scratch / "raw"),
        )
    if backend == "redis":
        url = args.redis_url
        if url is None:
            exe = shutil.which("redis-server")
            if exe is None:
                raise RuntimeError(
                    "redis-server not found (apt-get install redis-server) and no --redis-url"
                )
            url = stack.enter_context(RedisServer(exe)).url
        raw_redis = RawRedis(url)
        stack.callback(raw_redis.close)
        return _Case(
            "redis",
            lambda ns: create_storage(
                "redis", namespace=ns, extra_config={"url": url}, options=opts
            ),
            raw_redis,
        )
    # every side's rounds stay stored (fresh keys each round): room for all of them, so
    # no put waits on the store's eviction
    sides = len(args.records.split(",")) + 1
    written = page_bytes * args.objects * sides * (args.repeat + 1)
    gib = max(2, math.ceil(written * 1.25 / 2**30))
    master = (
        args.mooncake_master
        or stack.enter_context(MooncakeProcess(segment_size=f"{gib}GiB")).master_server_address
    )
    raw_mc = RawMooncake(master)
    stack.callback(raw_mc.close)
    return _Case(
        "mooncake",
        lambda ns: create_storage(
            "mooncake", namespace=ns, extra_config={"master_server_address": master}, options=opts
        ),
        raw_mc,
    )


if __name__ == "__main__":
    os.environ.setdefault("GLOG_minloglevel", "2")
    sys.exit(main())
