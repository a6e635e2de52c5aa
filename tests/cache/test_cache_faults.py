"""The facade under faults and its policies, through the request verbs, with exact state.

Each test here failed on the code before the request-level API (issue 8): a failed L2->L1
load raised out of ``poll`` and left unfilled L1 pages mapped, the selective write policy
counted inserts instead of requests, and the timeout deadline restarted after the lookup.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from hicache.cache import CacheRequest, HiCache, RequestState
from hicache.cache.report import cache_stats, check_integrity
from hicache.cache.request import CachedTokens
from hicache.config import CacheConfig, PrefetchConfig, WritePolicy
from hicache.keys import Namespace
from hicache.spec import KVSpec
from hicache.storage.backends.memory import MemoryFaults, MemoryStorage, MemoryStore
from hicache.storage.base import StorageOptions
from tests.helpers.kvdata import (
    FailingLoads,
    LoadGates,
    check_l1_hits,
    fill_device,
    finish,
    free_device_pages,
    page_kv,
    read_device,
    serve,
    write_tokens,
)

SPEC = KVSpec(num_layers=3, num_kv_heads=1, head_dim=2, dtype="float32")
PAGE = 2
TOKENS = [5, 6, 7, 8, 9, 10]


def make_cache(**overrides: object) -> HiCache:
    cfg: dict[str, object] = dict(
        page_size=PAGE, device_tokens=16, hicache_ratio=2.0, load_back_threshold=0
    )
    cfg.update(overrides)
    return HiCache(CacheConfig(**cfg), SPEC).start()  # type: ignore[arg-type]


@pytest.fixture
def failing() -> Iterator[tuple[HiCache, FailingLoads]]:
    hook = FailingLoads()
    cfg = CacheConfig(page_size=PAGE, device_tokens=16, hicache_ratio=2.0, load_back_threshold=0)
    cache = HiCache(cfg, SPEC, layer_hook=hook).start()
    yield cache, hook
    cache.close()


def test_a_failed_load_fails_its_request_unmaps_its_pages_and_releases_its_pins(
    failing: tuple[HiCache, FailingLoads],
) -> None:
    cache, hook = failing
    assert serve(cache, TOKENS) is not None
    cache.sync(wait=True)
    assert cache.full.pages.evict_device(8) == 3  # demoted: L2 only now
    hook.on = True
    req = cache.open(TOKENS, compute_last=False)
    assert cache.admit(req, TOKENS)
    assert req.prefix_pages == 3 and req.loading
    assert req.wait_layer(0, 10)  # layer 0 arrived before the failure
    assert not req.wait_layer(1, 10) and req.failed is not None
    cache.sync()
    (node,) = cache.full.pages.tree.iter_nodes()
    assert node.device is None and node.host is not None  # unmapped, L2 copy kept
    assert node.lock_ref == 0 and node.host_ref == 0
    assert cache_stats(cache).counters["load_failures_total"] == 1
    cache.commit(req, TOKENS)  # a failed request commits nothing
    cache.release(req, TOKENS)
    assert req.state is RequestState.RELEASED
    check_integrity(cache)
    assert cache.full.pages.device_pool.allocator.used_pages == 0
    cache.reset()  # nothing is left pinned
    assert serve(cache, TOKENS) is not None  # works again, recomputed


def test_a_failed_request_requeued_recomputes_what_its_load_could_not_bring(
    failing: tuple[HiCache, FailingLoads],
) -> None:
    """The fallback: requeue of a failed handle keeps nothing, and its next admission loads
    nothing from L2 (the load would fail again: every load does here), so its prefix is
    the part L1 still holds and the rest is computed; once committed, the next request
    hits all of it in L1."""
    cache, hook = failing
    serve(cache, TOKENS[:PAGE])  # page 0 is a node of its own
    assert serve(cache, TOKENS) is not None
    cache.sync(wait=True)
    assert cache.full.pages.evict_device(2) == 2  # pages 1-2 are in L2 only, page 0 stays in L1
    hook.on = True
    req = cache.open(TOKENS, compute_last=False)
    assert cache.admit(req, TOKENS) and req.prefix_pages == 3 and req.loading
    assert not all(req.wait_layer(i, 10) for i in range(SPEC.num_layers))
    cache.requeue(req, TOKENS)
    assert req.state is RequestState.WAITING and req.failed is not None
    cache.sync()  # the failed load applied: its chain is out of L1
    loads = cache_stats(cache).counters["load_failures_total"]
    assert cache.admit(req, TOKENS)
    assert req.failed is None and req.prefix_pages == 1 and not req.loading
    assert req.cached == CachedTokens(device=PAGE)
    assert read_device(cache, req.pages[:1]).equal(page_kv(cache, TOKENS, 0, 1))
    assert cache_stats(cache).counters["load_fallbacks_total"] == 1
    write_tokens(cache, TOKENS, req.pages[1:3], 1)  # the recompute
    cache.release(req, TOKENS)
    cache.sync()
    assert cache_stats(cache).counters["load_failures_total"] == loads  # nothing loaded
    hook.on = False
    again = serve(cache, TOKENS, hold=True)  # serve() checks the cached bytes
    assert again is not None and again.cached.device == len(TOKENS)
    cache.release(again)
    check_integrity(cache)


def test_after_a_failed_load_the_next_request_loads_the_right_bytes(
    failing: tuple[HiCache, FailingLoads],
) -> None:
    cache, hook = failing
    serve(cache, TOKENS)
    cache.sync(wait=True)
    cache.full.pages.evict_device(8)
    hook.on = True
    req = cache.open(TOKENS, compute_last=False)
    assert cache.admit(req, TOKENS)
    assert not all(req.wait_layer(i, 10) for i in range(SPEC.num_layers))
    cache.release(req, TOKENS, commit=False)
    hook.on = False
    again = serve(cache, TOKENS, hold=True)  # serve() checks the loaded bytes
    assert again is not None and again.cached.host == len(TOKENS)
    cache.release(again)
    check_integrity(cache)


def test_write_through_selective_counts_requests_not_inserts() -> None:
    with make_cache(write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE) as cache:
        req = serve(cache, TOKENS, hold=True)
        assert req is not None
        longer = [*TOKENS, 11, 12, 13, 14]  # its output crosses two page boundaries
        assert cache.grow(req, len(longer))
        write_tokens(cache, longer, req.pages[3:5], 3)
        cache.commit(req, longer)  # the prompt's node is passed again: no new hit
        cache.release(req, longer)
        cache.sync(wait=True)
        assert all(n.host is None for n in cache.full.pages.tree.iter_nodes())
        assert serve(cache, TOKENS) is not None  # the second request reusing it
        cache.sync(wait=True)
        prompt = cache.full.pages.match_prefix(TOKENS).last_device_node
        assert prompt.hit_count == 2 and prompt.host is not None
        check_integrity(cache)


def test_hits_are_counted_once_per_request_even_when_requeued() -> None:
    with make_cache() as cache:
        serve(cache, TOKENS)
        req = cache.open([*TOKENS, 1])
        assert cache.admit(req, [*TOKENS, 1])
        assert req.cached.device == 6
        cache.requeue(req, [*TOKENS, 1])
        assert req.state is RequestState.WAITING
        assert cache.admit(req, [*TOKENS, 1])
        c = cache_stats(cache).counters
        assert c["prefix_queries_total"] == 2 and c["device_hit_tokens_total"] == 6
        cache.release(req)
        check_integrity(cache)


def test_priority_reaches_the_tree_through_open() -> None:
    with make_cache(eviction_policy="priority") as cache:
        serve(cache, [1, 1, 1, 1], priority=5)
        serve(cache, [2, 2, 2, 2], priority=0)
        cache.sync(wait=True)
        cache.full.pages.evict_device(2)  # the low-priority span goes first, though it is newer
        assert cache.full.pages.match_prefix([1, 1, 1, 1]).device_tokens == 4
        assert cache.full.pages.match_prefix([2, 2, 2, 2]).device_tokens == 0


def _l3(cache: HiCache, store: MemoryStore, prefetch: PrefetchConfig) -> None:
    ns = Namespace.for_spec(
        SPEC,
        model="m",
        weights_fingerprint="w",
        layout=cache.context.config.mem_layout,
        page_size=PAGE,
    )
    cache.l3.attach(MemoryStorage(ns, store=store), ns, prefetch)


@pytest.mark.parametrize(
    ("base", "per_ki", "cap", "expected"),
    [
        (2.0, 0.0, 30.0, 2.0),  # the base term
        (0.0, 1024.0, 30.0, 6.0),  # the per-token term: 6 tokens looked up
        (2.0, 1024.0, 5.0, 5.0),  # the cap
    ],
)
def test_timeout_deadline_counts_from_arrival_and_covers_the_lookup(
    base: float, per_ki: float, cap: float, expected: float
) -> None:
    prefetch = PrefetchConfig(
        policy="timeout",
        prefetch_threshold=0,
        prefetch_timeout_base=base,
        prefetch_timeout_per_ki_token=per_ki,
        prefetch_timeout_max=cap,
    )
    with make_cache() as cache:
        _l3(cache, MemoryStore(), prefetch)
        req = cache.open(TOKENS, compute_last=False)
        p = req.prefetch
        assert p is not None
        assert p.deadline - p.started == pytest.approx(expected)
        cache.release(req)
        cache.sync(wait=True)
        check_integrity(cache)


def test_l3_backup_counts_written_pages_not_present_ones() -> None:
    store = MemoryStore()
    prefetch = PrefetchConfig(policy="wait_complete", prefetch_threshold=0)
    with make_cache() as a:
        _l3(a, store, prefetch)
        serve(a, TOKENS)
        a.sync(wait=True)
        assert cache_stats(a).counters["l3_backup_tokens_total"] == 6
    with make_cache() as b:  # the same pages again: all present already
        _l3(b, store, prefetch)
        pages = b.full.pages.alloc(3)
        assert pages is not None
        write_tokens(b, TOKENS, pages, 0)
        b.full.pages.insert(TOKENS, pages)
        b.sync(wait=True)
        c = cache_stats(b).counters
        assert c["l3_backup_tokens_total"] == 0 and c["l3_backup_present_tokens_total"] == 6


def test_a_queued_request_takes_what_best_effort_prefetched() -> None:
    store = MemoryStore()
    with make_cache() as a:
        _l3(a, store, PrefetchConfig(policy="wait_complete", prefetch_threshold=0))
        serve(a, TOKENS)
    with make_cache() as b:
        _l3(b, store, PrefetchConfig(policy="best_effort", prefetch_threshold=0))
        req = b.open(TOKENS, compute_last=False)  # arrives; the engine is busy elsewhere
        p = req.prefetch
        assert p is not None
        for _ in range(2000):
            b.sync()
            if p.finished:
                break
            time.sleep(0.001)
        assert b.ready(req) and b.admit(req, TOKENS)  # admitted later, from the queue
        assert req.cached.storage == 6
        assert all(req.wait_layer(i, 10) for i in range(SPEC.num_layers))
        assert read_device(b, req.pages[:3]).equal(page_kv(b, TOKENS, 0, 3))
        b.release(req, TOKENS)
        b.sync(wait=True)
        check_integrity(b)


def test_an_l3_read_past_its_deadline_never_lands_in_pages_someone_else_owns() -> None:
    """A get that overran its deadline writes its pages late: they stay quarantined until
    it returns, so the L2 copies of other requests keep their bytes."""
    store = MemoryStore()
    with make_cache(mem_layout="page_first") as a:
        _l3(a, store, PrefetchConfig(policy="wait_complete", prefetch_threshold=0))
        serve(a, TOKENS)
    prefetch = PrefetchConfig(
        policy="timeout",
        prefetch_threshold=0,
        prefetch_timeout_base=0.3,
        prefetch_timeout_per_ki_token=0.0,
    )
    with make_cache(mem_layout="page_first", hicache_ratio=1.5) as b:  # L1 8, L2 12 pages
        ns = Namespace.for_spec(
            SPEC,
            model="m",
            weights_fingerprint="w",
            layout=b.context.config.mem_layout,
            page_size=PAGE,
        )
        slow = MemoryStorage(
            ns,
            StorageOptions(timeout_s=0.1),
            store=store,
            faults=MemoryFaults(get_delay_s=2.0),
        )
        b.l3.attach(slow, ns, prefetch)
        req = b.open(TOKENS, compute_last=False)
        start = time.monotonic()
        while not b.ready(req):  # as agreed at the last sync
            time.sleep(0.005)
            b.sync()
        assert b.admit(req, TOKENS) and req.cached.storage == 0  # the get timed out
        assert cache_stats(b).counters["prefetch_timeouts_total"] == 1  # admitted unfinished
        b.release(req, TOKENS)
        check_integrity(b)  # the 3 read pages are held by the op, not free
        assert (
            b.l3.attached is not None
            and len(b.l3.attached.prefetches.quarantined_host_pages()) == 3
        )
        # other requests fill every other L2 page with their backups meanwhile
        others = [[i] * 4 for i in range(20, 24)]
        for toks in others:
            serve(b, toks)
        assert time.monotonic() - start < 2.0, "the late write landed before the check"
        assert len(b.l3.attached.prefetches.quarantined_host_pages()) == 3
        b.sync(wait=True)  # waits for the late write too: it lands in the quarantined pages only
        assert b.l3.attached.prefetches.quarantined_host_pages() == []
        check_integrity(b)
        b.full.pages.evict_device(8)  # everything L2-only: load back checks every byte
        for toks in others:
            if b.full.pages.match_prefix(toks).host_tokens:
                assert serve(b, toks) is not None
        check_integrity(b)


class GatedFailingBackup:
    """Wraps a copier: the first backup waits for ``gate``, then fails."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.failed = False

    def backup(self, *args: Any) -> None:
        if not self.failed:
            self.failed = True
            assert self.gate.wait(10)
            raise RuntimeError("injected backup failure")
        self.inner.backup(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _namespace(cache: HiCache) -> Namespace:
    return Namespace.for_spec(
        SPEC,
        model="m",
        weights_fingerprint="w",
        layout=cache.context.config.mem_layout,
        page_size=PAGE,
    )


def test_a_failed_backup_never_frees_l2_pages_another_op_still_uses() -> None:
    """The parent's backup fails while its child's backup (queued behind it) and then
    the child's slow L3 write still use the child's L2 pages: those stay until both
    are done, and only then are the L2 copies of the run (and below) dropped."""
    with make_cache(hicache_ratio=4.0) as cache:
        ns = _namespace(cache)
        slow_writes = MemoryStorage(ns, store=MemoryStore(), faults=MemoryFaults(delay_s=0.5))
        cache.l3.attach(slow_writes, ns, PrefetchConfig(prefetch_threshold=0))
        assert cache.full.pages.host_pool is not None
        engine = cache.full.pages.host.controller._engine
        gated = GatedFailingBackup(engine.copier)
        engine.copier = gated
        parent, child = [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]
        p_pages = cache.full.pages.alloc(2)
        assert p_pages is not None
        write_tokens(cache, parent, p_pages, 0)
        cache.full.pages.insert(parent, p_pages)  # backup op 1: will fail
        c_pages = cache.full.pages.alloc(2)
        assert c_pages is not None
        write_tokens(cache, child, c_pages, 2)
        cache.full.pages.insert(
            child, cache.full.pages.match_prefix(parent).device_pages + c_pages
        )  # op 2
        p_node = cache.full.pages.match_prefix(parent).last_device_node
        c_node = cache.full.pages.match_prefix(child).last_device_node
        assert p_node.host is not None and c_node.host is not None
        c_host = list(c_node.host)
        gated.gate.set()
        cache.full.pages.host.wait_idle()  # op 1 failed, op 2 landed: the child's L3 write is slow
        assert c_node.host is not None and list(c_node.host) == c_host  # not freed
        assert all(cache.full.pages.host.allocator.is_used(p) for p in c_host)
        assert p_node.lock_ref == 1  # the failed run stays pinned in L1 meanwhile
        cache.sync(wait=True)  # the L3 write lands; then the L2 copies are dropped
        cache.sync()
        assert p_node.host is None and c_node.host is None and p_node.lock_ref == 0
        assert cache_stats(cache).counters["backup_failures_total"] == 1
        check_integrity(cache)
        assert cache.full.pages.host.allocator.used_pages == 0


def test_detach_after_a_timed_out_flush_leaks_nothing() -> None:
    with make_cache() as cache:
        ns = _namespace(cache)
        slow = MemoryStorage(ns, store=MemoryStore(), faults=MemoryFaults(delay_s=1.0))
        cache.l3.attach(slow, ns, PrefetchConfig(prefetch_threshold=0))
        serve(cache, TOKENS)
        assert cache.full.pages.host_pool is not None
        cache.full.pages.host.wait_idle()  # the L2 copy landed; its L3 write now takes 1 s
        assert cache.l3.detach(timeout_s=0.1)  # the flush times out
        assert not (cache.l3.attached is not None)
        assert all(n.host_ref == 0 and n.lock_ref == 0 for n in cache.full.pages.tree.iter_nodes())
        check_integrity(cache)
        cache.reset()  # /flush_cache is not refused: no pin is left behind
        assert cache.full.pages.host.allocator.used_pages == 0


def _only_in_l3(cache: HiCache) -> tuple[Namespace, MemoryStore]:
    """Serve TOKENS with an L3 attached, detach it and empty L1 and L2: TOKENS' pages are
    then in the returned store alone (under the returned namespace)."""
    ns = _namespace(cache)
    store = MemoryStore()
    cache.l3.attach(MemoryStorage(ns, store=store), ns, PrefetchConfig())
    assert serve(cache, TOKENS) is not None
    cache.sync(wait=True)  # TOKENS' pages are in L3
    assert cache.l3.detach()
    cache.reset()
    return ns, store


def test_l2_pages_a_detached_backend_still_writes_stay_out_of_use_until_it_settles() -> None:
    """A prefetch read overran its deadline (the backend writes its L2 pages late) when
    the backend is detached: those pages stay used and counted held, and only once the
    backend says its writes settled does a poll free them."""
    with make_cache() as cache:
        ns, store = _only_in_l3(cache)
        assert (
            cache.full.pages.host_pool is not None
            and cache.full.pages.host.allocator.used_pages == 0
        )
        late = MemoryStorage(
            ns, StorageOptions(timeout_s=0.1), store=store, faults=MemoryFaults(get_delay_s=1.5)
        )
        cache.l3.attach(late, ns, PrefetchConfig(prefetch_threshold=0))
        req = cache.open(TOKENS, compute_last=False)
        end = time.monotonic() + 10
        while (
            cache.l3.attached is not None
            and not cache.l3.attached.prefetches.quarantined_host_pages()
        ):
            assert time.monotonic() < end, "the prefetch read was never issued"
            cache.sync()
            time.sleep(0.001)
        held = (
            cache.l3.attached.prefetches.quarantined_host_pages()
            if cache.l3.attached is not None
            else []
        )
        assert len(held) == 3
        assert cache.l3.detach()  # the read timed out; its bytes land later
        assert not (cache.l3.attached is not None)
        cache.sync()
        assert cache.full.pages.host.allocator.used_pages == 3  # quarantined, not free
        assert all(cache.full.pages.host.allocator.is_used(p) for p in held)
        check_integrity(cache)  # counted held by the detached backend
        end = time.monotonic() + 10
        while cache.full.pages.host.allocator.used_pages:
            assert time.monotonic() < end, "the retired backend's pages were never freed"
            cache.sync()
            time.sleep(0.01)
        assert late.host_writes_settled(0.0)
        cache.release(req)
        check_integrity(cache)


def test_a_waiting_request_whose_prefetch_a_detach_gave_up_is_ready_under_a_new_backend() -> None:
    """A request still waiting on a ``wait_complete`` prefetch when its backend is
    detached: the prefetch was given up with the tier, so under the next backend it waits
    for nothing: ready at once, admitted with what L1 and L2 hold (the rest recomputed)."""
    with make_cache() as cache:
        ns, store = _only_in_l3(cache)
        slow = MemoryStorage(ns, store=store, faults=MemoryFaults(get_delay_s=0.5))
        waiting = PrefetchConfig(policy="wait_complete", prefetch_threshold=0)
        cache.l3.attach(slow, ns, waiting)
        req = cache.open(TOKENS, compute_last=False)
        cache.sync()
        assert not cache.ready(req)  # its read takes 0.5 s
        assert cache.l3.detach()
        cache.l3.attach(MemoryStorage(ns, store=MemoryStore()), ns, waiting)
        cache.sync()
        assert cache.ready(req)  # nothing left to wait for
        assert cache.admit(req, TOKENS)
        assert req.cached.storage == 0
        cache.release(req)
        check_integrity(cache)


# -- load back under concurrency and faults ---------------------------------------------

LONGER = [*TOKENS, 11, 12, 13, 14]  # TOKENS and two more pages
OTHER = [1, 2, 3, 4, 1, 2]  # shares no page with TOKENS


def _l2_only(cache: HiCache, *seqs: list[int]) -> None:
    """Serve each of ``seqs`` (computing it) and leave it cached in L2 only."""
    for seq in seqs:
        assert serve(cache, seq) is not None
    cache.sync(wait=True)
    cache.full.pages.evict_device(cache.full.pages.usable)
    assert cache.full.pages.device_pool.allocator.used_pages == 0


def _admit(cache: HiCache, tokens: list[int]) -> CacheRequest:
    req = cache.open(tokens, compute_last=False)
    assert cache.admit(req, tokens)
    return req


def _settled(cache: HiCache, ops: int = 0) -> None:
    """Wait until at most ``ops`` L1<->L2 copies are in flight (others are parked)."""
    assert cache.full.pages.host_pool is not None
    end = time.monotonic() + 10
    while cache.full.pages.host.controller.pending > ops:
        assert time.monotonic() < end, "copies never finished"
        time.sleep(0.001)


@pytest.fixture
def gated() -> Iterator[tuple[HiCache, LoadGates]]:
    gates = LoadGates()
    cfg = CacheConfig(page_size=PAGE, device_tokens=16, hicache_ratio=2.0, load_back_threshold=0)
    cache = HiCache(cfg, SPEC, layer_hook=gates, wait_timeout_s=2.0).start()
    try:
        yield cache, gates
    finally:
        gates.release_all()
        cache.close()


def test_a_load_failing_while_admit_makes_room_leaves_no_l1_hit_on_unwritten_pages(
    failing: tuple[HiCache, FailingLoads],
) -> None:
    """L1 has exactly the load's pages free (another holder keeps the rest): the load is
    issued, then the rest of the prompt finds no room. However that admission ends, the
    failed load must leave no L1 page of TOKENS mapped that it never wrote."""
    cache, hook = failing
    _l2_only(cache, TOKENS)
    held = cache.full.pages.alloc(5)
    assert held is not None
    fill_device(cache, free_device_pages(cache), 7.0)  # what an unwritten page shows
    hook.on = True
    req = cache.open(LONGER, compute_last=False)
    if cache.admit(req, LONGER):
        assert not all(req.wait_layer(i, 10) for i in range(SPEC.num_layers))
        cache.release(req, commit=False)
    else:
        cache.release(req)
    cache.full.pages.free(held)
    cache.sync(wait=True)  # the load has failed by now
    hook.on = False
    m = cache.full.pages.match_prefix(TOKENS)
    assert read_device(cache, m.device_pages).equal(
        page_kv(cache, TOKENS, 0, m.device_tokens // PAGE)
    )
    assert (m.device_tokens, m.host_tokens) == (0, 6)  # the L2 copy stays, L1 has nothing
    check_integrity(cache)
    assert cache.full.pages.device_pool.allocator.used_pages == 0
    assert serve(cache, TOKENS) is not None  # loads the right bytes now


class _BackupAfterFailedLoad:
    """Wraps a copier: each backup first waits (at most 3 s) until ``hook`` has failed a
    load and that load has posted its completion (this backup is the only copy left)."""

    def __init__(self, inner: Any, cache: HiCache, hook: FailingLoads) -> None:
        self.inner = inner
        self.cache = cache
        self.hook = hook

    def backup(self, *args: Any) -> None:
        assert self.cache.full.pages.host_pool is not None
        end = time.monotonic() + 3
        self.hook.fired.wait(3)
        while self.cache.full.pages.host.controller.pending > 1 and time.monotonic() < end:
            time.sleep(0.001)
        self.inner.backup(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_load_failing_while_admit_pins_its_chain_is_dropped_all_the_same(
    failing: tuple[HiCache, FailingLoads],
) -> None:
    """The issue's sequence: admit loads TOKENS, then waits for a backup in flight to make
    room for the rest of its pages; the load fails meanwhile and its completion is
    applied in that wait, while admit pins the chain. The request must fail and no later
    match may return the chain's L1 pages."""
    cache, hook = failing
    _l2_only(cache, TOKENS)
    assert cache.full.pages.host_pool is not None
    engine = cache.full.pages.host.controller._engine
    engine.copier = _BackupAfterFailedLoad(engine.copier, cache, hook)  # type: ignore[assignment]
    x = [3, 3, 3, 3]
    x_pages = cache.full.pages.alloc(2)
    assert x_pages is not None
    write_tokens(cache, x, x_pages, 0)
    cache.full.pages.insert(x, x_pages)  # write-through: its backup pins it in L1 until it lands
    held = cache.full.pages.alloc(3)  # another holder: 3 pages free, the load's size
    assert held is not None
    fill_device(cache, free_device_pages(cache), 7.0)
    hook.on = True
    req = _admit(cache, LONGER)  # room for the rest came from X, once backed up
    assert req.prefix_pages == 3
    assert not req.wait_layer(1, 10) and req.failed is not None
    cache.sync()
    m = cache.full.pages.match_prefix(TOKENS)
    assert (m.device_tokens, m.host_tokens) == (0, 6)
    assert req.node is None  # failed and unpinned
    cache.release(req, commit=False)
    cache.full.pages.free(held)
    hook.on = False
    cache.sync(wait=True)
    check_l1_hits(cache, [TOKENS, x])
    check_integrity(cache)
    assert serve(cache, TOKENS) is not None


def test_two_l2_hits_admitted_in_one_step_load_concurrently(
    gated: tuple[HiCache, LoadGates],
) -> None:
    """The first request's load is parked before its layer 1: the second request's
    admission does not wait for it, and its own load runs to the end meanwhile."""
    cache, gates = gated
    _l2_only(cache, TOKENS, OTHER)
    gates.park(0)
    first = _admit(cache, TOKENS)
    assert gates.parked(0)
    second = _admit(cache, OTHER)  # before the fix: waited for the first load (timeout)
    assert all(second.wait_layer(i, 10) for i in range(SPEC.num_layers))
    assert first.loading and not second.loading
    assert read_device(cache, second.pages[:3]).equal(page_kv(cache, OTHER, 0, 3))
    with pytest.raises(TimeoutError):
        first.wait_layer(1, 0.05)
    gates.release(0)
    assert finish(cache, first, TOKENS)  # checks its loaded bytes
    assert finish(cache, second, OTHER)
    cache.sync(wait=True)
    c = cache_stats(cache).counters
    assert c["load_ops_total"] == 2 and c["load_failures_total"] == 0
    check_integrity(cache)


def test_a_request_sharing_a_chain_still_loading_waits_for_its_layers(
    gated: tuple[HiCache, LoadGates],
) -> None:
    """The second request's prefix is the first one's chain (still loading) plus two
    pages of its own it loads itself: it depends on both loads and waits for each."""
    cache, gates = gated
    _l2_only(cache, LONGER)
    gates.park(0)
    first = _admit(cache, TOKENS)  # loads pages 0-2 (the cached span splits)
    assert gates.parked(0)
    second = _admit(cache, LONGER)  # pages 0-2 in L1 (loading), loads pages 3-4
    assert second.prefix_pages == 5 and second.cached.host == 4
    assert list(second.pages[:3]) == list(first.pages[:3])
    assert second.loading
    assert second.wait_layer(0, 10)  # layer 0 of both loads arrived
    with pytest.raises(TimeoutError):
        second.wait_layer(1, 0.05)  # layer 1 of the first load has not
    _settled(cache, ops=1)  # its own load went on to the end meanwhile
    gates.release(0)
    assert finish(cache, second, LONGER)  # all five pages hold their bytes
    assert finish(cache, first, TOKENS)
    cache.sync(wait=True)
    check_l1_hits(cache, [TOKENS, LONGER])
    check_integrity(cache)


def test_a_failed_load_fails_every_request_over_it_and_drops_the_loads_below(
    gated: tuple[HiCache, LoadGates],
) -> None:
    """The first load fails while the second request pins its chain and its own load
    of the pages below is still copying: both requests fail, neither chain stays in L1
    (the one still copying leaves the tree at once, its pages are freed when its copy is
    done), and the L2 copies stay."""
    cache, gates = gated
    _l2_only(cache, LONGER)
    gates.park(0, fail=True)
    gates.park(1)
    first = _admit(cache, TOKENS)
    assert gates.parked(0)
    second = _admit(cache, LONGER)
    assert gates.parked(1)
    gates.release(0)
    _settled(cache, ops=1)  # the first load failed and posted it; the second is parked
    cache.sync()
    assert first.failed is not None and second.failed is not None
    assert first.node is None and second.node is None
    m = cache.full.pages.match_prefix(LONGER)
    assert (m.device_tokens, m.host_tokens) == (0, 10)
    check_integrity(cache)  # the parked load's pages are held, not free
    assert not second.wait_layer(1, 10)
    for req in (first, second):
        cache.release(req, commit=False)
    gates.release(1)
    cache.sync(wait=True)
    assert cache.full.pages.device_pool.allocator.used_pages == 0
    assert all(n.lock_ref == 0 and n.host_ref == 0 for n in cache.full.pages.tree.iter_nodes())
    check_integrity(cache)
    assert serve(cache, LONGER) is not None  # loads the right bytes now


def test_a_commit_that_adopts_pages_still_loading_waits_for_them() -> None:
    """The first request computed TOKENS itself (too short to load back); meanwhile a
    second one loads LONGER, whose first pages are TOKENS. The first one's commit gives it
    the tree's pages, which that load is still writing: its next forward must wait."""
    gates = LoadGates()
    cfg = CacheConfig(page_size=PAGE, device_tokens=16, hicache_ratio=2.0, load_back_threshold=8)
    cache = HiCache(cfg, SPEC, layer_hook=gates, wait_timeout_s=2.0).start()
    try:
        _l2_only(cache, LONGER)
        first = _admit(cache, TOKENS)
        assert first.prefix_pages == 0 and not first.loading  # 6 tokens: not loaded back
        write_tokens(cache, TOKENS, first.pages, 0)
        gates.park(0)
        second = _admit(cache, LONGER)  # 10 tokens: loaded back
        assert gates.parked(0) and second.loading
        cache.commit(first, TOKENS)  # its pages are duplicates of the loading ones
        assert list(first.pages) == list(second.pages[:3])
        assert first.loading
        with pytest.raises(TimeoutError):
            first.wait_layer(1, 0.05)
        gates.release(0)
        assert all(first.wait_layer(i, 10) for i in range(SPEC.num_layers))
        assert read_device(cache, first.pages).equal(page_kv(cache, TOKENS, 0, 3))
        cache.release(first)
        assert finish(cache, second, LONGER)
        cache.sync(wait=True)
        check_integrity(cache)
    finally:
        gates.release_all()
        cache.close()
