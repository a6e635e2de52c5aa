"""Announcement records (``storage/announce.py``) on the memory and file backends: what
one instance announces another reads, until it expires; a new announcement replaces an
old one; an announcement never passes for the page, and a failing store reads none."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hicache.config import MemLayout
from hicache.keys import Namespace, PageKey, page_keys
from hicache.memory import HostPool
from hicache.spec import KVSpec
from hicache.storage import MemoryFaults, MemoryStorage, MemoryStore
from hicache.storage.announce import ANNOUNCE_PAYLOAD, announce_key
from hicache.storage.base import HiCacheStorage
from hicache.storage.registry import create_storage

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4)
NS = Namespace.for_spec(
    SPEC, model="m", weights_fingerprint="w", layout="page_first_direct", page_size=2
)


def keys(n: int = 3) -> list[PageKey]:
    return page_keys(NS, list(range(2 * n)))


@pytest.fixture(params=["memory", "file"])
def pair(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[HiCacheStorage, ...]]:
    """A writer and a reader instance over one store."""
    if request.param == "memory":
        store = MemoryStore()
        made = [MemoryStorage(NS, store=store) for _ in range(2)]
    else:
        extra = {"file_path": str(tmp_path)}
        made = [create_storage("file", namespace=NS, extra_config=extra) for _ in range(2)]
    for s in made:
        s.start()
    yield tuple(made)
    for s in made:
        s.close()


def test_the_key_is_its_own_record_with_the_pages_header_fields() -> None:
    k = keys(1)[0]
    a = announce_key(k)
    assert a.key != k.key and a.key.startswith("hc3-") and len(a.key) == len(k.key)
    assert (a.fingerprint, a.namespace_digest) == (k.fingerprint, k.namespace_digest)
    assert announce_key(k) == a
    assert ANNOUNCE_PAYLOAD == 16


def test_what_one_announces_another_reads_until_it_expires(
    pair: tuple[HiCacheStorage, HiCacheStorage],
) -> None:
    writer, reader = pair
    k = keys()
    assert reader.announced(k[0]) == 0.0
    assert writer.announce(k[:2], 5.0) == 2
    assert 4.0 < reader.announced(k[0]) <= 5.0
    assert 4.0 < reader.announced(k[1]) <= 5.0
    assert reader.announced(k[2]) == 0.0  # not announced
    assert reader.batch_exists(k) == 0  # an announcement is not the page
    many = reader.announced_many(k)  # the same, in one call
    assert 4.0 < many[0] <= 5.0 and 4.0 < many[1] <= 5.0 and many[2] == 0.0
    assert reader.announced_many([]) == []
    writer.announce(k[2:], 0.05)
    assert reader.announced(k[2]) > 0
    time.sleep(0.1)
    assert reader.announced(k[2]) == 0.0  # expired


def test_a_new_announcement_replaces_an_expired_one(
    pair: tuple[HiCacheStorage, HiCacheStorage],
) -> None:
    writer, reader = pair
    k = keys(1)
    writer.announce(k, 0.01)
    time.sleep(0.03)
    assert reader.announced(k[0]) == 0.0
    assert writer.announce(k, 5.0) == 1
    assert reader.announced(k[0]) > 4.0


def test_the_page_written_under_an_announced_key_reads_as_the_page(
    pair: tuple[HiCacheStorage, HiCacheStorage],
) -> None:
    writer, reader = pair
    host = HostPool(SPEC, 4, 2, MemLayout.PAGE_FIRST_DIRECT, pin_memory=False)
    host.buffer.copy_(torch.randn(host.buffer.shape))
    k = keys(1)
    writer.announce(k, 5.0)
    assert writer.batch_set(k, host, [0]).written == 1
    got = HostPool(SPEC, 4, 2, MemLayout.PAGE_FIRST_DIRECT, pin_memory=False)
    assert reader.batch_get(k, got, [1]) == [True]
    assert torch.equal(got.page_view(1)[0], host.page_view(0)[0])


def test_a_failing_store_stores_and_reads_no_announcement() -> None:
    store = MemoryStore()
    with (
        MemoryStorage(NS, store=store, faults=MemoryFaults(fail_after=0)) as broken,
        MemoryStorage(NS, store=store) as reader,
    ):
        k = keys(1)
        assert broken.announce(k, 5.0) == 0
        assert reader.announced(k[0]) == 0.0
        reader.announce(k, 5.0)
        assert broken.announced(k[0]) == 0.0  # cannot tell: no announcement
        assert broken.stats().errors >= 2
