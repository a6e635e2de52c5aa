"""L3 through SGLang: ``HiCacheL3`` beside SGLang's own backends, on the same SGLang host pool.

``hicache bench storage --sglang`` (or ``python -m hicache.bench.storage_sglang``). On one
SGLang ``MHATokenToKVPoolHost`` (8 layers x K,V x 8 heads x 128 dims, bfloat16: 32 KiB per
token; ``--objects`` pages of ``--object-mib`` MiB, layout ``--layout``) the same pages are
written and read back through ``HiCacheL3`` over hicache's ``file``, ``mooncake`` and
``nixl`` backends, and through SGLang's own ``file``, ``mooncake`` and ``nixl``, each built
by SGLang's ``StorageBackendFactory``. Units: GB/s of page bytes (10**9 B/s), the median of
``--repeat`` runs (fresh keys, who goes first alternating). SGLang must be importable
(:mod:`hicache.integrations.pinned`). Usage: ``hicache bench storage --sglang --backends
file,mooncake --json out.json``. Each side's calls: ``docs/benchmarks/l3.md``.
"""

from __future__ import annotations

import argparse
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

from hicache.bench.report import write_json
from hicache.integrations import pinned

__all__ = ["SGLangBenchResult", "main"]

LAYERS, HEADS, DIM = 8, 8, 128
TOKEN_BYTES = 2 * LAYERS * HEADS * DIM * 2
"""Bytes per token of the pool: 8 layers x K,V x 8 heads x 128 dims x bfloat16 (32 KiB)."""
BACKENDS = ("file", "mooncake", "nixl")
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


@dataclass(frozen=True)
class SGLangBenchResult:
    """Median GB/s of one store and operation: HiCacheL3 next to SGLang's own backend
    (``sglang_gbps`` None when SGLang's backend could not run here, ``note`` says why);
    ``*_runs``: every run's GB/s."""

    store: str
    op: str
    hicache_gbps: float
    sglang_gbps: float | None
    note: str = ""
    hicache_runs: tuple[float, ...] = ()
    sglang_runs: tuple[float, ...] = ()

    @property
    def ratio(self) -> float | None:
        return self.hicache_gbps / self.sglang_gbps if self.sglang_gbps else None


def import_sglang(path: str | None) -> None:
    """Make the pinned SGLang importable (:func:`hicache.integrations.pinned.enable`, from
    ``path`` or its default folders) and import its backend factory; SystemExit naming
    the folders when it is not installed."""
    if not pinned.enable("sglang", path):
        raise SystemExit(
            "SGLang is not installed: run `make venv` (requirements/sglang.txt into "
            f"<venv>/sglang), or give --sglang-path or {pinned.PINNED['sglang']}"
        )
    import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401  (fails clearly here)


class _Pools:
    """One SGLang host pool (over a device pool) and a copy of its random pages."""

    def __init__(self, objects: int, page_size: int, layout: str) -> None:
        from hicache.integrations.sglang.cpu_pools import device_pool, host_of

        dev = device_pool(
            "mha", tokens=objects * page_size, page_size=page_size, layers=LAYERS,
            heads=HEADS, head_dim=DIM,
        )  # fmt: skip
        self.pool = host_of(dev, layout, ratio=1.0)
        flat = self.pool.kv_buffer.view(-1)
        flat.copy_(torch.randn(flat.shape).to(flat.dtype))
        self.page_size = page_size
        self.objects = objects
        self.reference = [self._page(i) for i in range(objects)]
        self.indices = torch.arange(objects * page_size, dtype=torch.int64)

    @property
    def nbytes(self) -> int:
        return self.objects * self.page_size * TOKEN_BYTES

    def _page(self, i: int) -> torch.Tensor:
        page = self.pool.get_data_page(i * self.page_size, flat=True)
        return page.contiguous().view(torch.int16).clone()

    def clear(self) -> None:
        """Zero the pool between a put and its get (the get must bring every byte back)."""
        self.pool.kv_buffer.zero_()

    def check(self) -> None:
        """Every page read back equals what was written (a benchmark of wrong bytes is
        void); the pool holds it again for the next put."""
        for i, ref in enumerate(self.reference):
            if not torch.equal(self._page(i), ref):
                raise RuntimeError(f"page {i} read back differs from the page written")


def _storage_config(extra: dict[str, Any]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=f"bench-{uuid.uuid4().hex[:8]}",
        extra_config=dict(extra),
    )


def _attach(name: str, extra: dict[str, Any], pool: Any) -> Any:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    backend = StorageBackendFactory.create_backend(name, _storage_config(extra), pool)
    backend.register_mem_pool_host(pool)
    return backend


def _attach_sglang(store: str, extra: dict[str, Any], pool: Any, root: Path) -> Any:
    """SGLang's own ``store`` backend; its ``nixl`` (``HiCacheNixl``, the POSIX plugin)
    takes its directory from ``SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR`` only, set for its
    construction to a folder of ``root``."""
    if store != "nixl":
        return _attach(store, extra, pool)
    var = "SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR"
    folder = root / "sglang-nixl"
    folder.mkdir(parents=True, exist_ok=True)
    old = os.environ.get(var)
    os.environ[var] = str(folder)
    try:
        return _attach(store, extra, pool)
    finally:
        if old is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = old


def _hicache_extra(store: str, root: Path, master: str) -> dict[str, Any]:
    own = (
        {"file_path": str(root / f"hicache-{store}")}
        if store in ("file", "nixl")
        else {"master_server_address": master}
    )
    return {
        "backend_name": "hicache",
        "module_path": "hicache.integrations.sglang",
        "class_name": "HiCacheL3",
        "interface_v1": 1,
        "hicache_backend": store,
        "timeout_s": 120.0,
        "max_batch_pages": 1024,
        **own,
    }


def _sglang_extra(store: str, root: Path, master: str) -> dict[str, Any]:
    if store == "file":
        return {"file_storage_path": str(root / "sglang")}
    if store == "nixl":  # its directory comes from the environment (_attach_sglang)
        return {}
    return {
        "master_server_address": master,
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "device_name": "",
        "global_segment_size": 0,
    }


Mover = Callable[[Any, list[str], "_Pools"], None]


def _v1_put(be: Any, keys: list[str], p: _Pools) -> None:
    _ok(be.batch_set_v1(keys, p.indices), "put")


def _v1_get(be: Any, keys: list[str], p: _Pools) -> None:
    _ok(be.batch_get_v1(keys, p.indices), "get")


def _copy_put(be: Any, keys: list[str], p: _Pools) -> None:
    """SGLang's controller's generic set: flat pages, then ``batch_set``."""
    data = [p.pool.get_data_page(i * p.page_size) for i in range(len(keys))]
    if not be.batch_set(keys, data):
        raise RuntimeError("put failed")


def _copy_get(be: Any, keys: list[str], p: _Pools) -> None:
    """SGLang's controller's generic get: dummy flat pages, ``batch_get``, then copies."""
    dummies = [p.pool.get_dummy_flat_data_page() for _ in keys]
    got = be.batch_get(keys, dummies)
    for i, page in enumerate(got):
        if page is None:
            raise RuntimeError(f"get: page {i} missing")
        p.pool.set_from_flat_data_page(i * p.page_size, page)


def _ok(ok: Sequence[bool] | None, op: str) -> None:
    if ok is None or not all(ok):
        raise RuntimeError(f"{op}: not every page succeeded ({ok})")


def _run_store(
    store: str, p: _Pools, root: Path, master: str, repeat: int
) -> list[SGLangBenchResult]:
    ours = _attach("dynamic", _hicache_extra(store, root, master), p.pool)
    theirs: Any = None
    note = ""
    try:
        theirs = _attach_sglang(store, _sglang_extra(store, root, master), p.pool, root)
    except Exception as e:  # SGLang's backend may not run here: say why
        note = f"SGLang's {store} backend could not start: {e!r}"[:200]
    sg_put, sg_get = (_copy_put, _copy_get) if store == "file" else (_v1_put, _v1_get)
    h_put: list[float] = []
    h_get: list[float] = []
    s_put: list[float] = []
    s_get: list[float] = []
    for i in range(repeat):
        steps = ["hicache", "sglang"] if i % 2 == 0 else ["sglang", "hicache"]
        for step in steps:
            if step == "hicache":
                a, b = _measure(ours, _v1_put, _v1_get, p)
                h_put.append(a)
                h_get.append(b)
            elif theirs is not None:
                try:
                    a, b = _measure(theirs, sg_put, sg_get, p)
                    s_put.append(a)
                    s_get.append(b)
                except Exception as e:
                    note = f"SGLang's {store} backend failed: {e!r}"[:200]
                    theirs = None
    med = statistics.median
    for be in (ours, theirs):
        if be is not None and hasattr(be, "close"):
            be.close()
    return [
        SGLangBenchResult(store, op, med(h), med(s) if s else None, note, tuple(h), tuple(s))
        for op, h, s in (("put", h_put, s_put), ("get", h_get, s_get))
    ]


def _measure(be: Any, put: Mover, get: Mover, p: _Pools) -> tuple[float, float]:
    """Put every page under fresh keys, zero the pool, get them back (checked): GB/s."""
    keys = [uuid.uuid4().hex + uuid.uuid4().hex for _ in range(p.objects)]
    t = time.perf_counter()
    put(be, keys, p)
    put_s = time.perf_counter() - t
    p.clear()
    t = time.perf_counter()
    get(be, keys, p)
    get_s = time.perf_counter() - t
    p.check()
    return p.nbytes / put_s / 1e9, p.nbytes / get_s / 1e9


def _print_table(results: Sequence[SGLangBenchResult], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("store", "op", "HiCacheL3 GB/s", "SGLang's own GB/s", "HiCacheL3 / SGLang"):
        table.add_column(col, justify="left" if col in ("store", "op") else "right")
    for r in results:
        sg = "-" if r.sglang_gbps is None else f"{r.sglang_gbps:.2f}"
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
        table.add_row(r.store, r.op, f"{r.hicache_gbps:.2f}", sg, ratio)
    Console().print(table)
    for note in sorted({r.note for r in results if r.note}):
        print(f"note: {note}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0, or 2 for bad arguments, 1 when a store could not run."""
    p = argparse.ArgumentParser(
        prog="hicache bench storage --sglang", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--backends", default="file,mooncake", help="comma list of file, mooncake, nixl")
    p.add_argument("--object-mib", type=float, default=1.0, help="page size in MiB (default 1)")
    p.add_argument("--objects", type=int, default=64, help="pages per batch (default 64)")
    p.add_argument("--repeat", type=int, default=3, help="runs per figure (median; default 3)")
    p.add_argument("--layout", default="page_first", choices=LAYOUTS, help="host pool layout")
    p.add_argument("--dir", default=None, help="file stores' directory (default: a temp dir)")
    p.add_argument("--mooncake-master", default=None, help="use this master instead of one here")
    p.add_argument("--sglang-path", default=None, help="directory holding the sglang package")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    stores = [b.strip() for b in args.backends.split(",") if b.strip()]
    object_bytes = int(args.object_mib * 2**20)
    bad = sorted(set(stores) - set(BACKENDS))
    if bad or object_bytes <= 0 or object_bytes % TOKEN_BYTES or args.objects < 1:
        print(
            f"error: backends must be among {','.join(BACKENDS)} (got {bad or stores}); the "
            f"page size must be a positive multiple of {TOKEN_BYTES // 1024} KiB; objects >= 1",
            file=sys.stderr,
        )
        return 2
    if args.repeat < 1:
        print("error: repeat must be >= 1", file=sys.stderr)
        return 2
    import_sglang(args.sglang_path)
    pools = _Pools(args.objects, object_bytes // TOKEN_BYTES, args.layout)
    results: list[SGLangBenchResult] = []
    with ExitStack() as stack:
        root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="hicache-sgl-"))
        if not args.dir:
            stack.callback(shutil.rmtree, root, True)
        master = args.mooncake_master or ""
        for store in stores:
            try:
                if store == "mooncake" and not master:
                    from hicache.services.mooncake_process import MooncakeProcess

                    svc = stack.enter_context(MooncakeProcess(segment_size="2GiB"))
                    master = svc.master_server_address
                results += _run_store(store, pools, root, master, args.repeat)
            except Exception as e:
                print(f"{store}: skipped: {e!r}", file=sys.stderr)
    if not results:
        return 1
    title = (
        f"L3 through SGLang ({args.layout}): {args.objects} pages x {args.object_mib:g} MiB "
        "(GB/s, median)"
    )
    _print_table(results, title)
    if args.json:
        doc: dict[str, Any] = {
            "object_bytes": object_bytes,
            "objects": args.objects,
            "repeat": args.repeat,
            "layout": args.layout,
            "results": [asdict(r) | {"ratio": r.ratio} for r in results],
        }
        write_json(args.json, doc)
    return 0 if len(results) == 2 * len(stores) else 1


if __name__ == "__main__":
    os.environ.setdefault("GLOG_minloglevel", "2")
    sys.exit(main())
