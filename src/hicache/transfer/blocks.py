"""CPU block copies by address: one libc ``memmove`` per contiguous block of an op.

A layer-wise load at page 64 moves one contiguous block per (page, kind) on both sides for
``layer_first`` and ``page_first_direct`` hosts (``ps x H x D`` elements: 128 KiB for 8 x 128
fp16 heads). Through torch each block is a ``copy_`` whose TensorIterator set-up and
intra-op thread hand-off cost about as much as moving 128 KiB, and on a loaded 2-core host
the hand-off stalls whenever the other core is busy. A ``memmove`` per block costs under a
microsecond of Python, runs on the calling thread and releases the GIL. Measured in one
run with ``hicache bench transfer`` (page 64, 256 MiB ops, 2-vCPU VM): ``page_first_direct``
load 0.6 -> 0.9-1.0x of a contiguous copy (see docs/benchmarks.md).

Offsets are computed once per op (:class:`BlockPlan`, int64 torch arithmetic) and the layer
adds one constant per side. Safety rests on the op's validation: pages are in range, so
every block lies inside its (contiguous, live) pool buffer; :func:`copy_blocks` checks the
buffers are contiguous CPU tensors and the extreme blocks are in bounds before copying.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

__all__ = ["MIN_SPLIT_BYTES", "BlockPlan", "copy_blocks", "copy_layers"]

_memmove = ctypes.memmove

MIN_SPLIT_BYTES = 4 * 2**20
"""A call moving at least this many bytes is split over the copy threads."""

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def _helpers(n: int) -> ThreadPoolExecutor | None:
    """The shared helper pool with at least ``n`` threads (created or grown lazily)."""
    global _pool, _pool_size
    if n < 1:
        return None
    with _pool_lock:
        if _pool is None or _pool_size < n:
            old = _pool
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="hicache-copy")
            _pool_size = n
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def _run(dbase: int, sbase: int, dst: list[int], src: list[int], nbytes: list[int]) -> None:
    for d, s, n in zip(dst, src, nbytes, strict=True):
        _memmove(dbase + d, sbase + s, n)


class BlockPlan(NamedTuple):
    """Block copies of one layer-wise load, as byte offsets into the two buffers.

    Block ``i`` of layer ``l`` copies ``nbytes[i]`` bytes from
    ``src_base + src[i] + l * src_layer_stride`` to
    ``dst_base + dst[i] + l * dst_layer_stride`` (offsets in bytes, Python ints).
    ``dst_end`` / ``src_end`` are the largest ``offset + nbytes`` of layer 0 (bounds);
    ``total`` the bytes of one layer.
    """

    dst: list[int]
    src: list[int]
    nbytes: list[int]
    dst_layer_stride: int
    src_layer_stride: int
    dst_end: int
    src_end: int
    total: int

    @classmethod
    def build(
        cls,
        dst: list[int],
        src: list[int],
        nbytes: list[int],
        dst_layer_stride: int,
        src_layer_stride: int,
    ) -> BlockPlan:
        """A plan of the given blocks; raises ValueError for a negative offset or size."""
        if len(dst) != len(src) or len(dst) != len(nbytes):
            raise ValueError("dst, src and nbytes differ in length")
        if dst and (min(dst) < 0 or min(src) < 0 or min(nbytes) < 0):
            raise ValueError("negative block offset or size")
        dst_end = max((d + n for d, n in zip(dst, nbytes, strict=True)), default=0)
        src_end = max((s + n for s, n in zip(src, nbytes, strict=True)), default=0)
        return cls(
            dst, src, nbytes, dst_layer_stride, src_layer_stride, dst_end, src_end, sum(nbytes)
        )


def copy_blocks(
    dst: torch.Tensor,
    src: torch.Tensor,
    plan: BlockPlan,
    layer: int,
    *,
    threads: int | None = None,
) -> None:
    """Copy ``layer``'s blocks of ``plan`` from ``src``'s buffer into ``dst``'s buffer.

    Both must be contiguous CPU tensors (the pool buffers) that hold every block of
    ``layer``; raises ValueError / IndexError (before any byte moves) otherwise.
    A call moving at least :data:`MIN_SPLIT_BYTES` is split into ``threads`` parts of
    about equal bytes (default ``torch.get_num_threads()``, like a torch copy), all but
    one run by a shared, lazily started helper pool; returns when every part is done.
    """
    if dst.device.type != "cpu" or src.device.type != "cpu":
        raise ValueError("copy_blocks copies CPU memory only")
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("copy_blocks needs contiguous buffers")
    if layer < 0:
        raise IndexError(f"layer {layer} < 0")
    if not plan.dst:
        return
    dl, sl = layer * plan.dst_layer_stride, layer * plan.src_layer_stride
    if (
        plan.dst_end + dl > dst.numel() * dst.element_size()
        or plan.src_end + sl > src.numel() * src.element_size()
    ):
        raise IndexError("a block lies outside its buffer")
    dbase, sbase = dst.data_ptr() + dl, src.data_ptr() + sl
    parts = _parts(plan, threads)
    helpers = _helpers(len(parts) - 1)
    futures: list[Future[None]] = []
    if helpers is not None:
        futures = [
            helpers.submit(_run, dbase, sbase, plan.dst[a:b], plan.src[a:b], plan.nbytes[a:b])
            for a, b in parts[1:]
        ]
    a, b = parts[0]
    try:
        _run(dbase, sbase, plan.dst[a:b], plan.src[a:b], plan.nbytes[a:b])
    finally:
        for f in futures:
            f.result()


def _parts(plan: BlockPlan, threads: int | None) -> list[tuple[int, int]]:
    """Block index ranges ``[a, b)`` of about equal bytes, one per copy thread."""
    n = len(plan.dst)
    want = torch.get_num_threads() if threads is None else threads
    total = plan.total
    want = max(1, min(want, n))
    if want == 1 or total < MIN_SPLIT_BYTES:
        return [(0, n)]
    out: list[tuple[int, int]] = []
    a, acc, goal = 0, 0, total / want
    for i, nb in enumerate(plan.nbytes):
        acc += nb
        if acc >= goal * (len(out) + 1) and len(out) < want - 1:
            out.append((a, i + 1))
            a = i + 1
    out.append((a, n))
    return out


def copy_layers(
    dst: torch.Tensor,
    src: torch.Tensor,
    plan: BlockPlan,
    num_layers: int,
    done: Callable[[int], None],
    *,
    threads: int | None = None,
) -> None:
    """Copy layers ``0 .. num_layers-1`` of ``plan`` (see :func:`copy_blocks`), up to
    ``threads`` layers at once, each by one thread (default ``torch.get_num_threads()``;
    the caller's thread takes every ``threads``-th layer, the shared helper pool the rest),
    and call ``done(layer)`` on the caller's thread in layer order as each has landed.

    Why whole layers per thread: a layer of a load is a few MiB (8 MiB for 32 pages of 8 x
    128 fp16 heads at page 64), and splitting each one over the threads pays a hand-off
    and a barrier per layer that cost as much as a good part of the copy; copying
    different layers at once pays them once per op. On an error, raises once every copy
    started has ended (later layers are not started; the ones reported done stay valid).
    """
    want = torch.get_num_threads() if threads is None else threads
    want = max(1, min(want, num_layers))
    helpers = _helpers(want - 1)
    if helpers is None:
        for layer in range(num_layers):
            copy_blocks(dst, src, plan, layer, threads=1)
            done(layer)
        return
    futures = {
        layer: helpers.submit(copy_blocks, dst, src, plan, layer, threads=1)
        for layer in range(num_layers)
        if layer % want
    }
    try:
        for layer in range(num_layers):
            if layer % want == 0:
                copy_blocks(dst, src, plan, layer, threads=1)
            else:
                futures[layer].result()
            done(layer)
    finally:
        for f in futures.values():
            f.cancel()
        for f in futures.values():
            if not f.cancelled():
                f.exception()  # wait until it has ended; its error, if any, is raised above
