"""One forward's work: the :class:`Chunk` of each request in it, and the runner's inputs
they make (:func:`forward_batch`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.engine.request import Request
from hicache.runner.model_runner import ForwardBatch


@dataclass(frozen=True, slots=True)
class Chunk:
    """One request's part of a forward: ``tokens`` new positions from ``req.kv_len``, and
    after which of them the runner keeps the sequence's extras (``keep``: the cache's
    chunk plan, asked once when the batch is built)."""

    req: Request
    tokens: int
    keep: tuple[int, ...] = ()


def forward_batch(batch: list[Chunk], page_size: int, layer_wait_timeout_s: float) -> ForwardBatch:
    """The runner's inputs for ``batch`` (pages of ``page_size`` tokens): new token ids
    and positions, each sequence's L1 slots and its slots in every other pool the cache
    keeps for it, the positions where the runner keeps per-request extras (each chunk's
    plan), and a layer wait (at most ``layer_wait_timeout_s`` per layer) for the requests
    whose prefix is still being loaded back."""
    ps = page_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[torch.Tensor] = []
    pool_slots: dict[str, list[torch.Tensor]] = {}  # per component pool the model uses
    loading = []
    keep: list[tuple[int, ...]] = []
    for chunk in batch:
        req, n = chunk.req, chunk.tokens
        assert req.cache is not None
        ids += req.all_ids[req.kv_len : req.kv_len + n]
        positions += range(req.kv_len, req.kv_len + n)
        slots.append(req.cache.slots(ps, req.kv_len + n))
        for name, table in req.cache.pool_slots(ps, req.kv_len + n).items():
            pool_slots.setdefault(name, []).append(table)
        keep.append(chunk.keep)
        if req.cache.loading:
            loading.append(req.cache)
    timeout = layer_wait_timeout_s  # the longest wait for one layer

    def layer_wait(layer: int) -> None:
        for handle in loading:
            handle.wait_layer(layer, timeout)  # False: the request fails later

    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        extend_lens=[chunk.tokens for chunk in batch],
        seq_slots=slots,
        layer_wait=layer_wait if loading else None,
        seq_ids=[chunk.req.rid for chunk in batch],
        pool_slots=pool_slots or None,
        keep=keep if any(keep) else None,
    )


__all__ = ["Chunk", "forward_batch"]
