"""Exact-state tests of the HiCache facade on CPU: write policies, eviction, load back."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from hicache.cache import HiCache
from hicache.cache.report import cache_stats, check_integrity
from hicache.config import CacheConfig, WritePolicy
from hicache.spec import KVSpec
from tests.helpers.kvdata import page_kv, read_device, serve

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")


def make_cache(**overrides: object) -> HiCache:
    cfg: dict[str, object] = dict(
        page_size=2, device_tokens=8, hicache_ratio=2.0, load_back_threshold=0
    )
    cfg.update(overrides)
    return HiCache(CacheConfig(**cfg), SPEC).start()  # type: ignore[arg-type]


@pytest.fixture
def cache() -> Iterator[HiCache]:
    c = make_cache()
    yield c
    c.close()


def run_request(cache: HiCache, tokens: list[int]) -> tuple[int, int]:
    """Drive one request as an engine would; returns (device hit, host hit) tokens."""
    req = serve(cache, tokens)
    assert req is not None
    return req.cached.device, req.cached.host


def test_write_through_backs_up_on_insert(cache: HiCache) -> None:
    run_request(cache, [1, 2, 3, 4])
    cache.sync(wait=True)
    (node,) = cache.full.pages.tree.iter_nodes()
    assert list(node.device) == [0, 1] and list(node.host) == [0, 1]
    assert node.lock_ref == 0
    c = cache_stats(cache).counters
    assert c["backup_tokens_total"] == 4 and c["backup_ops_total"] == 1
    assert c["backup_bytes_total"] == 4 * SPEC.token_bytes
    host = cache.full.pages.host_pool
    assert host is not None
    assert torch.equal(host.read_pages(torch.tensor([0, 1])), page_kv(cache, [1, 2, 3, 4], 0, 2))
    check_integrity(cache)


def test_write_through_selective_waits_for_threshold() -> None:
    with make_cache(write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE) as cache:
        run_request(cache, [1, 2, 3, 4])
        cache.sync(wait=True)
        (node,) = cache.full.pages.tree.iter_nodes()
        assert node.host is None and node.hit_count == 1
        run_request(cache, [1, 2, 3, 4])
        cache.sync(wait=True)
        assert node.hit_count == 2 and list(node.host) == [0, 1]
        check_integrity(cache)


def test_write_back_backs_up_only_on_eviction() -> None:
    with make_cache(write_policy="write_back") as cache:
        run_request(cache, [1, 2, 3, 4])
        cache.sync(wait=True)
        (node,) = cache.full.pages.tree.iter_nodes()
        assert node.host is None
        assert cache.full.pages.evict_device(2) == 2
        assert node.device is None and list(node.host) == [0, 1]
        c = cache_stats(cache).counters
        assert c["backup_tokens_total"] == 4 and c["device_demoted_tokens_total"] == 4
        assert cache.full.pages.host_pool is not None
        assert torch.equal(
            cache.full.pages.host_pool.read_pages(torch.tensor([0, 1])),
            page_kv(cache, [1, 2, 3, 4], 0, 2),
        )
        check_integrity(cache)


def test_load_back_restores_bytes_after_demotion(cache: HiCache) -> None:
    tokens = [5, 6, 7, 8, 9, 10]
    run_request(cache, tokens)
    cache.sync(wait=True)
    assert cache.full.pages.evict_device(4) == 3
    m = cache.full.pages.match_prefix([*tokens, 11])
    assert (m.device_tokens, m.host_tokens) == (0, 6)
    req = cache.open([*tokens, 11])
    assert cache.admit(req, [*tokens, 11])
    assert req.cached.host == 6 and req.prefix_tokens == 6 and len(req.pages) == 4
    assert all(req.wait_layer(i, 10) for i in range(SPEC.num_layers))
    assert torch.equal(read_device(cache, req.pages[:3]), page_kv(cache, tokens, 0, 3))
    cache.release(req)
    cache.sync(wait=True)
    st = cache_stats(cache)
    assert st.counters["load_tokens_total"] == 6 and st.counters["host_hit_tokens_total"] == 6
    assert st.device_cached_tokens == 6 and st.host_only_tokens == 0
    assert st.hit_rate == pytest.approx(6 / 13)  # the first request queried 6, hit 0
    check_integrity(cache)


def test_max_load_restores_whole_pages_up_to_the_cap_and_l1_is_free(cache: HiCache) -> None:
    """``max_load``: at most that many tokens come back from L2 (floored to a page; the
    node is split there), the rest is recomputed; what L1 holds does not count."""
    tokens = [5, 6, 7, 8, 9, 10]
    run_request(cache, tokens)
    cache.sync(wait=True)
    assert cache.full.pages.evict_device(4) == 3  # all 6 tokens in L2 only
    req = cache.open([*tokens, 11], max_load=3)
    assert cache.admit(req, [*tokens, 11])
    assert (req.cached.device, req.cached.host) == (0, 2) and req.prefix_tokens == 2
    assert all(req.wait_layer(i, 10) for i in range(SPEC.num_layers))
    assert torch.equal(read_device(cache, req.pages[:1]), page_kv(cache, tokens, 0, 1))
    cache.release(req)
    cache.sync(wait=True)
    assert cache_stats(cache).counters["load_tokens_total"] == 2
    req = cache.open([*tokens, 11], max_load=2)  # [5, 6] in L1 now: 2 more from L2
    assert cache.admit(req, [*tokens, 11])
    assert (req.cached.device, req.cached.host) == (2, 2)
    assert all(req.wait_layer(i, 10) for i in range(SPEC.num_layers))
    cache.release(req)
    req = cache.open([*tokens, 11], max_load=0)  # L1 alone: [5, 6, 7, 8]
    assert cache.admit(req, [*tokens, 11])
    assert (req.cached.device, req.cached.host) == (4, 0)
    cache.release(req)
    cache.sync(wait=True)
    with pytest.raises(ValueError, match="max_load=-1 is invalid"):
        cache.open(tokens, max_load=-1)
    check_integrity(cache)


def test_load_back_threshold_and_all_or_nothing() -> None:
    with make_cache(load_back_threshold=6) as cache:
        run_request(cache, [1, 2, 3, 4])
        cache.sync(wait=True)
        cache.full.pages.evict_device(2)
        req = cache.open([1, 2, 3, 4], compute_last=False)
        assert cache.admit(req, [1, 2, 3, 4])
        assert req.cached.host == 0 and req.prefix_pages == 0  # 4 < 6 tokens: recompute
        assert cache_stats(cache).counters["load_skipped_tokens_total"] == 4
        cache.release(req)
        check_integrity(cache)
    with make_cache() as cache:
        run_request(cache, [1, 2, 3, 4, 5, 6])
        cache.sync(wait=True)
        cache.full.pages.evict_device(3)
        pinned = cache.full.pages.alloc(2)  # L1 has 4 pages: 2 left, the chain needs 3
        assert pinned is not None
        req = cache.open([1, 2, 3, 4, 5, 6], compute_last=False)
        assert not cache.admit(req, [1, 2, 3, 4, 5, 6])  # no room: nothing loaded or held
        (node,) = cache.full.pages.tree.iter_nodes()
        assert node.device is None and node.host_ref == 0 and node.lock_ref == 0
        check_integrity(cache, request_pages=pinned)


def test_alloc_evicts_lru_and_host_eviction_makes_room() -> None:
    with make_cache(hicache_ratio=1.5) as cache:  # L1: 4 pages, L2: 6 pages
        run_request(cache, [1, 1, 1, 1])  # A: 2 pages
        run_request(cache, [2, 2, 2, 2])  # B: 2 pages
        cache.sync(wait=True)
        run_request(cache, [3, 3, 3, 3])  # C needs 2 pages: A (LRU) demoted
        cache.sync(wait=True)
        tiers = {
            n.key[:4]: (n.device is not None, n.host is not None)
            for n in cache.full.pages.tree.iter_nodes()
        }
        assert tiers == {
            bytes([1, 0, 0, 0]): (False, True),
            bytes([2, 0, 0, 0]): (True, True),
            bytes([3, 0, 0, 0]): (True, True),
        }
        run_request(cache, [4, 4, 4, 4])  # L1: B demoted; L2 full: A dropped from L2
        cache.sync(wait=True)
        st = cache_stats(cache)
        assert st.counters["host_evicted_tokens_total"] == 4
        assert cache.full.pages.match_prefix([1, 1, 1, 1]).matched_tokens == 0
        assert cache.full.pages.match_prefix([2, 2, 2, 2]).host_tokens == 4
        check_integrity(cache)


def test_reset_empties_l1_and_l2(cache: HiCache) -> None:
    run_request(cache, [1, 2, 3, 4])
    held = serve(cache, [1, 2, 3, 4], hold=True)
    assert held is not None
    with pytest.raises(RuntimeError, match="hold prefixes"):
        cache.reset()
    cache.release(held)
    cache.reset()
    st = cache_stats(cache)
    assert st.nodes == 0 and st.device_free_tokens == 8 and st.host_free_tokens == 16
    check_integrity(cache)


def test_plain_radix_cache_without_host_tier() -> None:
    with make_cache(enable_hierarchical_cache=False) as cache:
        assert cache.full.pages.host_pool is None
        run_request(cache, [1, 2, 3, 4])
        assert cache.full.pages.evict_device(2) == 2
        assert cache_stats(cache).counters["device_evicted_tokens_total"] == 4
        assert cache.full.pages.tree.stats().nodes == 0
        check_integrity(cache)


def test_integrity_detects_a_leak(cache: HiCache) -> None:
    run_request(cache, [1, 2, 3, 4])
    leaked = cache.full.pages.alloc(1)
    assert leaked is not None
    with pytest.raises(AssertionError, match="leak"):
        check_integrity(cache)
    check_integrity(cache, request_pages=leaked)


def test_full_l2_drops_copies_of_l1_resident_spans_for_new_backups() -> None:
    # L1: 8 pages; L2: 6 pages (64 bytes each) - three 2-page prompts fill L2 with copies
    page_gb = 2 * SPEC.token_bytes / 1e9
    with make_cache(device_tokens=16, hicache_size=6 * page_gb) as cache:
        assert cache.full.pages.host_pool is not None and cache.full.pages.host_pool.num_pages == 6
        for first in (1, 2, 3):
            run_request(cache, [first] * 4)
            cache.sync(wait=True)
        assert cache_stats(cache).host_free_tokens == 0
        run_request(cache, [4] * 4)  # L1 has room; its backup needs L2 pages
        cache.sync(wait=True)
        tiers = {
            n.key[0]: (n.device is not None, n.host is not None)
            for n in cache.full.pages.tree.iter_nodes()
        }
        # no L2-only leaf to evict: the LRU copy of a span still in L1 (prompt 1) went
        assert tiers == {1: (True, False), 2: (True, True), 3: (True, True), 4: (True, True)}
        assert cache_stats(cache).counters["host_evicted_tokens_total"] == 4
        check_integrity(cache)
