"""The v2 calls for side pools (here an SWA-style MHA host pool registered as ``swa``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

from tests.integrations.sglang.pools import attach, fill, host_pool, indices, page_bytes

KEYS = [f"{i:064x}" for i in range(3)]


def _attach(tmp_path: Path, seed: int, layout: str = "page_first") -> tuple[object, object, object]:
    kv, swa = host_pool("mha", layout), host_pool("mha", "layer_first")
    fill(kv, seed=seed)
    fill(swa, seed=seed + 1)
    be = attach(kv, {"file_path": str(tmp_path)})
    be.register_mem_host_pool_v2(swa, PoolName.SWA)
    return be, kv, swa


@pytest.mark.parametrize("layout", ["page_first", "page_head"])
def test_side_pool_pages_round_trip_and_gate_the_hit(tmp_path: Path, layout: str) -> None:
    """Side-pool pages are one record per page beside the KV pool's page records
    (``page_first``) or head records (``page_head``)."""
    be, _, swa = _attach(tmp_path, seed=20, layout=layout)
    assert be.batch_set_v1(KEYS, indices([0, 1, 2])) == [True] * 3  # type: ignore[attr-defined]
    put = PoolTransfer(name=PoolName.SWA, host_indices=indices([4, 5]), keys=KEYS[:2])
    assert be.batch_set_v2([put]) == {"swa": [True, True]}  # type: ignore[attr-defined]

    rd, _, swa2 = _attach(tmp_path, seed=40, layout=layout)
    trailing = PoolTransfer(
        name=PoolName.SWA, keys=KEYS[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES
    )
    res = rd.batch_exists_v2(KEYS, [trailing])  # type: ignore[attr-defined]
    assert (res.kv_hit_pages, res.restorable_prefix_pages) == (2, [1, 2])
    assert res.extra_pool_hit_pages == {"kv": 3, "swa": 2}
    every = PoolTransfer(name=PoolName.SWA, keys=KEYS, hit_policy=PoolHitPolicy.ALL_PAGES)
    assert rd.batch_exists_v2(KEYS, [every]).kv_hit_pages == 2  # type: ignore[attr-defined]
    get = PoolTransfer(name=PoolName.SWA, host_indices=indices([7, 8, 9]), keys=KEYS)
    assert rd.batch_get_v2([get]) == {"swa": [True, True, False]}  # type: ignore[attr-defined]
    assert page_bytes(swa2, 7) == page_bytes(swa, 4) and page_bytes(swa2, 8) == page_bytes(swa, 5)


def test_unregistered_side_pool_is_a_miss(tmp_path: Path) -> None:
    be, _, _ = _attach(tmp_path, seed=60)
    assert be.batch_set_v1(KEYS, indices([0, 1, 2])) == [True] * 3  # type: ignore[attr-defined]
    mamba = PoolTransfer(name=PoolName.MAMBA, host_indices=indices([1]), keys=KEYS[:1])
    assert be.batch_get_v2([mamba]) == {"mamba": [False]}  # type: ignore[attr-defined]
    probe = PoolTransfer(name=PoolName.MAMBA, keys=KEYS[:1], hit_policy=PoolHitPolicy.ALL_PAGES)
    assert be.batch_exists_v2(KEYS, [probe]).kv_hit_pages == 0  # type: ignore[attr-defined]
