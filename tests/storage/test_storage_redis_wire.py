"""The ``redis`` backend's own wire protocol: pipelines it writes in RESP itself (``EXISTS``,
``SET ... NX [EX ttl]``) land as redis-py's would, under ``key_prefix``, with the TTL."""

from __future__ import annotations

import pytest
import torch

from hicache.config import MemLayout
from hicache.keys import Namespace, page_keys
from hicache.memory import HostPool
from hicache.services.redis import RedisServer
from hicache.spec import KVSpec
from hicache.storage import SetOutcome, StorageOptions, create_storage
from hicache.storage.backends import redis as redis_mod
from hicache.storage.record import HEADER_SIZE, encode_record

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16")
NS = Namespace.for_spec(
    SPEC, model="m", weights_fingerprint="wire", layout="page_first", page_size=4
)


@pytest.mark.parametrize("precheck", [False, True], ids=["set-nx-alone", "exists-first"])
def test_prefixed_ttl_records_are_exact_and_present_keys_skipped(
    redis_service: RedisServer, monkeypatch: pytest.MonkeyPatch, precheck: bool
) -> None:
    """Small pages go straight to ``SET NX``; pages of ``PRECHECK_MIN_BYTES`` and more are
    looked up first (forced here by a zero threshold): the same outcomes and records."""
    import redis

    if precheck:
        monkeypatch.setattr(redis_mod, "PRECHECK_MIN_BYTES", 0)
    src = HostPool(SPEC, 6, 4, MemLayout.PAGE_FIRST, pin_memory=False)
    dst = HostPool(SPEC, 6, 4, MemLayout.PAGE_FIRST, pin_memory=False)
    raw = src.buffer.view(torch.uint8).view(-1)
    raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8))
    first = 2000 if precheck else 500  # the two cases share the server: their own keys
    keys = page_keys(NS, list(range(first, first + 24)))
    extra = {"url": redis_service.url, "key_prefix": "wire:", "ttl_s": 300}
    opts = StorageOptions(timeout_s=5.0, max_batch_pages=4)  # 6 pages: two chunks
    client = redis.Redis.from_url(redis_service.url)
    with create_storage("redis", namespace=NS, extra_config=extra, options=opts) as st:
        assert st.batch_set(keys[:2], src, [0, 1]).all_ok
        result = st.batch_set(keys, src, [0, 1, 2, 3, 4, 5])
        assert result.outcomes == (SetOutcome.SKIPPED,) * 2 + (SetOutcome.WRITTEN,) * 4
        assert st.batch_exists(keys) == 6
        for i, k in enumerate(keys):
            stored = client.get("wire:" + k.key)
            payload = [bytes(p) for p in src.page_bytes_views(i)]
            assert stored == encode_record(NS.digest, k.fingerprint, payload)
            assert 0 < client.ttl("wire:" + k.key) <= 300
            assert client.get(k.key) is None  # nothing outside the prefix
        assert st.batch_get(keys, dst, [5, 4, 3, 2, 1, 0]) == [True] * 6
    client.close()
    for i, back in enumerate([5, 4, 3, 2, 1, 0]):
        assert [bytes(p) for p in dst.page_bytes_views(back)] == [
            bytes(p) for p in src.page_bytes_views(i)
        ]
    assert len(stored) == HEADER_SIZE + src.page_bytes
