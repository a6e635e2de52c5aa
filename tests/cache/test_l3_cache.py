"""L3 at the facade: backup of every span reaching L2, prefetch into an L2-only leaf,
private (salted) spans (rank agreement with real processes: test_ranks.py)."""

from __future__ import annotations

import torch

from hicache.cache import HiCache
from hicache.cache.report import cache_stats, check_integrity
from hicache.config import CacheConfig, PrefetchConfig
from hicache.keys import Namespace
from hicache.spec import KVSpec
from hicache.storage.backends.memory import MemoryStorage, MemoryStore
from tests.helpers.kvdata import page_kv, read_device, serve, write_tokens

MHA = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
PAGE = 2


def make(spec: KVSpec, store: MemoryStore) -> HiCache:
    cfg = CacheConfig(page_size=PAGE, device_tokens=16, hicache_ratio=2.0, load_back_threshold=0)
    cache = HiCache(cfg, spec).start()
    ns = Namespace.for_spec(
        spec, model="m", weights_fingerprint="w", layout=cfg.mem_layout, page_size=PAGE
    )
    prefetch = PrefetchConfig(policy="wait_complete", prefetch_threshold=0)
    cache.l3.attach(MemoryStorage(ns, store=store), ns, prefetch)
    return cache


def put(cache: HiCache, tokens: list[int], *, tenant: str = "") -> None:
    pages = cache.full.pages.alloc(len(tokens) // PAGE)
    assert pages is not None
    write_tokens(cache, tokens, pages, 0)
    cache.full.pages.insert(tokens, pages, tenant=tenant)
    cache.sync(wait=True)


def fetch(cache: HiCache, tokens: list[int], tenant: str = "") -> tuple[int, torch.Tensor]:
    """Prefetch + load back ``tokens``; returns (tokens from L3, their L1 bytes)."""
    req = serve(cache, tokens, tenant=tenant, hold=True)
    assert req is not None
    data = read_device(cache, req.pages[: req.cached.total // PAGE])  # the cached prefix
    got = req.cached.storage
    cache.release(req)
    cache.sync(wait=True)
    return got, data


TOKENS = [3, 1, 4, 1, 5, 9, 2, 6]


def test_backup_then_prefetch_into_a_fresh_cache_is_byte_exact() -> None:
    store = MemoryStore()
    with make(MHA, store) as a:
        put(a, TOKENS)
        assert len(store) == 4
        assert cache_stats(a).counters["l3_backup_tokens_total"] == 8
    with make(MHA, store) as b:
        got, data = fetch(b, [*TOKENS, 7])
        assert got == 8 and torch.equal(data, page_kv(b, TOKENS, 0, 4))
        assert cache_stats(b).counters["storage_hit_tokens_total"] == 8
        check_integrity(b)
        node = b.full.pages.match_prefix(TOKENS).last_device_node
        assert node.device is not None and node.host is not None


def test_prefetch_only_fills_what_is_missing_locally() -> None:
    store = MemoryStore()
    with make(MHA, store) as a:
        put(a, TOKENS)
    with make(MHA, store) as b:
        put(b, TOKENS[:4])  # first two pages local
        got, data = fetch(b, TOKENS)
        assert got == 4 and torch.equal(data, page_kv(b, TOKENS, 0, 4))
        check_integrity(b)


def test_a_tenants_spans_reach_only_that_tenant_through_l3() -> None:
    store = MemoryStore()
    with make(MHA, store) as a:
        put(a, TOKENS, tenant="acme")
        assert len(store) == 4
    with make(MHA, store) as b:
        assert fetch(b, TOKENS)[0] == 0  # not under the shared namespace
        assert fetch(b, TOKENS, tenant="globex")[0] == 0
        got, data = fetch(b, TOKENS, tenant="acme")
        assert got == 8 and torch.equal(data, page_kv(b, TOKENS, 0, 4))
        check_integrity(b)


def test_a_split_during_the_l2_backup_loses_nothing_on_the_way_to_l3() -> None:
    store = MemoryStore()
    with make(MHA, store) as a:
        pages = a.full.pages.alloc(4)
        assert pages is not None
        write_tokens(a, TOKENS, pages, 0)
        a.full.pages.insert(TOKENS, pages)  # backup L1 -> L2 in flight, applied at the next poll
        a.full.pages.tree.match_prefix([*TOKENS[:4], 0, 0])  # splits the node before that
        a.sync(wait=True)
        assert len(store) == 4 and cache_stats(a).counters["l3_backup_tokens_total"] == 8
        check_integrity(a)
    with make(MHA, store) as b:
        got, data = fetch(b, TOKENS)
        assert got == 8 and torch.equal(data, page_kv(b, TOKENS, 0, 4))


def make_write_back(spec: KVSpec, store: MemoryStore) -> HiCache:
    cfg = CacheConfig(
        page_size=PAGE,
        device_tokens=16,
        hicache_ratio=2.0,
        load_back_threshold=0,
        write_policy="write_back",
    )
    cache = HiCache(cfg, spec).start()
    ns = Namespace.for_spec(
        spec, model="m", weights_fingerprint="w", layout=cfg.mem_layout, page_size=PAGE
    )
    cache.l3.attach(
        MemoryStorage(ns, store=store),
        ns,
        PrefetchConfig(policy="wait_complete", prefetch_threshold=0),
    )
    return cache


def test_l3_pages_past_a_span_held_in_l1_alone_are_fetched() -> None:
    """Under write_back a cache holds its prefix in L1 alone; another instance wrote the
    prefix and more to L3 (a decode instance's offload). The continuation is fetched: the
    L1-only span adopts its L3 copy as its L2 copy (contiguity), the rest hangs past it;
    the bytes are exact. When L3 has nothing past the span, nothing is read."""
    store = MemoryStore()
    longer = [*TOKENS, 8, 8, 7, 7]  # 6 pages
    with make(MHA, store) as writer:
        put(writer, longer)
        assert len(store) == 6
    with make_write_back(MHA, store) as b:
        put(b, TOKENS)  # 4 pages in L1 alone (write_back: no backup)
        node = b.full.pages.match_prefix(TOKENS).last_device_node
        assert node.host is None and len(store) == 6
        # nothing in L3 past the held span: no read (the held pages are not re-read)
        got, _ = fetch(b, TOKENS[:6])
        assert got == 0 and cache_stats(b).counters.get("prefetch_tokens_total", 0) == 0
        got, data = fetch(b, [*longer, 9])
        assert got == 4  # the two pages past the span come from L3
        assert torch.equal(data, page_kv(b, longer, 0, 6))
        node = b.full.pages.match_prefix(TOKENS).last_device_node
        assert node.host is not None  # the span adopted its L3 copy
        assert cache_stats(b).counters["prefetch_tokens_total"] == 12  # 6 pages read
        check_integrity(b)


def test_an_l3_read_and_its_load_back_are_measured() -> None:
    """Each L3 read batch and each L2 -> L1 load is one observation of its tier's rate:
    its bytes (this rank's full KV of the pages) over its seconds."""
    store = MemoryStore()
    with make(MHA, store) as a:
        put(a, TOKENS)
    with make(MHA, store) as b:
        assert b.restore_rates.storage is None and b.restore_rates.host is None
        got, _ = fetch(b, [*TOKENS, 7])
        rates = b.restore_rates
        assert got == 8 and rates.token_bytes == MHA.token_bytes == 32
        c = cache_stats(b).counters
        for fit in (rates.storage, rates.host):  # one read of 4 pages, one load of them
            assert fit is not None and fit.observations == 1
            assert fit.mean_amount == 8 * rates.token_bytes == c["load_bytes_total"]
            assert fit.per_second > 0 and fit.overhead_s == 0.0
        assert cache_stats(b).restores == rates
