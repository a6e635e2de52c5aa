"""Micro-benchmark of device <-> host page copies (the L1 <-> L2 path).

For each host layout x io backend x page size it builds a device pool and a host pool,
picks ``--pages`` SHUFFLED page ids on each side (fragmented, not one contiguous run) and
measures, as the transfer engine runs them:

- backup: ``copier.backup`` (device -> host, all layers);
- load: ``copier.load_layers`` (host -> device, every layer, as the transfer engine runs
  it; a copier may copy several layers at once);
- memcpy: a contiguous ``dst.copy_(src)`` of the same number of bytes, in the same run
  (device -> pinned host on CUDA; on CPU both buffers advised to use huge pages like the
  pools, see :mod:`hicache.memory.hugepages`).

Each figure is the median of ``--repeat`` timed runs after one warm-up; GB/s is 1e9 B/s.
On a CPU-only host the "device" pool lives in RAM, so all three are RAM -> RAM copies.
``--bounds`` instead times one thread's CPU cost of the copy patterns a ``page_first``
load is made of (:mod:`hicache.bench.transfer_bounds`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from hicache.bench.report import print_table, write_json
from hicache.bench.transfer_bounds import measure_bounds
from hicache.config import IOBackend, MemLayout
from hicache.memory import DevicePool, HostPool
from hicache.memory.hugepages import advise_huge_pages
from hicache.spec import KVSpec
from hicache.transfer import PageCopier, make_copier
from hicache.transfer.kernel import PAGE_FIRST_LOAD_STEPS

__all__ = ["BenchRun", "main", "run_one"]

DEFAULT_OP_MIB_LARGE = 256
"""Default bytes per op (MiB) for page sizes >= 16."""
DEFAULT_OP_MIB_SMALL = 32
"""Default bytes per op (MiB) for smaller page sizes (many more, smaller copies)."""


@dataclass(frozen=True)
class BenchRun:
    """One measured configuration; bandwidths in GB/s (1e9 bytes per second)."""

    layout: str
    io_backend: str
    page_size: int
    pages: int
    op_bytes: int
    backup_gbps: float
    load_gbps: float
    memcpy_gbps: float

    @property
    def backup_ratio(self) -> float:
        return self.backup_gbps / self.memcpy_gbps

    @property
    def load_ratio(self) -> float:
        return self.load_gbps / self.memcpy_gbps


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    """Seconds one call of ``fn`` takes, device work included."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def run_one(
    device_pool: DevicePool,
    host_pool: HostPool,
    copier: PageCopier,
    pages: int,
    repeat: int,
    seed: int = 0,
    *,
    sequential: bool = False,
) -> BenchRun:
    """Measure one configuration on existing pools (each must hold >= ``pages`` pages).

    The ``repeat`` timed runs of memcpy, backup and load are interleaved (each op right
    after the others, as in serving, where copies follow torch work), or with
    ``sequential`` each op's runs come back to back (a load after loads)."""
    gen = torch.Generator().manual_seed(seed)
    dev_pages = torch.randperm(device_pool.num_pages, generator=gen)[:pages]
    host_pages = torch.randperm(host_pool.num_pages, generator=gen)[:pages]
    op_bytes = pages * device_pool.page_bytes
    dev = device_pool.device
    elems = op_bytes // device_pool.buffer.element_size()
    # the baseline crosses the same boundary as the copies: RAM -> RAM on CPU, D -> pinned H
    # on CUDA; on CPU its buffers get the same huge-page advice as the pools, so the ratio
    # measures the copier, not the page size
    src = torch.empty(elems, dtype=device_pool.dtype, device=dev)
    dst = torch.empty(elems, dtype=device_pool.dtype, pin_memory=dev.type == "cuda")
    for t in (src, dst):
        advise_huge_pages(t)
    src.fill_(1)
    dst.zero_()

    def memcpy() -> None:
        dst.copy_(src)

    def backup() -> None:
        copier.backup(device_pool, host_pool, dev_pages, host_pages)

    def load() -> None:  # as the transfer engine runs a load: every layer, in order
        copier.load_layers(device_pool, host_pool, host_pages, dev_pages, lambda layer: None)

    times: dict[str, list[float]] = {"memcpy": [], "backup": [], "load": []}
    fns = {"memcpy": memcpy, "backup": backup, "load": load}
    for fn in fns.values():
        fn()  # warm-up
    if sequential:
        for name, fn in fns.items():
            times[name] = [_timed(fn, dev) for _ in range(repeat)]
    else:
        for _ in range(repeat):
            for name, fn in fns.items():
                times[name].append(_timed(fn, dev))
    gbps = {k: op_bytes / statistics.median(v) / 1e9 for k, v in times.items()}
    return BenchRun(
        layout=host_pool.layout.value,
        io_backend=copier.name,
        page_size=device_pool.page_size,
        pages=pages,
        op_bytes=op_bytes,
        backup_gbps=gbps["backup"],
        load_gbps=gbps["load"],
        memcpy_gbps=gbps["memcpy"],
    )


def _loadavg() -> float:
    """The host's 1-minute load average (NaN where the OS does not report one): on a
    shared host the ratios move with it, so every table states it."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return float("nan")


def _print_table(runs: list[BenchRun], title: str) -> None:
    header = (
        "layout",
        "io_backend",
        "page",
        "op MiB",
        "backup GB/s",
        "load GB/s",
        "memcpy GB/s",
        "backup/memcpy",
        "load/memcpy",
    )
    rows = [
        (
            r.layout,
            r.io_backend,
            str(r.page_size),
            f"{r.op_bytes / 2**20:.1f}",
            f"{r.backup_gbps:.2f}",
            f"{r.load_gbps:.2f}",
            f"{r.memcpy_gbps:.2f}",
            f"{r.backup_ratio:.2f}",
            f"{r.load_ratio:.2f}",
        )
        for r in runs
    ]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(" | ".join(header))
        for row in rows:
            print(" | ".join(row))
        return
    table = Table(title=title)
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i < 2 else "right")
    for row in rows:
        table.add_row(*row)
    Console(width=max(Console().width, 132)).print(table)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m hicache.bench.transfer", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--json", metavar="PATH", help="also write the runs as JSON here")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    p.add_argument(
        "--pages",
        type=int,
        default=None,
        help=f"pages moved per op (default: {DEFAULT_OP_MIB_LARGE} MiB per op at page >= 16, "
        f"{DEFAULT_OP_MIB_SMALL} MiB below)",
    )
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--page-sizes", default="64,1", help="comma-separated page sizes")
    p.add_argument("--layouts", default=",".join(m.value for m in MemLayout))
    p.add_argument("--io-backends", default=",".join(b.value for b in IOBackend))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bounds",
        action="store_true",
        help="instead of the copiers: one thread's CPU time of each copy pattern of a "
        "page_first load against a contiguous copy (first page size; CPU only)",
    )
    p.add_argument(
        "--sequential",
        action="store_true",
        help="time each op's runs back to back (default: memcpy, backup, load interleaved)",
    )
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    if args.pages is not None and args.pages < 1:
        p.error("--pages must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    spec = KVSpec(
        num_layers=args.layers, num_kv_heads=args.heads, head_dim=args.head_dim, dtype=args.dtype
    )
    page_sizes = [int(x) for x in args.page_sizes.split(",") if x]
    layouts = [MemLayout(x) for x in args.layouts.split(",") if x]
    backends = [IOBackend(x) for x in args.io_backends.split(",") if x]
    load_before = _loadavg()
    if args.bounds:
        return _bounds(args, spec, page_sizes[0], load_before)
    runs: list[BenchRun] = []
    for ps in page_sizes:
        pages = _op_pages(args, spec, ps)
        device_pool = DevicePool(spec, 2 * pages, ps, device=args.device)
        device_pool.buffer.fill_(1)
        for layout in layouts:
            host_pool = HostPool.create(spec, 2 * pages, ps, layout, args.device)
            for backend in backends:
                copier = make_copier(backend)
                runs.append(
                    run_one(
                        device_pool,
                        host_pool,
                        copier,
                        pages,
                        args.repeat,
                        args.seed,
                        sequential=args.sequential,
                    )
                )
            del host_pool
        del device_pool
    threads = torch.get_num_threads()
    load_after = _loadavg()
    _print_table(
        runs,
        f"hicache transfer bench: L={spec.num_layers} H={spec.heads} D={spec.dim} "
        f"{spec.dtype}, device={args.device}, torch threads={threads}, "
        f"1-min load average {load_before:.2f} -> {load_after:.2f}",
    )
    if args.json:
        keys = ("layout", "io_backend", "page_size", "backup_gbps", "load_gbps", "memcpy_gbps")
        payload = {
            "runs": [{k: asdict(r)[k] for k in keys} for r in runs],
            "loadavg_1min": [load_before, load_after],
        }
        write_json(args.json, payload)
    return 0


def _op_pages(args: argparse.Namespace, spec: KVSpec, ps: int) -> int:
    """Pages per op: ``--pages``, else the default MiB per op for this page size."""
    if args.pages is not None:
        return int(args.pages)
    mib = DEFAULT_OP_MIB_LARGE if ps >= 16 else DEFAULT_OP_MIB_SMALL
    return max(1, mib * 2**20 // (ps * spec.token_bytes))


def _bounds(args: argparse.Namespace, spec: KVSpec, ps: int, load_before: float) -> int:
    """``--bounds``: print (and write) :func:`measure_bounds` for the bench's shape."""
    layers = spec.num_layers
    row_bytes = spec.heads * spec.dim * spec.dtype_bytes
    op_bytes = _op_pages(args, spec, ps) * ps * spec.token_bytes  # as the copiers' ops
    group = max(1, -(-layers // PAGE_FIRST_LOAD_STEPS))
    bounds = measure_bounds(
        layers=layers,
        row_bytes=row_bytes,
        op_bytes=op_bytes,
        page_size=ps,
        group=group,
        repeat=args.repeat,
    )
    load_after = _loadavg()
    print_table(
        f"page_first load bounds, one thread's CPU time: L={layers}, {row_bytes} B rows, "
        f"page {ps}, groups of {group} layers, {op_bytes / 2**20:.0f} MiB per op, "
        f"1-min load average {load_before:.2f} -> {load_after:.2f}",
        ("pattern", "CPU ms", "GB/s", "contiguous/pattern"),
        [(b.pattern, f"{b.cpu_s * 1e3:.2f}", f"{b.gbps:.2f}", f"{b.ratio:.2f}") for b in bounds],
    )
    if args.json:
        payload = {
            "bounds": [asdict(b) for b in bounds],
            "loadavg_1min": [load_before, load_after],
        }
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
