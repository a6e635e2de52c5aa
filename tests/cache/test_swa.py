"""Sliding-window KV through the request verbs (tiny sizes, exact state).

Window 4 tokens, pages of 2: a request keeps the SWA pages from
``min((c - 4) // 2, c // 2 - 2)`` on when ``c`` positions are computed, freeing its own
pages below; a commit hands the tree every SWA page the request still holds (the tree keeps
them until the SWA pool's LRU needs room), so positions passed between commits (decode
steps) are tombstones; a match ends only where the 2 pages before the boundary hold SWA
values in some tier.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from hicache.cache import CacheRequest, HiCache
from hicache.cache.components import SwaStore
from hicache.cache.components.swa import SWA, SlidingTable, check_swa_pool, request_pages
from hicache.cache.report import cache_stats, check_integrity
from hicache.config import CacheConfig
from hicache.spec import CacheSpec, KVSpec, SlidingWindowSpec
from hicache.tree.components import Tier
from tests.helpers.kvdata import LoadGates

FULL = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32")
SWA_SPEC = SlidingWindowSpec(kv=KVSpec(num_layers=2, num_kv_heads=1, head_dim=2), window=4)
PAGE = 2
PROMPT = list(range(100, 117))  # 17 tokens: 8 whole pages before the last token


def config(**kw: object) -> CacheConfig:
    args: dict[str, object] = dict(
        page_size=PAGE, device_tokens=32, hicache_ratio=2.0, load_back_threshold=0,
        swa_full_tokens_ratio=0.5,
    )  # fmt: skip
    args.update(kw)
    return CacheConfig(**args)  # type: ignore[arg-type]


@pytest.fixture
def cache() -> Iterator[HiCache]:
    with HiCache(config(), CacheSpec(kv=FULL, components=(SWA_SPEC,))) as c:
        yield c


def swa_of(cache: HiCache) -> SwaStore:
    """The cache's sliding-window store."""
    store = cache.stores.of_type(SwaStore)
    assert store is not None
    return store


def table(cache: HiCache, req: CacheRequest) -> SlidingTable | None:
    """``req``'s sliding-window page table (None: not admitted)."""
    return swa_of(cache).table(req)


def swa_value(tokens: list[int], pos: int) -> float:
    """The SWA K/V a model would compute at ``pos``: depends on the whole prefix."""
    return float(sum(tokens[: pos + 1]) + pos)


def write_swa(cache: HiCache, req: CacheRequest, tokens: list[int], lo: int, hi: int) -> None:
    """Write positions ``[lo, hi)`` of ``tokens`` into ``req``'s SWA slots (all layers)."""
    t = table(cache, req)
    assert t is not None
    slots = t.slots(PAGE, hi)
    first = hi - len(slots)
    buf = swa_of(cache).device_pool.buffer  # (K, L, S, H, D)
    for pos in range(lo, hi):
        buf[:, :, int(slots[pos - first])] = swa_value(tokens, pos)


def read_swa(cache: HiCache, req: CacheRequest, tokens: list[int], lo: int, hi: int) -> bool:
    """Whether ``req``'s SWA slots of positions ``[lo, hi)`` hold ``tokens``' values."""
    t = table(cache, req)
    assert t is not None
    slots = t.slots(PAGE, hi)
    first = hi - len(slots)
    buf = swa_of(cache).device_pool.buffer
    return all(
        bool((buf[:, :, int(slots[pos - first])] == swa_value(tokens, pos)).all())
        for pos in range(lo, hi)
    )


def forward(cache: HiCache, req: CacheRequest, tokens: list[int], start: int, end: int) -> None:
    """What the scheduler does for a forward of positions ``[start, end)``."""
    assert cache.grow(req, end, computed=start)
    t = table(cache, req)
    assert t is not None and t.first == swa_of(cache).keep_from(start)
    write_swa(cache, req, tokens, start, end)


def serve_in_chunks(cache: HiCache, tokens: list[int]) -> None:
    """Compute ``tokens`` in chunks of 8, committing after each, then release."""
    req = cache.open(tokens)
    assert cache.admit(req, tokens)
    pos = req.prefix_tokens
    while pos < len(tokens):
        end = min(pos + 8, len(tokens))
        forward(cache, req, tokens, pos, end)
        pos = end
        cache.commit(req, tokens[:pos])
        check_integrity(cache)
    cache.release(req, tokens)
    cache.sync(wait=True)  # backups landed: their L1 sources are unpinned
    check_integrity(cache)


def serve_token_by_token(cache: HiCache, tokens: list[int]) -> None:
    """Compute ``tokens`` one position at a time (as decode steps do), committing only at
    the release."""
    req = cache.open(tokens)
    assert cache.admit(req, tokens[:1])
    for c in range(1, len(tokens) + 1):
        forward(cache, req, tokens, c - 1, c)
    cache.release(req, tokens)
    cache.sync(wait=True)
    check_integrity(cache)


def swa_used(cache: HiCache, tier: Tier = Tier.DEVICE) -> int:
    return swa_of(cache).pool(tier).allocator.used_pages


def test_a_long_sequence_keeps_only_its_window_in_the_swa_pool(cache: HiCache) -> None:
    tokens = list(range(1, 31))
    req = cache.open(tokens, compute_last=True)
    assert cache.admit(req, tokens[:2])
    bound = request_pages(4, 1, PAGE)
    assert bound == 4
    for c in range(2, 30):
        forward(cache, req, tokens, c - 1 if c > 2 else 0, c)
        held = len(table(cache, req).pages)  # type: ignore[union-attr]
        assert swa_used(cache) == held <= bound
        assert len(req.pages) == (c + 1) // 2  # the full pool grows with the sequence
        check_integrity(cache)
    # at c = 28 the request keeps pages from min((28 - 4) // 2, 14 - 2) = 12 on
    t = table(cache, req)
    assert t is not None and t.first == 12 and len(t.pages) == 3
    assert read_swa(cache, req, tokens, 24, 29)
    cache.release(req)
    assert swa_used(cache) == 0
    check_integrity(cache)


def test_commits_hand_the_tree_every_swa_page_the_request_holds(cache: HiCache) -> None:
    """Chunks of 8 with a commit after each (as prefill chunks are): the next chunk's trim
    only drops the tree's pages from the table, so every boundary keeps its window."""
    serve_in_chunks(cache, PROMPT[:16])
    tree = cache.full.pages.tree
    m = tree.match_prefix(PROMPT[:16])
    assert m.device_tokens == 16
    assert list(tree.hit_ids(SWA, m.last_device_node)) != []
    assert tree.component_stats(SWA).device_ids == 8
    for n in (4, 10, 12):  # e.g. where a shared system prompt ends
        assert cache.full.pages.match_prefix(PROMPT[: n + 1]).device_tokens == n
    check_integrity(cache)


def test_positions_passed_between_commits_are_tombstones(cache: HiCache) -> None:
    """One position at a time, committed only at the release: the request freed its own
    pages as its window moved, so the tree gets pages 5..7 only (the table at c = 15)."""
    serve_token_by_token(cache, PROMPT[:16])
    tree = cache.full.pages.tree
    assert tree.component_stats(SWA).device_ids == 3
    assert swa_used(cache) == 3
    assert cache.full.pages.match_prefix(PROMPT[:16]).device_tokens == 16
    assert cache.full.pages.match_prefix(PROMPT[:15]).device_tokens == 14  # pages 5, 6
    m = cache.full.pages.match_prefix(PROMPT[:13])  # 12 needs pages 4, 5: page 4 is a tombstone
    assert m.device_tokens == 0 and m.limited_by == SWA
    assert tree.stats().device_pages == 8  # the full KV of every page stays
    check_integrity(cache)


def test_swa_eviction_leaves_the_node_and_moves_the_boundary(cache: HiCache) -> None:
    serve_in_chunks(cache, PROMPT[:16])
    cache.full.pages.match_prefix(PROMPT[:16])  # the node [8, 16) is needed last: evicted last
    # the SWA pool has 8 pages, all the tree's: asking for 4 evicts the least recently
    # needed node's (pages 0..3 of the node [0, 8)), not those of [8, 16)
    got = swa_of(cache).alloc(Tier.DEVICE, 4)
    assert got is not None and swa_used(cache) == 8
    assert cache.full.pages.tree.component_stats(SWA).device_ids == 4
    assert cache.full.pages.match_prefix(PROMPT[:16]).device_tokens == 16  # its window is there
    assert cache.full.pages.match_prefix(PROMPT[:13]).device_tokens == 12  # pages 4, 5 are there
    m = cache.full.pages.match_prefix(PROMPT[:11])  # 10 needs page 3, 8 needs 2 and 3: evicted
    assert m.device_tokens == 0 and m.host_tokens == 10  # from L1; L2 has a copy
    assert cache.full.pages.tree.stats().device_pages == 8  # the full KV of every node stays
    swa_of(cache).free(Tier.DEVICE, got)
    # and evicting the window before 16 leaves no boundary at all
    node = cache.full.pages.match_prefix(PROMPT[:16]).last_device_node
    for need in swa_of(cache).hit_needs(node):
        ids = cache.full.pages.tree.evict_component(SWA, need.node, Tier.DEVICE)
        swa_of(cache).free(Tier.DEVICE, ids)
    assert cache.full.pages.match_prefix(PROMPT[:16]).matched_tokens == 16  # from L2 (backed up)
    check_integrity(cache)


def test_backup_and_load_back_cover_the_hit_window_and_no_more(cache: HiCache) -> None:
    serve_in_chunks(cache, PROMPT[:16])
    cache.sync(wait=True)
    # write_through: each commit's SWA pages went to L2 with their full pages
    assert swa_used(cache, Tier.HOST) == 8
    assert cache.full.pages.evict_device(10**6) == 8
    assert swa_used(cache) == 0  # the cascade freed the L1 windows
    req = cache.open(PROMPT)
    assert cache.admit(req, PROMPT)
    assert req.prefix_tokens == 16 and req.cached.host == 16
    # only the window before 16 came back: pages 6, 7
    t = table(cache, req)
    assert t is not None and t.first == 6 and len(t.pages) == 2
    assert swa_used(cache) == 2
    assert read_swa(cache, req, PROMPT, 12, 16)
    forward(cache, req, PROMPT, 16, 17)
    cache.release(req, PROMPT)
    cache.sync(wait=True)
    check_integrity(cache)
    assert all(n.lock_ref == 0 and n.host_ref == 0 for n in cache.full.pages.tree.iter_nodes())


def test_a_window_evicted_from_l1_only_is_loaded_back_from_l2(cache: HiCache) -> None:
    serve_in_chunks(cache, PROMPT[:16])
    cache.sync(wait=True)
    node = cache.full.pages.match_prefix(PROMPT[:16]).last_device_node
    for need in swa_of(cache).hit_needs(node):
        swa_of(cache).free(
            Tier.DEVICE, cache.full.pages.tree.evict_component(SWA, need.node, Tier.DEVICE)
        )
    m = cache.full.pages.match_prefix(PROMPT[:16])
    assert m.device_tokens == 12 and m.matched_tokens == 16  # full KV in L1, window in L2
    req = cache.open(PROMPT)
    assert cache.admit(req, PROMPT)
    t = table(cache, req)
    assert req.prefix_tokens == 16 and t is not None and t.first == 6
    assert read_swa(cache, req, PROMPT, 12, 16)
    assert len(req.pages) == 9
    cache.release(req)
    check_integrity(cache)


def test_an_swa_allocation_waits_for_backups_not_for_another_requests_load() -> None:
    """The SWA pool is short and only a backup in flight pins what could be evicted (C's
    window): the allocation waits for that backup, never for A's load, which is parked
    mid-way (a long layer-wise load must not hold another request's forward)."""
    gates = LoadGates()
    spec = CacheSpec(kv=KVSpec(num_layers=2, num_kv_heads=1, head_dim=2), components=(SWA_SPEC,))
    cache = HiCache(config(), spec, layer_hook=gates, wait_timeout_s=1.0).start()
    a, b, c = list(range(100, 109)), list(range(200, 209)), list(range(300, 308))
    try:
        serve_in_chunks(cache, a)
        assert cache.full.pages.evict_device(10**6) == 4 and swa_used(cache) == 0  # A: L2 only
        gates.park(0)
        req_a = cache.open(a)
        assert cache.admit(req_a, a)  # its 4 pages load (parked after layer 0)
        assert gates.parked(0) and req_a.loading and req_a.prefix_tokens == 8
        assert swa_used(cache) == 2  # its window came back at once (the store's copy)
        req_b = cache.open(b)
        assert cache.admit(req_b, b)
        req_c = cache.open(c, compute_last=False)
        assert cache.admit(req_c, c)
        forward(cache, req_c, c, 0, 8)
        cache.release(req_c, c)  # its backup pins its window until it is applied
        # the pin split C's span: the backup pins the window [4, 8) only, not [0, 4)
        node_c = cache.full.pages.tree.match_prefix(c).last_device_node  # the tree's: no poll
        assert node_c.lock_ref == 1 and cache.full.pages.tree.num_pages(node_c) == 2
        assert swa_used(cache) == 6 and swa_of(cache).allocator(Tier.DEVICE).free_pages == 2
        t0 = time.monotonic()
        assert cache.grow(req_b, 9, computed=0)  # 5 SWA pages: C's whole span is evicted
        assert time.monotonic() - t0 < 0.5
        assert cache.full.pages.tree.component(SWA).get(node_c, Tier.DEVICE) is None
        assert swa_used(cache) == 7 and cache.full.pages.tree.component_stats(SWA).device_ids == 2
        assert node_c.lock_ref == 0 and req_a.loading  # the backup landed; A still parked
        write_swa(cache, req_b, b, 0, 9)
        gates.release(0)
        assert all(req_a.wait_layer(i, 10) for i in range(2))
        cache.release(req_a)
        cache.release(req_b)
        cache.sync(wait=True)
        check_integrity(cache)
    finally:
        gates.release_all()
        cache.close()


def test_integrity_catches_a_leaked_or_doubly_owned_swa_page(cache: HiCache) -> None:
    serve_in_chunks(cache, PROMPT[:8])
    leaked = swa_of(cache).alloc(Tier.DEVICE, 1)
    assert leaked is not None
    with pytest.raises(AssertionError, match="L1 SWA"):
        check_integrity(cache)
    swa_of(cache).free(Tier.DEVICE, leaked)
    check_integrity(cache)
    node = cache.full.pages.match_prefix(PROMPT[:8]).last_device_node
    owned = cache.full.pages.tree.hit_ids(SWA, node)
    req = cache.open(PROMPT[:9])
    assert cache.admit(req, PROMPT[:9])
    t = table(cache, req)
    assert t is not None
    t.pages = t.pages + owned  # a tree page listed as the request's own
    with pytest.raises(AssertionError, match="L1 SWA"):
        check_integrity(cache)
    t.pages = t.pages[: -len(owned)]
    cache.release(req)
    check_integrity(cache)


def test_stats_report_bytes_per_cached_token_per_component(cache: HiCache) -> None:
    serve_token_by_token(cache, PROMPT[:16])
    comps = {c.name: c for c in cache_stats(cache).components}
    assert set(comps) == {"full", SWA}
    full, swa = comps["full"], comps[SWA]
    assert (full.device_used, full.device_total) == (8, 16)
    assert (swa.device_used, swa.device_total) == (3, 8)
    assert full.bytes_per_cached_token == FULL.token_bytes
    # 3 SWA pages for 16 cached tokens: the sliding layers hold the final window only
    assert swa.bytes_per_cached_token == SWA_SPEC.kv.token_bytes * 3 * PAGE / 16
    assert swa.host_total == int(8 * 2.0)


def test_reset_empties_the_swa_pools(cache: HiCache) -> None:
    serve_in_chunks(cache, PROMPT[:16])
    cache.reset()
    assert swa_used(cache) == 0 and swa_used(cache, Tier.HOST) == 0
    check_integrity(cache)


def test_an_swa_pool_smaller_than_one_window_and_chunk_is_refused() -> None:
    check_swa_pool(config(swa_full_tokens_ratio=0.5), window=4, chunk=8)  # 8 >= 2 + 4 + 1
    with pytest.raises(ValueError, match=r"swa_full_tokens_ratio=0\.25.* 4 pages.* needs 7"):
        check_swa_pool(config(swa_full_tokens_ratio=0.25), window=4, chunk=8)


def test_a_cache_without_swa_keeps_no_table() -> None:
    with HiCache(config(), FULL) as c:
        req = c.open(PROMPT)
        assert c.admit(req, PROMPT)
        assert c.stores.names == [] and req.part(SWA) is None and req.pool_slots(PAGE, 17) == {}
        assert [x.name for x in cache_stats(c).components] == ["full"]
        c.release(req)
