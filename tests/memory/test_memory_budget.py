"""Pool sizes are checked against the memory available before anything is allocated.

Issue 8, defect 7: ``--hicache-size 1e6``, ``--device-cache-size 1e6`` or
``--max-total-tokens 10**12`` grew to 24 GB and were OOM-killed with an empty log, because
the page allocator (a free list of one entry per page) was built before any size check and
the device pool had no check at all. Each test below guards the allocating calls, so a
regression fails here instead of exhausting the machine.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import hicache.memory.base as pool_base
import hicache.memory.budget as budget
from hicache.config import CacheConfig, MemLayout
from hicache.memory import DevicePool, HostPool, PoolSizeError, check_pool_sizes
from hicache.spec import KVSpec

SPEC = KVSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16")
"""SmolLM2-135M's KV shape: 23,040 bytes per token."""


class AllocatedError(AssertionError):
    """Raised by the guards: something was allocated before the size check."""


@pytest.fixture
def no_allocation(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make building a page allocator or a pool buffer fail the test."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AllocatedError("allocated before checking the size against memory")

    monkeypatch.setattr(pool_base, "PageAllocator", refuse)
    monkeypatch.setattr(torch, "empty", refuse)
    yield


def fake_ram(monkeypatch: pytest.MonkeyPatch, available: int) -> None:
    monkeypatch.setattr(
        budget.psutil, "virtual_memory", lambda: SimpleNamespace(available=available)
    )


def test_device_pool_over_ram_raises_with_numbers(
    monkeypatch: pytest.MonkeyPatch, no_allocation: None
) -> None:
    fake_ram(monkeypatch, 10**6)
    with pytest.raises(PoolSizeError) as info:
        DevicePool(SPEC, 100, 16, "cpu")  # 36.9 MB of buffer on a host with 1 MB free
    err = info.value
    assert err.requested == 100 * 16 * SPEC.token_bytes + 100 * budget.PAGE_BOOKKEEPING_BYTES
    assert err.available == 10**6 and err.allowed == 900_000 and err.where == "RAM"
    msg = str(err)
    assert f"{err.requested:,} bytes" in msg and "1,000,000 bytes" in msg
    assert "--max-total-tokens" in msg and "--device-cache-size" in msg
    assert isinstance(err, ValueError)


@pytest.mark.parametrize(
    "tokens",
    [10**12, 10**15 // SPEC.token_bytes],  # --max-total-tokens 10**12; --device-cache-size 1e6
)
def test_huge_device_pool_raises_fast_and_allocates_nothing(
    tokens: int, no_allocation: None
) -> None:
    cfg = CacheConfig(page_size=16, device_tokens=tokens, enable_hierarchical_cache=False)
    start = time.perf_counter()
    with pytest.raises(PoolSizeError, match="device"):
        DevicePool(SPEC, cfg.device_pages, cfg.page_size, "cpu")
    with pytest.raises(PoolSizeError, match="--max-total-tokens"):
        check_pool_sizes(cfg, SPEC, "cpu")
    assert time.perf_counter() - start < 1.0


def test_huge_hicache_size_raises_fast_and_allocates_nothing(no_allocation: None) -> None:
    cfg = CacheConfig(page_size=16, device_tokens=16384, hicache_size=1e6)  # 1e6 GB of L2
    start = time.perf_counter()
    with pytest.raises(PoolSizeError) as info:
        HostPool.for_config(SPEC, cfg, "cpu")
    assert info.value.requested >= 10**15 - cfg.page_bytes(SPEC)
    assert "--hicache-size" in str(info.value)
    with pytest.raises(PoolSizeError, match="host"):
        check_pool_sizes(cfg, SPEC, "cpu")
    assert time.perf_counter() - start < 1.0


def test_host_pool_over_ram_raises_before_allocating(
    monkeypatch: pytest.MonkeyPatch, no_allocation: None
) -> None:
    fake_ram(monkeypatch, 10**6)
    with pytest.raises(PoolSizeError, match="host"):
        HostPool(SPEC, 100, 16, MemLayout.PAGE_FIRST, pin_memory=False)


def test_both_pools_in_ram_are_checked_together(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = CacheConfig(page_size=16, device_tokens=1024, hicache_ratio=2.0)
    sizes = check_pool_sizes(cfg, SPEC, "cpu")
    assert sizes.device == budget.pool_bytes(1024 * SPEC.token_bytes, 64)
    assert sizes.host == budget.pool_bytes(2048 * SPEC.token_bytes, 128)
    # each pool alone fits in 90% of this, both together do not
    fake_ram(monkeypatch, (sizes.host * 10) // 9 + 10)
    with pytest.raises(PoolSizeError, match="both in RAM") as info:
        check_pool_sizes(cfg, SPEC, "cpu")
    assert info.value.requested == sizes.device + sizes.host
    off = CacheConfig(page_size=16, device_tokens=1024, enable_hierarchical_cache=False)
    assert check_pool_sizes(off, SPEC, "cpu").host == 0


def test_pools_that_fit_are_built() -> None:
    pool = DevicePool(SPEC, 4, 16, "cpu")
    assert pool.allocator.num_pages == 4 and pool.nbytes == 4 * 16 * SPEC.token_bytes


def test_engine_flags_in_gb_are_checked_before_the_model_loads(no_allocation: None) -> None:
    from hicache.server.args import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    argv = ["--device", "cpu", "--enable-hierarchical-cache", "--hicache-size", "1e6"]
    with pytest.raises(PoolSizeError, match="--hicache-size"):
        engine_config_from_args(p.parse_args(argv))
    with pytest.raises(PoolSizeError, match="--device-cache-size"):
        engine_config_from_args(p.parse_args(["--device", "cpu", "--device-cache-size", "1e6"]))
    # --hicache-size without the L2 tier sizes nothing
    engine_config_from_args(p.parse_args(["--device", "cpu", "--hicache-size", "1e6"]))


def test_non_finite_sizes_are_refused_by_the_config() -> None:
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="hicache_size"):
            CacheConfig(hicache_size=bad)
        with pytest.raises(ValueError, match="hicache_ratio"):
            CacheConfig(hicache_ratio=bad)


@pytest.mark.gpu
def test_cuda_device_pool_checked_against_free_device_memory(no_allocation: None) -> None:
    free, _ = torch.cuda.mem_get_info()
    pages = free // (16 * SPEC.token_bytes) + 1
    with pytest.raises(PoolSizeError, match="cuda") as info:
        DevicePool(SPEC, pages, 16, "cuda")
    assert info.value.available <= free + (1 << 30)
