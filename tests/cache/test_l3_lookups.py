"""``StorageController`` lookups as the rates see them: each record says how long the
store took to answer the run (``L3Lookup.seconds``), and a lookup cancelled before the
lookup thread reaches it asks the store nothing (no hit, no time): the queue of a slow
store drains as soon as its requests stop waiting."""

from __future__ import annotations

import time

from hicache.controller import CompletionQueue, L3Lookup
from hicache.controller.storage_controller import StorageController
from hicache.keys import Namespace, page_keys
from hicache.memory import HostPool
from hicache.spec import KVSpec
from hicache.storage import MemoryFaults, MemoryStorage

MHA = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
PAGE = 2
DELAY = 0.3


def lookups(queue: CompletionQueue, n: int, timeout_s: float) -> list[L3Lookup]:
    got: list[L3Lookup] = []
    end = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < end:
        got += [r for r in queue.wait(0.05) if isinstance(r, L3Lookup)]
    return got


def test_a_lookup_is_timed_and_a_cancelled_one_asks_nothing() -> None:
    ns = Namespace.for_spec(MHA, model="m", weights_fingerprint="w", layout="page_first",
                            page_size=PAGE)  # fmt: skip
    storage = MemoryStorage(ns, faults=MemoryFaults(delay_s=DELAY))
    host = HostPool(MHA, 4, PAGE, ns.layout, pin_memory=False)
    out = CompletionQueue()
    keys = page_keys(ns, list(range(8)), PAGE)
    with StorageController(storage, host, out) as ctl:
        t0 = time.monotonic()
        ctl.lookup(1, keys)
        ctl.lookup(2, keys)
        ctl.lookup(3, keys)
        ctl.cancel(2)  # queued behind the first: never asked
        first, second, third = lookups(out, 3, 10 * DELAY)
        elapsed = time.monotonic() - t0
    assert [r.op_id for r in (first, second, third)] == [1, 2, 3]
    assert first.hit_pages == 0 and first.seconds >= DELAY
    assert second == L3Lookup(2, 0)  # no hit, no time: the rates take nothing from it
    assert third.seconds >= DELAY
    assert 2 * DELAY <= elapsed < 3 * DELAY  # two store calls, not three
