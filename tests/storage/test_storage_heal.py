"""The bad-record marks behind self-healing L3 (:mod:`hicache.storage.heal`): which misses
mark a key, what unmarks it, the bound, and that a failed overwrite is tried again."""

from __future__ import annotations

import random

import pytest

from hicache.config import MemLayout
from hicache.keys import Namespace, page_keys
from hicache.memory import HostPool
from hicache.spec import KVSpec
from hicache.storage import MemoryStorage, MemoryStore, SetOutcome
from hicache.storage.backends.memory import MemoryFaults
from hicache.storage.heal import REPLACEABLE, BadRecords
from hicache.storage.stats import MissReason

WRITTEN, SKIPPED, FAILED = SetOutcome.WRITTEN, SetOutcome.SKIPPED, SetOutcome.FAILED


def test_only_corrupt_and_stale_records_mark_their_key() -> None:
    assert {MissReason.CORRUPT, MissReason.STALE} == REPLACEABLE
    bad = BadRecords()
    keys = [r.value for r in MissReason]
    bad.note(keys, list(MissReason))
    assert bad.flags(keys) == [r in REPLACEABLE for r in MissReason]
    bad.note(["corrupt"], [None])  # read good again: someone healed it
    assert bad.flags(keys) == [r is MissReason.STALE for r in MissReason]


def test_a_write_unmarks_what_it_stored_and_counts_the_replaced() -> None:
    bad = BadRecords()
    bad.note(["a", "b", "c"], [MissReason.CORRUPT] * 3)
    replace = bad.flags(["a", "b", "c", "d"])
    assert replace == [True, True, True, False]
    assert bad.written(["a", "b", "c", "d"], [WRITTEN, FAILED, SKIPPED, WRITTEN], replace) == 1
    assert bad.flags(["a", "b", "c", "d"]) == [False, True, True, False]


def test_the_marks_are_bounded_oldest_first() -> None:
    bad = BadRecords(limit=2)
    bad.note(["a", "b"], [MissReason.CORRUPT] * 2)
    bad.note(["a"], [MissReason.STALE])  # marked again: most recent
    bad.note(["c"], [MissReason.CORRUPT])
    assert len(bad) == 2 and "b" not in bad and "a" in bad and "c" in bad
    with pytest.raises(ValueError, match="limit=0"):
        BadRecords(limit=0)


def test_an_overwrite_that_fails_keeps_the_mark_and_the_next_write_heals() -> None:
    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32")
    ns = Namespace.for_spec(
        spec, model="tiny", weights_fingerprint="heal", layout=MemLayout.PAGE_FIRST, page_size=2
    )
    host = HostPool(spec, 4, 2, MemLayout.PAGE_FIRST, pin_memory=False)
    host.buffer.uniform_()
    store = MemoryStore()
    keys = page_keys(ns, [random.randrange(2**32) for _ in range(5)])
    with MemoryStorage(ns, store=store) as st:
        assert st.batch_set(keys, host, [0, 1]).all_ok
        blob = store.get(keys[0].key)
        assert blob is not None
        store.replace(keys[0].key, blob[:-1] + bytes([blob[-1] ^ 1]))
        assert st.batch_get(keys, host, [2, 3]) == [False, True]
        st.set_faults(MemoryFaults(fail_after=0))
        assert st.batch_set(keys, host, [0, 1]).outcomes == (FAILED, FAILED)
        st.set_faults(MemoryFaults())
        assert st.batch_set(keys, host, [0, 1]).outcomes == (WRITTEN, SKIPPED)
        assert st.batch_get(keys, host, [2, 3]) == [True, True]
        assert st.stats().repaired == 1
