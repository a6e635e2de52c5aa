"""Decode attention read in place from the paged pool (Triton): no copy of any context.

One program per (sequence, KV head) walks the sequence's keys ``BLOCK_N`` at a time through
its page table (key ``n`` at slot ``table[n // PAGE] * PAGE + n % PAGE``; ``PAGE == 1``: a
slot table) with an online softmax in fp32 (running max ``m``, normalizer ``l``,
accumulator) for the ``GROUP = Hq / Hkv`` query heads of the KV head, one tile padded to
``BLOCK_G >= 16`` rows, so K/V are read once per group. Numerics: scores and softmax in
fp32; ``q·k`` in the inputs' dtype with fp32 accumulation (``ieee`` for fp32 inputs, so fp32
matches SDPA to ~1e-6); ``p·v`` with ``p`` cast to V's dtype. The reference is
:meth:`~hicache.runner.models.attention.PagedAttention._attend_decode`; why a kernel:
``docs/architecture.md``, "Attention kernels".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache.runner.kernels.inputs import check_pool_inputs

__all__ = ["paged_decode_attention"]


# Triton reads a kernel's annotations as specialization hints (tl.constexpr), so the
# pointer and stride arguments stay unannotated; their types are the wrapper's.
@triton.jit
def _decode_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    lens_ptr,
    out_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_tb,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g
    q_mask = g_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask)
    n_keys = tl.load(lens_ptr + b)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(0, n_keys, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < n_keys
        page = tl.load(table_ptr + b * stride_tb + n // PAGE, mask=n_ok, other=0)
        slot = page.to(tl.int64) * PAGE + n % PAGE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=kv_mask)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + slot[:, None] * stride_vt + kvh * stride_vh + d[None, :], mask=kv_mask)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    *,
    page_size: int,
    scale: float,
    block_n: int = 64,
) -> torch.Tensor:
    """Attention of ``B`` single-token queries over their sequences' keys in the pool.

    ``q (B, Hq, D)``; ``k_cache``/``v_cache (S, Hkv, D)``: one layer of the pool (token
    slots, last dim contiguous), ``Hq`` a multiple of ``Hkv``; ``table (B, W)`` int:
    each sequence's page ids in order (``page_size`` > 1) or slots (``page_size == 1``),
    right-padded with anything valid; ``lengths (B,)``: keys per sequence (>= 1, at most
    ``W * page_size``), its query at the last of them (every key is visible). Returns
    ``(B, Hq, D)`` in ``q``'s dtype; all tensors on one device.
    """
    bsz, hq, dim = q.shape
    hkv = k_cache.shape[1]
    check_pool_inputs(q, k_cache, v_cache)
    if table.shape[0] != bsz or lengths.shape != (bsz,):
        raise ValueError(f"table {tuple(table.shape)} / lengths {tuple(lengths.shape)} for B={bsz}")
    table = table.contiguous()
    group = hq // hkv
    out = torch.empty_like(q)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _decode_kernel[(bsz, hkv)](
        q,
        k_cache,
        v_cache,
        table,
        lengths,
        out,
        scale,
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
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        PRECISION=precision,
    )
    return out
