"""The DSA indexer's keys as the cache tests write and check them: each position's keys
derive from its token prefix, so a cached prefix's keys can be checked byte for byte on
any rank and after any tier walk.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from hicache.cache import HiCache
from hicache.cache.components import IndexerStore
from hicache.spec import IndexerSpec


def token_key(spec: IndexerSpec, tokens: Sequence[int], pos: int) -> torch.Tensor:
    """The keys ``(spec.num_layers, 1, spec.index_head_dim)`` of ``tokens[pos]`` given its
    prefix (fp32, seeded from a hash of ``tokens[: pos + 1]``)."""
    digest = hashlib.sha256(repr(["indexer", *tokens[: pos + 1]]).encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return torch.randn((spec.num_layers, 1, spec.index_head_dim), generator=gen)


def keys_buffer(cache: HiCache) -> torch.Tensor:
    """The indexer's L1 buffer ``(layers, slots, 1, index_head_dim)`` (the cache must
    have the indexer component)."""
    store = cache.stores.of_type(IndexerStore)
    assert store is not None, "the cache has no indexer component"
    return store.device_pool.buffer[0]
