"""Page copies between the device pool and pinned host memory in one kernel launch (Triton).

:func:`copy_pages` copies whole pages of some layers from one pool to another through
pinned host memory's device-visible address: one program per (page pair, kind, layer)
moves the page's ``page_size`` rows of ``H x D`` values as integer words (byte-exact), for
any pair of layouts. Row addressing (as in :mod:`hicache.transfer.rows`): the row of kind
``k``, page ``p``, layer ``l``, offset ``j`` is ``k * RK + p * RP + l * RL + j * RJ``, with
``K`` kinds, ``L`` layers, ``S`` slots, ``P`` pages of ``ps`` tokens:
``layer_first`` ``RK = L * S``, ``RP = ps``, ``RL = S``, ``RJ = 1``; ``page_first``
``RK = S * L``, ``RP = ps * L``, ``RL = 1``, ``RJ = L``; ``page_first_direct``
``RK = P * L * ps``, ``RP = L * ps``, ``RL = ps``, ``RJ = 1``.
On CUDA the host side must be pinned; :func:`uva_usable` checks once per device, by a probe
copy compared byte for byte, that the kernel runs there (a copier falls back to its DMA
path otherwise). With ``TRITON_INTERPRET=1`` it also runs on CPU tensors (the tests).
"""

from __future__ import annotations

import logging
import os

import torch

from hicache.config import MemLayout
from hicache.device_probe import DeviceProbe
from hicache.memory.base import KVPool
from hicache.transfer.rows import rows, word_dtype

__all__ = ["copy_pages", "row_strides", "uva_usable"]

log = logging.getLogger("hicache.transfer")

_TILE_WORDS = 4096
"""Words one program moves per step (rows x words per row, rounded to powers of two)."""


def row_strides(pool: KVPool) -> tuple[int, int, int, int]:
    """``(RK, RP, RL, RJ)``: rows per kind, page, layer and token-in-page of ``pool``."""
    nl, s, ps = pool.spec.num_layers, pool.size_tokens, pool.page_size
    if pool.layout is MemLayout.LAYER_FIRST:
        return nl * s, ps, s, 1
    if pool.layout is MemLayout.PAGE_FIRST:
        return s * nl, ps * nl, 1, nl
    return pool.num_pages * nl * ps, nl * ps, ps, 1


def _kernel():  # type: ignore[no-untyped-def]
    """The Triton kernel, built on first use (Triton is imported only then)."""
    import triton
    import triton.language as tl

    # Triton reads annotations as specialization hints: arguments stay unannotated.
    @triton.jit
    def copy_kernel(  # type: ignore[no-untyped-def]
        src,
        dst,
        src_pages,
        dst_pages,
        layer0,
        s_k,
        s_p,
        s_l,
        s_j,
        d_k,
        d_p,
        d_l,
        d_j,
        WORDS: tl.constexpr,
        PAGE: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        i = tl.program_id(0)
        k = tl.program_id(1).to(tl.int64)
        layer = layer0 + tl.program_id(2).to(tl.int64)
        sp = tl.load(src_pages + i).to(tl.int64)
        dp = tl.load(dst_pages + i).to(tl.int64)
        src_base = k * s_k + sp * s_p + layer * s_l
        dst_base = k * d_k + dp * d_p + layer * d_l
        w = tl.arange(0, BLOCK_W)
        w_ok = w < WORDS
        for j0 in range(0, PAGE, ROWS):
            j = j0 + tl.arange(0, ROWS).to(tl.int64)
            mask = (j < PAGE)[:, None] & w_ok[None, :]
            src_rows = src_base + j * s_j
            dst_rows = dst_base + j * d_j
            x = tl.load(src + src_rows[:, None] * WORDS + w[None, :], mask=mask)
            tl.store(dst + dst_rows[:, None] * WORDS + w[None, :], x, mask=mask)

    return copy_kernel


_compiled = None


def copy_pages(
    src: KVPool,
    dst: KVPool,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    layers: range,
) -> None:
    """Copy page ``src_pages[i]`` of ``src`` to page ``dst_pages[i]`` of ``dst``, every kind,
    the layers ``layers`` (consecutive), in one launch on the current stream.

    The pools must share spec and page size; ``src_pages``/``dst_pages`` are 1-D int64 of
    equal length on the launching device (the device pool's). The caller validated the
    page ids (in range): the kernel does not check them.
    """
    global _compiled
    import triton

    if src.spec != dst.spec or src.page_size != dst.page_size:
        raise ValueError("copy_pages needs pools of one spec and page size")
    if src_pages.shape != dst_pages.shape or src_pages.dim() != 1:
        raise ValueError(
            f"src_pages {tuple(src_pages.shape)} and dst_pages {tuple(dst_pages.shape)}"
            " must be 1-D and of equal length"
        )
    if layers.step != 1 or not 0 <= layers.start < layers.stop <= src.spec.num_layers:
        raise ValueError(f"layers {layers} must be consecutive and within the pools")
    n = src_pages.numel()
    if n == 0:
        return
    word = word_dtype(src)
    s_rows, d_rows = rows(src, word), rows(dst, word)
    words = s_rows.shape[1]
    block_w = triton.next_power_of_2(words)
    tile_rows = max(1, min(triton.next_power_of_2(src.page_size), _TILE_WORDS // block_w))
    if _compiled is None:
        _compiled = _kernel()
    grid = (n, src.spec.num_kv, len(layers))
    _compiled[grid](
        s_rows,
        d_rows,
        src_pages,
        dst_pages,
        layers.start,
        *row_strides(src),
        *row_strides(dst),
        WORDS=words,
        PAGE=src.page_size,
        ROWS=tile_rows,
        BLOCK_W=block_w,
    )


def uva_usable(device: torch.device) -> bool:
    """Whether :func:`copy_pages` runs on ``device`` between its memory and pinned host
    memory (Triton installed, CUDA, and a probe copy byte-equal both ways); checked once
    per device, a failure logged once. Always False on CPU outside Triton's interpreter."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return _uva_probe(device)


def _probe(device: torch.device) -> bool:
    """One small load and backup through :func:`copy_pages`, compared with index copies."""
    from hicache.memory import DevicePool, HostPool
    from hicache.spec import KVSpec

    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16")
    dev = DevicePool(spec, 4, 2, device)
    host = HostPool.create(spec, 4, 2, MemLayout.PAGE_FIRST_DIRECT, device)
    gen = torch.Generator().manual_seed(0)
    host.buffer.copy_(torch.randn(host.buffer.shape, generator=gen).to(host.buffer.dtype))
    dev.buffer.zero_()
    pages = torch.tensor([2, 0], dtype=torch.int64, device=dev.device)
    back = torch.tensor([1, 3], dtype=torch.int64, device=dev.device)
    copy_pages(host, dev, pages, back, range(0, 2))
    copy_pages(dev, host, back, torch.tensor([1, 3], device=dev.device), range(0, 2))
    if dev.device.type == "cuda":
        torch.cuda.synchronize(dev.device)
    h = host.buffer.view(torch.int16)
    return bool(torch.equal(h[:, 1], h[:, 2]) and torch.equal(h[:, 3], h[:, 0]))


_uva_probe = DeviceProbe("the UVA page-copy kernel", "DMA copies", _probe, log)
