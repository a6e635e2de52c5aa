"""The negative lookup cache at the facade, over the real file backend: store lookups are
counted by the backend itself (``StorageStats.exists_calls``)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from hicache.cache import HiCache
from hicache.cache.report import cache_stats, check_integrity
from hicache.config import CacheConfig, PrefetchConfig
from hicache.keys import Namespace
from hicache.spec import KVSpec
from hicache.storage.base import ExistsRun
from hicache.storage.registry import create_storage
from tests.helpers.kvdata import page_kv, read_device, serve, wait_ready

MHA = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
PAGE = 2
PREFIX = [3, 1, 4, 1, 5, 9]  # three pages nobody has written


def make(root: Path, ttl: float, entries: int = 1024) -> HiCache:
    cfg = CacheConfig(page_size=PAGE, device_tokens=64, hicache_ratio=2.0, load_back_threshold=0)
    cache = HiCache(cfg, MHA).start()
    ns = Namespace.for_spec(
        MHA, model="m", weights_fingerprint="w", layout=cfg.mem_layout, page_size=PAGE
    )
    storage = create_storage("file", namespace=ns, extra_config={"file_path": str(root)})
    prefetch = PrefetchConfig(
        policy="wait_complete",
        prefetch_threshold=0,
        negative_ttl_s=ttl,
        negative_max_entries=entries,
    )
    cache.l3.attach(storage, ns, prefetch)
    return cache


def lookups(cache: HiCache) -> int:
    """Store lookups the backend served (``batch_exists`` calls)."""
    return int(cache_stats(cache).storage.exists_calls)


def counter(cache: HiCache, name: str) -> int:
    return cache_stats(cache).counters[name]


def ask(cache: HiCache, tokens: list[int]) -> int:
    """One request that looks ``tokens`` up and goes away (aborted before it ran):
    returns the tokens its prefetch found in L3."""
    cache.sync()
    req = cache.open(tokens, compute_last=False)
    wait_ready(cache, req)
    found = req.prefetch.boundary * PAGE if req.prefetch is not None else 0
    cache.release(req)
    cache.sync(wait=True)
    return found


def put(cache: HiCache, tokens: list[int]) -> None:
    """Compute and commit ``tokens`` (written through to L2 and L3)."""
    serve(cache, tokens)
    cache.sync(wait=True)


@pytest.mark.parametrize(("ttl", "asked"), [(60.0, 1), (0.0, 5)])
def test_a_stream_over_the_same_absent_run_asks_the_store_once(
    tmp_path: Path, ttl: float, asked: int
) -> None:
    with make(tmp_path, ttl) as cache:
        for i in range(5):  # the same unwritten prefix, a new last page each time
            assert ask(cache, [*PREFIX, 7, i]) == 0
        assert lookups(cache) == asked
        saved = 5 - asked
        assert counter(cache, "l3_negative_lookups_saved_total") == saved
        assert counter(cache, "l3_negative_keys_skipped_total") == 4 * saved
        check_integrity(cache)


@pytest.mark.parametrize(("ttl", "asked"), [(60.0, 1), (0.0, 4)])
def test_a_burst_of_requests_arriving_together_asks_once(
    tmp_path: Path, ttl: float, asked: int
) -> None:
    with make(tmp_path, ttl) as cache:
        cache.sync()
        reqs = [cache.open([*PREFIX, 7, i], compute_last=False) for i in range(4)]
        for req in reqs:  # every lookup queued before any answer came back
            wait_ready(cache, req)
        for req in reqs:
            cache.release(req)
        cache.sync(wait=True)
        assert lookups(cache) == asked
        assert counter(cache, "l3_negative_lookups_saved_total") == 4 - asked


def test_only_the_keys_before_a_remembered_miss_are_asked(tmp_path: Path) -> None:
    with make(tmp_path, 0.0) as writer:
        put(writer, PREFIX[:4])  # two pages in L3
    with make(tmp_path, 60.0) as cache:
        before = cache_stats(cache).storage
        assert ask(cache, [*PREFIX, 7, 7]) == 4  # asks 4 keys, finds 2, remembers the 3rd
        cache.reset()  # the 2 pages fetched leave L2: a lookup starts from the first again
        assert ask(cache, [*PREFIX, 7, 8]) == 4  # asks the 2 keys before the miss alone
        after = cache_stats(cache).storage
        assert after.exists_calls - before.exists_calls == 2
        assert after.exists_keys - before.exists_keys == 4 + 2
        assert counter(cache, "l3_negative_keys_skipped_total") == 2
        assert counter(cache, "l3_negative_lookups_saved_total") == 0


def test_a_page_another_instance_writes_is_found_once_the_ttl_passed(tmp_path: Path) -> None:
    ttl = 1.0
    with make(tmp_path, ttl) as b:
        assert ask(b, [*PREFIX, 7]) == 0  # remembered missing
        with make(tmp_path, 0.0) as a:  # another instance on the same L3
            put(a, PREFIX)
        start = time.monotonic()
        assert ask(b, [*PREFIX, 7]) == 0  # within the TTL: the store is not asked
        assert lookups(b) == 1
        time.sleep(max(0.0, ttl - (time.monotonic() - start)) + 0.05)
        got = serve(b, [*PREFIX, 7], hold=True)
        assert got is not None and got.cached.storage == 6 and lookups(b) == 2
        data = read_device(b, got.pages[:3])
        assert torch.equal(data, page_kv(b, PREFIX, 0, 3))
        b.release(got)
        b.sync(wait=True)
        check_integrity(b)


def test_a_write_of_this_instance_clears_its_misses_at_once(tmp_path: Path) -> None:
    with make(tmp_path, 60.0) as cache:
        assert ask(cache, [*PREFIX, 7]) == 0
        assert ask(cache, [*PREFIX, 7]) == 0
        assert lookups(cache) == 1
        put(cache, PREFIX)  # written through to L3: the misses are forgotten
        cache.reset()  # L1 and L2 emptied; L3 keeps the pages
        got = serve(cache, [*PREFIX, 7], hold=True)
        assert got is not None and got.cached.storage == 6 and lookups(cache) == 2
        assert torch.equal(read_device(cache, got.pages[:3]), page_kv(cache, PREFIX, 0, 3))
        cache.release(got)
        cache.sync(wait=True)
        check_integrity(cache)


def test_the_bound_on_entries_holds(tmp_path: Path) -> None:
    with make(tmp_path, 60.0, entries=2) as cache:
        runs = [[p, p, 1, 1, 2, 2] for p in (10, 11, 12)]  # three absent runs
        for run in runs:
            ask(cache, run)
        assert lookups(cache) == 3
        ask(cache, runs[2])  # remembered
        assert lookups(cache) == 3
        ask(cache, runs[0])  # pushed out by the third: asked again
        assert lookups(cache) == 4
        negative = cache._l3.tier.controller.negative
        assert negative is not None and len(negative) == 2


def test_a_failed_lookup_is_not_remembered(tmp_path: Path) -> None:
    with make(tmp_path, 60.0) as cache:
        storage = cache._l3.tier.controller.storage
        real = storage.exists_run
        storage.exists_run = lambda keys: ExistsRun(0, failed=True)
        assert ask(cache, [*PREFIX, 7]) == 0
        storage.exists_run = real
        with make(tmp_path, 0.0) as a:
            put(a, PREFIX)
        assert ask(cache, [*PREFIX, 7]) == 6  # asked at once, found
        assert lookups(cache) == 1
