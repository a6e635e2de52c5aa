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

import torch
from hypothesis import HealthCheck, settings

from hicache.cache import CacheRequest, HiCache
from hicache.cache.components.indexer import INDEXER
from hicache.spec import CacheSpec, IndexerSpec
from tests.cache.test_cache_property import PAGE, SPEC, CacheMachine
from tests.cache.test_load_faults_property import LoadFaultMachine
from tests.helpers.indexer_keys import keys_buffer, token_key
from tests.helpers.kvdata import compute, wait_ready

KEYS = IndexerSpec(num_layers=2, index_head_dim=3)


def serve_with_keys(
    cache: HiCache, tokens: list[int], *, tenant: str = "", priority: int = 0, hold: bool = False
) -> CacheRequest | None:
    """``tests.helpers.kvdata.serve`` with the indexer's keys: check the cached prefix's KV
    and keys, write both for the rest, commit."""
    req = cache.open(tokens, tenant=tenant, priority=priority, compute_last=False)
    wait_ready(cache, req)
    if not cache.admit(req, tokens):
        cache.release(req)
        return None
    compute(cache, req, tokens)  # the KV: the prefix checked, the rest written
    buf = keys_buffer(cache)
    slots = req.pool_slots(PAGE, len(req.pages) * PAGE)[INDEXER]
    for pos in range(req.prefix_tokens):
        assert torch.equal(buf[:, int(slots[pos])], token_key(KEYS, tokens, pos)), (
            f"the indexer keys of cached position {pos} came back with other bytes"
        )
    full = len(tokens) // cache.context.page_size
    for pos in range(req.prefix_tokens, full * PAGE):
        buf[:, int(slots[pos])] = token_key(KEYS, tokens, pos)
    cache.commit(req, tokens)
    if not hold:
        cache.release(req)
    return req


class IndexerCacheMachine(CacheMachine):
    """:class:`CacheMachine` over the indexer's cache; every request checks and writes the
    keys beside the KV (:func:`serve_with_keys`)."""

    def cache_spec(self) -> CacheSpec:
        return CacheSpec(kv=SPEC, components=(KEYS,))

    def serve(
        self, tokens: list[int], *, tenant: str = "", priority: int = 0, hold: bool = False
    ) -> CacheRequest | None:
        return serve_with_keys(self.c, tokens, tenant=tenant, priority=priority, hold=hold)


IndexerCacheMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIndexerCacheMachine = IndexerCacheMachine.TestCase


class IndexerLoadFaultMachine(LoadFaultMachine):
    """:class:`LoadFaultMachine` over the indexer's cache (the KV alone is written: the
    check is that the indexer's ids follow the full KV's through every fault)."""

    def cache_spec(self) -> CacheSpec:
        return CacheSpec(kv=SPEC, components=(KEYS,))


IndexerLoadFaultMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIndexerLoadFaultMachine = IndexerLoadFaultMachine.TestCase
