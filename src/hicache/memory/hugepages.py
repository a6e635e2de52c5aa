"""Transparent huge pages for large CPU pool buffers (Linux ``madvise(MADV_HUGEPAGE)``).

A KV page copy touches one 128 KiB block per (page, layer, kind), or for ``page_first``
loads one 2 KiB row every 64 KiB: with 4 KiB OS pages nearly every block or row is a TLB
miss. Backing the pools with 2 MiB pages removes most of them. Measured with
``hicache bench transfer`` at page 64 on a 2-vCPU VM (same-run ratios to a contiguous
copy): ``page_first`` backup 0.21 -> 0.74 and load 0.20 -> 0.52 (see docs/benchmarks/transfer.md).

The advice must come before the buffer is first touched (the pools zero-fill right after
allocating), since the kernel picks the page size at the first fault. It is best-effort:
on other systems, with THP disabled (``/sys/kernel/mm/transparent_hugepage/enabled`` =
``never``), or for pinned (CUDA host) memory it does nothing and returns False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable
from functools import cache

import torch

__all__ = ["HUGE_PAGE_MIN_BYTES", "MADV_HUGEPAGE", "advise_huge_pages"]

MADV_HUGEPAGE = 14
"""Linux ``madvise`` advice number for transparent huge pages."""

HUGE_PAGE_MIN_BYTES = 4 * 2**20
"""Buffers smaller than this (bytes) are not advised: too small to hold a 2 MiB page."""


@cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise``, or None off Linux / without libc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    madvise: Callable[[int, int, int], int] = fn
    return madvise


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask the kernel to back ``t``'s memory with transparent huge pages.

    ``t`` must be a contiguous CPU tensor that has not been written yet (otherwise the
    pages already faulted in stay 4 KiB until khugepaged merges them). Returns True if the
    advice was accepted; False (and nothing changed) for small, pinned, non-CPU or
    non-contiguous tensors, off Linux, or when ``madvise`` fails.
    """
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or not t.is_contiguous() or nbytes < HUGE_PAGE_MIN_BYTES:
        return False
    if t.is_pinned():
        return False
    fn = _madvise()
    if fn is None:
        return False
    page = os.sysconf("SC_PAGE_SIZE")
    addr = t.data_ptr()
    lo = (addr + page - 1) // page * page  # madvise needs a page-aligned start
    hi = (addr + nbytes) // page * page
    if hi <= lo:
        return False
    return int(fn(lo, hi - lo, MADV_HUGEPAGE)) == 0
