"""The tree's L3 marks (``TreeNode.stored``): set when a write landed on every rank or a
prefetch read the pages from L3, kept by splits, never set by a failed write, forgotten
when the tier detaches."""

from __future__ import annotations

from hicache.cache import HiCache
from hicache.config import CacheConfig
from hicache.spec import KVSpec
from hicache.storage.backends.memory import MemoryFaults, MemoryStore
from tests.helpers.kvdata import insert, serve
from tests.helpers.l3_cache import attach_memory

MHA = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
PAGE = 2
TOKENS = [3, 1, 4, 1, 5, 9, 2, 6]


def make(store: MemoryStore, faults: MemoryFaults | None = None) -> HiCache:
    cfg = CacheConfig(page_size=PAGE, device_tokens=16, hicache_ratio=2.0, load_back_threshold=0)
    cache = HiCache(cfg, MHA).start()
    attach_memory(cache, store, faults=faults)
    return cache


def marks(cache: HiCache) -> list[tuple[int, bool]]:
    """(tokens, stored) of every node, parents first along each path."""
    tree = cache.full.pages.tree
    return [(tree.num_tokens(n), n.stored) for n in tree.iter_nodes()]


def test_a_landed_write_marks_its_run_and_a_split_keeps_the_mark() -> None:
    with make(MemoryStore()) as cache:
        insert(cache, TOKENS)
        assert marks(cache) == [(8, False)]  # the L2 backup has not landed yet
        cache.full.pages.tree.match_prefix([*TOKENS[:4], 0, 0])  # split while in flight
        cache.sync(wait=True)
        assert marks(cache) == [(4, True), (4, True)]
        cache.full.pages.tree.match_prefix([*TOKENS[:2], 0, 0])  # a split after landing
        assert marks(cache) == [(2, True), (2, True), (4, True)]


def test_a_failed_write_marks_nothing() -> None:
    with make(MemoryStore(), MemoryFaults(fail_after=0)) as cache:
        insert(cache, TOKENS)
        cache.sync(wait=True)
        assert marks(cache) == [(8, False)]


def test_pages_a_prefetch_read_are_marked_and_a_detach_forgets_every_mark() -> None:
    store = MemoryStore()
    with make(store) as a:
        insert(a, TOKENS)
        a.sync(wait=True)
    with make(store) as b:
        req = serve(b, [*TOKENS, 7], hold=True)
        assert req is not None and req.cached.storage == 8
        assert marks(b) == [(8, True)]
        b.release(req)
        b.sync(wait=True)
        assert b.l3.detach()
        assert marks(b) == [(8, False)]
