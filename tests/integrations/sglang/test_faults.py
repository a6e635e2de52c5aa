"""SGLang's own fault injector around HiCacheL3: misses, never wrong bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector

from tests.integrations.sglang.pools import attach, fill, host_pool, indices, page_bytes


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
