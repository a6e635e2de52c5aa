"""The fake in-memory backend's injectable latency and failures (for controller tests)."""

from __future__ import annotations

import time

import pytest
import torch

from hicache.config import MemLayout
from hicache.keys import Namespace, PageKey, page_keys
from hicache.memory import HostPool
from hicache.spec import KVSpec
from hicache.storage import MemoryFaults, MemoryStorage, MemoryStore, StorageOptions, create_storage
from hicache.storage.backends.memory import shared_store
from hicache.storage.record import encode_record

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4)
NS = Namespace.for_spec(
    SPEC, model="m", weights_fingerprint="w", layout="page_first_direct", page_size=2
)


def pool() -> HostPool:
    p = HostPool(SPEC, 4, 2, MemLayout.PAGE_FIRST_DIRECT, pin_memory=False)
    p.buffer.copy_(torch.randn(p.buffer.shape))
    return p


def keys(n: int = 2) -> list[PageKey]:
    return page_keys(NS, list(range(2 * n)))


def test_delay_below_deadline_only_slows() -> None:
    with MemoryStorage(NS, StorageOptions(timeout_s=1.0), faults=MemoryFaults(delay_s=0.05)) as st:
        t = time.monotonic()
        assert st.batch_set(keys(), pool(), [0, 1]).ok == [True, True]
        assert time.monotonic() - t >= 0.05
        assert st.batch_get(keys(), pool(), [2, 3]) == [True, True]


def test_delay_past_deadline_times_out_at_the_deadline() -> None:
    st = MemoryStorage(NS, StorageOptions(timeout_s=0.1), faults=MemoryFaults(delay_s=10.0))
    with st:
        t = time.monotonic()
        assert st.batch_get(keys(), pool(), [0, 1]) == [False, False]
        assert st.batch_exists(keys()) == 0
        failed = st.batch_set(keys(), pool(), [0, 1])
        assert (failed.written, failed.present, failed.failed) == (0, 0, 2)
        assert time.monotonic() - t < 1.0
        s = st.stats()
        assert s.miss("timeout") == 2 and s.timeouts == 3 and s.set_failed == 2


def test_fail_after_and_runtime_change() -> None:
    with MemoryStorage(NS, faults=MemoryFaults(fail_after=1)) as st:
        assert st.batch_set(keys(), pool(), [0, 1]).ok == [True, True]  # operation 1
        assert st.batch_get(keys(), pool(), [2, 3]) == [False, False]  # operation 2 fails
        assert st.stats().miss("error") == 2 and st.stats().errors == 1
        st.set_faults(MemoryFaults())
        assert st.batch_get(keys(), pool(), [2, 3]) == [True, True]


def test_bad_records_planted_in_the_store() -> None:
    store = MemoryStore()
    with MemoryStorage(NS, store=store) as st:
        ks = keys()
        st.batch_set(ks, pool(), [0, 1])
        good = store.get(ks[0].key)
        assert good is not None
        store.replace(ks[0].key, good[:-1] + bytes([good[-1] ^ 1]))
        store.replace(
            ks[1].key, encode_record(NS.with_salt("x").digest, ks[1].fingerprint, [good[64:]])
        )
        dst = pool()
        before = dst.read_pages([2, 3]).clone()
        assert st.batch_get(ks, dst, [2, 3]) == [False, False]
        assert torch.equal(dst.read_pages([2, 3]), before)  # a bad record never touches the pool
        assert st.stats().miss("corrupt") == 1 and st.stats().miss("foreign") == 1


def test_registry_shares_named_stores_and_validates() -> None:
    shared_store("t-shared").clear()
    a = create_storage("memory", namespace=NS, extra_config={"store": "t-shared"})
    b = create_storage("memory", namespace=NS, extra_config={"store": "t-shared", "delay_s": 0.0})
    with a, b:
        assert a.batch_set(keys(), pool(), [0, 1]).ok == [True, True]
        assert b.batch_exists(keys()) == 2
    with pytest.raises(ValueError, match="delay_s"):
        create_storage("memory", namespace=NS, extra_config={"delay_s": -1})
    with pytest.raises(ValueError, match="fail_after"):
        create_storage("memory", namespace=NS, extra_config={"fail_after": 1.5})
    with pytest.raises(ValueError, match="'latency' \\(value 1\\) is unknown"):
        create_storage("memory", namespace=NS, extra_config={"latency": 1})


def test_faults_of_another_rank_do_not_apply_here() -> None:
    # no process group here: this process is rank 0
    mine = create_storage("memory", namespace=NS, extra_config={"fail_after": 0, "fault_rank": 0})
    other = create_storage("memory", namespace=NS, extra_config={"fail_after": 0, "fault_rank": 1})
    assert isinstance(mine, MemoryStorage) and isinstance(other, MemoryStorage)
    assert mine.faults.fail_after == 0 and other.faults == MemoryFaults()
    with pytest.raises(ValueError, match=r"fault_rank=-1 is invalid"):
        create_storage("memory", namespace=NS, extra_config={"fault_rank": -1})
