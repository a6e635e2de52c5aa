"""HiCacheL3 through SGLang's StorageBackendFactory (dynamic) over SGLang's own host pools."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hicache.integrations.sglang import HiCacheL3
from tests.integrations.sglang.pools import (
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    attach,
    fill,
    host_pool,
    indices,
    page_bytes,
)

CASES = [("mha", lay) for lay in MHA_LAYOUTS] + [("mla", lay) for lay in MLA_LAYOUTS]
KEYS = ["a" * 64, "b" * 64, "c" * 64]


@pytest.mark.parametrize(("kind", "layout"), CASES)
def test_v1_round_trip_is_byte_exact(kind: str, layout: str, tmp_path: Path) -> None:
    """Pages 1..3 of one pool, written through batch_set_v1, read back by another
    instance into pages 5..7 of a fresh pool: byte-equal, every other page untouched."""
    extra = {"hicache_backend": "file", "file_path": str(tmp_path)}
    src = host_pool(kind, layout)
    fill(src, seed=1)
    writer = attach(src, extra, mla=kind == "mla")
    assert isinstance(writer, HiCacheL3)
    assert writer.batch_set_v1(KEYS, indices([1, 2, 3])) == [True, True, True]
    assert writer.batch_set_v1(KEYS[:1], indices([1])) == [True]  # present: skipped, success
    dst = host_pool(kind, layout)
    reader = attach(dst, extra, mla=kind == "mla")
    assert reader.batch_exists(KEYS) == 3
    assert reader.batch_get_v1(KEYS, indices([5, 6, 7])) == [True, True, True]
    for s, d in zip([1, 2, 3], [5, 6, 7], strict=True):
        assert page_bytes(dst, d) == page_bytes(src, s)
    zero = bytes(len(page_bytes(dst, 0)))
    assert all(page_bytes(dst, p) == zero for p in range(dst.page_num) if p not in (5, 6, 7))
    assert reader.stats is not None and reader.stats.get_hits == 3
    writer.close()
    reader.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_head"])
def test_copying_calls_share_records_with_v1(layout: str, tmp_path: Path) -> None:
    """The legacy calls move SGLang's flat pages (get_data_page / the dummy flat page);
    their records are the v1 records: set by one path, read by the other."""
    extra = {"file_path": str(tmp_path)}  # hicache_backend defaults to file
    src = host_pool("mha", layout)
    fill(src, seed=2)
    be = attach(src, extra)
    flat = [src.get_data_page(p * src.page_size, flat=True) for p in (1, 2)]
    assert be.batch_set(KEYS[:2], flat) is True
    assert be.set(KEYS[2], src.get_data_page(3 * src.page_size, flat=True)) is True
    dst = host_pool("mha", layout)
    rd = attach(dst, extra)
    assert rd.batch_get_v1(KEYS, indices([4, 5, 6])) == [True, True, True]
    for s, d in zip([1, 2, 3], [4, 5, 6], strict=True):
        assert page_bytes(dst, d) == page_bytes(src, s)
    targets = [dst.get_dummy_flat_data_page() for _ in KEYS]
    got = rd.batch_get([*KEYS, "d" * 64], [*targets, dst.get_dummy_flat_data_page()])
    assert got[3] is None
    for s, t in zip([1, 2, 3], got[:3], strict=True):
        assert t is not None
        assert t.view(torch.uint8).numpy().tobytes() == page_bytes(src, s)
    assert rd.get(KEYS[0], dst.get_dummy_flat_data_page()) is not None
    assert rd.exists(KEYS[0]) and not rd.exists("d" * 64)


def test_batch_exists_is_the_leading_run(tmp_path: Path) -> None:
    pool = host_pool("mha", "page_first")
    fill(pool, seed=3)
    be = attach(pool, {"file_path": str(tmp_path)})
    k = [f"{i:064x}" for i in range(5)]
    assert be.batch_set_v1([k[0], k[1], k[3], k[4]], indices([0, 1, 3, 4])) == [True] * 4
    assert be.batch_exists(k) == 2
    assert be.batch_exists(k[2:]) == 0
    assert be.batch_exists(k[3:]) == 2
    assert be.batch_exists([]) == 0
    assert [be.exists(x) for x in k] == [True, True, False, True, True]


def _record_of(be: HiCacheL3, key: str) -> Path:
    assert be.store is not None
    return be.store.path_of(be.page_key(key).key)  # type: ignore[attr-defined]


def test_flipped_byte_is_a_miss_then_healed(tmp_path: Path) -> None:
    """One flipped payload byte: that page misses (counted corrupt), its neighbours hit;
    the next write of the page replaces the record and it hits again."""
    src = host_pool("mha", "page_first_direct")
    fill(src, seed=4)
    be = attach(src, {"file_path": str(tmp_path)})
    assert be.batch_set_v1(KEYS, indices([1, 2, 3])) == [True] * 3
    path = _record_of(be, KEYS[1])
    blob = bytearray(path.read_bytes())
    blob[100] ^= 0x01
    path.write_bytes(bytes(blob))
    dst = host_pool("mha", "page_first_direct")
    rd = attach(dst, {"file_path": str(tmp_path)})
    assert rd.batch_get_v1(KEYS, indices([4, 5, 6])) == [True, False, True]
    assert page_bytes(dst, 4) == page_bytes(src, 1) and page_bytes(dst, 6) == page_bytes(src, 3)
    assert rd.stats is not None and rd.stats.misses["corrupt"] == 1
    assert be.batch_get_v1(KEYS[1:2], indices([9])) == [False]  # the writer reads it bad too
    assert be.batch_set_v1(KEYS[1:2], indices([2])) == [True]
    assert rd.batch_get_v1(KEYS[1:2], indices([5])) == [True]
    assert page_bytes(dst, 5) == page_bytes(src, 2)


def test_foreign_record_is_a_miss(tmp_path: Path) -> None:
    """A good record of another namespace (another model) planted under this model's key
    reads as a miss (foreign), never as data."""
    a = host_pool("mha", "page_first")
    fill(a, seed=5)
    be_a = attach(a, {"file_path": str(tmp_path)}, model="model-a")
    be_b = attach(host_pool("mha", "page_first"), {"file_path": str(tmp_path)}, model="model-b")
    assert be_a.batch_set_v1(KEYS[:1], indices([1])) == [True]
    assert be_b.batch_exists(KEYS[:1]) == 0  # other namespace: other keys
    planted = _record_of(be_b, KEYS[0])
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_bytes(_record_of(be_a, KEYS[0]).read_bytes())
    assert be_b.batch_get_v1(KEYS[:1], indices([2])) == [False]
    assert be_b.stats is not None and be_b.stats.misses["foreign"] == 1


def test_mla_writer_rule_and_shared_namespace(tmp_path: Path) -> None:
    """MLA: rank 1 (not the storage writer) never writes but reports success; rank 0's
    pages are read by rank 1 (one namespace for all MLA ranks). MHA ranks do not share."""
    extra = {"file_path": str(tmp_path)}
    p0, p1 = host_pool("mla", "page_first"), host_pool("mla", "page_first")
    fill(p0, seed=6)
    fill(p1, seed=7)
    r0 = attach(p0, extra, mla=True, tp_rank=0, tp_size=2)
    r1 = attach(p1, extra, mla=True, tp_rank=1, tp_size=2)
    assert not r1.is_writer and r0.is_writer
    assert r1.batch_set_v1(KEYS[:1], indices([1])) == [True]
    assert r1.batch_set([KEYS[1]], [p1.get_data_page(4, flat=True)]) is True
    assert r0.batch_exists(KEYS) == 0 and list(tmp_path.iterdir()) == []
    assert r0.batch_set_v1(KEYS[:1], indices([1])) == [True]
    assert r1.batch_get_v1(KEYS[:1], indices([3])) == [True]
    assert page_bytes(p1, 3) == page_bytes(p0, 1)
    m0 = attach(host_pool("mha", "page_first"), extra, tp_rank=0, tp_size=2)
    m1 = attach(host_pool("mha", "page_first"), extra, tp_rank=1, tp_size=2)
    assert m0.batch_set_v1(KEYS[:1], indices([1])) == [True]
    assert m1.batch_exists(KEYS[:1]) == 0 and m0.batch_exists(KEYS[:1]) == 1


def test_store_down_gives_misses_not_errors() -> None:
    """A Redis that is not there: construction and registration succeed, every call is a
    miss (False / None / 0) within the deadline, none raises."""
    pool = host_pool("mha", "page_first")
    fill(pool, seed=8)
    extra = {
        "hicache_backend": "redis",
        "url": "redis://127.0.0.1:9/0",
        "timeout_s": 0.5,
        "connect_timeout_s": 0.5,
    }
    be = attach(pool, extra)
    assert be.batch_set_v1(KEYS, indices([1, 2, 3])) == [False] * 3
    assert be.batch_get_v1(KEYS, indices([1, 2, 3])) == [False] * 3
    assert be.batch_exists(KEYS) == 0 and be.exists(KEYS[0]) is False
    assert be.batch_get(KEYS[:1], [pool.get_dummy_flat_data_page()]) == [None]
    assert be.batch_set(KEYS[:1], [pool.get_data_page(0, flat=True)]) is False


def test_a_store_down_at_registration_is_retried(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis frozen when SGLang registers the pool: the start fails (logged), calls miss;
    once it answers again, the next call past the retry interval starts the backend."""
    import os
    import signal

    from hicache.integrations.sglang import backend as backend_module

    server = request.getfixturevalue("redis_private")
    pool = host_pool("mha", "page_first")
    fill(pool, seed=9)
    extra = {"hicache_backend": "redis", "url": server.url, "timeout_s": 0.5}
    extra["connect_timeout_s"] = 0.5
    os.kill(server.pid, signal.SIGSTOP)
    try:
        be = attach(pool, extra)
        assert be.store is not None and not be.store.started
        assert be.batch_set_v1(KEYS[:1], indices([1])) == [False]  # within the interval
    finally:
        os.kill(server.pid, signal.SIGCONT)
    monkeypatch.setattr(backend_module, "RETRY_START_S", 0.0)
    assert be.batch_set_v1(KEYS[:1], indices([1])) == [True]
    assert be.batch_exists(KEYS[:1]) == 1


def test_get_stats_reports_each_transfer_to_sglangs_metrics(tmp_path: Path) -> None:
    """With SGLang's storage metrics on, get_stats() is SGLang's StorageMetrics of the KV
    page gets and sets since the last call (pages counted hit or not, as SGLang's Mooncake
    backend does), which SGLang's own collector accepts; off, it is None."""
    from sglang.srt.observability.metrics_collector import StorageMetrics

    extra = {"hicache_backend": "file", "file_path": str(tmp_path)}
    pool = host_pool("mha", "page_first")
    fill(pool, seed=3)
    quiet = attach(pool, extra)
    assert quiet.get_stats() is None
    quiet.close()
    be = attach(pool, extra, metrics=True)
    assert be.batch_set_v1(KEYS, indices([1, 2, 3])) == [True] * 3
    assert be.batch_get_v1([*KEYS[:2], "d" * 64], indices([4, 5, 6])) == [True, True, False]
    got = be.get_stats()
    assert isinstance(got, StorageMetrics)
    assert (got.backup_pgs, got.prefetch_pgs) == ([3], [3])
    assert len(got.backup_bandwidth) == len(got.prefetch_bandwidth) == 1
    assert got.backup_bandwidth[0] > 0 and got.prefetch_bandwidth[0] > 0
    again = be.get_stats()
    assert (again.backup_pgs, again.prefetch_pgs, again.prefetch_bandwidth) == ([], [], [])
    be.close()


@pytest.mark.parametrize(("layout", "zero_copy"), [("page_first", True), ("page_head", True),
                                                   ("page_first", False)])  # fmt: skip
def test_mooncake_moves_sglangs_pages_in_place(
    layout: str, zero_copy: bool, request: pytest.FixtureRequest
) -> None:
    """Over Mooncake the pages travel by address from and into SGLang's ``kv_buffer``,
    registered whole, byte-exact and no other page touched; with ``zero_copy: false`` the
    pool stays unregistered (pages are staged through hicache's arenas)."""
    svc = request.getfixturevalue("mooncake_service")
    # the test's pages are small: zero_copy_min_bytes 0 moves them in place all the same
    extra = {
        "hicache_backend": "mooncake",
        "zero_copy": zero_copy,
        "zero_copy_min_bytes": 0,
        **svc.extra_config,
    }
    keys = [f"{layout}-{zero_copy}-{i}".ljust(64, "x") for i in range(3)]
    src = host_pool("mha", layout)
    fill(src, seed=5)
    writer = attach(src, extra)
    assert writer.batch_set_v1(keys, indices([1, 2, 3])) == [True] * 3
    dst = host_pool("mha", layout)
    fill(dst, seed=6)
    reader = attach(dst, extra)
    untouched = [page_bytes(dst, p) for p in range(8) if p not in (5, 6, 7)]
    assert reader.batch_get_v1(keys, indices([5, 6, 7])) == [True] * 3
    assert [page_bytes(dst, p) for p in (5, 6, 7)] == [page_bytes(src, p) for p in (1, 2, 3)]
    assert [page_bytes(dst, p) for p in range(8) if p not in (5, 6, 7)] == untouched
    for be, pool in ((writer, src), (reader, dst)):
        ranges = be.store.registered_ranges()
        buf = pool.kv_buffer
        if zero_copy:
            assert ranges[buf.data_ptr()] == buf.numel() * buf.element_size()
        else:
            assert buf.data_ptr() not in ranges
        be.close()
