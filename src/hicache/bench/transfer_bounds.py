"""What bounds a ``page_first`` load on CPU: one thread's CPU time for each copy pattern.

A ``page_first`` host keeps a token's layers together (``(S, L, row)`` per kind); a
layer-wise load writes each layer's rows consecutively into the device ``(L, S, row)``,
so it reads one row of every token, ``L`` rows apart. Every pattern below moves the same
bytes as a contiguous copy, on the calling thread with torch's intra-op threads set to 1
(no OpenMP team), timed as that thread's CPU time (``time.thread_time``: time-slicing by
other jobs does not count). The ratio ``contiguous CPU time / pattern CPU time`` bounds
what any number of such threads can reach against a contiguous copy that is not limited
by memory bandwidth. Findings: ``docs/benchmarks/transfer.md``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from hicache.memory.hugepages import advise_huge_pages

__all__ = ["Bound", "measure_bounds"]

STAGE_BYTES = 512 * 1024
"""Bytes of the staging buffer of the staged patterns (fits a core's L2 cache)."""


@dataclass(frozen=True)
class Bound:
    """One pattern: median CPU seconds of one op on one thread, as GB/s (1e9 B/s) and as
    the ratio of the contiguous copy's CPU time to this pattern's."""

    pattern: str
    cpu_s: float
    gbps: float
    ratio: float


def _word(row_bytes: int) -> torch.dtype:
    for word in (torch.int64, torch.int32, torch.int16):
        if row_bytes % word.itemsize == 0:
            return word
    return torch.uint8


def _buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(numel, dtype=dtype)
    advise_huge_pages(t)  # like the pools
    t.zero_()
    return t


def _patterns(
    host: torch.Tensor, dev: torch.Tensor, stage: torch.Tensor, page_size: int, group: int
) -> dict[str, Callable[[], object]]:
    """The copy patterns of a load of every row of ``host`` ``(S, L, E)`` into ``dev``
    ``(L, S, E)``; ``stage`` holds ``n`` tokens of all layers ``(n, L, E)``, or as many
    rows of one layer."""
    tokens, layers, _ = host.shape
    n = stage.shape[0]
    groups = [(f, min(f + group, layers)) for f in range(0, layers, group)]
    pages = range(0, tokens, page_size)
    per_page = (
        [dev[a:b, p : p + page_size] for a, b in groups for p in pages],
        [host[p : p + page_size, a:b].transpose(0, 1) for a, b in groups for p in pages],
    )
    chunks = range(0, tokens, n)
    hn, dn = host.numpy(), dev.numpy()
    ids = torch.arange(tokens)

    def staged(read: bool, write: bool) -> None:
        for t in chunks:
            m = min(n, tokens - t)
            if read:
                stage[:m].copy_(host[t : t + m])
            if write:
                dev[:, t : t + m].copy_(stage[:m].transpose(0, 1))

    rows = stage.view(-1, stage.shape[-1])  # the stage as rows of one layer
    row_chunks = range(0, tokens, rows.shape[0])

    def layer_rows_to_stage() -> None:
        for layer in range(layers):
            for t in row_chunks:
                m = min(rows.shape[0], tokens - t)
                rows[:m].copy_(host[t : t + m, layer])

    def torch_groups() -> None:
        for a, b in groups:
            dev[a:b].copy_(host[:, a:b].transpose(0, 1))

    def numpy_groups() -> None:  # integer words, as storage/headio.py copies
        for a, b in groups:
            np.copyto(dn[a:b], hn[:, a:b].transpose(1, 0, 2))

    def index_put_groups() -> None:  # iterates the host's order (its values)
        for a, b in groups:
            dev[a:b].transpose(0, 1).index_put_((ids,), host[:, a:b])

    return {
        "contiguous copy": lambda: dev.view(-1).copy_(host.view(-1)),
        "load, one view per layer group": torch_groups,
        "load, one view per page and group": lambda: torch._foreach_copy_(*per_page),
        "load, numpy copyto per group": numpy_groups,
        "load, index_put_ in token order": index_put_groups,
        "read only: whole tokens -> stage": lambda: staged(True, False),
        "read only: layer rows -> stage": layer_rows_to_stage,
        "write only: stage -> layer rows": lambda: staged(False, True),
        "load through the stage (both)": lambda: staged(True, True),
    }


def measure_bounds(
    *, layers: int, row_bytes: int, op_bytes: int, page_size: int, group: int, repeat: int
) -> list[Bound]:
    """CPU time of each pattern (see the module docstring) for ``op_bytes`` (rounded down
    to whole pages of ``page_size`` tokens of ``layers`` rows of ``row_bytes``), median
    of ``repeat`` runs after one warm-up, patterns interleaved run by run."""
    word = _word(row_bytes)
    width = row_bytes // word.itemsize
    tokens = max(1, op_bytes // (layers * row_bytes * page_size)) * page_size
    host = _buffer(tokens * layers * width, word).view(tokens, layers, width)
    dev = _buffer(tokens * layers * width, word).view(layers, tokens, width)
    host.view(torch.uint8).copy_(
        torch.randint(0, 256, host.view(torch.uint8).shape, dtype=torch.uint8)
    )
    n = max(1, min(tokens, STAGE_BYTES // (layers * row_bytes)))
    stage = torch.empty((n, layers, width), dtype=word)
    fns = _patterns(host, dev, stage, page_size, group)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {name: [] for name in fns}
    try:
        for name, fn in fns.items():  # warm-up; each "load" must copy every row
            dev.zero_()
            fn()
            if name.startswith("load") and not torch.equal(dev, host.transpose(0, 1)):
                raise AssertionError(f"{name}: the load did not copy every row")
        for _ in range(repeat):
            for name, fn in fns.items():
                t0 = time.thread_time()
                fn()
                times[name].append(time.thread_time() - t0)
    finally:
        torch.set_num_threads(threads)
    nbytes = tokens * layers * row_bytes
    base = statistics.median(times["contiguous copy"])
    out = []
    for name, ts in times.items():
        cpu = max(statistics.median(ts), 1e-9)
        out.append(Bound(name, cpu, nbytes / cpu / 1e9, base / cpu))
    return out
