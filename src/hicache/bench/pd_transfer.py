"""``hicache bench pd-transfer``: how fast a prefill instance's pages reach a decode
instance's pool over each PD transport, against a plain copy of the same bytes.

A spawned receiver holds a CPU :class:`~hicache.memory.device_pool.DevicePool` of ``2 *
--pages`` pages registered with the transport; this process writes ``--pages`` pages of
random bytes into it (:func:`~hicache.disagg.pages.page_spans`, then
:meth:`~hicache.disagg.transport.Transport.write`) for each of ``--backends``, ``contiguous``
(one span per kind and layer) and ``scattered`` (one span per page, kind and layer). A
figure counts only if the receiver's hash of the pages equals the sender's. Baselines in
the same run: ``torch-pages`` (the same pages between two pools of this process) and
``memcpy``. Units: GB/s = 1e9 B/s, the median of ``--repeat`` runs after a warm-up. The
method in full: ``docs/benchmarks/pd.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection

import torch

from hicache.bench.report import print_table, write_json
from hicache.disagg.config import TransferBackend
from hicache.memory.device_pool import DevicePool
from hicache.spec import KVSpec

__all__ = ["Figure", "main", "run"]

PATTERNS = ("contiguous", "scattered")


@dataclass(frozen=True)
class Figure:
    """One (method, pattern): bytes per write, the median and best of the timed runs."""

    method: str
    pattern: str
    spans: int
    nbytes: int
    median_s: float
    best_s: float
    verified: bool

    @property
    def gbps(self) -> float:
        """Median throughput, 1e9 bytes per second."""
        return self.nbytes / self.median_s / 1e9


def _random_pool(spec: KVSpec, pages: int, page_size: int, seed: int) -> DevicePool:
    pool = DevicePool(spec, pages, page_size)
    g = torch.Generator().manual_seed(seed)
    b = pool.buffer.view(torch.uint8)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
    return pool


def _digest(pool: DevicePool, pages: Sequence[int]) -> str:
    data = pool.read_pages(list(pages)).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def _receiver(conn: Connection, backend: str, spec: KVSpec, pages: int, page_size: int) -> None:
    """The decode side: answers ``("hash", pages)`` with the pages' sha256 until
    ``("stop",)``."""
    from hicache.disagg.backends import make_transport
    from hicache.disagg.pages import PoolGeometry

    pool = DevicePool(spec, pages, page_size)
    try:
        t = make_transport(backend, "127.0.0.1", "bench-decode")
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    try:
        geo = PoolGeometry.of(pool)
        t.register([geo.region()])
        conn.send((t.endpoint, geo.to_dict()))
        while (cmd := conn.recv())[0] != "stop":
            conn.send(_digest(pool, cmd[1]))
    finally:
        t.close()


def _time(fn: Callable[[], None], repeat: int) -> tuple[float, float]:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def _plans(pages: int, seed: int) -> dict[str, tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    scattered = torch.randperm(2 * pages, generator=g)[:pages].tolist()
    return {"contiguous": (list(range(pages)), list(range(pages))),
            "scattered": (list(range(pages)), scattered)}  # fmt: skip


def _baselines(
    src: DevicePool, plans: dict[str, tuple[list[int], list[int]]], repeat: int
) -> list[Figure]:
    dst = DevicePool(src.spec, 2 * src.num_pages, src.page_size)
    ps = src.page_size
    out = []
    for pattern, (sp, dp) in plans.items():
        s_slots = torch.tensor([p * ps + i for p in sp for i in range(ps)])
        d_slots = torch.tensor([p * ps + i for p in dp for i in range(ps)])

        def copy_pages(s: torch.Tensor = s_slots, d: torch.Tensor = d_slots) -> None:
            dst.buffer[:, :, d] = src.buffer[:, :, s]

        med, best = _time(copy_pages, repeat)
        ok = _digest(dst, dp) == _digest(src, sp)
        out.append(Figure("torch-pages", pattern, 0, len(sp) * src.page_bytes, med, best, ok))
    flat_src = src.buffer.view(torch.uint8).flatten()
    flat_dst = torch.empty_like(flat_src)

    def memcpy() -> None:
        flat_dst.copy_(flat_src)

    med, best = _time(memcpy, repeat)
    ok = torch.equal(flat_src, flat_dst)
    out.append(Figure("memcpy", "contiguous", 1, flat_src.numel(), med, best, ok))
    return out


def _one_backend(
    backend: TransferBackend,
    src: DevicePool,
    plans: dict[str, tuple[list[int], list[int]]],
    repeat: int,
    timeout_s: float,
) -> list[Figure] | str:
    """The figures of one transport, or why it could not run."""
    import multiprocessing as mp

    from hicache.disagg.backends import make_transport
    from hicache.disagg.pages import PoolGeometry, page_spans
    from hicache.disagg.transport import Span, TransportUnavailable

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    args = (there, backend.value, src.spec, 2 * src.num_pages, src.page_size)
    proc = ctx.Process(target=_receiver, args=args, daemon=True)
    proc.start()
    there.close()
    try:
        if not here.poll(60):
            return "the receiver did not start within 60 s"
        endpoint, geo_doc = here.recv()
        if endpoint == "error":
            return str(geo_doc)
        try:
            t = make_transport(backend, "127.0.0.1", "bench-prefill")
        except TransportUnavailable as e:
            return str(e)
        try:
            local = PoolGeometry.of(src)
            t.register([local.region()])
            geo = PoolGeometry.from_dict(geo_doc)
            out = []
            for pattern, (sp, dp) in plans.items():
                spans = page_spans(local, sp, geo, dp)

                def write(spans: list[Span] = spans) -> None:
                    t.write(endpoint, spans, timeout_s)

                med, best = _time(write, repeat)
                here.send(("hash", dp))
                ok = here.recv() == _digest(src, sp)
                nbytes = sum(s.nbytes for s in spans)
                out.append(Figure(backend.value, pattern, len(spans), nbytes, med, best, ok))
            return out
        finally:
            t.close()
    finally:
        if proc.is_alive():
            here.send(("stop",))
            proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        here.close()


def run(
    spec: KVSpec,
    *,
    pages: int,
    page_size: int,
    backends: Sequence[TransferBackend],
    repeat: int,
    timeout_s: float = 60.0,
    seed: int = 0,
) -> tuple[list[Figure], dict[str, str]]:
    """The figures (baselines first) and, per backend that could not run, why."""
    src = _random_pool(spec, pages, page_size, seed)
    plans = _plans(pages, seed)
    figures = _baselines(src, plans, repeat)
    skipped: dict[str, str] = {}
    for b in backends:
        got = _one_backend(b, src, plans, repeat, timeout_s)
        if isinstance(got, str):
            skipped[b.value] = got
        else:
            figures += got
    return figures, skipped


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hicache bench pd-transfer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON here")
    p.add_argument("--pages", type=int, default=64, help="pages per write")
    p.add_argument("--page-size", type=int, default=64, help="tokens per page")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--backends", default=",".join(b.value for b in TransferBackend))
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("pages", "page_size", "layers", "heads", "head_dim", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        backends = [TransferBackend(b) for b in args.backends.split(",") if b]
    except ValueError as e:
        p.error(f"--backends: {e}")
    spec = KVSpec(
        num_layers=args.layers, num_kv_heads=args.heads, head_dim=args.head_dim, dtype=args.dtype
    )
    figures, skipped = run(
        spec,
        pages=args.pages,
        page_size=args.page_size,
        backends=backends,
        repeat=args.repeat,
        seed=args.seed,
    )
    page_kib = args.page_size * spec.token_bytes / 1024
    print_table(
        f"PD page writes: {args.pages} pages of {page_kib:g} KiB ({args.layers} layers, "
        f"K and V, {args.heads} x {args.head_dim} {args.dtype}, {args.page_size} tokens); "
        f"ms: median of {args.repeat}",
        ["method", "pattern", "spans", "MiB", "ms", "best ms", "GB/s", "ok"],
        [
            [
                f.method,
                f.pattern,
                str(f.spans) if f.spans else "-",
                f"{f.nbytes / 2**20:.1f}",
                f"{f.median_s * 1e3:.2f}",
                f"{f.best_s * 1e3:.2f}",
                f"{f.gbps:.2f}",
                "yes" if f.verified else "NO",
            ]
            for f in figures
        ],
    )
    for name, why in skipped.items():
        print(f"{name}: not run: {why}")
    if args.json:
        write_json(
            args.json,
            {
                "args": vars(args),
                "figures": [asdict(f) | {"gbps": f.gbps} for f in figures],
                "skipped": skipped,
            },
        )
    return 0 if all(f.verified for f in figures) else 1


if __name__ == "__main__":
    raise SystemExit(main())
