"""Byte exactness of recurrent-state snapshots through every tier, and spec-version safety.

* D -> H -> D: SHA-256 of each snapshot's bytes is unchanged after an L1 -> L2 backup and
  an L2 -> L1 load, for every host layout and io backend.
* H -> L3 -> H: unchanged after an L2 -> L3 write and an L3 -> L2 read (``"mamba"``
  records), for every host layout and the memory, file, redis and mooncake backends;
  the record's payload is the documented canonical byte order.
* A version-1 record never reads as data: planted under a version-2 key it is a
  ``stale`` miss (counted); under its own ``hc1-`` key a version-2 reader never finds it.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pytest
import torch
import xxhash

from hicache.config import IOBackend, MemLayout
from hicache.keys import Namespace, PageKey, page_keys
from hicache.memory.state_pool import StatePool
from hicache.spec import SnapshotSpec, StateTensor
from hicache.storage import MissReason
from hicache.storage.backends.memory import MemoryStorage
from hicache.storage.base import HiCacheStorage
from hicache.storage.record import HEADER_SIZE, RECORD_MAGIC
from hicache.storage.registry import create_storage
from hicache.transfer.state import make_state_copier
from tests.helpers.storage_fixtures import open_component_storage

STATE = SnapshotSpec(
    num_layers=3,
    tensors=(
        StateTensor(name="conv", shape=(4, 3), dtype="bfloat16"),
        StateTensor(name="ssm", shape=(2, 3, 5), dtype="float32"),
    ),
)
SLOTS = 6
PAGE = 4
TOKENS = list(range(100, 100 + 3 * PAGE))


def ns(layout: MemLayout) -> Namespace:
    base = Namespace(
        model="tiny-hybrid",
        weights_fingerprint="w1",
        kv_dtype="float32",
        layout=layout,
        page_size=PAGE,
    )
    return base.with_component("mamba")


def random_slots(pool: StatePool, slots: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    data = []
    for t, b in zip(STATE.tensors, pool.buffers, strict=True):
        x = torch.randn((len(slots), STATE.num_layers, *t.shape), generator=g)
        data.append(x.to(b.dtype))
    pool.write_slots(slots, data)


def canonical_bytes(pool: StatePool, slot: int) -> bytes:
    """The documented payload: per tensor in spec order, the slot's (L, *shape) bytes."""
    return b"".join(
        t.contiguous().view(torch.uint8).numpy().tobytes() for t in pool.read_slots([slot])
    )


def sha(pool: StatePool, slot: int) -> str:
    return hashlib.sha256(canonical_bytes(pool, slot)).hexdigest()


@pytest.mark.parametrize("io", list(IOBackend))
@pytest.mark.parametrize("layout", list(MemLayout))
def test_device_host_device_is_byte_exact(layout: MemLayout, io: IOBackend) -> None:
    device = StatePool.device(STATE, SLOTS, "cpu")
    host = StatePool.host(STATE, SLOTS, layout, "cpu")
    random_slots(device, [0, 2, 5], seed=1)
    want = [sha(device, s) for s in (0, 2, 5)]
    copier = make_state_copier(io)
    copier.backup(device, host, [0, 2, 5], [4, 1, 3])
    assert [sha(host, s) for s in (4, 1, 3)] == want
    copier.load(device, host, [4, 1, 3], [1, 3, 4])
    assert [sha(device, s) for s in (1, 3, 4)] == want


def snapshot_keys(layout: MemLayout) -> list[PageKey]:
    return page_keys(ns(layout), TOKENS)


def open_backend(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path, layout: MemLayout
) -> HiCacheStorage:
    # a fresh prefix per test: redis and mooncake are shared by the session
    base = Namespace(
        model=f"tiny-hybrid-{request.node.name}",
        weights_fingerprint="w1",
        kv_dtype="float32",
        layout=layout,
        page_size=PAGE,
    )
    return open_component_storage(backend, request, tmp_path, base, "mamba")


@pytest.mark.parametrize("backend", ["memory", "file", "redis", "mooncake", "aibrix-shfs", "nixl"])
@pytest.mark.parametrize("layout", list(MemLayout))
def test_host_l3_host_is_byte_exact(
    backend: str, layout: MemLayout, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    st = open_backend(backend, request, tmp_path, layout)
    try:
        keys = page_keys(st.namespace.with_component("mamba"), TOKENS)
        src = StatePool.host(STATE, SLOTS, layout, "cpu")
        random_slots(src, [1, 3, 4], seed=2)
        want = [sha(src, s) for s in (1, 3, 4)]
        assert st.batch_set_state(keys, src, [1, 3, 4]).written == 3
        assert st.batch_contains(keys) == [True, True, True]
        dst = StatePool.host(STATE, SLOTS, layout, "cpu")
        assert st.batch_get_state(keys, dst, [0, 5, 2]) == [True, True, True]
        assert [sha(dst, s) for s in (0, 5, 2)] == want
        # present keys are skipped, not rewritten
        assert st.batch_set_state(keys[:1], src, [1]).present == 1
    finally:
        st.close()


def test_record_payload_is_the_canonical_byte_order() -> None:
    for layout in MemLayout:
        st = MemoryStorage(ns(layout).with_component("full"))
        st.start()
        st.allow_component("mamba")
        pool = StatePool.host(STATE, SLOTS, layout, "cpu")
        random_slots(pool, [2], seed=3)
        key = snapshot_keys(layout)[1]
        st.batch_set_state([key], pool, [2])
        blob = st.store.get(key.key)
        assert blob is not None and len(blob) == HEADER_SIZE + STATE.slot_bytes
        assert blob[HEADER_SIZE:] == canonical_bytes(pool, 2)
        st.close()


def v1_record(payload: bytes, namespace_digest: bytes, fingerprint: bytes) -> bytes:
    """A record as spec version 1 wrote it (same layout, version field 1)."""
    head = struct.pack(
        "<4sHH32s8sQ", RECORD_MAGIC, 1, HEADER_SIZE, namespace_digest, fingerprint, len(payload)
    )
    cs = xxhash.xxh3_64(head)
    cs.update(payload)
    return head + struct.pack("<Q", cs.intdigest()) + payload


@pytest.mark.parametrize("backend", ["memory", "file"])
def test_a_version_1_record_reads_as_a_miss(backend: str, tmp_path: Path) -> None:
    layout = MemLayout.PAGE_FIRST
    base = ns(layout).with_component("full")
    if backend == "memory":
        st: HiCacheStorage = MemoryStorage(base)
    else:
        st = create_storage("file", namespace=base, extra_config={"file_path": str(tmp_path)})
    st.start()
    st.allow_component("mamba")
    key = snapshot_keys(layout)[0]
    pool = StatePool.host(STATE, SLOTS, layout, "cpu")
    random_slots(pool, [0], seed=4)
    blob = v1_record(canonical_bytes(pool, 0), key.namespace_digest, key.fingerprint)

    def plant(name: str) -> None:
        if isinstance(st, MemoryStorage):
            st.store.replace(name, blob)
        else:
            path = st.path_of(name)  # type: ignore[attr-defined]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(blob)

    # under its own v1 key ("hc1-" + the same hex): a v2 reader never looks there
    plant("hc1-" + key.digest.hex())
    assert st.batch_contains([key]) == [False]
    assert st.batch_get_state([key], pool, [1]) == [False]
    assert st.stats().miss(MissReason.ABSENT) == 1
    # planted under the v2 key: intact, but of version 1 -> a counted "stale" miss
    plant(key.key)
    assert st.batch_get_state([key], pool, [1]) == [False]
    assert st.stats().miss(MissReason.STALE) == 1
    st.close()
