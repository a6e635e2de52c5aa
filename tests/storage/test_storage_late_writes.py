"""Gets that overran their deadline and write host pages late: ``host_writes_settled``.

The fake backend's ``get_delay_s`` makes a get's read land after ``batch_get`` returned
(like a zero-copy Mooncake get behind a frozen store); ``host_writes_settled`` must say
False exactly until those bytes have landed. Under CI the same is checked against a real,
frozen Mooncake store, and a nixl get behind a record file that stalls.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

from hicache.config import MemLayout
from hicache.keys import Namespace, PageKey, page_keys
from hicache.memory import HostPool
from hicache.spec import KVSpec
from hicache.storage import (
    MemoryFaults,
    MemoryStorage,
    MemoryStore,
    StorageOptions,
    create_storage,
)
from hicache.storage.deadline import DeadlineRunner
from tests.helpers.services import start_mooncake
from tests.helpers.storage_fixtures import require_nixl

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16")
PAGE = 4
NS = Namespace.for_spec(
    SPEC, model="m", weights_fingerprint="late", layout="page_first", page_size=PAGE
)
TIMEOUT_S = 0.2
DELAY_S = 0.8


def pool(fill: float) -> HostPool:
    p = HostPool(SPEC, 8, PAGE, MemLayout.PAGE_FIRST, pin_memory=False)
    p.buffer.fill_(fill)
    return p


def keys(first: int, n: int) -> list[PageKey]:
    return page_keys(NS, list(range(first, first + n * PAGE)))


def late_storage(store: MemoryStore) -> MemoryStorage:
    return MemoryStorage(
        NS,
        StorageOptions(timeout_s=TIMEOUT_S),
        store=store,
        faults=MemoryFaults(get_delay_s=DELAY_S),
    )


def test_timed_out_get_writes_late_and_settled_says_when() -> None:
    store = MemoryStore()
    src, dst = pool(1.0), pool(0.0)
    ks = keys(0, 2)
    with MemoryStorage(NS, store=store) as writer:
        assert writer.batch_set(ks, src, [0, 1]).all_ok
    with late_storage(store) as st:
        assert st.host_writes_settled(0)
        t = time.monotonic()
        assert st.batch_get(ks, dst, [5, 6]) == [False, False]
        assert time.monotonic() - t < TIMEOUT_S + 0.5  # returned at the deadline
        assert st.stats().miss("timeout") == 2
        assert not st.host_writes_settled(0)
        assert torch.count_nonzero(dst.read_pages([5, 6])) == 0  # not landed yet
        assert st.host_writes_settled(DELAY_S + 2.0)
        # settled means landed: the late read wrote the records into the pages it was handed
        assert torch.equal(dst.read_pages([5, 6]), src.read_pages([0, 1]))
        assert torch.count_nonzero(dst.read_pages([0, 1, 2, 3, 4, 7])) == 0


def test_settled_is_tracked_after_close() -> None:
    store = MemoryStore()
    ks = keys(100, 1)
    with MemoryStorage(NS, store=store) as writer:
        writer.batch_set(ks, pool(2.0), [0])
    st = late_storage(store)
    dst = pool(0.0)
    with st:
        assert st.batch_get(ks, dst, [3]) == [False]
    assert not st.host_writes_settled(0)  # closed, yet the stuck read runs on
    assert st.host_writes_settled(DELAY_S + 2.0)
    assert torch.count_nonzero(dst.read_pages([3])) > 0


def test_a_get_within_its_deadline_leaves_nothing_behind() -> None:
    store = MemoryStore()
    ks = keys(200, 2)
    with MemoryStorage(NS, store=store) as writer:
        writer.batch_set(ks, pool(3.0), [0, 1])
    faults = MemoryFaults(get_delay_s=0.05)
    with MemoryStorage(NS, StorageOptions(timeout_s=2.0), store=store, faults=faults) as st:
        assert st.batch_get(ks, pool(0.0), [0, 1]) == [True, True]
        assert st.host_writes_settled(0)


def test_backends_writing_only_on_the_calling_thread_are_always_settled(tmp_path: Path) -> None:
    with MemoryStorage(NS) as mem:
        assert mem.host_writes_settled(0)
    st = create_storage("file", namespace=NS, extra_config={"file_path": str(tmp_path)})
    assert st.host_writes_settled(0)  # before start too
    with st:
        assert st.host_writes_settled(0)
    with pytest.raises(ValueError, match="timeout_s"):
        st.host_writes_settled(-1)
    with pytest.raises(ValueError, match="timeout_s"):
        st.host_writes_settled(float("nan"))


def test_runner_counts_only_stuck_host_writers() -> None:
    runner = DeadlineRunner("t", workers=2)
    runner.start()
    release = threading.Event()
    try:
        assert runner.call(release.wait, 0.05, writes_host=False).timed_out
        assert runner.stuck == 1 and runner.stuck_host_writers == 0
        assert runner.wait_host_writes(0)
        assert runner.call(release.wait, 0.05, refuse_if_stuck=False, writes_host=True).timed_out
        assert runner.stuck == 2 and runner.stuck_host_writers == 1
        assert not runner.wait_host_writes(0.05)
        release.set()
        assert runner.wait_host_writes(2.0)
        assert runner.stuck_host_writers == 0
        assert runner.wait_idle(2.0) and runner.stuck == 0
    finally:
        release.set()
        runner.close()


class _Result:
    """A call's result that a weak reference can watch."""


def test_a_worker_keeps_no_result_once_its_call_returned() -> None:
    """A worker idling after a call holds nothing of it: the caller's dropping the result
    frees it (a Redis get's records, 64 MiB at 1 MiB pages, were held by each idle worker
    and freed inside the next call's time)."""
    runner = DeadlineRunner("t", workers=1)
    runner.start()
    try:
        res = runner.call(_Result, 2.0)
        assert res.ok and isinstance(res.value, _Result)
        ref = weakref.ref(res.value)
        del res
        assert runner.wait_idle(2.0)
        assert ref() is None
    finally:
        runner.close()


def test_mooncake_zero_copy_get_behind_a_frozen_store() -> None:
    """A zero-copy get in flight when the store freezes: settled only after it returns."""
    svc = start_mooncake(segment_size="64MiB")
    try:
        st = create_storage(
            "mooncake",
            namespace=NS,
            extra_config={**svc.extra_config, "zero_copy_min_bytes": 0},
            options=StorageOptions(timeout_s=1.0, connect_timeout_s=5.0),
        )
        src, dst = pool(1.0), pool(0.0)
        ks = keys(300, 2)
        with st:
            assert st.batch_set(ks, src, [0, 1]).all_ok
            assert st.batch_get(ks, dst, [2, 3]) == [True, True]  # pool registered, warm
            assert st.host_writes_settled(0)
            svc.freeze()
            try:
                t = time.monotonic()
                assert st.batch_get(ks, dst, [5, 6]) == [False, False]
                assert time.monotonic() - t < 1.0 + 2.5
                assert not st.host_writes_settled(0)
            finally:
                svc.thaw()
            assert st.host_writes_settled(60.0)
    finally:
        svc.kill()
        svc.close()


def test_nixl_get_behind_a_stalled_record_file(tmp_path: Path) -> None:
    """A nixl get whose record file stalls (a FIFO whose open blocks until a writer comes,
    as a hung file system would): the batch ends at its deadline with timeout misses,
    the stuck call is reported unsettled, and calls behind it are refused as timeouts
    until it returns; then the backend works again."""
    require_nixl()
    st = create_storage(
        "nixl",
        namespace=NS,
        extra_config={"file_path": str(tmp_path)},
        options=StorageOptions(timeout_s=0.3, stall_s=0.2),
    )
    src, dst = pool(1.0), pool(0.0)
    ks = keys(400, 2)
    with st:
        assert st.batch_set(ks, src, [0, 1]).all_ok
        fifo = st.path_of(ks[1].key)  # type: ignore[attr-defined]
        fifo.unlink()
        os.mkfifo(fifo)
        unblocked = False
        try:
            t = time.monotonic()
            assert st.batch_get(ks, dst, [2, 3]) == [False, False]
            assert time.monotonic() - t < 0.3 + 0.5
            assert not st.host_writes_settled(0)
            assert st.batch_get(ks[:1], dst, [4]) == [False]  # refused behind the stuck call
            assert st.batch_set(keys(500, 1), src, [2]).failed == 1
            s = st.stats()
            assert s.miss("timeout") == 3 and s.set_failed == 1
            assert dict(s.op_timeouts) == {"exists": 0, "get": 2, "set": 1}
            assert s.stalls["get"] == 1  # the one that waited its deadline
            os.close(os.open(fifo, os.O_WRONLY))  # a writer comes: the open returns
            unblocked = True
            assert st.host_writes_settled(5.0)
        finally:
            if not unblocked:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        fifo.unlink()
        assert st.batch_get(ks, dst, [2, 3]) == [True, False]  # absent now
        assert st.batch_set(ks, src, [0, 1]).outcomes[1].value == "written"
        assert st.batch_get(ks, dst, [2, 3]) == [True, True]
    assert torch.equal(dst.read_pages([2, 3]), src.read_pages([0, 1]))
