"""The transfer engine's order: ops that share no written page run at once, the others in
submission order (a load of host pages a backup still writes waits for it)."""

from __future__ import annotations

import threading
import time

import pytest

from hicache.transfer import KernelCopier, TransferEngine
from tests.transfer.test_transfer import engine_pools, pages, sha


class Parking:
    """A layer hook that parks op ``op`` after its layer 0 until ``go`` is set."""

    def __init__(self, op: int) -> None:
        self.op = op
        self.parked = threading.Event()
        self.go = threading.Event()

    def __call__(self, op_id: int, layer: int) -> None:
        if op_id == self.op and layer == 0:
            self.parked.set()
            assert self.go.wait(10)


def test_a_load_runs_while_an_earlier_load_of_other_pages_is_parked() -> None:
    device, host = engine_pools()
    host.write_pages(pages([0, 1]), device.read_pages(pages([5, 6])))
    hook = Parking(1)
    with TransferEngine(device, host, KernelCopier(), layer_hook=hook) as engine:
        first = engine.submit_load(1, pages([0]), pages([9]))
        assert hook.parked.wait(10)
        second = engine.submit_load(2, pages([1]), pages([10]))
        second.wait_all(timeout=10)  # not held behind the first one's layers
        assert first.layers_done == 1 and engine.pending == 1
        hook.go.set()
        engine.wait_idle(timeout=10)
    assert sha(device.read_pages(pages([9]))) == sha(device.read_pages(pages([5])))
    assert sha(device.read_pages(pages([10]))) == sha(device.read_pages(pages([6])))


def test_ops_sharing_a_written_page_keep_their_submission_order() -> None:
    device, host = engine_pools()
    hook = Parking(1)
    with TransferEngine(device, host, KernelCopier(), layer_hook=hook) as engine:
        engine.submit_load(1, pages([0]), pages([9]))  # parked: writes device page 9
        assert hook.parked.wait(10)
        engine.submit_backup(2, pages([9]), pages([4]))  # reads page 9: waits for op 1
        late = engine.submit_load(3, pages([4]), pages([11]))  # reads what op 2 writes
        engine.submit_backup(4, pages([3]), pages([5]))  # shares nothing: runs now
        with pytest.raises(TimeoutError):
            late.wait(0, timeout=0.05)
        with pytest.raises(TimeoutError):
            engine.wait_backups(timeout=0.05)  # op 2 waits for the parked load
        end = time.monotonic() + 10
        while engine.pending > 3 and time.monotonic() < end:
            time.sleep(0.001)
        assert engine.pending == 3  # ops 1, 2 and 3 wait; op 4 is done
        hook.go.set()
        late.wait_all(timeout=10)
        engine.wait_idle(timeout=10)
        done = [c.op_id for c in engine.drain_completions()]
    assert done.index(1) < done.index(2) < done.index(3)
    loaded = sha(host.read_pages(pages([0])))
    assert sha(device.read_pages(pages([9]))) == loaded
    assert sha(host.read_pages(pages([4]))) == loaded
    assert sha(device.read_pages(pages([11]))) == loaded
    assert sha(host.read_pages(pages([5]))) == sha(device.read_pages(pages([3])))


def test_wait_backups_does_not_wait_for_a_load_of_other_pages() -> None:
    device, host = engine_pools()
    hook = Parking(1)
    with TransferEngine(device, host, KernelCopier(), layer_hook=hook) as engine:
        engine.submit_load(1, pages([0]), pages([9]))
        assert hook.parked.wait(10)
        engine.submit_backup(2, pages([3]), pages([5]))
        engine.wait_backups(timeout=10)
        assert engine.pending_backups == 0 and engine.pending == 1
        hook.go.set()


def test_workers_must_be_a_positive_int() -> None:
    device, host = engine_pools()
    with pytest.raises(ValueError, match="workers=0"):
        TransferEngine(device, host, KernelCopier(), workers=0)
