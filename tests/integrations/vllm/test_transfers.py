"""The tier's rows and IO thread on their own (no vLLM manager): exact outcomes."""

from __future__ import annotations

import uuid

import pytest

from hicache.config import MemLayout
from hicache.integrations.vllm.namespace import page_keys_of
from hicache.integrations.vllm.rows import Rows, flat_rows
from hicache.integrations.vllm.transfers import Direction, Finished, TierTransfers, Transfer
from hicache.keys import Namespace
from hicache.storage.registry import create_storage

ROW = 64
NS = Namespace(
    model="m",
    weights_fingerprint="w",
    kv_dtype="float16",
    layout=MemLayout.PAGE_FIRST,
    page_size=4,
    tp_size=1,
    tp_rank=None,
    engine_layout="vllm:test",
)


def rows_view(n: int) -> memoryview:
    return memoryview(bytearray(n * ROW)).cast("B", (n, ROW))


def job(job_id: int, direction: Direction, ids: list[int], chunks: list[int]) -> Transfer:
    keys = tuple(i.to_bytes(32, "big") + b"\0\0\0\0" for i in ids)
    return Transfer(job_id, direction, keys, tuple(page_keys_of(NS, keys)), tuple(chunks))


def test_flat_rows_and_bad_rows_are_refused() -> None:
    flat, n, row = flat_rows(rows_view(3))
    assert (flat.nbytes, n, row) == (3 * ROW, 3, ROW)
    with pytest.raises(ValueError, match="2-D"):
        flat_rows(memoryview(bytearray(8)))
    with pytest.raises(ValueError, match="writable"):
        flat_rows(memoryview(bytes(8)).cast("B", (2, 4)))
    with pytest.raises(ValueError, match=r"chunk ids \[3\] are outside .*\[0, 3\)"):
        Rows(flat, ROW, [0, 3], for_get=False)
    with pytest.raises(ValueError, match="repeat a row"):
        Rows(flat, ROW, [1, 1], for_get=True)
    with pytest.raises(ValueError, match="must pair up"):
        Transfer(0, Direction.LOAD, (b"k" * 36,), (), (0,))


def test_jobs_post_finished_records_and_close_finishes_the_queue() -> None:
    view = rows_view(4)
    flat, _, _ = flat_rows(view)
    flat[0:ROW] = bytes(range(ROW))
    flat[ROW : 2 * ROW] = bytes(reversed(range(ROW)))
    storage = create_storage("memory", namespace=NS, extra_config={"store": uuid.uuid4().hex})
    io = TierTransfers(storage, flat, ROW)
    io.start()
    io.submit(job(1, Direction.STORE, [10, 11], [0, 1]))
    io.submit(job(2, Direction.LOAD, [11, 12, 10], [3, 2, 1]))
    assert io.wait_idle(10.0)
    assert io.busy  # results not taken yet
    k10, k11, k12 = (job(0, Direction.LOAD, [i], [0]).keys[0] for i in (10, 11, 12))
    store_done, load_done = io.take()
    assert store_done == Finished(1, Direction.STORE, (k10, k11), (), store_done.seconds, 2 * ROW)
    assert load_done == Finished(2, Direction.LOAD, (k11, k10), (k12,), load_done.seconds, 2 * ROW)
    assert not io.busy and io.take() == []
    assert bytes(flat[3 * ROW :]) == bytes(reversed(range(ROW)))  # key 11 into row 3
    assert bytes(flat[ROW : 2 * ROW]) == bytes(range(ROW))  # key 10 into row 1
    assert bytes(flat[2 * ROW : 3 * ROW]) == bytes(ROW)  # key 12 absent: row untouched
    for i in range(5):
        io.submit(job(10 + i, Direction.STORE, [20 + i], [2]))
    io.close()  # the queued jobs still finish, then the backend closes
    assert [f.job_id for f in io.take()] == [10, 11, 12, 13, 14]
    assert not storage.started
    with pytest.raises(RuntimeError, match="not running"):
        io.submit(job(99, Direction.STORE, [1], [0]))
