"""L3 waits are counted: every batch call is timed per operation (exists, get, set), slow
ones are stalls, deadline overruns timeouts, and a prefetch the policy stopped waiting for
is counted by the cache.

The defect: with Redis frozen every request waited ~2 s (the ``timeout`` prefetch
policy's own deadline, while the lookup's ``EXISTS`` hung), yet no exported counter moved
(the lookup is no get, so ``misses{timeout}`` stayed 0; the backend's timeouts were not
exported, and a socket timeout was counted as neither).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch

from hicache.cache.report import cache_stats
from hicache.config import MemLayout, PrefetchConfig
from hicache.keys import Namespace, page_keys
from hicache.memory import HostPool
from hicache.spec import KVSpec
from hicache.storage import StorageOptions
from hicache.storage.backends.memory import MemoryFaults, MemoryStorage, MemoryStore
from hicache.storage.stats import LATENCY_BUCKETS_S, OPS
from tests.helpers.kvdata import serve
from tests.helpers.l3_cache import cache_over_l3

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
PAGE = 4
NS = Namespace.for_spec(
    SPEC, model="m", weights_fingerprint="stalls", layout="page_first", page_size=PAGE
)


def pool() -> HostPool:
    p = HostPool(SPEC, 8, PAGE, MemLayout.PAGE_FIRST, pin_memory=False)
    p.buffer.copy_(torch.randn(p.buffer.shape))
    return p


KEYS = page_keys(NS, list(range(2 * PAGE)))


def test_stall_threshold_is_validated() -> None:
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="stall_s"):
            StorageOptions(stall_s=bad)
    assert StorageOptions.from_extra({"stall_s": 0.05}).stall_s == 0.05


def test_fast_calls_are_timed_but_no_stall() -> None:
    with MemoryStorage(NS, StorageOptions(stall_s=0.2), store=MemoryStore()) as st:
        src = pool()
        assert st.batch_set(KEYS, src, [0, 1]).all_ok
        assert st.batch_exists(KEYS) == 2
        assert st.batch_contains(KEYS) == [True, True]
        assert st.batch_get(KEYS, pool(), [2, 3]) == [True, True]
        s = st.stats()
    assert s.backend == "memory" and s.stall_s == 0.2
    assert dict(s.stalls) == dict.fromkeys(OPS, 0)
    assert dict(s.op_timeouts) == dict.fromkeys(OPS, 0)
    assert {op: s.latency[op].calls for op in OPS} == {"exists": 2, "get": 1, "set": 1}
    assert s.latency["get"].counts[0] == 1  # under a millisecond: the first bucket
    assert s.latency["get"].cumulative()[-1] == ("+Inf", 1)


def test_slow_calls_are_stalls_and_overruns_timeouts() -> None:
    faults = MemoryFaults(delay_s=0.3)
    opts = StorageOptions(timeout_s=1.0, stall_s=0.2)
    with MemoryStorage(NS, opts, store=MemoryStore(), faults=faults) as st:
        src = pool()
        assert st.batch_set(KEYS, src, [0, 1]).all_ok
        assert st.batch_get(KEYS, pool(), [2, 3]) == [True, True]
        s = st.stats()
        assert dict(s.stalls) == {"exists": 0, "get": 1, "set": 1}
        assert dict(s.op_timeouts) == dict.fromkeys(OPS, 0)
        bucket = LATENCY_BUCKETS_S.index(0.5)  # 0.3 s lands in (0.25, 0.5]
        assert s.latency["get"].counts[bucket] == 1
        assert 0.3 <= s.latency["get"].sum_s < 0.5
        st.set_faults(MemoryFaults(delay_s=10.0))  # past the deadline
        assert st.batch_exists(KEYS) == 0
        assert st.batch_get(KEYS, pool(), [2, 3]) == [False, False]
        assert st.batch_set(page_keys(NS, list(range(50, 50 + PAGE))), src, [4]).failed == 1
        s = st.stats()
    assert dict(s.op_timeouts) == {"exists": 1, "get": 1, "set": 1}
    assert dict(s.stalls) == {"exists": 1, "get": 2, "set": 2}  # a timeout waited too
    assert s.latency["exists"].counts[LATENCY_BUCKETS_S.index(2.5)] == 1  # just over 1 s


# ---------------------------------------------------------------------- a frozen Redis


def test_a_frozen_redis_shows_in_the_counters(redis_private: Any) -> None:
    """Requests wait the prefetch policy's deadline while the lookup hangs on a frozen
    Redis: each such prefetch is counted, and the hung lookups are stalls and timeouts
    of ``exists`` (before, every exported counter stayed 0)."""
    prefetch = PrefetchConfig(
        policy="timeout",
        prefetch_threshold=0,
        prefetch_timeout_base=0.4,
        prefetch_timeout_per_ki_token=0.0,
    )
    options = StorageOptions(timeout_s=1.0, connect_timeout_s=5.0, stall_s=0.2)
    extra = {"url": redis_private.url}
    with cache_over_l3(SPEC, "redis", extra, options, prefetch, device_pages=32) as cache:
        assert serve(cache, list(range(100, 100 + 4 * PAGE))) is not None
        cache.sync(wait=True)
        os.kill(redis_private.pid, signal.SIGSTOP)
        waits = []
        for i in range(2):
            t = time.monotonic()
            assert serve(cache, [1000 * (i + 1) + j for j in range(4 * PAGE)]) is not None
            waits.append(time.monotonic() - t)
        assert all(0.35 <= w < 1.5 for w in waits), waits  # the policy's 0.4 s, each
        assert cache_stats(cache).counters["prefetch_timeouts_total"] == 2
        end = time.monotonic() + 10  # the hung EXISTS return at their 1 s deadline
        while time.monotonic() < end:
            st = cache_stats(cache).storage
            if st.stalls["exists"] >= 1 and st.op_timeouts["exists"] >= 1:
                break
            time.sleep(0.05)
        assert st.backend == "redis"
        assert st.stalls["exists"] >= 1, dict(st.stalls)
        assert st.op_timeouts["exists"] >= 1, dict(st.op_timeouts)
        assert st.miss("timeout") == 0  # no get was made: the misses were never the signal
        os.kill(redis_private.pid, signal.SIGCONT)
