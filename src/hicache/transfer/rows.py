"""Row views of pool buffers and row ids, for index-based (gather/scatter) copies.

Every pool buffer is contiguous, so it is also a 2-D matrix of *rows*, one row being the
``H x D`` values of one (kind, layer, token), reinterpreted as integer words (copying words
copies bytes exactly). Row ids per layout (K kinds, L layers, S token slots, P pages of
``ps`` tokens; token ``t`` is in page ``t // ps`` at offset ``t % ps``):

- ``layer_first`` ``(K, L, S, H, D)``: ``(k * L + l) * S + t``
- ``page_first`` ``(K, S, L, H, D)``: ``(k * S + t) * L + l``
- ``page_first_direct`` ``(K, P, L, ps, H, D)``: ``((k * P + t // ps) * L + l) * ps + t % ps``

A copy is then ``dst_rows.index_copy_(0, dst_ids, src_rows.index_select(0, src_ids))``,
torch's fast path for contiguous 2-D tensors on both CPU and CUDA.
"""

from __future__ import annotations

import torch

from hicache.config import MemLayout
from hicache.memory.base import KVPool, row_words

__all__ = ["row_ids", "rows", "word_dtype"]


def word_dtype(pool: KVPool) -> torch.dtype:
    """The widest integer word dividing a row's bytes (int64 for any even head size)."""
    row_bytes = pool.spec.heads * pool.spec.dim * pool.spec.dtype_bytes
    for word in (torch.int64, torch.int32):
        if row_bytes % word.itemsize == 0:
            return word
    return torch.int16


def rows(pool: KVPool, word: torch.dtype | None = None) -> torch.Tensor:
    """``pool.buffer`` as a 2-D ``(rows, words per row)`` view (a view, not a copy)."""
    w = row_words(pool.buffer, word or word_dtype(pool))
    return w.view(-1, w.shape[-1])


def row_ids(pool: KVPool, k: torch.Tensor, layer: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """Row ids of (kind, layer, token slot) in ``pool``; the three broadcast together."""
    nl, s = pool.spec.num_layers, pool.size_tokens
    layout = pool.layout
    if layout is MemLayout.LAYER_FIRST:
        return (k * nl + layer) * s + tok
    if layout is MemLayout.PAGE_FIRST:
        return (k * s + tok) * nl + layer
    ps = pool.page_size
    return ((k * pool.num_pages + tok // ps) * nl + layer) * ps + tok % ps
