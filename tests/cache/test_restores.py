"""Restores at the facade: L3 -> L2 ahead of the request, held (host_ref) until released;
failures (no L3, a failing lookup) hold nothing and say why."""

from __future__ import annotations

import time

import torch

from hicache.cache import HiCache
from hicache.cache.report import cache_stats, check_integrity
from hicache.cache.request import CachedTokens
from hicache.cache.restores import NO_L3, Restore, RestoreStage
from hicache.config import CacheConfig, PrefetchConfig
from hicache.keys import Namespace
from hicache.storage.backends.memory import MemoryFaults, MemoryStorage, MemoryStore
from tests.cache.test_l3_cache import MHA, PAGE, TOKENS, fetch, make, put
from tests.helpers.kvdata import page_kv


def settle(cache: HiCache, r: Restore, timeout_s: float = 10.0) -> None:
    """Sync until ``r`` leaves LOADING."""
    deadline = time.monotonic() + timeout_s
    while not cache.restores.advance(r):
        assert time.monotonic() < deadline, "the restore did not settle"
        cache.sync()
        time.sleep(0.001)


def stored() -> MemoryStore:
    """A store holding TOKENS' pages, written by a cache closed since."""
    store = MemoryStore()
    with make(MHA, store) as a:
        put(a, TOKENS)
    return store


def held_refs(cache: HiCache) -> list[int]:
    node = cache.full.pages.tree.match_full(TOKENS).last_host_node
    refs = []
    while node.parent is not None:
        refs.append(node.host_ref)
        node = node.parent
    return refs


def test_a_restore_brings_the_prefix_into_l2_and_holds_it_until_released() -> None:
    store = stored()
    with make(MHA, store) as b:
        r = b.restores.start([*TOKENS, 7])  # the partial last page is not restored
        assert r.stage is RestoreStage.LOADING and r.tokens == TOKENS
        settle(b, r)
        assert r.stage is RestoreStage.HELD and r.error is None
        assert b.restores.resident(r) == CachedTokens(device=0, host=8, storage=8)
        assert held_refs(b) == [1]  # one node, pinned in L2
        check_integrity(b)
        b.restores.release(r)
        assert r.stage is RestoreStage.ENDED and held_refs(b) == [0]
        c = cache_stats(b).counters
        assert c["restores_total"] == 1 and c["restore_tokens_total"] == 8
        assert c["restore_failures_total"] == 0
        b.restores.release(r)  # idempotent
        got, data = fetch(b, [*TOKENS, 7])
        assert got == 0 and torch.equal(data, page_kv(b, TOKENS, 0, 4))  # from L2 now
        check_integrity(b)


def test_a_restore_of_a_prefix_held_locally_holds_it_at_once() -> None:
    with make(MHA, MemoryStore()) as a:
        put(a, TOKENS)
        r = a.restores.start(TOKENS)
        assert r.prefetch is None  # nothing to fetch
        assert a.restores.advance(r) and r.stage is RestoreStage.HELD
        assert a.restores.resident(r) == CachedTokens(device=8, host=8, storage=0)
        a.restores.release(r)
        check_integrity(a)


def test_a_restore_released_while_loading_leaves_what_arrived_cached_unpinned() -> None:
    store = stored()
    with make(MHA, store) as b:
        r = b.restores.start(TOKENS)
        b.restores.release(r)
        assert r.stage is RestoreStage.ENDED and r.node is None
        b.sync(wait=True)
        assert all(n.host_ref == 0 for n in b.full.pages.tree.iter_nodes())
        check_integrity(b)


def test_a_restore_without_l3_fails_and_holds_nothing() -> None:
    cfg = CacheConfig(page_size=PAGE, device_tokens=16, hicache_ratio=2.0)
    with HiCache(cfg, MHA).start() as cache:
        r = cache.restores.start(TOKENS)
        assert r.stage is RestoreStage.FAILED and r.error == NO_L3
        assert not cache.restores.advance(r)
        cache.restores.release(r)
        assert r.stage is RestoreStage.FAILED


def test_a_failing_lookup_fails_the_restore_with_the_backends_reason() -> None:
    store = stored()
    with make(MHA, store) as b:
        storage = b.l3.attached.controller.storage  # type: ignore[union-attr]
        assert isinstance(storage, MemoryStorage)
        storage.set_faults(MemoryFaults(fail_after=0))
        r = b.restores.start(TOKENS)
        settle(b, r)
        assert r.stage is RestoreStage.FAILED and r.node is None
        assert r.error is not None and "injected failure" in r.error
        assert cache_stats(b).counters["restore_failures_total"] == 1
        assert all(n.host_ref == 0 for n in b.full.pages.tree.iter_nodes())
        check_integrity(b)


def test_a_detach_under_a_loading_restore_fails_it() -> None:
    store = stored()
    with make(MHA, store) as b:
        r = b.restores.start(TOKENS)
        b.l3.detach()
        assert b.restores.advance(r) and r.stage is RestoreStage.FAILED
        assert r.error is not None and "detached" in r.error
        b.restores.release(r)
        assert all(n.host_ref == 0 for n in b.full.pages.tree.iter_nodes())


def test_a_restore_reads_a_hit_under_the_prefetch_threshold() -> None:
    store = stored()
    cfg = CacheConfig(page_size=PAGE, device_tokens=16, hicache_ratio=2.0, load_back_threshold=0)
    with HiCache(cfg, MHA).start() as b:
        ns = Namespace.for_spec(
            MHA, model="m", weights_fingerprint="w", layout=cfg.mem_layout, page_size=PAGE
        )
        prefetch = PrefetchConfig(policy="wait_complete", prefetch_threshold=100)
        b.l3.attach(MemoryStorage(ns, store=store), ns, prefetch)
        r = b.restores.start(TOKENS)
        settle(b, r)
        assert b.restores.resident(r) == CachedTokens(device=0, host=8, storage=8)
        b.restores.release(r)
        check_integrity(b)


def test_a_held_prefix_goes_on_into_l1_only_within_the_spare_pages() -> None:
    store = stored()
    with make(MHA, store) as b:
        r = b.restores.start(TOKENS)
        settle(b, r)
        assert b.restores.load_to_l1(r, spare_pages=3) == 0  # 4 pages needed
        assert b.restores.resident(r) == CachedTokens(device=0, host=8, storage=8)
        free = b.full.pages.device.allocator.free_pages
        assert b.restores.load_to_l1(r, spare_pages=4) == 8
        assert cache_stats(b).counters["restore_l1_tokens_total"] == 8
        assert b.full.pages.device.allocator.free_pages == free - 4  # nothing evicted
        assert b.restores.resident(r) == CachedTokens(device=8, host=8, storage=8)
        b.sync(wait=True)  # the copy lands and unpins
        b.restores.release(r)
        assert all(n.lock_ref == 0 and n.host_ref == 0 for n in b.full.pages.tree.iter_nodes())
        got, data = fetch(b, [*TOKENS, 7])
        assert got == 0 and torch.equal(data, page_kv(b, TOKENS, 0, 4))  # the bytes in L1
        check_integrity(b)
