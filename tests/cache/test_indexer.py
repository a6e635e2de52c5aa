"""The DSA indexer's keys as a component store (tiny sizes, exact state, byte equality).

Pages of 2 tokens; the keys are one vector of ``index_head_dim = 3`` values per token and
layer (2 layers), in pools on the full KV's page ids. A request writes the keys of its new
positions into its slots (:meth:`CacheRequest.pool_slots`), which are its full-KV slots;
the cache backs them up, loads them back and writes them to L3 with the full KV, and a
match ends before the first node without its keys (ALL_PAGES).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest
import torch

from hicache.cache import CacheRequest, HiCache
from hicache.cache.components import IndexerStore
from hicache.cache.components.indexer import INDEXER
from hicache.cache.report import cache_stats, check_integrity
from hicache.config import CacheConfig, MemLayout
from hicache.keys import Namespace, page_keys
from hicache.memory.layout import gather_pages
from hicache.spec import CacheSpec, IndexerSpec, KVSpec
from hicache.storage.backends.memory import MemoryStore
from hicache.tree.components import Tier
from hicache.tree.node import TreeNode
from tests.helpers.kvdata import wait_ready
from tests.helpers.l3_cache import attach_recording
from tests.helpers.recording_storage import RecordingStorage

FULL = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32")
SPEC = IndexerSpec(num_layers=2, index_head_dim=3)
PAGE = 2
PROMPT = list(range(100, 117))  # 17 tokens: 8 whole pages before the last token


def config(**kw: object) -> CacheConfig:
    args: dict[str, object] = dict(
        page_size=PAGE, device_tokens=32, hicache_ratio=2.0, load_back_threshold=0
    )
    args.update(kw)
    return CacheConfig(**args)  # type: ignore[arg-type]


def make(**kw: object) -> HiCache:
    return HiCache(config(**kw), CacheSpec(kv=FULL, components=(SPEC,))).start()


@pytest.fixture
def cache() -> Iterator[HiCache]:
    with make() as c:
        yield c


def store_of(cache: HiCache) -> IndexerStore:
    s = cache.stores.of_type(IndexerStore)
    assert s is not None
    return s


def key_value(tokens: list[int], pos: int, layer: int) -> torch.Tensor:
    """The indexer key a model would compute at ``pos`` (depends on the whole prefix)."""
    base = float(sum(tokens[: pos + 1]) + pos)
    return torch.tensor([base, base + 0.5 + layer, -base - layer])


def write_keys(cache: HiCache, req: CacheRequest, tokens: list[int], lo: int, hi: int) -> None:
    """A forward's keys of positions ``[lo, hi)`` into ``req``'s indexer slots."""
    slots = req.pool_slots(PAGE, hi)[INDEXER]
    assert torch.equal(slots, req.slots(PAGE, hi))  # the full KV's slots
    buf = store_of(cache).device_pool.buffer  # (1, L, S, 1, D)
    for pos in range(lo, hi):
        for layer in range(SPEC.num_layers):
            buf[0, layer, int(slots[pos]), 0] = key_value(tokens, pos, layer)


def keys_ok(cache: HiCache, req: CacheRequest, tokens: list[int], hi: int) -> bool:
    """Whether ``req``'s indexer slots of positions ``[0, hi)`` hold ``tokens``' keys."""
    slots = req.pool_slots(PAGE, hi)[INDEXER]
    buf = store_of(cache).device_pool.buffer
    return all(
        torch.equal(buf[0, layer, int(slots[pos]), 0], key_value(tokens, pos, layer))
        for pos in range(hi)
        for layer in range(SPEC.num_layers)
    )


def serve_in_chunks(cache: HiCache, tokens: list[int], chunk: int = 8) -> None:
    """Compute ``tokens`` in chunks of ``chunk``, committing after each, then release."""
    req = cache.open(tokens)
    assert cache.admit(req, tokens)
    assert keys_ok(cache, req, tokens, req.prefix_tokens)
    pos = req.prefix_tokens
    while pos < len(tokens):
        end = min(pos + chunk, len(tokens))
        assert cache.grow(req, end, computed=pos)
        write_keys(cache, req, tokens, pos, end)
        pos = end
        cache.commit(req, tokens[:pos])
        check_integrity(cache)
    cache.release(req, tokens)
    cache.sync(wait=True)
    check_integrity(cache)


def admit_and_check(cache: HiCache, tokens: list[int]) -> int:
    """Admit ``tokens``, check the prefix's keys in L1, release; returns the prefix."""
    req = cache.open(tokens)
    wait_ready(cache, req)
    assert cache.admit(req, tokens)
    prefix = req.prefix_tokens
    assert keys_ok(cache, req, tokens, prefix)
    cache.release(req)
    cache.sync(wait=True)
    check_integrity(cache)
    return prefix


def path(cache: HiCache, tokens: list[int]) -> list[TreeNode]:
    """The nodes the tree holds for ``tokens`` (any tier), top-down."""
    last = cache.full.pages.tree.match_full(tokens).last_host_node
    return cache.full.pages.tree.path_tail(last, cache.full.pages.tree.depth_pages(last))


def drop_keys(cache: HiCache, node: TreeNode, tier: Tier) -> None:
    """Forget ``node``'s keys in ``tier`` (what a lost copy or record leaves)."""
    cache.full.pages.tree.component(INDEXER).set(node, tier, None)


# ---------------------------------------------------------------------- the spec


def test_the_spec_is_validated_and_sized() -> None:
    with pytest.raises(ValueError, match="index_head_dim"):
        IndexerSpec(num_layers=2, index_head_dim=0)
    with pytest.raises(ValueError, match="dtype"):
        IndexerSpec(num_layers=2, index_head_dim=4, dtype="fp8")
    assert SPEC.kv.token_bytes == 2 * 3 * 4
    assert SPEC.device_token_bytes(config()) == 24.0


# ---------------------------------------------------------------------- the pools


def test_pools_share_the_full_kvs_page_ids(cache: HiCache) -> None:
    s = store_of(cache)
    assert s.device_pool.num_pages == cache.full.pages.device_pool.num_pages == 16
    assert s.host_pool is not None and cache.full.pages.host_pool is not None
    assert s.host_pool.num_pages == cache.full.pages.host_pool.num_pages == 32
    serve_in_chunks(cache, PROMPT)
    for n in path(cache, PROMPT):
        assert cache.full.pages.tree.component(INDEXER).get(n, Tier.DEVICE) == n.device
        assert cache.full.pages.tree.component(INDEXER).get(n, Tier.HOST) == n.host
    assert (
        cache.full.pages.tree.component_ids(INDEXER, Tier.DEVICE)
        == cache.full.pages.tree.device_page_ids()
    )
    full, keys = cache_stats(cache).components
    assert (keys.name, keys.device_used, keys.device_cached) == (INDEXER, 8, 8)
    assert (full.device_used, full.device_cached) == (8, 8)
    assert (keys.host_used, keys.host_cached) == (full.host_used, full.host_cached) == (8, 8)
    with pytest.raises(RuntimeError, match="no allocator"):
        s.allocator(Tier.DEVICE)


def test_a_request_reuses_the_keys_from_l1(cache: HiCache) -> None:
    serve_in_chunks(cache, PROMPT)
    assert admit_and_check(cache, PROMPT) == 16
    assert cache.stores.component_hits()[0].l1 == 1


# ---------------------------------------------------------------------- ALL_PAGES


def test_the_match_stops_before_the_first_node_without_its_keys(cache: HiCache) -> None:
    serve_in_chunks(cache, PROMPT)  # nodes of pages [0, 4), [4, 8)
    top, second = path(cache, PROMPT)
    assert cache.full.pages.tree.match_prefix(PROMPT).device_tokens == 16
    drop_keys(cache, second, Tier.DEVICE)  # its L2 keys stay: an L2 hit
    m = cache.full.pages.tree.match_prefix(PROMPT)
    assert (m.device_tokens, m.host_tokens) == (8, 8)
    drop_keys(cache, second, Tier.HOST)  # in no tier now: the match ends above it
    m = cache.full.pages.tree.match_prefix(PROMPT)
    assert (m.device_tokens, m.host_tokens, m.limited_by) == (8, 0, INDEXER)
    drop_keys(cache, top, Tier.HOST)  # L1 only at the top: a hit anywhere still
    assert cache.full.pages.tree.match_prefix(PROMPT).device_tokens == 8
    drop_keys(cache, top, Tier.DEVICE)
    assert cache.full.pages.tree.match_prefix(PROMPT).matched_tokens == 0
    check_integrity(cache)


def test_keys_in_l2_only_are_loaded_with_the_hit(cache: HiCache) -> None:
    serve_in_chunks(cache, PROMPT)
    _, second = path(cache, PROMPT)
    drop_keys(cache, second, Tier.DEVICE)
    assert admit_and_check(cache, PROMPT) == 16  # the keys of [4, 8) came from L2
    assert cache.full.pages.tree.component(INDEXER).get(second, Tier.DEVICE) == second.device
    assert cache.stores.component_hits()[0].l2 == 1


def test_a_commit_marks_no_keys_on_nodes_whose_pages_are_not_the_requests(
    cache: HiCache,
) -> None:
    serve_in_chunks(cache, PROMPT[:9])  # pages [0, 4) cached with their keys
    (top,) = path(cache, PROMPT[:9])
    drop_keys(cache, top, Tier.DEVICE)
    drop_keys(cache, top, Tier.HOST)  # no hit: a request recomputes pages [0, 4)
    req = cache.open(PROMPT)
    assert cache.admit(req, PROMPT) and req.prefix_tokens == 0
    write_keys(cache, req, PROMPT, 0, 17)
    own = req.pages[:4]
    cache.commit(req, PROMPT)
    assert top.device is not None and top.device != own  # the tree kept its pages
    assert (
        cache.full.pages.tree.component(INDEXER).get(top, Tier.DEVICE) is None
    )  # so no keys there
    cache.release(req, PROMPT)
    cache.sync(wait=True)
    check_integrity(cache)


# ---------------------------------------------------------------------- eviction


def test_eviction_drops_keys_with_their_full_kv_and_keeps_the_invariant() -> None:
    with make(device_tokens=20, hicache_ratio=1.5) as cache:  # 10 L1 pages, 15 L2 pages
        prompts = [[p * 50 + i for i in range(9)] for p in range(6)]  # 4 pages each
        for p in prompts:
            serve_in_chunks(cache, p)
        comp = cache.full.pages.tree.component(INDEXER)
        for n in cache.full.pages.tree.iter_nodes():
            if n.parent is None:
                continue
            assert comp.get(n, Tier.DEVICE) == n.device
            assert comp.get(n, Tier.HOST) == n.host
        assert cache.full.pages.counters.device_demoted_tokens_total == 32  # 16 pages left L1
        assert cache.full.pages.counters.host_evicted_tokens_total == 24  # 12 pages left L2
        assert admit_and_check(cache, prompts[-1]) == 8
        cache.full.pages.evict_device(cache.full.pages.device_pool.num_pages)
        assert cache.full.pages.tree.component_ids(INDEXER, Tier.DEVICE) == []
        assert admit_and_check(cache, prompts[-1]) == 8  # from L2, keys and all
        check_integrity(cache)


# ---------------------------------------------------------------------- byte equality


def digest(pool_buffer: torch.Tensor, layout: MemLayout, pages: list[int]) -> str:
    """SHA-256 of ``pages`` of an indexer pool in canonical order (path order)."""
    idx = torch.tensor(pages, dtype=torch.int64)
    data = gather_pages(pool_buffer, layout, idx, PAGE)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def prefix_pages(cache: HiCache, tokens: list[int], tier: Tier) -> list[int]:
    out: list[int] = []
    for n in path(cache, tokens):
        ids = cache.full.pages.tree.component(INDEXER).get(n, tier)
        assert ids is not None
        out += ids
    return out


LAYOUTS = [MemLayout.LAYER_FIRST, MemLayout.PAGE_FIRST, MemLayout.PAGE_FIRST_DIRECT]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_keys_survive_device_host_device(layout: MemLayout) -> None:
    with make(mem_layout=layout) as cache:
        s = store_of(cache)
        serve_in_chunks(cache, PROMPT)
        before = digest(
            s.device_pool.buffer, MemLayout.LAYER_FIRST, prefix_pages(cache, PROMPT, Tier.DEVICE)
        )
        assert s.host_pool is not None
        host = digest(s.host_pool.buffer, layout, prefix_pages(cache, PROMPT, Tier.HOST))
        assert host == before
        cache.full.pages.evict_device(cache.full.pages.device_pool.num_pages)  # L2 only now
        s.device_pool.buffer.zero_()  # nothing left in L1 to be read by mistake
        assert admit_and_check(cache, PROMPT) == 16
        after = digest(
            s.device_pool.buffer, MemLayout.LAYER_FIRST, prefix_pages(cache, PROMPT, Tier.DEVICE)
        )
        assert after == before


def namespace(layout: MemLayout) -> Namespace:
    """What :func:`attach_recording` keys a cache of ``layout`` under."""
    return Namespace.for_spec(
        FULL, model="m", weights_fingerprint="w", layout=layout, page_size=PAGE
    )


def attach(cache: HiCache, store: MemoryStore, layout: MemLayout) -> RecordingStorage:
    assert cache.context.config.mem_layout == layout
    return attach_recording(cache, store, INDEXER)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_keys_survive_host_l3_host(layout: MemLayout) -> None:
    store = MemoryStore()
    with make(mem_layout=layout) as cache:
        attach(cache, store, layout)
        serve_in_chunks(cache, PROMPT)
        s = store_of(cache)
        assert s.host_pool is not None
        before = digest(s.host_pool.buffer, layout, prefix_pages(cache, PROMPT, Tier.HOST))
        cache.sync(wait=True)
        assert cache.full.pages.counters.l3_backup_indexer_pages_total == 8
        assert cache.full.pages.counters.l3_backup_indexer_pages_failed_total == 0
    keys = page_keys(namespace(layout).with_component(INDEXER), PROMPT, PAGE)
    assert [store.contains(k.key) for k in keys] == [True] * 8
    with make(mem_layout=layout) as cold:  # a second server over the same L3
        storage = attach(cold, store, layout)
        req = cold.open(PROMPT)
        wait_ready(cold, req)
        s2 = store_of(cold)
        assert cold.admit(req, PROMPT)
        assert req.cached.storage == 16
        assert storage.read() == (8, 8)  # every page and its keys' record
        assert keys_ok(cold, req, PROMPT, 16)
        assert s2.host_pool is not None
        after = digest(s2.host_pool.buffer, layout, prefix_pages(cold, PROMPT, Tier.HOST))
        assert after == before
        cold.release(req)
        cold.sync(wait=True)
        check_integrity(cold)


def test_a_prefetch_stops_at_the_first_page_without_its_record() -> None:
    store = MemoryStore()
    layout = MemLayout.PAGE_FIRST
    with make(mem_layout=layout) as cache:
        attach(cache, store, layout)
        serve_in_chunks(cache, PROMPT)
    keys = page_keys(namespace(layout).with_component(INDEXER), PROMPT, PAGE)
    store.delete(keys[5].key)  # page 6's keys are gone: pages 6.. cannot be used
    with make(mem_layout=layout) as cold:
        storage = attach(cold, store, layout)
        assert admit_and_check(cold, PROMPT) == 10  # pages 1..5
        assert storage.read() == (5, 5)  # pages past 5 are not read
        assert cold.full.pages.counters.prefetch_tokens_total == 10
        assert cold.full.pages.counters.prefetch_component_records_total == 5
