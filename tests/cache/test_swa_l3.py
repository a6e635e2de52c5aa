"""Sliding-window pages through L3 at the cache level (in-memory backend, exact counts).

Window 4 tokens, pages of 2 (a hit of ``d`` pages needs the SWA pages ``d - 1, d``):

* A span written to L3 carries every L2 SWA page it holds, as ``"swa"`` records (as the
  L2 backup copies every L1 SWA page of the span), so a boundary inside it is an L3
  boundary too.
* A cold cache's prefetch reads the full pages up to the deepest boundary whose window L3
  has and exactly that window's SWA records (counted per record read); the window's bytes
  come back exactly and the storage hit is that boundary.
* A prefetch starts from what the tree holds, in any tier, even where the SWA validator
  ends the match earlier (tombstoned windows): held pages are never read again, and a
  window reaching back into the held part is read for the pages the tree has no SWA value
  of (adopted by the held nodes), not for those it has.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hicache.cache import HiCache
from hicache.cache.report import check_integrity
from hicache.config import CacheConfig, MemLayout, PrefetchConfig
from hicache.keys import Namespace, page_keys
from hicache.spec import CacheSpec
from hicache.storage.backends.memory import MemoryStore
from hicache.tree.components import Tier
from tests.cache.test_swa import FULL, PAGE, SWA_SPEC, read_swa, serve_in_chunks, swa_of
from tests.helpers.kvdata import wait_ready
from tests.helpers.recording_storage import RecordingStorage

LONG = list(range(100, 121))  # 21 tokens: 10 whole pages before the last token
NS = Namespace.for_spec(
    FULL, model="m", weights_fingerprint="w", layout=MemLayout.PAGE_FIRST, page_size=PAGE
)


def make_cache(store: MemoryStore) -> tuple[HiCache, RecordingStorage]:
    cfg = CacheConfig(
        page_size=PAGE, device_tokens=32, hicache_ratio=2.0, load_back_threshold=0,
        swa_full_tokens_ratio=0.5,
    )  # fmt: skip
    cache = HiCache(cfg, CacheSpec(kv=FULL, components=(SWA_SPEC,))).start()
    storage = RecordingStorage(store, NS, "swa")
    policy = PrefetchConfig(policy="wait_complete", prefetch_threshold=0)
    cache.l3.attach(storage, NS, policy)
    return cache, storage


@pytest.fixture
def store() -> Iterator[MemoryStore]:
    """L3 after one cache computed ``LONG`` in chunks of 8 tokens, committing each (runs
    end at pages 4, 8 and 10: the SWA records of pages 1..10 are written)."""
    st = MemoryStore()
    cache, _ = make_cache(st)
    with cache:
        serve_in_chunks(cache, LONG)
        assert cache.full.pages.counters.l3_backup_tokens_total == 10 * PAGE
        assert cache.full.pages.counters.l3_backup_swa_pages_total == 10
        assert cache.full.pages.counters.l3_backup_swa_pages_failed_total == 0
    yield st


def swa_pages_in(store: MemoryStore, tokens: list[int]) -> list[int]:
    """The pages of ``tokens`` whose SWA record is in ``store``."""
    keys = page_keys(NS.with_component("swa"), tokens, PAGE)
    return [i + 1 for i, k in enumerate(keys) if store.contains(k.key)]


def fetch(cache: HiCache, tokens: list[int]) -> tuple[int, int]:
    """A request for ``tokens`` after its prefetch, admitted: (storage hit, prefix); the
    window before the prefix holds ``tokens``' SWA values; released after."""
    req = cache.open(tokens)
    wait_ready(cache, req)
    assert cache.admit(req, tokens)
    prefix = req.prefix_tokens
    assert read_swa(cache, req, tokens, max(0, prefix - SWA_SPEC.window), prefix)
    out = (req.cached.storage, prefix)
    cache.release(req)
    cache.sync(wait=True)
    check_integrity(cache)
    return out


def test_written_records_are_every_swa_page_of_the_written_spans(store: MemoryStore) -> None:
    assert swa_pages_in(store, LONG[:20]) == list(range(1, 11))


def test_a_cold_prefetch_reads_the_boundarys_window_and_no_more(store: MemoryStore) -> None:
    prompt = LONG[:17]  # 8 whole pages before the last token
    cache, storage = make_cache(store)
    with cache:
        assert fetch(cache, prompt) == (8 * PAGE, 8 * PAGE)
        assert storage.read() == (8, 2)  # full pages 1..8, SWA records 7 and 8 only
        assert cache.full.pages.counters.prefetch_component_records_total == 2
        assert len(swa_of(cache).owned(Tier.HOST)) == 2


def test_a_boundary_without_its_window_in_l3_is_not_read(store: MemoryStore) -> None:
    prompt = LONG[:13]  # 6 whole pages; without page 5's record 6 and 5 have no window
    store.delete(page_keys(NS.with_component("swa"), LONG, PAGE)[4].key)
    cache, storage = make_cache(store)
    with cache:
        assert fetch(cache, prompt) == (4 * PAGE, 4 * PAGE)  # the deepest usable: 4
        assert storage.read() == (4, 2)  # pages past 4 are not read


def test_the_prefetch_starts_from_what_the_tree_holds(store: MemoryStore) -> None:
    cache, storage = make_cache(store)
    with cache:
        assert fetch(cache, LONG[:17]) == (8 * PAGE, 8 * PAGE)
        storage.read()
        # drop every SWA value the tree has (both tiers): pages 1..8 stay held, but no
        # boundary is valid locally any more
        tree, swa = cache.full.pages.tree, swa_of(cache)
        assert swa is not None
        for tier in Tier:
            for node in list(tree.component_eviction_order("swa", tier)):
                swa.free(tier, tree.evict_component("swa", node, tier))
        assert cache.full.pages.match_prefix(LONG[:16]).matched_tokens == 0
        # 9 pages: the window of 9 is pages 8 (held, no SWA value: read and adopted by
        # the held node) and 9 (read with its full page); pages 1..8 are not read again
        assert fetch(cache, LONG[:19]) == (1 * PAGE, 9 * PAGE)
        assert storage.read() == (1, 2)
        # 10 pages, the window of 9 held now: only page 10 and its SWA page are read
        assert fetch(cache, LONG) == (1 * PAGE, 10 * PAGE)
        assert storage.read() == (1, 1)


def test_a_held_boundary_fetches_its_window_alone(store: MemoryStore) -> None:
    cache, storage = make_cache(store)
    with cache:
        assert fetch(cache, LONG[:17]) == (8 * PAGE, 8 * PAGE)
        storage.read()
        tree, swa = cache.full.pages.tree, swa_of(cache)
        assert swa is not None
        for tier in Tier:  # pages 1..8 stay held (L1 and L2), no SWA value is left
            for node in list(tree.component_eviction_order("swa", tier)):
                swa.free(tier, tree.evict_component("swa", node, tier))
        assert cache.full.pages.match_prefix(LONG[:16]).matched_tokens == 0
        assert cache.full.pages.evict_device(100) == 8  # pages 1..8 in L2 only
        # the whole prompt is held: only the window of 8 (SWA pages 7, 8) is read
        assert fetch(cache, LONG[:17]) == (8 * PAGE, 8 * PAGE)
        assert storage.read() == (0, 2)
        assert cache.full.pages.counters.prefetch_component_records_total == 2 + 2
        assert cache.full.pages.match_prefix(LONG[:16]).matched_tokens == 8 * PAGE
