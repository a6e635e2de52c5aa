"""Run a function on N real rank processes joined by a gloo group, with a bound on time.

``run_ranks(fn, n, tmp_path, *args)`` spawns ``n`` processes; each joins a gloo group on a
free local port (a short collective timeout, so a hang fails instead of blocking), runs
``fn(rank, n, out_dir, *args)`` and writes what it returns (JSON) to ``rank<r>.json``. The
results come back in rank order; a rank that raises fails the caller with its traceback.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hicache.lifecycle import skip_final_collection
from hicache.services.process import free_port

COLLECTIVE_TIMEOUT_S = 60.0
"""Longest one collective may block in a test before the rank fails."""


def _main(
    rank: int, fn: Callable[..., Any], n: int, port: int, out: str, args: tuple[Any, ...]
) -> None:
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=n,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        torch.set_num_threads(1)
        result = fn(rank, n, out, *args)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    except BaseException:
        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        skip_final_collection()  # the rank exits next; the test waits on its join


def run_ranks(fn: Callable[..., Any], n: int, tmp_path: Path, *args: Any) -> list[Any]:
    """``fn(rank, n, str(tmp_path), *args)`` on ``n`` gloo ranks; their JSON results."""
    os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    port = free_port()
    try:
        mp.start_processes(
            _main,
            args=(fn, n, port, str(tmp_path), args),
            nprocs=n,
            join=True,
            start_method="spawn",
        )
    except Exception:
        errors = "\n".join(p.read_text() for p in sorted(tmp_path.glob("rank*.err")))
        raise AssertionError(f"a rank failed:\n{errors}") from None
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]
