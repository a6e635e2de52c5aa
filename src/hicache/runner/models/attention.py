"""Paged attention: K/V live only in the device pool and are addressed by token slot.

A token's *slot* is ``page * page_size + offset_in_page`` in :class:`DevicePool`. For each
layer, attention (1) writes the new tokens' K/V into their slots, (2) calls
``layer_wait(layer)`` so a layer-wise load from host memory can gate the read, (3) gathers
each sequence's K/V (prefix, then new tokens) by slot and (4) computes causal attention for
the new tokens: new token ``i`` of a sequence with ``prefix`` cached tokens attends to key
positions ``0 .. prefix + i``. With the Triton kernels (:mod:`hicache.runner.kernels`),
steps (3) and (4) are one launch for the single-token sequences and one for the others,
reading K/V in place through page tables (:class:`DecodeGather`, :class:`ExtendTable`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hicache.heads import HeadSplit
from hicache.memory import DevicePool
from hicache.runner.models.config import DecoderConfig
from hicache.runner.models.layers import RMSNorm
from hicache.runner.models.rope import apply_rotary
from hicache.runner.parallel import HeadParallelLinear, RowParallelLinear, TPGroup

__all__ = ["AttentionContext", "DecodeGather", "ExtendTable", "PagedAttention", "SlidingKV"]


@dataclass(frozen=True)
class DecodeGather:
    """Padded gather for the sequences of a batch that add exactly one token.

    ``seqs`` are their positions in the batch and ``rows (B,)`` their tokens' rows among
    the batch's ``T`` new tokens. With ``by_page`` (every sequence's slots lie over whole
    pages in order, as a request's do), ``index (B, Pmax)`` holds page ids, right-padded
    with each one's last page, and K/V are gathered a page at a time (``Lmax = Pmax *
    page_size``); else ``index (B, Lmax)`` holds slots, right-padded with the last slot.
    ``mask (B, 1, 1, Lmax)`` is True on real keys; every row has at least one;
    ``lengths (B,)`` counts them. ``kernel``: attend with the Triton kernel, which reads
    K/V in place through ``index`` (:mod:`hicache.runner.kernels.decode_attention`),
    instead of gathering them for SDPA.
    """

    seqs: frozenset[int]
    rows: torch.Tensor
    index: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor
    by_page: bool = False
    page_size: int = 1
    kernel: bool = False


@dataclass(frozen=True)
class ExtendTable:
    """The sequences of a batch that add several tokens, for the Triton extend kernel
    (:mod:`hicache.runner.kernels.extend_attention`), which reads their K/V in place.

    ``seqs`` are their positions in the batch; for the ``B`` of them in batch order,
    ``index (B, W)`` holds page ids right-padded with each one's last page when
    ``page_size > 1`` (every sequence's slots lie over whole pages in order, as a
    request's do), else slots right-padded with the last slot (``page_size == 1``, also
    for a pool with larger pages whose slots do not allow pages). ``prefix_lens``,
    ``extend_lens`` and ``q_starts (B,)`` int64: cached tokens, new tokens (>= 2) and the
    first new token's row among the batch's ``T``; ``max_extend`` is the largest extend.
    All tensors on the pool's device.
    """

    seqs: frozenset[int]
    index: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    q_starts: torch.Tensor
    max_extend: int
    page_size: int


@dataclass(frozen=True)
class SlidingKV:
    """The sliding-window layers' own pool for one forward (a cache with a sliding-window store).

    ``seq_slots[i]``: slots in ``pool`` of the *last* ``len(seq_slots[i])`` positions of
    sequence ``i`` (its new tokens last); earlier positions are out of every window of
    this forward and absent. ``write_slots (T,)``: the new tokens' slots in batch order.
    Both on the pool's device.
    """

    pool: DevicePool
    seq_slots: list[torch.Tensor]
    write_slots: torch.Tensor

    @classmethod
    def build(
        cls, pool: DevicePool, seq_slots: Sequence[torch.Tensor], extend_lens: Sequence[int]
    ) -> SlidingKV:
        """Move the slots to the pool's device (one copy) and cut out the new ones."""
        lengths = [int(s.shape[0]) for s in seq_slots]
        flat = torch.cat([s.to(torch.int64) for s in seq_slots]).to(pool.device)
        slots = list(flat.split(lengths))
        write = torch.cat([s[len(s) - n :] for s, n in zip(slots, extend_lens, strict=True)])
        return cls(pool=pool, seq_slots=slots, write_slots=write)


@dataclass(frozen=True)
class AttentionContext:
    """Per-forward attention inputs, shared by all layers (built once per batch).

    ``seq_slots[i]`` are sequence ``i``'s slots (prefix first, ``extend_lens[i]`` new ones
    last) on the pool's device; ``write_slots (T,)`` concatenates the new slots in batch
    order. ``masks[i]`` is the ``(extend, prefix + extend)`` bool mask (True = attend), or
    None when no explicit mask is needed: a single query sees every key, and a prefill
    without prefix uses SDPA's ``is_causal`` (which keeps the flash kernels eligible).
    ``decode`` gathers the single-token sequences into one padded call when there are
    several of them (a decode batch, or the decode part of a mixed batch), or attends
    them all with the Triton kernel (``decode_kernel``, any number). ``extend``: the
    sequences of several new tokens, attended in one launch of the Triton extend kernel
    (``extend_kernel``; None without it or without such sequences). ``swa``: the
    sliding layers' own pool (then ``pool`` holds the global layers only); None when
    every attention layer lives in ``pool``.
    """

    pool: DevicePool
    seq_slots: list[torch.Tensor]
    extend_lens: list[int]
    write_slots: torch.Tensor
    masks: list[torch.Tensor | None]
    decode: DecodeGather | None
    layer_wait: Callable[[int], None] | None = None
    swa: SlidingKV | None = None
    extend: ExtendTable | None = None

    @classmethod
    def build(
        cls,
        pool: DevicePool,
        seq_slots: Sequence[torch.Tensor],
        extend_lens: Sequence[int],
        layer_wait: Callable[[int], None] | None = None,
        swa: SlidingKV | None = None,
        *,
        decode_kernel: bool = False,
        extend_kernel: bool = False,
    ) -> AttentionContext:
        """Move slots to the pool's device and precompute masks (see the class doc)."""
        device = pool.device
        lengths = [int(s.shape[0]) for s in seq_slots]
        host = [s.to("cpu", torch.int64) for s in seq_slots]  # page tables are built here
        flat = torch.cat(host).to(device)  # one copy
        slots = list(flat.split(lengths))
        write = torch.cat([s[len(s) - n :] for s, n in zip(slots, extend_lens, strict=True)])
        masks: list[torch.Tensor | None] = []
        for s, n in zip(slots, extend_lens, strict=True):
            prefix = len(s) - n
            if n == 1 or prefix == 0:
                masks.append(None)
                continue
            query_pos = torch.arange(prefix, prefix + n, device=device)
            masks.append(torch.arange(len(s), device=device)[None, :] <= query_pos[:, None])
        offsets = [0]
        for n in extend_lens:
            offsets.append(offsets[-1] + n)
        decode = None
        singles = [i for i, n in enumerate(extend_lens) if n == 1]
        if len(singles) > 1 or (decode_kernel and singles):
            decode = _decode_gather(
                [host[i] for i in singles],
                frozenset(singles),
                torch.tensor([offsets[i] for i in singles], device=device),
                pool.page_size,
                decode_kernel,
            )
        extend = None
        multi = [i for i, n in enumerate(extend_lens) if n > 1]
        if extend_kernel and multi:
            extend = _extend_table(
                [host[i] for i in multi],
                [extend_lens[i] for i in multi],
                [offsets[i] for i in multi],
                frozenset(multi),
                pool.page_size,
                device,
            )
        return cls(
            pool=pool,
            seq_slots=slots,
            extend_lens=list(extend_lens),
            write_slots=write,
            masks=masks,
            decode=decode,
            layer_wait=layer_wait,
            swa=swa,
            extend=extend,
        )


def _page_table(
    slots: list[torch.Tensor], page_size: int, device: torch.device
) -> tuple[torch.Tensor, bool]:
    """``(index, by_page)``: the sequences' page ids ``(B, Pmax)`` right-padded with each
    one's last page when every sequence's slots lie over whole pages in order (``by_page``),
    else their slots ``(B, Lmax)`` right-padded with each one's last slot. ``slots`` are CPU
    tensors (the checks cost no device sync); ``index`` is moved to ``device`` once."""
    pages = [s[::page_size] // page_size for s in slots]
    offsets = torch.arange(page_size)
    by_page = all(
        s[0] % page_size == 0
        and torch.equal((p[:, None] * page_size + offsets).reshape(-1)[: len(s)], s)
        for s, p in zip(slots, pages, strict=True)
    )
    rows_of = pages if by_page else slots
    width = max(len(r) for r in rows_of)
    index = torch.stack([torch.cat((r, r[-1:].expand(width - len(r)))) for r in rows_of])
    return index.to(device), by_page


def _extend_table(
    slots: list[torch.Tensor],
    extend_lens: list[int],
    q_starts: list[int],
    seqs: frozenset[int],
    page_size: int,
    device: torch.device,
) -> ExtendTable:
    """The page (or slot) table and lengths of the multi-token sequences (``slots`` on
    CPU; the tables land on ``device``)."""
    index, by_page = _page_table(slots, page_size, device)
    lens = torch.tensor(
        [[len(s) - n for s, n in zip(slots, extend_lens, strict=True)], extend_lens, q_starts],
        dtype=torch.int64,
    ).to(device)  # one copy
    return ExtendTable(
        seqs=seqs,
        index=index,
        prefix_lens=lens[0],
        extend_lens=lens[1],
        q_starts=lens[2],
        max_extend=max(extend_lens),
        page_size=page_size if by_page else 1,
    )


def _decode_gather(
    slots: list[torch.Tensor],
    seqs: frozenset[int],
    rows: torch.Tensor,
    page_size: int,
    kernel: bool,
) -> DecodeGather:
    """The padded gather of single-token sequences (``slots`` on CPU, the tables on
    ``rows``' device); by page when their slots allow."""
    device = rows.device
    lengths = [int(s.shape[0]) for s in slots]
    index, by_page = _page_table(slots, page_size, device)
    keys = index.shape[1] * page_size if by_page else index.shape[1]
    valid = torch.tensor(lengths).to(device)
    mask = torch.arange(keys, device=device)[None, :] < valid[:, None]
    return DecodeGather(
        seqs=seqs,
        rows=rows,
        index=index,
        mask=mask[:, None, None, :],
        lengths=valid,
        by_page=by_page,
        page_size=page_size,
        kernel=kernel,
    )


class PagedAttention(nn.Module):
    """Multi-head (GQA) self-attention of one layer over the paged pool.

    Over a tensor-parallel group ``tp`` (default: one rank) the heads are split as
    :class:`~hicache.heads.HeadSplit` says (:attr:`heads`): this rank holds query heads
    ``[rank * Hq / size, ...)`` and the K/V heads they read, ``[rank * Hkv / size, ...)``
    while the K/V heads are at least as many as the ranks, else the one K/V head
    ``rank // (size / Hkv)``, replicated on ``size / Hkv`` ranks. ``q/k/v_proj`` are
    column-parallel by those head ranges (:class:`HeadParallelLinear`, whole heads) and
    ``o_proj`` row-parallel over the query heads, which keeps GQA's grouping local: local
    query head ``j`` reads local K/V head ``j // (local Hq / local Hkv)``.
    :attr:`num_heads` and :attr:`num_kv_heads` are the *local* counts, and the pool holds
    this rank's K/V heads only. Qwen3's per-head q/k norms are whole on every rank (one
    ``head_dim`` weight for all heads).
    """

    def __init__(self, cfg: DecoderConfig, layer_id: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp or TPGroup.single()
        self.layer_id = layer_id
        self.heads = HeadSplit(cfg.num_heads, cfg.num_kv_heads, tp.size, tp.rank)
        self.num_heads = self.heads.local_heads
        self.num_kv_heads = self.heads.local_kv_heads
        self.head_dim = d = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        h, qkv_bias = cfg.hidden_size, cfg.qkv_bias
        q_heads = (self.heads.first_head, self.num_heads)
        kv_heads = (self.heads.first_kv_head, self.num_kv_heads)
        self.q_proj = HeadParallelLinear(h, cfg.num_heads, d, q_heads, bias=qkv_bias, tp=tp)
        self.k_proj = HeadParallelLinear(h, cfg.num_kv_heads, d, kv_heads, bias=qkv_bias, tp=tp)
        self.v_proj = HeadParallelLinear(h, cfg.num_kv_heads, d, kv_heads, bias=qkv_bias, tp=tp)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, h, bias=cfg.o_bias, tp=tp)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """``x (T, hidden)``, ``cos``/``sin (T, head_dim)`` -> ``(T, hidden)``."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        k_cache = ctx.pool.k_buffer(self.layer_id)
        v_cache = ctx.pool.v_buffer(self.layer_id)
        k_cache[ctx.write_slots] = k.to(k_cache.dtype)
        v_cache[ctx.write_slots] = v.to(v_cache.dtype)
        if ctx.layer_wait is not None:
            ctx.layer_wait(self.layer_id)

        decode = ctx.decode
        if decode is not None and len(decode.seqs) == len(ctx.extend_lens):
            # a decode batch: its rows are every token, in order; no per-sequence pass
            out = self._attend_decode(q, k_cache, v_cache, decode)
        else:
            out = self._attend_each(q, k_cache, v_cache, ctx)
            if decode is not None:
                out[decode.rows] = self._attend_decode(q[decode.rows], k_cache, v_cache, decode)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """``q (..., Hq, n, D)``, ``k``/``v (..., Hkv, L, D)`` -> ``(..., Hq, n, D)``.

        ``is_causal`` aligns the causal mask top-left, so it is only right when ``n == L``.
        """
        return F.scaled_dot_product_attention(
            q,
            k.to(q.dtype),
            v.to(q.dtype),
            attn_mask=mask,
            is_causal=is_causal,
            scale=self.scale,
            enable_gqa=True,
        )

    def _attend_each(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """One SDPA call per sequence in neither ``ctx.decode`` nor ``ctx.extend``, and one
        extend-kernel launch for those in ``ctx.extend``; ``q (T, Hq, D)`` -> ``(T, Hq,
        D)`` (rows of the decode group are left for :meth:`_attend_decode`)."""
        out = torch.empty_like(q)
        skip = ctx.decode.seqs if ctx.decode is not None else frozenset()
        if ctx.extend is not None:
            from hicache.runner.kernels.extend_attention import paged_extend_attention

            ext = ctx.extend
            paged_extend_attention(
                q if q.stride(-1) == 1 else q.contiguous(),
                k_cache,
                v_cache,
                ext.index,
                ext.prefix_lens,
                ext.extend_lens,
                page_size=ext.page_size,
                scale=self.scale,
                q_starts=ext.q_starts,
                max_extend=ext.max_extend,
                out=out,
            )
            skip = skip | ext.seqs
        start = 0
        for i, (slots, n, mask) in enumerate(
            zip(ctx.seq_slots, ctx.extend_lens, ctx.masks, strict=True)
        ):
            if i in skip:
                start += n
                continue
            # 4-D (1, H, L, D): only then does torch pick its fused CPU kernel (with GQA);
            # 3-D inputs fall back to the math path, ~6x slower for a 1k-token prefill
            q_i = q[start : start + n].transpose(0, 1)[None]
            k_i = k_cache[slots].transpose(0, 1)[None]
            v_i = v_cache[slots].transpose(0, 1)[None]
            causal = mask is None and n > 1  # a prefill without prefix: L == n
            out[start : start + n] = self._sdpa(q_i, k_i, v_i, mask, causal)[0].transpose(0, 1)
            start += n
        return out

    def _attend_decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, gather: DecodeGather
    ) -> torch.Tensor:
        """One padded SDPA call (or one kernel launch) for B single-token queries;
        ``q (B, Hq, D)`` -> same."""
        if gather.kernel:
            from hicache.runner.kernels.decode_attention import paged_decode_attention

            return paged_decode_attention(
                q.contiguous(),
                k_cache,
                v_cache,
                gather.index,
                gather.lengths,
                page_size=gather.page_size if gather.by_page else 1,
                scale=self.scale,
            )
        if gather.by_page:  # page-sized blocks: far fewer, larger copies than per token
            b, ps, tail = gather.index.shape[0], gather.page_size, k_cache.shape[1:]
            k = k_cache.view(-1, ps, *tail)[gather.index].view(b, -1, *tail).transpose(1, 2)
            v = v_cache.view(-1, ps, *tail)[gather.index].view(b, -1, *tail).transpose(1, 2)
        else:
            k = k_cache[gather.index].transpose(1, 2)  # (B, Hkv, Lmax, D)
            v = v_cache[gather.index].transpose(1, 2)
        return self._sdpa(q[:, :, None, :], k, v, gather.mask)[:, :, 0, :]
