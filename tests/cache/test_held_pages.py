"""What an admitted request holds in L1, store by store (``held_pages``): the seam a
transfer of a request's KV to another instance iterates. Tiny sizes, exact state: the
held pages are the pages the forward's slots point at, and copying each store's held
pages from one cache into another's moves the request's KV position by position."""

from __future__ import annotations

import pytest
import torch

from hicache.cache import HiCache
from hicache.cache.held import held_pages
from hicache.cache.request import CacheRequest, page_slots
from hicache.config import CacheConfig
from hicache.spec import CacheSpec, IndexerSpec, KVSpec, SlidingWindowSpec

FULL = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32")
SWA = SlidingWindowSpec(kv=KVSpec(num_layers=2, num_kv_heads=1, head_dim=2), window=4)
INDEXER = IndexerSpec(num_layers=2, index_head_dim=3)
PAGE = 2
PROMPT = list(range(100, 117))  # 17 tokens: 9 pages
OTHER = list(range(500, 511))  # 11 tokens: 6 pages


def make() -> HiCache:
    config = CacheConfig(
        page_size=PAGE, device_tokens=64, hicache_ratio=2.0, swa_full_tokens_ratio=0.5
    )
    return HiCache(config, CacheSpec(kv=FULL, components=(SWA, INDEXER))).start()


def admitted(cache: HiCache, tokens: list[int]) -> CacheRequest:
    req = cache.open(tokens)
    cache.sync()
    assert cache.admit(req, tokens)
    assert cache.grow(req, len(tokens), computed=0)
    return req


def slots_of(cache: HiCache, req: CacheRequest, name: str, upto: int) -> torch.Tensor:
    """The forward's slots of ``req`` in store ``name``'s pool, up to ``upto``."""
    return req.slots(PAGE, upto) if name == "full" else req.pool_slots(PAGE, upto)[name]


def pool_of(cache: HiCache, name: str) -> torch.Tensor:
    """Store ``name``'s L1 buffer, ``(K, L, slots, H, D)``."""
    if name == "full":
        return cache.full.pages.device_pool.buffer
    store = cache.stores.get(name)
    assert store is not None
    pool = store.device_pool
    assert isinstance(pool.buffer, torch.Tensor)
    return pool.buffer


def test_each_store_holds_the_pages_the_forward_writes() -> None:
    with make() as cache:
        req = admitted(cache, PROMPT)
        held = held_pages(cache, req)
        assert [h.name for h in held] == ["full", "swa", "indexer"]
        n = len(PROMPT)
        for h in held:
            got = page_slots(h.pages, PAGE, n - h.first * PAGE)
            assert torch.equal(got, slots_of(cache, req, h.name, n)), h.name
        full, swa, indexer = held
        assert list(indexer.pages) == list(full.pages)  # the keys live on the KV's page ids
        assert swa.first == 0  # the prefill's forward reads the whole prompt
        cache.commit(req, PROMPT)
        assert cache.grow(req, n + 1, computed=n)  # a decode step reads the window only
        held = held_pages(cache, req)
        for h in held:
            got = page_slots(h.pages, PAGE, n + 1 - h.first * PAGE)
            assert torch.equal(got, slots_of(cache, req, h.name, n + 1)), h.name
        assert held[1].first > 0  # the window's fallen-out pages are not held
        cache.release(req, commit=False)


def test_copying_every_store_s_held_pages_moves_the_request_s_kv() -> None:
    with make() as src, make() as dst:
        taken = admitted(dst, OTHER)  # the receiver's page ids differ from the sender's
        a = admitted(src, PROMPT)
        n = len(PROMPT)
        for i, h in enumerate(held_pages(src, a)):
            data = h.read()
            h.write(torch.arange(data.numel(), dtype=data.dtype).reshape(data.shape) + 1000 * i)
        b = admitted(dst, PROMPT)
        sent, into = held_pages(src, a), held_pages(dst, b)
        assert [(h.name, h.first) for h in sent] == [(h.name, h.first) for h in into]
        assert list(sent[0].pages) != list(into[0].pages)
        for s, d in zip(sent, into, strict=True):
            d.write(s.read())
        for s in sent:
            theirs = pool_of(src, s.name)[:, :, slots_of(src, a, s.name, n)]
            ours = pool_of(dst, s.name)[:, :, slots_of(dst, b, s.name, n)]
            assert torch.equal(theirs, ours), s.name
        for cache, req in ((src, a), (dst, b), (dst, taken)):
            cache.release(req, commit=False)


def test_a_request_not_admitted_holds_nothing() -> None:
    with make() as cache:
        req = cache.open(PROMPT)
        with pytest.raises(RuntimeError, match="not admitted"):
            held_pages(cache, req)
        cache.release(req)
