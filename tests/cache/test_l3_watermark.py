"""The ``watermark`` write policy: L2 -> L3 writes ahead of eviction, exact on tiny sizes.

L1 holds 4 pages of 2 tokens, L2 10 pages; a high mark of 0.5 is 5 L2 pages. Nothing is
written below the mark; above it, exactly the coldest L2-only pages not in L3 (as many as
the tree's L2 pages pass the mark) are written, one op per run. Eviction takes the spans
L3 holds first and never waits on a write; an unstored span evicted is counted lost. A
span being written is never written again, split or not. ``write_path`` writes a path's
unwritten L2 runs on demand (under any policy). Two real ranks decide alike (MHA: both
write their shard; MLA: rank 0 alone writes, both mark).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from hicache.cache import HiCache
from hicache.cache.l3.tier import L3Tier
from hicache.cache.l3.writes import Writes
from hicache.cache.report import cache_stats, check_integrity, tree_digest
from hicache.config import CacheConfig, PrefetchConfig
from hicache.controller.rank_group import RankGroup
from hicache.keys import Namespace
from hicache.spec import AttentionKind, CacheSpec, KVSpec
from hicache.storage.backends.memory import MemoryFaults, MemoryStorage, MemoryStore
from hicache.storage.registry import create_storage
from hicache.tokens import decode_tokens
from hicache.tree import TreeNode
from tests.cache.test_swa import FULL, SWA_SPEC, serve_in_chunks
from tests.cache.test_swa_l3 import LONG, NS, fetch, make_cache, swa_pages_in
from tests.helpers.kvdata import insert
from tests.helpers.l3_cache import attach_memory
from tests.helpers.ranks import run_ranks

MHA = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
MLA = KVSpec(num_layers=2, attention=AttentionKind.MLA, kv_lora_rank=4, qk_rope_head_dim=2)
PAGE = 2
X1, X2, Y, Z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]


def config(policy: str = "watermark", threshold: float = 0.5) -> CacheConfig:
    return CacheConfig(
        page_size=PAGE,
        device_tokens=8,
        hicache_ratio=2.5,
        load_back_threshold=0,
        write_policy=policy,
        write_back_threshold=threshold,
    )


def make(
    store: MemoryStore,
    *,
    policy: str = "watermark",
    threshold: float = 0.5,
    faults: MemoryFaults | None = None,
) -> HiCache:
    cache = HiCache(config(policy, threshold), MHA).start()
    attach_memory(cache, store, faults=faults)
    return cache


def settle(cache: HiCache) -> None:
    """Land every copy and write, then the writes a sync issued ahead."""
    cache.sync(wait=True)
    cache.sync(wait=True)


def node(cache: HiCache, tokens: list[int]) -> TreeNode:
    m = cache.full.pages.match_prefix(tokens)
    assert m.matched_tokens == len(tokens)
    return m.last_host_node if m.last_host_node.parent is not None else m.last_device_node


def state(cache: HiCache) -> dict[tuple[int, ...], str]:
    """Each node's tokens -> its tiers: D (L1), H (L2), S (L3 mark)."""
    tree = cache.full.pages.tree
    out = {}
    for n in tree.iter_nodes():
        toks = tuple(decode_tokens(tree.path_key(n)))
        tiers = "D" * (n.device is not None) + "H" * (n.host is not None) + "S" * n.stored
        out[toks[-tree.num_tokens(n) :]] = tiers
    return out


def writes(cache: HiCache) -> Writes:
    tier = cache.l3.attached
    assert tier is not None
    return tier.writes


def counter(cache: HiCache, name: str) -> int:
    return int(getattr(cache.full.pages.counters, name))


def test_nothing_is_written_below_the_mark() -> None:
    store = MemoryStore()
    with make(store) as cache:
        insert(cache, X1)
        insert(cache, X2)  # L1 full, L2: 4 pages <= 5
        settle(cache)
        assert state(cache) == {(1, 2, 3, 4): "DH", (5, 6, 7, 8): "DH"}
        assert len(store) == 0 and counter(cache, "l3_backup_tokens_total") == 0


def test_above_the_mark_exactly_the_coldest_unstored_pages_are_written() -> None:
    store = MemoryStore()
    with make(store) as cache:
        insert(cache, X1)
        insert(cache, X2)
        settle(cache)
        insert(cache, Y)  # X1 leaves L1 (coldest): L2 6 pages, 1 past the mark
        settle(cache)
        assert state(cache) == {(1, 2, 3, 4): "HS", (5, 6, 7, 8): "DH", (9, 10, 11, 12): "DH"}
        assert len(store) == 2 and counter(cache, "l3_ahead_writes_total") == 1
        insert(cache, Z)  # X2 leaves L1: L2 8 pages, 3 past; X1 (2, stored) + X2 (2)
        settle(cache)
        assert state(cache)[(5, 6, 7, 8)] == "HS"
        assert state(cache)[(9, 10, 11, 12)] == "DH"
        assert len(store) == 4 and counter(cache, "l3_ahead_writes_total") == 2
        check_integrity(cache)


def test_the_write_through_policy_writes_every_run_at_landing() -> None:
    store = MemoryStore()
    with make(store, policy="write_through") as cache:
        insert(cache, X1)
        settle(cache)
        assert state(cache) == {(1, 2, 3, 4): "DHS"} and len(store) == 2


def test_eviction_takes_stored_spans_first_and_never_waits_on_a_write() -> None:
    store = MemoryStore()
    with make(store, threshold=1.0, faults=MemoryFaults(delay_s=1.0)) as cache:
        for tokens in (X1, X2, Y, Z):  # X1, X2 end in L2 alone, X1 the coldest
            insert(cache, tokens)
            cache.sync(wait=True)
        assert writes(cache).write_path(node(cache, X2))
        settle(cache)  # X2 in L3 (a second's write)
        assert state(cache)[(5, 6, 7, 8)] == "HS"
        assert writes(cache).write_path(node(cache, X1))  # in flight for a second
        start = time.monotonic()
        assert cache.full.pages.evict_host(2) == 2  # X2, though X1 is colder
        assert time.monotonic() - start < 0.5  # no wait on X1's write
        assert (1, 2, 3, 4) in state(cache) and (5, 6, 7, 8) not in state(cache)
        assert counter(cache, "l3_unstored_evicted_tokens_total") == 0
        settle(cache)
        check_integrity(cache)


def test_an_unstored_span_evicted_is_counted_lost() -> None:
    with make(MemoryStore(), threshold=1.0) as cache:
        for tokens in (X1, X2, Y, Z):
            insert(cache, tokens)
            cache.sync(wait=True)
        assert cache.full.pages.evict_host(2) == 2  # X1: in L2 alone, not in L3
        assert (1, 2, 3, 4) not in state(cache)
        assert counter(cache, "l3_unstored_evicted_tokens_total") == 4
        assert counter(cache, "host_evicted_tokens_total") == 4


def test_without_l3_nothing_counts_as_lost() -> None:
    with HiCache(config(threshold=1.0), MHA).start() as cache:
        for tokens in (X1, X2, Y, Z):
            insert(cache, tokens)
            cache.sync(wait=True)
        assert cache.full.pages.evict_host(2) == 2
        assert counter(cache, "l3_unstored_evicted_tokens_total") == 0


def test_a_span_in_flight_is_not_written_twice_even_split() -> None:
    store = MemoryStore()
    with make(store, threshold=1.0, faults=MemoryFaults(delay_s=0.3)) as cache:
        for tokens in (X1, X2, Y, Z):
            insert(cache, tokens)
            cache.sync(wait=True)
        w = writes(cache)
        assert w.write_path(node(cache, X1)) and len(w) == 1
        cache.full.pages.match_prefix([1, 2, 0, 0])  # splits X1 while it is written
        assert state(cache)[(1, 2)] == "H" and state(cache)[(3, 4)] == "H"
        assert w.write_path(node(cache, X1)) and w.write_path(node(cache, [1, 2]))
        assert len(w) == 1 and counter(cache, "l3_ahead_writes_total") == 1
        settle(cache)
        assert state(cache)[(1, 2)] == "HS" and state(cache)[(3, 4)] == "HS"
        assert len(store) == 2 and counter(cache, "l3_backup_tokens_total") == 4
        assert w.write_path(node(cache, X1)) and len(w) == 0  # stored: nothing to write


def test_write_path_writes_the_unwritten_runs_of_a_path_under_any_policy() -> None:
    store = MemoryStore()
    with make(store, policy="write_back") as cache:
        insert(cache, X1)  # write_back: in L1 alone
        settle(cache)
        assert not writes(cache).write_path(node(cache, X1))  # not in L2: cannot
        assert len(store) == 0


def test_watermark_writes_ahead_each_sync_until_the_coldest_are_clean() -> None:
    """Past the mark, a sync issues the writes; the next one issues none while they are
    in flight (no double write), nor after they landed."""
    store = MemoryStore()
    with make(store, faults=MemoryFaults(delay_s=0.2)) as cache:
        for tokens in (X1, X2, Y, Z):  # L2 8 pages: 3 past the mark
            insert(cache, tokens)
            cache.full.wait_idle()
            cache.sync()
        assert counter(cache, "l3_ahead_writes_total") == 2  # X1 then X2, one op each
        cache.sync()
        assert counter(cache, "l3_ahead_writes_total") == 2
        settle(cache)
        assert counter(cache, "l3_ahead_writes_total") == 2 and len(store) == 4


def test_stats_count_each_page_once_across_the_tiers() -> None:
    with make(MemoryStore()) as cache:
        for tokens in (X1, X2, Y, Z):  # X1, X2 written ahead; Y, Z in L1 and L2
            insert(cache, tokens)
            settle(cache)
        s = cache_stats(cache)
        assert (s.device_cached_tokens, s.host_cached_tokens, s.tree_tokens) == (8, 16, 16)
        assert s.l3_stored_tokens == 8 and s.distinct_tokens == 16
        assert cache.full.pages.evict_host(2) == 2  # X1 leaves L2: in L3 alone now
        s = cache_stats(cache)
        assert (s.tree_tokens, s.l3_stored_tokens, s.distinct_tokens) == (12, 4, 16)


def test_writes_ahead_pause_longer_after_each_failure() -> None:
    """A failing backend is asked again after 1 sync, then 2, 4, ...: not at every step."""
    with make(MemoryStore(), faults=MemoryFaults(fail_after=0)) as cache:
        for tokens in (X1, X2, Y):  # L2 past the mark: X1 to write
            insert(cache, tokens)
            cache.full.wait_idle()
        issued = []
        for _ in range(16):
            cache.l3.tier.flush(5.0)  # the write fails (and lands as failed)
            cache.sync()
            issued.append(counter(cache, "l3_ahead_writes_total"))
        # a write at once, then after pauses of 1, 2 and 4 syncs (one more sync each to land)
        assert issued == [1, 1, 2, 2, 2, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4]
        assert state(cache)[(1, 2, 3, 4)] == "H"  # never marked in L3


def test_a_reset_past_the_mark_waits_for_the_writes_its_sync_issued() -> None:
    store = MemoryStore()
    with make(store, faults=MemoryFaults(delay_s=0.2)) as cache:
        for tokens in (X1, X2, Y):
            insert(cache, tokens)
            cache.full.wait_idle()
        cache.reset()  # its sync writes X1 ahead; the reset waits for it, then empties
        assert state(cache) == {} and len(store) == 2


@pytest.mark.parametrize("value", [0, -0.1, 1.5, float("nan"), float("inf"), "x"])
def test_the_threshold_is_validated(value: Any) -> None:
    with pytest.raises(ValueError, match="write_back_threshold"):
        CacheConfig(write_policy="watermark", write_back_threshold=value)


def test_the_mark_is_the_threshold_share_of_l2_pages() -> None:
    assert config(threshold=0.5).write_back_mark(MHA) == 5
    assert config(threshold=1.0).write_back_mark(MHA) == 10
    assert config(policy="write_through").write_back_mark(MHA) is None


# ---------------------------------------------------------------------- two ranks


def _rank_main(rank: int, n: int, out: str, spec_name: str) -> dict[str, Any]:
    spec = MHA if spec_name == "mha" else MLA
    cfg = config()
    root = Path(out) / (f"l3-rank{rank}" if spec_name == "mha" else "l3-shared")
    with HiCache(cfg, spec, ranks=RankGroup()).start() as cache:
        ns = Namespace.for_spec(
            spec,
            model="m",
            weights_fingerprint="w",
            layout=cfg.mem_layout,
            page_size=PAGE,
            tp_size=2,
            tp_rank=rank,
        )
        storage = create_storage("file", namespace=ns, extra_config={"file_path": str(root)})
        prefetch = PrefetchConfig(policy="wait_complete", prefetch_threshold=0)
        cache.l3.attach(storage, ns, prefetch, cache.context.ranks)
        for tokens in (X1, X2, Y, Z):
            insert(cache, tokens)
            settle(cache)
        stats = cache.l3.attached.controller.storage.stats()  # type: ignore[union-attr]
        result = {
            "state": sorted((list(k), v) for k, v in state(cache).items()),
            "digest": tree_digest(cache, exact=True),
            "ahead": counter(cache, "l3_ahead_writes_total"),
            "sent_pages": stats.set_pages,
        }
        check_integrity(cache)
    return result


@pytest.mark.parametrize("spec_name", ["mha", "mla"])
def test_two_ranks_write_ahead_alike(tmp_path: Path, spec_name: str) -> None:
    r0, r1 = run_ranks(_rank_main, 2, tmp_path, spec_name)
    assert r0["state"] == r1["state"] and r0["digest"] == r1["digest"]
    marks = {tuple(k): v for k, v in r0["state"]}
    assert marks[(1, 2, 3, 4)] == "HS" and marks[(5, 6, 7, 8)] == "HS"
    assert r0["ahead"] == r1["ahead"] == 2
    assert r0["sent_pages"] == 4
    assert r1["sent_pages"] == (4 if spec_name == "mha" else 0)  # MLA: rank 0 alone sends


# ---------------------------------------------------------------------- a hybrid model


def test_a_hybrid_run_written_on_demand_carries_its_swa_pages() -> None:
    """Sliding-window layers: ``write_path`` writes the path's full pages as one run, with
    every L2 SWA page of it (as a write at landing does), and a cold cache reads it back."""
    store = MemoryStore()
    cfg = CacheConfig(
        page_size=PAGE, device_tokens=32, hicache_ratio=2.0, load_back_threshold=0,
        swa_full_tokens_ratio=0.5, write_policy="watermark", write_back_threshold=1.0,
    )  # fmt: skip
    with HiCache(cfg, CacheSpec(kv=FULL, components=(SWA_SPEC,))).start() as cache:
        prefetch = PrefetchConfig(policy="wait_complete", prefetch_threshold=0)
        tier = cache.l3.attach(MemoryStorage(NS, store=store), NS, prefetch)
        assert isinstance(tier, L3Tier)
        serve_in_chunks(cache, LONG)
        settle(cache)
        assert counter(cache, "l3_backup_tokens_total") == 0  # below the mark: nothing
        assert tier.writes.write_path(node(cache, LONG[:20]))
        settle(cache)
        assert counter(cache, "l3_backup_tokens_total") == 10 * PAGE
        assert counter(cache, "l3_backup_swa_pages_total") == 10
    assert swa_pages_in(store, LONG[:20]) == list(range(1, 11))
    cold, _ = make_cache(store)
    with cold:
        assert fetch(cold, LONG[:17]) == (8 * PAGE, 8 * PAGE)
