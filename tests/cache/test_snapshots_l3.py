"""Recurrent-state snapshots through L3 at the cache level (in-memory backend).

* A span written to L3 carries its L2 snapshots as ``"mamba"`` records.
* A prefetch reads only up to the deepest boundary whose snapshot L3 has: pages past it
  are not read, the inserted span ends there with that snapshot in L2, and the storage
  hit counted is that boundary; the snapshot's bytes come back exactly.
* No snapshot in L3: nothing is fetched (no hit), never a match without one.
* Ranks agree on the deepest boundary every rank has (all-reduce(min) only).
* A snapshot evicted from L1 and L2 while its node's full KV stayed held is fetched alone
  (one record, no page) and adopted by the held node when that node's full KV is in L2;
  the storage hit counted is what it made usable beyond the local valid match, as far as
  it is loaded from L2. A held node whose full KV is in L1 alone is skipped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from hicache.cache import HiCache
from hicache.cache.components import SnapshotStore
from hicache.cache.components.records import agree_boundary
from hicache.cache.report import check_integrity
from hicache.config import CacheConfig, MemLayout, PrefetchConfig
from hicache.keys import Namespace, page_keys
from hicache.spec import CacheSpec
from hicache.storage.backends.memory import MemoryStorage, MemoryStore
from hicache.tree import TreeNode
from hicache.tree.components import Tier
from tests.cache.test_snapshots import PAGE, SPEC, STATE, kept, resume_state, snapshot
from tests.helpers.kvdata import page_kv, read_device, wait_ready, write_tokens
from tests.helpers.recording_storage import RecordingStorage

PROMPT = list(range(40, 40 + 9))  # 4 whole pages before the last token


NS = Namespace.for_spec(
    SPEC, model="m", weights_fingerprint="w", layout=MemLayout.PAGE_FIRST, page_size=PAGE
)


def make_cache(store: MemoryStore, storage: MemoryStorage | None = None) -> HiCache:
    cfg = CacheConfig(
        page_size=PAGE, device_tokens=32, hicache_ratio=2.0, load_back_threshold=0,
        max_mamba_cache_size=4,
    )  # fmt: skip
    cache = HiCache(cfg, CacheSpec(kv=SPEC, components=(STATE,))).start()
    policy = PrefetchConfig(policy="wait_complete", prefetch_threshold=0)
    cache.l3.attach(storage or MemoryStorage(NS, store=store), NS, policy)
    return cache


@pytest.fixture
def store() -> Iterator[MemoryStore]:
    yield MemoryStore()


def compute(cache: HiCache, prompt: list[int], snaps: dict[int, list[torch.Tensor]]) -> None:
    """Admit ``prompt``, write its whole pages before the last token, commit them page by
    page with ``snaps[pages]`` as the snapshot after that many pages; release."""
    req = cache.open(prompt)
    assert cache.admit(req, prompt)
    full = (len(prompt) - 1) // PAGE
    write_tokens(cache, prompt, req.pages[req.prefix_pages : full], req.prefix_pages)
    for pages in range(1, full + 1):
        cache.commit(req, prompt[: pages * PAGE], extras=kept(pages * PAGE, snaps.get(pages)))
    cache.release(req)
    cache.sync(wait=True)
    check_integrity(cache)


def fetch(cache: HiCache, prompt: list[int]) -> tuple[int, int, list[torch.Tensor] | None]:
    """A fresh request for ``prompt`` after its prefetch: (storage hit, prefix, state)."""
    req = cache.open(prompt)
    wait_ready(cache, req)
    assert cache.admit(req, prompt)
    for layer in range(SPEC.num_layers):
        assert req.wait_layer(layer, 10)
    assert read_device(cache, req.pages[: req.prefix_pages]).equal(
        page_kv(cache, prompt, 0, req.prefix_pages)
    )
    out = (req.cached.storage, req.prefix_tokens, resume_state(req))
    cache.release(req)
    cache.sync(wait=True)
    check_integrity(cache)
    return out


def test_prefetch_ends_at_the_deepest_snapshot_in_l3(store: MemoryStore) -> None:
    s2 = snapshot(7)
    with make_cache(store) as cache:
        compute(cache, PROMPT, {2: s2})  # pages 1..4 in L3, a snapshot after page 2
        assert cache.full.pages.counters.l3_backup_snapshots_total == 1
        assert cache.full.pages.counters.l3_backup_tokens_total == 4 * PAGE
    with make_cache(store) as cold:  # an empty L1/L2 on the same L3
        hit, prefix, state = fetch(cold, PROMPT)
        assert (hit, prefix) == (2 * PAGE, 2 * PAGE)  # the usable boundary only
        assert state is not None and all(a.equal(b) for a, b in zip(state, s2, strict=True))
        assert cold.full.pages.tree.stats().host_pages == 2  # pages past the snapshot were not read
        assert cold.full.pages.counters.prefetch_tokens_total == 2 * PAGE
        snaps = cold.stores.of_type(SnapshotStore)
        assert snaps is not None and len(snaps.owned(Tier.HOST)) == 1


def test_no_snapshot_in_l3_is_no_hit(store: MemoryStore) -> None:
    with make_cache(store) as cache:
        compute(cache, PROMPT, {})
        assert cache.full.pages.counters.l3_backup_tokens_total == 4 * PAGE
        assert cache.full.pages.counters.l3_backup_snapshots_total == 0
    with make_cache(store) as cold:
        hit, prefix, state = fetch(cold, PROMPT)
        assert (hit, prefix, state) == (0, 0, None)
        assert cold.full.pages.tree.stats().host_pages == 0


def test_deeper_snapshot_wins_and_l1_snapshot_loads_back(store: MemoryStore) -> None:
    s2, s4 = snapshot(1), snapshot(2)
    with make_cache(store) as cache:
        compute(cache, PROMPT, {2: s2, 4: s4})
        assert cache.full.pages.counters.l3_backup_snapshots_total == 2
    with make_cache(store) as cold:
        hit, prefix, state = fetch(cold, PROMPT)
        assert (hit, prefix) == (4 * PAGE, 4 * PAGE)
        assert state is not None and all(a.equal(b) for a, b in zip(state, s4, strict=True))


def drop_snapshot(cache: HiCache, depth_pages: int) -> TreeNode:
    """Evict the snapshot after ``depth_pages`` pages from L1 and L2 (its node and full KV
    stay); returns its node."""
    tree, snaps = cache.full.pages.tree, cache.stores.of_type(SnapshotStore)
    assert snaps is not None
    found = None
    for tier in Tier:
        for node in list(tree.component_eviction_order("mamba", tier)):
            if tree.depth_pages(node) == depth_pages:
                snaps.free(tier, tree.evict_component("mamba", node, tier))
                found = node
    assert found is not None
    return found


def computed_with_l3(store: MemoryStore) -> tuple[HiCache, RecordingStorage, list[torch.Tensor]]:
    """A cache that computed ``PROMPT`` (snapshots after pages 2 and 4, all in L2 and L3)
    and then lost the snapshot after page 4 in L1 and L2; pages 1..4 stay held."""
    s2, s4 = snapshot(1), snapshot(2)
    storage = RecordingStorage(store, NS, "mamba")
    cache = make_cache(store, storage)
    compute(cache, PROMPT, {2: s2, 4: s4})
    assert cache.full.pages.counters.l3_backup_snapshots_total == 2
    node = drop_snapshot(cache, 4)
    assert node.host is not None and node.device is not None
    assert cache.full.pages.match_prefix(PROMPT[:8]).matched_tokens == 2 * PAGE  # the valid match
    assert cache.full.pages.tree.match_full(PROMPT[:8]).matched_tokens == 4 * PAGE
    storage.read()
    return cache, storage, s4


def test_a_held_boundary_fetches_its_snapshot_alone(store: MemoryStore) -> None:
    cache, storage, s4 = computed_with_l3(store)
    with cache:
        assert cache.full.pages.evict_device(100) == 4  # pages 1..4 in L2 only
        hit, prefix, state = fetch(cache, PROMPT)
        assert storage.read() == (0, 1)  # the snapshot after page 4, no page
        assert (hit, prefix) == (2 * PAGE, 4 * PAGE)  # pages 3, 4: usable thanks to L3
        assert state is not None and all(a.equal(b) for a, b in zip(state, s4, strict=True))
        assert cache.full.pages.counters.prefetch_component_records_total == 1
        assert cache.full.pages.counters.prefetch_tokens_total == 0
        assert cache.full.pages.match_prefix(PROMPT[:8]).matched_tokens == 4 * PAGE


def test_a_held_boundary_in_l1_counts_no_storage_hit(store: MemoryStore) -> None:
    cache, storage, s4 = computed_with_l3(store)
    with cache:
        hit, prefix, state = fetch(cache, PROMPT)  # full KV in L1 and L2
        assert storage.read() == (0, 1)
        assert (hit, prefix) == (0, 4 * PAGE)  # no page loaded from L2: device hits
        assert state is not None and all(a.equal(b) for a, b in zip(state, s4, strict=True))
        assert cache.full.pages.counters.prefetch_component_records_total == 1


def test_a_held_boundary_without_l2_full_kv_is_skipped(store: MemoryStore) -> None:
    cache, storage, _ = computed_with_l3(store)
    with cache:
        node = cache.full.pages.tree.match_full(PROMPT[:8]).last_host_node
        assert cache.full.pages.evict_host(1) == 1  # page 4's L2 copy: L1 alone holds it
        assert node.host is None and node.device is not None
        hit, prefix, _ = fetch(cache, PROMPT)
        assert storage.read() == (0, 0)  # nothing read: no L2 node could adopt it
        assert (hit, prefix) == (0, 2 * PAGE)
        assert cache.full.pages.counters.prefetch_component_records_total == 0


def test_a_held_boundary_without_its_snapshot_in_l3_reads_nothing(store: MemoryStore) -> None:
    cache, storage, _ = computed_with_l3(store)
    with cache:
        store.delete(page_keys(NS.with_component("mamba"), PROMPT[:8], PAGE)[3].key)
        hit, prefix, _ = fetch(cache, PROMPT)
        assert storage.read() == (0, 0)
        assert (hit, prefix) == (0, 2 * PAGE)


class _Group:
    """all-reduce(min) over threads, one per fake rank."""

    def __init__(self, n: int) -> None:
        self._barrier = threading.Barrier(n)
        self._vals: dict[int, int] = {}
        self._lock = threading.Lock()

    def min_for(self, rank: int) -> Callable[[int], int]:
        def rank_min(v: int) -> int:
            with self._lock:
                self._vals[rank] = v
            self._barrier.wait()
            out = min(self._vals.values())
            self._barrier.wait()
            return out

        return rank_min


@pytest.mark.parametrize(
    ("present", "limit", "want"),
    [
        (({2, 4, 6}, {2, 3, 6}), 5, 2),  # 4 and 3 are each one rank's only
        (({2, 4, 6}, {2, 3, 6}), 8, 6),
        (({2, 4}, {3}), 8, 0),
        (({1}, {1}), 0, 0),
    ],
)
def test_ranks_agree_on_a_boundary_every_rank_has(
    present: tuple[set[int], set[int]], limit: int, want: int
) -> None:
    group = _Group(2)
    got: dict[int, int] = {}

    def rank(r: int) -> None:
        got[r] = agree_boundary(group.min_for(r), present[r], limit)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert got == {0: want, 1: want}
    assert agree_boundary(lambda v: v, present[0], limit) == max(
        (b for b in present[0] if b <= limit), default=0
    )


def _replica_main(rank: int, n: int, out: str) -> dict[str, object]:
    """Rank ``rank`` of 2 holding the model's one K/V head (replicated: rank 0 writes its
    head records) and its own shard of the recurrent state: serve the prompt with a
    snapshot after page 2 (this rank's own values) to a shared file L3, empty L1 and L2,
    fetch it again."""
    from hicache.controller.rank_group import RankGroup
    from hicache.heads import HeadSplit
    from hicache.storage.registry import create_storage

    cfg = CacheConfig(
        page_size=PAGE, device_tokens=32, hicache_ratio=2.0, load_back_threshold=0,
        max_mamba_cache_size=4, write_policy="write_through",
    )  # fmt: skip
    ns = Namespace.for_spec(
        SPEC, model="m", weights_fingerprint="w", layout=cfg.mem_layout, page_size=PAGE,
        tp_size=n, tp_rank=rank, head_records=True,
    )  # fmt: skip
    storage = create_storage("file", namespace=ns, extra_config={"file_path": f"{out}/l3"})
    storage.use_heads(HeadSplit(2, 1, n, rank))
    mine = snapshot(7 + rank)
    with HiCache(cfg, CacheSpec(kv=SPEC, components=(STATE,)), ranks=RankGroup()) as cache:
        policy = PrefetchConfig(policy="wait_complete", prefetch_threshold=0)
        cache.l3.attach(storage, ns, policy)
        assert cache.l3.attached is not None and cache.l3.attached.keys.writer == (rank == 0)
        compute(cache, PROMPT, {2: mine})
        cache.reset()
        hit, prefix, state = fetch(cache, PROMPT)
        own = state is not None and all(a.equal(b) for a, b in zip(state, mine, strict=True))
        return {"hit": hit, "prefix": prefix, "own_state": own}


def test_a_replica_rank_writes_its_own_state_shard(tmp_path: Path) -> None:
    """Under head records a rank whose K/V head a lower rank writes still writes its own
    snapshot records (per rank): both ranks resume from L3, each from its own shard."""
    from tests.helpers.ranks import run_ranks

    r0, r1 = run_ranks(_replica_main, 2, tmp_path)
    assert r0 == r1 == {"hit": 2 * PAGE, "prefix": 2 * PAGE, "own_state": True}
