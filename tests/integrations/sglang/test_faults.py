"""SGLang's own fault injector around HiCacheL3: misses, never wrong bytes; and a get
that lands after its deadline never writes a page SGLang gave to another request."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.managers.cache_controller import PrefetchOperation
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector

from hicache.integrations.sglang.quarantine import HostQuarantine
from tests.helpers.services import private_mooncake
from tests.integrations.sglang.controller import TOKENS, WAIT_S, Make, pages_of, write_four_pages
from tests.integrations.sglang.pools import PAGE, attach, fill, host_pool, indices, page_bytes


def test_injected_failures_and_delays_are_misses_never_wrong_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = {"file_path": str(tmp_path)}
    src = host_pool("mha", "page_head")
    fill(src, seed=11)
    keys = [f"{i:064x}" for i in range(4)]
    clean = attach(src, extra)
    assert clean.batch_set_v1(keys, indices([0, 1, 2, 3])) == [True] * 4
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.5")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.002")
    dst = host_pool("mha", "page_head")
    faulty = attach(dst, extra)
    assert isinstance(faulty, HiCacheStorageFailureInjector)
    outcomes = set()
    for trial in range(24):
        fill(dst, seed=100 + trial)  # stale garbage in the target pages before each read
        ok = faulty.batch_get_v1(keys, indices([4, 5, 6, 7]))
        outcomes.add(all(ok))
        assert ok in ([True] * 4, [False] * 4)
        if all(ok):
            assert [page_bytes(dst, p) for p in (4, 5, 6, 7)] == [
                page_bytes(src, p) for p in (0, 1, 2, 3)
            ]
        hits = faulty.batch_exists(keys)
        assert hits in (0, 4)
    assert outcomes == {True, False}  # both happened (p = 2 * 0.5**24 that they did not)


def test_the_quarantine_keeps_held_pages_out_of_sglangs_free_list() -> None:
    """SGLang's own host pool: a held page SGLang frees stays allocated until the backend
    is settled, every other page is freed at once, and settling frees the deferred pages
    exactly once (SGLang's double-free check still holds)."""
    host = host_pool("mha", "page_first")
    settled = [False]
    q = HostQuarantine(host, lambda: settled[0])
    q.install()
    total = host.available_size()
    mine = host.alloc(2 * PAGE)
    other = host.alloc(2 * PAGE)
    q.hold(mine[PAGE:])  # the second page's get failed and may land late
    assert host.free(torch.cat([mine, other])) == 4 * PAGE
    assert q.deferred == mine[PAGE:].tolist()
    assert host.available_size() == total - PAGE
    rest = host.alloc(host.available_size())
    assert not set(rest.tolist()) & set(mine[PAGE:].tolist())
    assert host.alloc(PAGE) is None  # the held page is not handed out
    settled[0] = True
    back = host.alloc(PAGE)  # alloc settles first
    assert back is not None and back.tolist() == mine[PAGE:].tolist()
    assert (q.held, q.deferred) == ([], [])
    host.free(torch.cat([rest, back]))
    assert host.available_size() == total
    with pytest.raises(AssertionError, match="Double-free"):
        host.free(back)


@pytest.fixture
def frozen_mooncake() -> Iterator[Any]:
    """A Mooncake store of this test alone, which it freezes (SIGSTOP)."""
    with private_mooncake() as svc:
        yield svc


@pytest.mark.parametrize("store", ["memory", "mooncake"])
def test_a_late_zero_copy_get_never_changes_another_requests_pages(
    store: str, make: Make, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's controller prefetches four pages by zero-copy gets into its host pool,
    under SGLang's fault injector (random delays before every call); the get overruns its
    deadline (``memory``: its read sleeps 3 s past a 0.5 s deadline; ``mooncake``: the
    store is frozen) and writes the pages after SGLang freed them. Other requests then
    take every free host page: none of the four is among them, and no byte of any other
    page changes when the late write lands. Once it has, the four pages come back to
    SGLang's free list (free + reuse), holding the late records."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.01")
    svc = None
    if store == "memory":
        extra: dict[str, Any] = {"hicache_backend": "memory", "store": uuid.uuid4().hex}
        late = {**extra, "get_delay_s": 3.0, "timeout_s": 0.5}  # lands 2.5 s late
    else:
        svc = request.getfixturevalue("frozen_mooncake")
        # the test's pages are small: zero_copy_min_bytes 0 moves them in place all the same
        extra = {"hicache_backend": "mooncake", "zero_copy_min_bytes": 0, **svc.extra_config}
        late = {**extra, "timeout_s": 2.0}
    model = f"late-{uuid.uuid4().hex[:8]}"
    written = write_four_pages(make, "mha", "page_first", extra, model)
    reader = make("mha", "page_first", late, model)
    host, cc, backend = reader.host, reader.cc, reader.backend
    if store == "mooncake":  # a first zero-copy read registers the pool's kv_buffer
        warm = reader.prefetch("warm", TOKENS)
        assert pages_of(reader, warm.host_indices) == written
        host.free(warm.host_indices)
    q = backend.quarantine
    assert q is not None and backend.store is not None
    op = cc.prefetch("late", TOKENS)
    hit: PrefetchOperation = cc.prefetch_hit_queue.get(timeout=WAIT_S)
    assert hit is op and hit.storage_hit_count == len(TOKENS)
    indices = host.alloc(len(TOKENS))
    mine = sorted(indices.tolist())
    if svc is not None:
        svc.freeze()
    try:
        op.host_indices = indices
        cc.prefetch_buffer.put(op)
        while not cc.ack_prefetch_queue.get(timeout=WAIT_S).completed_req:
            pass
        completed, _ = cc.terminate_prefetch(op)
        assert completed == 0  # the get timed out: a miss
        assert not backend.store.host_writes_settled(0)
        cc.append_host_mem_release(indices[completed:])
        freed = [cc.host_mem_release_queue.get_nowait() for _ in range(len(TOKENS) // PAGE)]
        host.free(torch.cat(freed))  # SGLang frees the failed read's pages at once
        assert q.held == mine and q.deferred == mine
        others = host.alloc(host.available_size())  # other requests take every free page
        assert others is not None
        pages = sorted({i // PAGE for i in others.tolist()})  # theirs
        assert [p for p in range(host.size // PAGE) if p not in pages] == [
            i // PAGE for i in mine[::PAGE]
        ]
        fill(host, seed=41)  # their KV (and stale bytes in the held pages)
        before = [reader.page(p * PAGE) for p in pages]
    finally:
        if svc is not None:
            svc.thaw()
    assert backend.store.host_writes_settled(WAIT_S)  # the late write has landed
    assert [reader.page(p * PAGE) for p in pages] == before
    assert pages_of(reader, indices) == written  # it did land, in the held pages
    back = host.alloc(len(TOKENS))  # settled: the held pages are SGLang's again
    assert back is not None and sorted(back.tolist()) == mine
    assert (q.held, q.deferred) == ([], [])
    host.free(torch.cat([others, back]))
    assert host.available_size() == host.size
