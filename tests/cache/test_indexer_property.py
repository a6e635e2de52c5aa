"""Property test: the cache state machine of ``test_cache_property`` with the DSA indexer.

The same random sequences of verbs, evictions, flushes and resets (every write policy,
eviction policy, copy backend and host layout, with or without L3), over a model that also
caches indexer keys on the full KV's page ids. Every request writes the keys of the
positions it computes beside their KV; after each step the cache passes
``check_integrity`` (the indexer's ids in each tier are the full KV's there), and every
cached prefix comes back with the exact KV and the exact keys of its tokens.

And the load-fault machine of ``test_load_faults_property`` (loads and backups failing at
random under L1 pressure, requests sharing pages still loading) over the same model: after
every step the indexer's ids still are the full KV's in each tier (a failed load takes the
keys out of L1 with the KV, a failed backup drops their L2 copies with the KV's).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from hicache.cache import CacheRequest, HiCache
from hicache.cache.components import IndexerStore
from hicache.cache.components.indexer import INDEXER
from hicache.config import CacheConfig, CacheSpec, IndexerSpec, PrefetchConfig
from hicache.keys import Namespace
from hicache.storage.backends.memory import MemoryStorage, MemoryStore
from tests.cache.test_cache_property import PAGE, SPEC, CacheMachine, sequences
from tests.cache.test_load_faults_property import LoadFaultMachine
from tests.helpers.kvdata import FailingBackups, page_kv, read_device, write_tokens

KEYS = IndexerSpec(num_layers=2, index_head_dim=3)


def token_key(tokens: Sequence[int], pos: int) -> torch.Tensor:
    """The keys ``(layers, 1, index_head_dim)`` of ``tokens[pos]`` given its prefix."""
    digest = hashlib.sha256(repr(["indexer", *tokens[: pos + 1]]).encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return torch.randn((KEYS.num_layers, 1, KEYS.index_head_dim), generator=gen)


def keys_buffer(cache: HiCache) -> torch.Tensor:
    store = cache.store(IndexerStore)
    assert store is not None
    return store.device_pool.buffer[0]  # (L, S, 1, D)


def serve_with_keys(
    cache: HiCache, tokens: list[int], *, tenant: str = "", priority: int = 0, hold: bool = False
) -> CacheRequest | None:
    """``tests.helpers.kvdata.serve`` with the indexer's keys: check the cached prefix's KV
    and keys, write both for the rest, commit."""
    req = cache.open(tokens, tenant=tenant, priority=priority, compute_last=False)
    end = time.monotonic() + 10.0
    while not cache.ready(req):
        assert time.monotonic() < end, "the prefetch policy never let the request in"
        time.sleep(0.0005)
    if not cache.admit(req, tokens):
        cache.release(req)
        return None
    for layer in range(cache.spec.num_layers):
        assert req.wait_layer(layer, 10.0), req.failed
    prefix = req.pages[: req.prefix_pages]
    assert read_device(cache, prefix).equal(page_kv(cache, tokens, 0, len(prefix)))
    buf = keys_buffer(cache)
    slots = req.pool_slots(PAGE, len(req.pages) * PAGE)[INDEXER]
    for pos in range(req.prefix_tokens):
        assert torch.equal(buf[:, int(slots[pos])], token_key(tokens, pos)), (
            f"the indexer keys of cached position {pos} came back with other bytes"
        )
    full = len(tokens) // cache.page_size
    write_tokens(cache, tokens, req.pages[req.prefix_pages : full], req.prefix_pages)
    for pos in range(req.prefix_tokens, full * PAGE):
        buf[:, int(slots[pos])] = token_key(tokens, pos)
    cache.commit(req, tokens)
    if not hold:
        cache.release(req)
    return req


class IndexerCacheMachine(CacheMachine):
    @initialize(
        policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        eviction=st.sampled_from(["lru", "lfu", "fifo", "priority"]),
        io=st.sampled_from(["direct", "kernel"]),
        layout=st.sampled_from(["layer_first", "page_first", "page_first_direct"]),
        l3=st.booleans(),
    )
    def setup(self, policy: str, eviction: str, io: str, layout: str, l3: bool) -> None:
        cfg = CacheConfig(
            page_size=PAGE,
            device_tokens=8 * PAGE,
            hicache_ratio=2.0,
            write_policy=policy,  # type: ignore[arg-type]
            eviction_policy=eviction,  # type: ignore[arg-type]
            io_backend=io,  # type: ignore[arg-type]
            mem_layout=layout,  # type: ignore[arg-type]
            load_back_threshold=0,
        )
        self.cache = HiCache(cfg, CacheSpec(kv=SPEC, components=(KEYS,))).start()
        if l3:
            ns = Namespace.for_spec(
                SPEC, model="m", weights_fingerprint="w", layout=layout, page_size=PAGE
            )
            prefetch = PrefetchConfig(policy="wait_complete", prefetch_threshold=0)
            self.cache.attach_storage(MemoryStorage(ns, store=MemoryStore()), ns, prefetch)

    @rule(
        tokens=sequences,
        hold=st.booleans(),
        priority=st.integers(0, 2),
        tenant=st.sampled_from(["", "", "t1"]),
    )
    def request(self, tokens: list[int], hold: bool, priority: int, tenant: str) -> None:
        req = serve_with_keys(self.c, tokens, tenant=tenant, priority=priority, hold=hold)
        if req is None:
            return
        self.known.append((tokens, tenant))
        if hold:
            self.held.append(req)

    @rule(i=st.integers(0, 1000))
    def read_back(self, i: int) -> None:
        if not self.known:
            return
        tokens, tenant = self.known[i % len(self.known)]
        serve_with_keys(self.c, tokens, tenant=tenant)


IndexerCacheMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIndexerCacheMachine = IndexerCacheMachine.TestCase


class IndexerLoadFaultMachine(LoadFaultMachine):
    @initialize(
        policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        io=st.sampled_from(["direct", "kernel"]),
        first=st.lists(sequences, min_size=1, max_size=3),
    )
    def setup(self, policy: str, io: str, first: list[list[int]]) -> None:
        cfg = CacheConfig(
            page_size=PAGE,
            device_tokens=8 * PAGE,
            hicache_ratio=2.0,
            write_policy=policy,  # type: ignore[arg-type]
            io_backend=io,  # type: ignore[arg-type]
            load_back_threshold=0,
        )
        spec = CacheSpec(kv=SPEC, components=(KEYS,))
        self.cache = HiCache(cfg, spec, layer_hook=self.loads, wait_timeout_s=10.0).start()
        assert self.cache.host is not None
        engine = self.cache.host.controller._engine
        self.backups = FailingBackups(engine.copier)
        engine.copier = self.backups  # type: ignore[assignment]
        for tokens in first:
            self.request(tokens)


IndexerLoadFaultMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIndexerLoadFaultMachine = IndexerLoadFaultMachine.TestCase
