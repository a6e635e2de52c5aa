"""Extend attention read in place from the paged pool (Triton): no copy of any context.

An *extend* adds ``extend`` new tokens to a sequence holding ``prefix`` tokens in the pool
(``prefix == 0``: a plain prefill); their K/V are written to their slots before attention
runs. New token ``i`` (position ``prefix + i``) attends to keys ``0 .. prefix + i``, with a
sliding ``window`` only to those after ``prefix + i - window``. Key ``n`` lies at slot
``table[n // PAGE] * PAGE + n % PAGE`` (``PAGE == 1``: ``table`` is a slot table).
Shapes: one program per (sequence, block of ``BLOCK_M`` new tokens, KV head), serving the
``GROUP = Hq / Hkv`` query heads of that KV head as one token-major tile of ``ROWS =
BLOCK_M * BLOCK_G`` rows (``BLOCK_G = next_power_of_2(GROUP)``; padding rows masked);
:func:`_tile` keeps ``16 <= ROWS <= MAX_ROWS`` (128 for 16-bit inputs, 64 for fp32).
Numerics: ``q·k`` in the inputs' dtype with fp32 accumulation (``ieee`` for fp32, so fp32
matches SDPA to ~1e-6), scores and softmax in fp32, ``p`` cast to V's dtype for ``p·v``.
The reference is :meth:`~hicache.runner.models.attention.PagedAttention._attend_each`.
Work split, tile choice and K/V traffic: ``docs/architecture.md``, "Attention kernels".
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hicache.runner.kernels.inputs import check_pool_inputs

__all__ = ["paged_extend_attention"]

MAX_ROWS = 128
"""Most rows (tokens x padded group heads) of a program's query tile, 16-bit inputs."""

MAX_ROWS_FP32 = 64
"""Most rows of a program's query tile for fp32 inputs (twice the bytes per row)."""

MIN_ROWS = 16
"""Fewest rows of the query tile: ``tl.dot`` needs every dimension >= 16."""


class _Tile(NamedTuple):
    """A launch's tile: ``block_m`` new tokens (power of two) x ``block_g`` heads (the
    group padded to a power of two) = ``rows``; ``num_warps`` for that many rows."""

    block_m: int
    block_g: int
    rows: int
    num_warps: int


def _tile(block_m: int, group: int, dtype: torch.dtype) -> _Tile:
    """Tokens per program for ``group`` query heads per KV head: ``block_m`` (a power of
    two) halved until the tile has at most ``MAX_ROWS`` (``MAX_ROWS_FP32`` for fp32) rows,
    then doubled until it has at least ``MIN_ROWS``."""
    block_g = triton.next_power_of_2(group)
    max_rows = MAX_ROWS_FP32 if dtype == torch.float32 else MAX_ROWS
    while block_m > 1 and block_m * block_g > max_rows:
        block_m //= 2
    while block_m * block_g < MIN_ROWS:
        block_m *= 2
    rows = block_m * block_g
    return _Tile(block_m, block_g, rows, 8 if rows >= 128 else 4)


# Triton reads a kernel's annotations as specialization hints (tl.constexpr), so the
# pointer and stride arguments stay unannotated; their types are the wrapper's.
@triton.jit
def _extend_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    prefix_ptr,
    extend_ptr,
    qstart_ptr,
    out_ptr,
    scale,
    window,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_tb,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    mb = tl.program_id(1)
    kvh = tl.program_id(2)
    extend = tl.load(extend_ptr + b)
    m_start = mb * BLOCK_M
    if m_start >= extend:
        return
    prefix = tl.load(prefix_ptr + b)
    q_row0 = tl.load(qstart_ptr + b).to(tl.int64)

    # row r of the tile: token m_start + r // BLOCK_G, query head kvh * GROUP + r % BLOCK_G
    r = tl.arange(0, BLOCK_M * BLOCK_G)
    m = m_start + r // BLOCK_G
    g = r % BLOCK_G
    d = tl.arange(0, BLOCK_D)
    row_ok = (m < extend) & (g < GROUP)
    d_ok = d < HEAD_DIM
    q_mask = row_ok[:, None] & d_ok[None, :]
    rows = q_row0 + m
    heads = kvh * GROUP + g
    q_off = rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask)
    q_pos = prefix + m  # each query's position = the last key it sees

    # keys of this block: up to its last valid token; from the first its window reaches
    kv_end = prefix + tl.minimum(extend, m_start + BLOCK_M)
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(prefix + m_start - window + 1, 0)

    m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
    for start in range(kv_begin, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        page = tl.load(table_ptr + b * stride_tb + n // PAGE, mask=n_ok, other=0)
        slot = page.to(tl.int64) * PAGE + n % PAGE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        # one K and one V block per KV head, shared by the whole group's rows
        k = tl.load(k_ptr + slot[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=kv_mask)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
        visible = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that has seen no key yet keeps m == -inf; shift by 0 so exp gives 0, not nan
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_shift[:, None])
        alpha = tl.exp(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + slot[:, None] * stride_vt + kvh * stride_vh + d[None, :], mask=kv_mask)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    # every valid row sees its own key, so l > 0 there; masked rows are not stored
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    *,
    page_size: int,
    scale: float,
    q_starts: torch.Tensor | None = None,
    max_extend: int | None = None,
    window: int | None = None,
    out: torch.Tensor | None = None,
    block_m: int = 32,
    block_n: int = 64,
) -> torch.Tensor:
    """Causal attention of ``B`` sequences' new tokens over their keys in the pool.

    ``q (T, Hq, D)``: the new tokens' queries; sequence ``b``'s ``extend_lens[b]`` rows
    start at row ``q_starts[b]`` (default: the sequences' rows back to back, in order).
    ``k_cache``/``v_cache (S, Hkv, D)``: one layer of the pool (token slots, last dim
    contiguous), already holding the new tokens' K/V; ``Hq`` a multiple of ``Hkv``.
    ``table (B, W)`` int: each sequence's page ids in order (``page_size`` > 1) or slots
    (``page_size == 1``) covering its ``prefix_lens[b] + extend_lens[b]`` keys (at most
    ``W * page_size``), right-padded with anything valid. ``prefix_lens``/``extend_lens
    (B,)`` int: tokens already cached (>= 0) and new tokens (>= 1). New token ``i`` sees
    keys ``0 .. prefix + i``, and with ``window`` (tokens, >= 1) only those later than
    ``prefix + i - window``. ``max_extend``: ``max(extend_lens)`` if the caller knows it
    (saves a device sync). ``out``: write into this ``(T, Hq, D)`` tensor (rows of no
    sequence are left as they are) instead of a new one. Returns ``(T, Hq, D)`` in
    ``q``'s dtype (new rows not covered by a sequence are uninitialized); all tensors on
    one device.

    ``block_m`` (new tokens per program) and ``block_n`` (keys per step, >= 16): powers
    of two, untuned; each program serves one KV head's ``Hq / Hkv`` query heads, so
    ``block_m`` is lowered (or raised) to keep its query tile at 16 .. 128 rows (64 for
    fp32), as the module docstring tells.
    """
    t, hq, dim = q.shape
    hkv = k_cache.shape[1]
    bsz = table.shape[0]
    check_pool_inputs(q, k_cache, v_cache)
    if prefix_lens.shape != (bsz,) or extend_lens.shape != (bsz,):
        raise ValueError(
            f"prefix_lens {tuple(prefix_lens.shape)} / extend_lens {tuple(extend_lens.shape)}"
            f" for B={bsz}"
        )
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size < 1 or size & (size - 1) or (name == "block_n" and size < MIN_ROWS):
            raise ValueError(f"{name}={size} must be a power of two (block_n >= 16)")
    if window is not None and window < 1:
        raise ValueError(f"window={window} must be >= 1 or None")
    if q_starts is None:
        q_starts = torch.cumsum(extend_lens, 0) - extend_lens
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} must have q's shape {tuple(q.shape)}")
    if bsz == 0 or t == 0:
        return out
    if max_extend is None:
        max_extend = int(extend_lens.max().item())
    table = table.contiguous()
    group = hq // hkv
    tile = _tile(block_m, group, q.dtype)
    grid = (bsz, triton.cdiv(max_extend, tile.block_m), hkv)
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        table,
        prefix_lens.contiguous(),
        extend_lens.contiguous(),
        q_starts.contiguous(),
        out,
        scale,
        window if window is not None else 0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        table.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        PAGE=page_size,
        HEAD_DIM=dim,
        USE_WINDOW=window is not None,
        BLOCK_M=tile.block_m,
        BLOCK_G=tile.block_g,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=tile.num_warps,
    )
    return out
