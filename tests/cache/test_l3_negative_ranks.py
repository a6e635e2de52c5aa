"""Tensor-parallel ranks whose negative lookup caches disagree still agree on every hit.

Two real rank processes (gloo), each over its own L3 shard (the ``memory`` backend, one
store per rank). Each rank keeps its own negative cache, and their clocks and lookups
differ, so at one step a miss may be fresh on one rank and expired (or never seen) on the
other: here rank 0 remembers nothing (TTL 0) and rank 1 remembers for a minute. The agreed
hit is the minimum over ranks, so both take the shorter hit, compute the same pages and
end with equal trees.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hicache.cache import HiCache
from hicache.cache.report import cache_stats, check_integrity, tree_digest
from hicache.config import CacheConfig, PrefetchConfig
from hicache.controller.rank_group import RankGroup
from hicache.keys import Namespace
from hicache.spec import KVSpec
from hicache.storage.registry import create_storage
from tests.helpers.kvdata import serve, wait_ready
from tests.helpers.rank_cache import drive
from tests.helpers.ranks import run_ranks

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
PAGE = 2
B = [40, 41, 42, 43, 44, 45, 46, 47]
CFG = CacheConfig(page_size=PAGE, device_tokens=32, hicache_ratio=4.0, load_back_threshold=0)


def _attach(cache: HiCache, rank: int, store: str, ttl: float) -> None:
    ns = Namespace.for_spec(
        SPEC,
        model="m",
        weights_fingerprint="w",
        layout=CFG.mem_layout,
        page_size=PAGE,
        tp_size=2,
        tp_rank=rank,
    )
    storage = create_storage("memory", namespace=ns, extra_config={"store": store})
    prefetch = PrefetchConfig(policy="wait_complete", prefetch_threshold=0, negative_ttl_s=ttl)
    cache.l3.attach(storage, ns, prefetch)


def _main(rank: int, n: int, out: str) -> dict[str, Any]:
    store = f"negative-ranks-{rank}"
    with HiCache(CFG, SPEC, ranks=RankGroup()).start() as cache:
        _attach(cache, rank, store, ttl=60.0 if rank == 1 else 0.0)
        req = cache.open(B, compute_last=False)  # looked up (missing everywhere), not run
        wait_ready(cache, req)
        cache.release(req)
        cache.sync(wait=True)
        # another instance (one rank of another server) writes B to this rank's shard
        with HiCache(CFG, SPEC).start() as other:
            _attach(other, rank, store, ttl=0.0)
            serve(other, B)
            other.sync(wait=True)
        lookups = cache_stats(cache).storage.exists_calls
        hits = drive(cache, [[*B, 7]])
        cache.sync(wait=True)
        check_integrity(cache)
        return {
            "hits": hits,
            "digest": tree_digest(cache),
            "asked": cache_stats(cache).storage.exists_calls - lookups,
            "saved": cache_stats(cache).counters["l3_negative_lookups_saved_total"],
        }


def test_ranks_whose_negative_caches_disagree_take_the_shorter_hit(tmp_path: Path) -> None:
    r0, r1 = run_ranks(_main, 2, tmp_path)
    # rank 0 asked its store and found all of B; rank 1 answered from its negative cache
    assert (r0["asked"], r0["saved"]) == (1, 0)
    assert (r1["asked"], r1["saved"]) == (0, 1)
    assert r0["hits"] == r1["hits"] == [[0, 0, 0]]  # the minimum: no rank reads
    assert r0["digest"] == r1["digest"]
