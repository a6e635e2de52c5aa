"""A real Mooncake store frozen (SIGSTOP) while a zero-copy get is in flight.

The get overruns its deadline and lands only after SIGCONT. Its L2 pages must stay out of
every allocation until then, so the L2 copies other requests made meanwhile keep their
bytes (before the fix, the pages were freed at the deadline, handed to the next backups,
and the late get overwrote them: a later load back served wrong KV).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from hicache.cache import HiCache
from hicache.cache.report import check_integrity
from hicache.config import PrefetchConfig
from hicache.spec import KVSpec
from hicache.storage.base import StorageOptions
from tests.helpers.kvdata import serve
from tests.helpers.l3_cache import cache_over_l3
from tests.helpers.services import private_mooncake

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")
PAGE = 4
TOKENS = list(range(100, 100 + 8 * PAGE))


@pytest.fixture
def mooncake() -> Iterator[Any]:
    with private_mooncake() as svc:
        yield svc


def make(svc: Any, prefetch: PrefetchConfig, **cfg: Any) -> HiCache:
    options = StorageOptions(timeout_s=0.5, connect_timeout_s=10.0)
    # these pages are small: zero_copy_min_bytes 0 still moves them in place (the hazard)
    extra = {**svc.extra_config, "zero_copy_min_bytes": 0}
    return cache_over_l3(SPEC, "mooncake", extra, options, prefetch, **cfg)


def test_a_frozen_store_never_writes_into_pages_someone_else_owns(mooncake: Any) -> None:
    with make(mooncake, PrefetchConfig(policy="wait_complete", prefetch_threshold=0)) as a:
        assert serve(a, TOKENS) is not None
        a.sync(wait=True)
    prefetch = PrefetchConfig(
        policy="timeout",
        prefetch_threshold=0,
        prefetch_timeout_base=1.5,
        prefetch_timeout_per_ki_token=0.0,
    )
    with make(mooncake, prefetch) as b:
        req = b.open(TOKENS, compute_last=False)
        # freeze the store as soon as the lookup answered, before the read is issued
        end = time.monotonic() + 10
        while b._sync.completions._q.qsize() == 0:
            assert time.monotonic() < end, "the lookup never answered"
            time.sleep(0.001)
        mooncake.freeze()
        try:
            while not b.ready(req):  # as agreed at the last sync
                time.sleep(0.005)
                b.sync()
            assert b.admit(req, TOKENS)
            assert req.cached.storage == 0  # the get timed out: recomputed
            b.release(req, TOKENS)
            assert (
                b.l3.attached is not None
                and len(b.l3.attached.prefetches.quarantined_host_pages()) > 0
            )
            others = [[i] * (4 * PAGE) for i in range(1, 6)]
            for toks in others:  # their backups take every L2 page that is free
                assert serve(b, toks) is not None
            assert b.full.pages.host_pool is not None
            b.full.pages.host.wait_idle()
            check_integrity(b)
        finally:
            mooncake.thaw()
        b.sync(wait=True)  # the late get lands, in the quarantined pages only; then they are freed
        assert b.l3.attached.prefetches.quarantined_host_pages() == []
        b.full.pages.evict_device(64)
        for toks in others:  # every L2 copy still holds its own bytes (serve checks)
            if b.full.pages.match_prefix(toks).host_tokens:
                assert serve(b, toks) is not None
        check_integrity(b)
