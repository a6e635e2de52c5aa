"""CPU block copies by address: one libc ``memmove`` per contiguous block of an op.

For ``layer_first`` and ``page_first_direct`` hosts a layer-wise load moves one contiguous
block per (page, kind) on both sides (``ps x H x D`` elements). Offsets are computed once
per op (:class:`BlockPlan`, int64 torch arithmetic) and the layer adds one constant per
side; batches of ``memmove`` calls (GIL released) are the work units of
:mod:`hicache.transfer.workers`. Safety rests on the op's validation (pages in range, so
every block lies inside its contiguous, live pool buffer); :func:`copy_blocks` also checks
the buffers are contiguous CPU tensors and the extreme blocks are in bounds. Why by address
and what it gains: ``docs/architecture.md``, "Copies between L1 and L2".
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch

from hicache.transfer.workers import run_steps

__all__ = ["MIN_SPLIT_BYTES", "UNIT_BYTES", "BlockPlan", "copy_blocks", "copy_layers"]

_memmove = ctypes.memmove

MIN_SPLIT_BYTES = 4 * 2**20
"""A call moving at least this many bytes is split over the copy threads."""

UNIT_BYTES = 2 * 2**20
""":func:`copy_layers` cuts each layer into work units of about this many bytes."""


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
    about equal bytes (default ``torch.get_num_threads()``, like a torch copy), run by the
    shared copy threads (:func:`hicache.transfer.workers.run_steps`); returns when every
    part is done.
    """
    if not plan.dst:
        _check_buffers(dst, src)
        return
    dbase, sbase = _bases(dst, src, plan, layer)
    parts = _parts(plan, threads)
    if len(parts) == 1:
        _run(dbase, sbase, plan.dst, plan.src, plan.nbytes)
        return
    units = [_unit(plan, dbase, sbase, a, b) for a, b in parts]
    run_steps([units], lambda step: None, threads=len(parts))


def _check_buffers(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.device.type != "cpu" or src.device.type != "cpu":
        raise ValueError("copy_blocks copies CPU memory only")
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("copy_blocks needs contiguous buffers")


def _bases(dst: torch.Tensor, src: torch.Tensor, plan: BlockPlan, layer: int) -> tuple[int, int]:
    """Addresses of ``layer``'s block offset 0 in ``dst`` and ``src``, once the buffers
    and every block of the layer are checked (ValueError / IndexError otherwise)."""
    _check_buffers(dst, src)
    if layer < 0:
        raise IndexError(f"layer {layer} < 0")
    dl, sl = layer * plan.dst_layer_stride, layer * plan.src_layer_stride
    if (
        plan.dst_end + dl > dst.numel() * dst.element_size()
        or plan.src_end + sl > src.numel() * src.element_size()
    ):
        raise IndexError("a block lies outside its buffer")
    return dst.data_ptr() + dl, src.data_ptr() + sl


def _unit(plan: BlockPlan, dbase: int, sbase: int, a: int, b: int) -> Callable[[], None]:
    """Blocks ``[a, b)`` of ``plan`` at the given buffer addresses, as one work unit."""
    return partial(_run, dbase, sbase, plan.dst[a:b], plan.src[a:b], plan.nbytes[a:b])


def _parts(
    plan: BlockPlan, threads: int | None, *, min_split: int = MIN_SPLIT_BYTES
) -> list[tuple[int, int]]:
    """Block index ranges ``[a, b)`` of about equal bytes, ``threads`` of them (default
    ``torch.get_num_threads()``; one when the plan moves under ``min_split`` bytes)."""
    n = len(plan.dst)
    want = torch.get_num_threads() if threads is None else threads
    total = plan.total
    want = max(1, min(want, n))
    if want == 1 or total < min_split:
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
    """Copy layers ``0 .. num_layers-1`` of ``plan`` (see :func:`copy_blocks`) on
    ``threads`` copy threads (default ``torch.get_num_threads()``) and call ``done(layer)``
    on the caller's thread in layer order as each has landed.

    Each layer is cut into units of about :data:`UNIT_BYTES` that the threads claim in
    layer order (:func:`hicache.transfer.workers.run_steps`), so a thread short of CPU
    takes fewer units instead of holding a barrier per layer (the previous split, one
    whole layer per thread, waited for the slower thread at every layer). Bounds are
    checked for the last layer before any byte moves. On an error, raises once every copy
    started has ended (layers reported done stay valid).
    """
    if num_layers <= 0 or not plan.dst:
        for layer in range(max(0, num_layers)):
            done(layer)
        return
    for layer in (0, num_layers - 1):  # bounds of every layer, before any byte moves
        _bases(dst, src, plan, layer)
    pieces = max(1, min(len(plan.dst), -(-plan.total // UNIT_BYTES)))
    parts = _parts(plan, pieces, min_split=0)
    steps = []
    for layer in range(num_layers):
        dbase, sbase = _bases(dst, src, plan, layer)
        steps.append([_unit(plan, dbase, sbase, a, b) for a, b in parts])
    run_steps(steps, done, threads=threads)
