"""Byte exactness of sliding-window KV pages through every tier (``"swa"`` records).

* D -> H -> D: SHA-256 of each SWA page's bytes (all sliding layers, K and V) is unchanged
  after an L1 -> L2 backup and an L2 -> L1 load, for every host layout and io backend.
* H -> L3 -> H: unchanged after an L2 -> L3 write and an L3 -> L2 read under the ``"swa"``
  namespace, for every host layout and the memory, file, redis and mooncake backends.
* The record's payload is the documented byte order (a full page's, over the sliding
  layers), and an ``"swa"`` record is never found under the ``"full"`` key of its page.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from hicache.config import IOBackend, MemLayout
from hicache.keys import Namespace, page_keys
from hicache.memory import DevicePool, HostPool
from hicache.memory.base import KVPool
from hicache.spec import KVSpec
from hicache.storage.backends.memory import MemoryStorage
from hicache.storage.base import HiCacheStorage
from hicache.storage.record import HEADER_SIZE
from hicache.transfer import make_copier
from tests.helpers.storage_fixtures import open_component_storage

SWA_KV = KVSpec(num_layers=3, num_kv_heads=2, head_dim=4, dtype="bfloat16")
PAGES = 6
PAGE = 4
TOKENS = list(range(300, 300 + 3 * PAGE))


def ns(layout: MemLayout, model: str = "tiny-swa") -> Namespace:
    return Namespace.for_spec(
        SWA_KV, model=model, weights_fingerprint="w1", layout=layout, page_size=PAGE
    )


def random_pages(pool: KVPool, pages: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    s = SWA_KV
    data = torch.randn((len(pages), s.num_kv, s.num_layers, PAGE, s.heads, s.dim), generator=g)
    pool.write_pages(pages, data.to(pool.dtype))


def sha(pool: KVPool, page: int) -> str:
    data = pool.read_pages([page]).contiguous()
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("io", list(IOBackend))
@pytest.mark.parametrize("layout", list(MemLayout))
def test_device_host_device_is_byte_exact(layout: MemLayout, io: IOBackend) -> None:
    device = DevicePool(SWA_KV, PAGES, PAGE, "cpu")
    host = HostPool.create(SWA_KV, PAGES, PAGE, layout, "cpu")
    random_pages(device, [0, 2, 5], seed=1)
    want = [sha(device, p) for p in (0, 2, 5)]
    copier = make_copier(io)
    copier.backup(device, host, torch.tensor([0, 2, 5]), torch.tensor([4, 1, 3]))
    assert [sha(host, p) for p in (4, 1, 3)] == want
    copier.load(device, host, torch.tensor([4, 1, 3]), torch.tensor([1, 3, 4]))
    assert [sha(device, p) for p in (1, 3, 4)] == want


def open_backend(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path, layout: MemLayout
) -> HiCacheStorage:
    # a fresh prefix per test: redis and mooncake are shared by the session
    base = ns(layout, model=f"tiny-swa-{request.node.name}")
    return open_component_storage(backend, request, tmp_path, base, "swa")


@pytest.mark.parametrize("backend", ["memory", "file", "redis", "mooncake", "aibrix-shfs", "nixl"])
@pytest.mark.parametrize("layout", list(MemLayout))
def test_host_l3_host_is_byte_exact(
    backend: str, layout: MemLayout, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    st = open_backend(backend, request, tmp_path, layout)
    try:
        keys = page_keys(st.namespace.with_component("swa"), TOKENS, PAGE)
        src = HostPool.create(SWA_KV, PAGES, PAGE, layout, "cpu")
        random_pages(src, [1, 3, 4], seed=2)
        want = [sha(src, p) for p in (1, 3, 4)]
        assert st.batch_set(keys, src, [1, 3, 4]).written == 3
        assert st.batch_contains(keys) == [True, True, True]
        full = page_keys(st.namespace, TOKENS, PAGE)
        assert st.batch_exists(full) == 0  # another namespace: other keys
        dst = HostPool.create(SWA_KV, PAGES, PAGE, layout, "cpu")
        assert st.batch_get(keys, dst, [0, 5, 2]) == [True, True, True]
        assert [sha(dst, p) for p in (0, 5, 2)] == want
        assert st.batch_set(keys[:1], src, [1]).present == 1  # present keys are skipped
    finally:
        st.close()


@pytest.mark.parametrize("layout", list(MemLayout))
def test_record_payload_is_the_documented_byte_order(layout: MemLayout) -> None:
    st = MemoryStorage(ns(layout))
    st.start()
    st.allow_component("swa")
    pool = HostPool.create(SWA_KV, PAGES, PAGE, layout, "cpu")
    random_pages(pool, [2], seed=3)
    key = page_keys(ns(layout).with_component("swa"), TOKENS, PAGE)[1]
    st.batch_set([key], pool, [2])
    blob = st.store.get(key.key)
    assert blob is not None and len(blob) == HEADER_SIZE + pool.page_bytes
    canon = pool.read_pages([2])[0]  # (K, L, page, H, D)
    if layout is MemLayout.PAGE_FIRST:  # per kind (page, L, H, D)
        slabs = [canon[k].permute(1, 0, 2, 3) for k in range(SWA_KV.num_kv)]
    else:  # per kind (L, page, H, D)
        slabs = [canon[k] for k in range(SWA_KV.num_kv)]
    want = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in slabs)
    assert blob[HEADER_SIZE:] == want
    st.close()
