"""Copiers, layer progress and the transfer engine: byte-exact round trips on tiny pools."""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hicache.config import IOBackend, MemLayout
from hicache.memory import DevicePool, HostPool
from hicache.spec import AttentionKind, KVSpec
from hicache.transfer import (
    Completion,
    DirectCopier,
    KernelCopier,
    LayerProgress,
    OpPlan,
    PageCopier,
    Run,
    TransferEngine,
    TransferError,
    make_copier,
)
from hicache.transfer.kernel import CpuCopy

LAYOUTS = list(MemLayout)
DTYPES = ["float32", "float16", "bfloat16"]
HUGE = 1 << 60
gpu = pytest.mark.gpu  # skipped without CUDA by conftest.py

# name -> factory; the kernel variants force each of its strategies
COPIERS: dict[str, Callable[[], PageCopier]] = {
    "direct": DirectCopier,
    "kernel": KernelCopier,
    "kernel-slabs": lambda: KernelCopier(slab_min_bytes=0),
    "kernel-slabs-caller": lambda: KernelCopier(slab_min_bytes=0, cpu_copy="caller"),
    "kernel-slabs-threads": lambda: KernelCopier(slab_min_bytes=0, cpu_copy="threads"),
    "kernel-rows": lambda: KernelCopier(slab_min_bytes=HUGE),
    "kernel-device-dma": lambda: KernelCopier(force_device_path=True, dma_min_bytes=0),
    "kernel-device-staged": lambda: KernelCopier(force_device_path=True, dma_min_bytes=HUGE),
}

# 12 pages per op: shuffled singles plus consecutive runs on both sides (3,4,5 -> 20,21,22)
DEV_SRC = [3, 4, 5, 9, 1, 14, 0, 12, 7, 8, 15, 2]
HOST = [20, 21, 22, 2, 17, 0, 9, 10, 11, 5, 23, 13]
DEV_DST = [10, 11, 6, 18, 19, 13, 16, 17, 26, 27, 24, 21]
DEVICE_PAGES, HOST_PAGES = 28, 24


def spec_for(attention: str, dtype: str, layers: int = 3) -> KVSpec:
    if attention == "mha":
        return KVSpec(num_layers=layers, num_kv_heads=2, head_dim=8, dtype=dtype)
    return KVSpec(
        num_layers=layers,
        attention=AttentionKind.MLA,
        kv_lora_rank=6,
        qk_rope_head_dim=2,
        dtype=dtype,
    )


def randomize(pool: DevicePool, seed: int = 0) -> None:
    """Fill a pool with random bytes (every bit pattern, NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    raw = pool.buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def pages(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


# -- byte-exact round trips -------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("attention", ["mha", "mla"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("copier_name", list(COPIERS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=[m.value for m in LAYOUTS])
def test_round_trip_sha256(
    layout: MemLayout, copier_name: str, dtype: str, attention: str, page_size: int
) -> None:
    spec = spec_for(attention, dtype)
    device = DevicePool(spec, DEVICE_PAGES, page_size)
    host = HostPool(spec, HOST_PAGES, page_size, layout, pin_memory=False)
    randomize(device)
    src, hp, dst = pages(DEV_SRC), pages(HOST), pages(DEV_DST)
    before = device.read_pages(src)
    untouched_dev = [p for p in range(DEVICE_PAGES) if p not in DEV_DST]
    dev_rest = sha(device.read_pages(pages(untouched_dev)))
    copier = COPIERS[copier_name]()
    copier.backup(device, host, src, hp)
    assert sha(host.read_pages(hp)) == sha(before)
    other_host = [p for p in range(HOST_PAGES) if p not in HOST]
    assert bool((host.read_pages(pages(other_host)).view(torch.uint8) == 0).all())
    copier.load(device, host, hp, dst)
    assert sha(device.read_pages(dst)) == sha(before)
    assert sha(device.read_pages(pages(untouched_dev))) == dev_rest


@pytest.mark.parametrize("cpu_copy", ["caller", "threads"])
@pytest.mark.parametrize("attention", ["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[m.value for m in LAYOUTS])
def test_slab_load_in_uneven_layer_groups_round_trips(
    layout: MemLayout, attention: str, cpu_copy: CpuCopy
) -> None:
    """Slab loads copy groups of adjacent layers (5 layers: 2, 2, 1), one view pair per
    run placed by word offset: pages consecutive on both sides (dev 10, 11 <- host 20,
    21), on the host side only (6 <- 22) and single pages all land byte-exact, layers are
    reported in order, and no other device page changes."""
    spec = spec_for(attention, "float32", layers=5)
    device = DevicePool(spec, DEVICE_PAGES, 4)
    host = HostPool(spec, HOST_PAGES, 4, layout, pin_memory=False)
    randomize(device, seed=2)
    src, hp, dst = pages(DEV_SRC), pages(HOST), pages(DEV_DST)
    copier = KernelCopier(slab_min_bytes=0, cpu_copy=cpu_copy)
    copier.backup(device, host, src, hp)
    want = sha(device.read_pages(src))
    assert sha(host.read_pages(hp)) == want
    others = pages([p for p in range(DEVICE_PAGES) if p not in DEV_DST])
    rest = sha(device.read_pages(others))
    seen: list[int] = []
    copier.load_layers(device, host, hp, dst, seen.append)
    assert seen == list(range(spec.num_layers))
    assert sha(device.read_pages(dst)) == want
    assert sha(device.read_pages(others)) == rest


@pytest.mark.parametrize("copier_name", list(COPIERS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=[m.value for m in LAYOUTS])
def test_load_layer_copies_only_that_layer(layout: MemLayout, copier_name: str) -> None:
    spec = spec_for("mha", "float16", layers=4)
    device = DevicePool(spec, DEVICE_PAGES, 4)
    host = HostPool(spec, HOST_PAGES, 4, layout, pin_memory=False)
    randomize(device, seed=1)
    src, hp, dst = pages(DEV_SRC), pages(HOST), pages(DEV_DST)
    copier = COPIERS[copier_name]()
    copier.backup(device, host, src, hp)
    want = device.read_pages(src)
    old = device.read_pages(dst)
    copier.load_layer(device, host, hp, dst, 2)
    got = device.read_pages(dst)
    for layer in range(4):
        expect = want if layer == 2 else old
        assert sha(got[:, :, layer]) == sha(expect[:, :, layer]), layer
    with pytest.raises(IndexError, match="layer 4"):
        copier.load_layer(device, host, hp, dst, 4)


def reference_runs(dev: list[int], host: list[int], both: bool) -> list[Run]:
    out: list[Run] = []
    for i, (d, h) in enumerate(zip(dev, host, strict=True)):
        last = out[-1] if out else None
        if (
            last is not None
            and h == last.host + last.length
            and (not both or d == last.dev + last.length)
        ):
            out[-1] = last._replace(length=last.length + 1)
        else:
            out.append(Run(i, d, h, 1))
    return out


@pytest.mark.parametrize("n", [1, 20, 300, 1000])  # both the Python and the torch paths
def test_plan_runs_match_reference(n: int) -> None:
    spec = spec_for("mha", "float32", layers=1)
    device = DevicePool(spec, 2 * n + 8, 1)
    host = HostPool(spec, 2 * n + 8, 1, MemLayout.LAYER_FIRST, pin_memory=False)
    g = torch.Generator().manual_seed(n)
    dev_l = torch.randperm(2 * n + 8, generator=g).tolist()
    host_l = torch.randperm(2 * n + 8, generator=g).tolist()

    def plant(xs: list[int], at: int, first: int, length: int) -> None:
        for j in range(length):  # swap value first+j into position at+j (stays unique)
            i = xs.index(first + j)
            xs[at + j], xs[i] = xs[i], xs[at + j]

    if n >= 20:  # runs consecutive on both sides (5..9), and on the host side only (12..15)
        plant(dev_l, 5, 2 * n, 5)
        plant(host_l, 5, n, 5)
        plant(host_l, 12, n + 5, 4)
    dev, hp = torch.tensor(dev_l[:n]), torch.tensor(host_l[:n])
    plan = OpPlan(device, host, dev, hp, "backup")
    assert plan.runs == reference_runs(dev.tolist(), hp.tolist(), both=True)
    assert plan.host_runs == reference_runs(dev.tolist(), hp.tolist(), both=False)
    if n >= 20:
        assert Run(5, 2 * n, n, 5) in plan.runs
        assert any(r.pos <= 5 and r.pos + r.length >= 10 for r in plan.host_runs)
        assert any(r.pos <= 12 and r.pos + r.length >= 16 for r in plan.host_runs)


@pytest.mark.parametrize("copier_name", ["direct", "kernel", "kernel-slabs", "kernel-rows"])
def test_large_op_round_trip_and_validation(copier_name: str) -> None:
    """300 pages: validation and run finding take their vectorized (torch) paths."""
    spec = spec_for("mla", "bfloat16", layers=2)
    device = DevicePool(spec, 700, 1)
    host = HostPool(spec, 400, 1, MemLayout.PAGE_FIRST_DIRECT, pin_memory=False)
    randomize(device, seed=5)
    g = torch.Generator().manual_seed(0)
    src = torch.randperm(350, generator=g)[:300]
    src[:50] = torch.arange(100, 150)
    hp = torch.randperm(400, generator=g)[:300]
    dst = torch.randperm(350, generator=g)[:300] + 350
    copier = COPIERS[copier_name]()
    bad = hp.clone()
    bad[299] = 400
    with pytest.raises(IndexError, match="host_pages: page 400 out of range"):
        copier.backup(device, host, src, bad)
    dup = dst.clone()
    dup[299] = dup[0]
    with pytest.raises(ValueError, match="device_pages: a page appears more than once"):
        copier.load(device, host, hp, dup)
    assert bool((host.buffer.view(torch.uint8) == 0).all())
    copier.backup(device, host, src, hp)
    copier.load(device, host, hp, dst)
    assert sha(device.read_pages(dst)) == sha(device.read_pages(src))


def test_kernel_strategy_selection() -> None:
    spec = spec_for("mha", "float16", layers=2)  # row = 2 heads x 8 x 2 B = 32 B
    device = DevicePool(spec, 8, 4)
    lf = HostPool(spec, 8, 4, MemLayout.LAYER_FIRST, pin_memory=False)
    pf = HostPool(spec, 8, 4, MemLayout.PAGE_FIRST, pin_memory=False)
    k = KernelCopier()
    plan = k.plan(device, lf, pages([0, 1, 2]), pages([4, 5, 6]), "load")
    assert len(plan.runs) == 1 and plan.runs[0].length == 3
    # one run of 3 pages; a load view moves 3 pages x 4 tokens x 2 kinds x 32 B = 768 B
    assert k.strategy(device, lf, plan, backup=False) == "rows"
    assert KernelCopier(slab_min_bytes=768).strategy(device, lf, plan, backup=False) == "slabs"
    assert KernelCopier(slab_min_bytes=769).strategy(device, lf, plan, backup=False) == "rows"
    plan_pf = k.plan(device, pf, pages([0, 1, 2]), pages([4, 5, 7]), "backup")
    assert len(plan_pf.runs) == 2  # a backup view: 1.5 pages x 2 layers x 256 B = 768 B
    assert KernelCopier(slab_min_bytes=768).strategy(device, pf, plan_pf, backup=True) == "slabs"
    assert KernelCopier(slab_min_bytes=769).strategy(device, pf, plan_pf, backup=True) == "rows"
    assert (
        KernelCopier(force_device_path=True).strategy(device, pf, plan_pf, backup=True) == "device"
    )


def test_make_copier() -> None:
    assert isinstance(make_copier(IOBackend.DIRECT), DirectCopier)
    assert isinstance(make_copier("kernel"), KernelCopier)
    with pytest.raises(ValueError):
        make_copier("bogus")


# -- validation -------------------------------------------------------------------------


@pytest.mark.parametrize("copier_name", ["direct", "kernel", "kernel-slabs"])
def test_bad_ops_raise_before_copying(copier_name: str) -> None:
    spec = spec_for("mha", "float32")
    device = DevicePool(spec, 8, 2)
    host = HostPool(spec, 8, 2, MemLayout.PAGE_FIRST_DIRECT, pin_memory=False)
    randomize(device)
    copier = COPIERS[copier_name]()
    with pytest.raises(IndexError, match="host_pages: page 8 out of range"):
        copier.backup(device, host, pages([0, 1]), pages([0, 8]))
    with pytest.raises(IndexError, match="device_pages: page -1"):
        copier.backup(device, host, pages([-1, 1]), pages([0, 1]))
    with pytest.raises(ValueError, match="differ in length"):
        copier.backup(device, host, pages([0, 1]), pages([0]))
    with pytest.raises(ValueError, match="host_pages: a page appears more than once"):
        copier.backup(device, host, pages([0, 1]), pages([3, 3]))
    assert bool((host.buffer == 0).all())
    before = sha(device.buffer)
    with pytest.raises(ValueError, match="device_pages: a page appears more than once"):
        copier.load_layer(device, host, pages([0, 1]), pages([2, 2]), 0)
    with pytest.raises(IndexError):
        copier.load(device, host, pages([0, 1]), pages([2, 9]))
    assert sha(device.buffer) == before
    other = HostPool(spec_for("mha", "float16"), 8, 2, MemLayout.PAGE_FIRST, pin_memory=False)
    with pytest.raises(ValueError, match="differ in spec"):
        copier.backup(device, other, pages([0]), pages([0]))
    other_ps = HostPool(spec, 8, 4, MemLayout.PAGE_FIRST, pin_memory=False)
    with pytest.raises(ValueError, match="differ in page_size"):
        copier.backup(device, other_ps, pages([0]), pages([0]))
    copier.backup(device, host, pages([]), pages([]))  # empty op: a no-op


def test_plan_cache_sees_in_place_page_edits() -> None:
    spec = spec_for("mha", "float32")
    device = DevicePool(spec, 8, 2)
    host = HostPool(spec, 8, 2, MemLayout.LAYER_FIRST, pin_memory=False)
    randomize(device)
    copier = KernelCopier(slab_min_bytes=0)
    copier.backup(device, host, pages([0, 1, 2, 3]), pages([0, 1, 2, 3]))
    dst = pages([4, 5])
    hp = pages([0, 1])
    copier.load(device, host, hp, dst)
    hp[0] = 2  # in place: the cached plan must not be reused
    copier.load(device, host, hp, dst)
    assert sha(device.read_pages(pages([4]))) == sha(device.read_pages(pages([2])))
    assert sha(device.read_pages(pages([5]))) == sha(device.read_pages(pages([1])))


# -- LayerProgress ----------------------------------------------------------------------


def test_layer_progress_in_order_and_wait() -> None:
    p = LayerProgress(3)
    with pytest.raises(TimeoutError, match="0/3"):
        p.wait(0, timeout=0.01)
    p.mark_layer_done(0)
    p.wait(0, timeout=0)
    assert p.layers_done == 1 and not p.done
    with pytest.raises(ValueError, match="out of order"):
        p.mark_layer_done(2)
    with pytest.raises(IndexError):
        p.wait(3)
    p.mark_layer_done(1)
    p.mark_layer_done(2)
    assert p.done and not p.failed
    p.wait_all(timeout=0)
    assert LayerProgress.completed(4).done
    with pytest.raises(ValueError):
        LayerProgress(0)


def test_layer_progress_wakes_waiter_and_reports_failure() -> None:
    p = LayerProgress(3)
    arrived = threading.Event()

    def consumer() -> None:
        p.wait(1, timeout=5)
        arrived.set()

    t = threading.Thread(target=consumer)
    t.start()
    p.mark_layer_done(0)
    assert not arrived.wait(0.05)
    p.mark_layer_done(1)
    assert arrived.wait(5)
    t.join()
    boom = OSError("disk on fire")
    p.fail(boom)
    p.wait(1)  # arrived before the failure: still valid
    with pytest.raises(TransferError, match="disk on fire") as info:
        p.wait(2, timeout=1)
    assert info.value.__cause__ is boom and p.failed and p.error is boom
    with pytest.raises(ValueError, match="after fail"):
        p.mark_layer_done(2)


# -- TransferEngine ---------------------------------------------------------------------


def engine_pools(
    layers: int = 3, layout: MemLayout = MemLayout.PAGE_FIRST
) -> tuple[DevicePool, HostPool]:
    spec = spec_for("mha", "bfloat16", layers=layers)
    device = DevicePool(spec, 16, 2)
    host = HostPool(spec, 16, 2, layout, pin_memory=False)
    randomize(device, seed=7)
    return device, host


@pytest.mark.parametrize("backend", ["direct", "kernel"])
def test_engine_backup_then_load(backend: str) -> None:
    device, host = engine_pools()
    src, hp, dst = pages([1, 2, 3, 7]), pages([9, 4, 5, 6]), pages([12, 13, 0, 15])
    want = sha(device.read_pages(src))
    with TransferEngine(device, host, make_copier(backend)) as engine:
        engine.submit_backup(1, src, hp)
        progress = engine.submit_load(2, hp, dst)  # FIFO: runs after the backup
        progress.wait_all(timeout=10)
        engine.wait_idle(timeout=10)
        assert engine.pending == 0
        done = engine.drain_completions()
        assert engine.drain_completions() == []
    assert [(c.op_id, c.kind, c.ok, c.error, c.nbytes) for c in done] == [
        (1, "backup", True, None, 4 * device.page_bytes),
        (2, "load", True, None, 4 * device.page_bytes),
    ]
    assert all(isinstance(c, Completion) and c.seconds >= 0 for c in done)
    assert sha(host.read_pages(hp)) == want
    assert sha(device.read_pages(dst)) == want


def test_engine_snapshots_page_lists_at_submit() -> None:
    device, host = engine_pools()
    gate = threading.Event()
    release = threading.Event()

    def hook(op_id: int, layer: int) -> None:
        if op_id == 0 and layer == 0:
            gate.set()
            release.wait(10)

    with TransferEngine(device, host, KernelCopier(), layer_hook=hook) as engine:
        host.write_pages(pages([0]), device.read_pages(pages([5])))
        engine.submit_load(0, pages([0]), pages([9]))  # blocks the worker after layer 0
        assert gate.wait(10)
        src, hp = pages([1, 2]), pages([3, 4])
        engine.submit_backup(1, src, hp)
        src[0], hp[0] = 6, 7  # the engine must use what was submitted
        release.set()
        engine.wait_idle(timeout=10)
    assert sha(host.read_pages(pages([3, 4]))) == sha(device.read_pages(pages([1, 2])))
    assert bool((host.read_pages(pages([7])).view(torch.uint8) == 0).all())


@pytest.mark.parametrize("backend", ["direct", "kernel"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[m.value for m in LAYOUTS])
def test_engine_layer_wise_load(layout: MemLayout, backend: str) -> None:
    device, host = engine_pools(layers=3, layout=layout)
    src, hp, dst = pages([1, 2, 3]), pages([8, 9, 3]), pages([10, 4, 11])
    want = device.read_pages(src)
    old = device.read_pages(dst)
    held = threading.Event()
    release = threading.Event()

    def hook(op_id: int, layer: int) -> None:
        if op_id == 7 and layer == 0:
            held.set()
            assert release.wait(10)

    with TransferEngine(device, host, make_copier(backend), layer_hook=hook) as engine:
        engine.submit_backup(6, src, hp)
        progress = engine.submit_load(7, hp, dst)
        progress.wait(0, timeout=10)
        assert held.wait(10)  # the worker is parked between layer 0 and layer 1
        now = device.read_pages(dst)
        assert sha(now[:, :, 0]) == sha(want[:, :, 0])
        assert sha(now[:, :, 1]) == sha(old[:, :, 1])
        assert sha(now[:, :, 2]) == sha(old[:, :, 2])
        assert progress.layers_done == 1 and not progress.done
        with pytest.raises(TimeoutError):
            progress.wait(1, timeout=0.05)
        with pytest.raises(TimeoutError):
            engine.wait_idle(timeout=0.05)
        assert engine.pending == 1
        release.set()
        progress.wait_all(timeout=10)
        engine.wait_idle(timeout=10)
    assert sha(device.read_pages(dst)) == sha(want)


def test_engine_failed_op_reports_and_engine_keeps_working() -> None:
    device, host = engine_pools()
    with TransferEngine(device, host, KernelCopier()) as engine:
        bad = engine.submit_load(1, pages([0, 99]), pages([2, 3]))
        engine.submit_backup(2, pages([0]), pages([100]))
        good = engine.submit_load(3, pages([0]), pages([4]))
        engine.submit_backup(4, pages([5]), pages([6]))
        with pytest.raises(TransferError, match="page 99 out of range"):
            bad.wait(0, timeout=10)
        good.wait_all(timeout=10)
        engine.wait_idle(timeout=10)
        done = {c.op_id: c for c in engine.drain_completions()}
    assert [done[i].ok for i in (1, 2, 3, 4)] == [False, False, True, True]
    assert done[1].error is not None and done[1].error.startswith("IndexError: host_pages: page 99")
    assert done[2].error is not None and "page 100 out of range" in done[2].error
    assert bad.failed and not good.failed
    assert sha(host.read_pages(pages([6]))) == sha(device.read_pages(pages([5])))
    assert sha(device.read_pages(pages([4]))) == sha(host.read_pages(pages([0])))


def test_engine_hook_error_fails_the_op() -> None:
    device, host = engine_pools()

    def hook(op_id: int, layer: int) -> None:
        raise RuntimeError(f"hook {op_id}/{layer}")

    with TransferEngine(device, host, DirectCopier(), layer_hook=hook) as engine:
        p = engine.submit_load(5, pages([0]), pages([1]))
        engine.wait_idle(timeout=10)
        (c,) = engine.drain_completions()
    assert (c.op_id, c.ok, c.error) == (5, False, "RuntimeError: hook 5/0")
    p.wait(0)
    with pytest.raises(TransferError):
        p.wait(1)


def test_engine_lifecycle() -> None:
    device, host = engine_pools()
    engine = TransferEngine(device, host, KernelCopier())
    with pytest.raises(RuntimeError, match="new"):
        engine.submit_backup(0, pages([0]), pages([0]))
    engine.start()
    with pytest.raises(RuntimeError, match="cannot start"):
        engine.start()
    engine.submit_backup(0, pages([0]), pages([0]))
    engine.close()
    engine.close()  # idempotent
    assert [c.ok for c in engine.drain_completions()] == [True]  # close drains
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit_load(1, pages([0]), pages([1]))
    with pytest.raises(RuntimeError, match="closed"):
        engine.start()
    never = TransferEngine(device, host, KernelCopier())
    never.close()
    with pytest.raises(RuntimeError, match="closed"):
        never.submit_backup(0, pages([0]), pages([0]))
    mismatch = HostPool(spec_for("mla", "bfloat16"), 4, 2, MemLayout.PAGE_FIRST, pin_memory=False)
    with pytest.raises(ValueError, match="differ in spec"):
        TransferEngine(device, mismatch, KernelCopier())


def test_engine_close_cancel_drops_queued_ops() -> None:
    device, host = engine_pools()
    held = threading.Event()
    release = threading.Event()

    def hook(op_id: int, layer: int) -> None:
        if op_id == 0 and layer == 0:
            held.set()
            release.wait(10)

    engine = TransferEngine(device, host, KernelCopier(), layer_hook=hook, workers=1)
    engine.start()  # one worker: ops 1 and 2 stay queued behind the parked op 0
    first = engine.submit_load(0, pages([0]), pages([1]))
    assert held.wait(10)
    queued = engine.submit_load(1, pages([0]), pages([2]))
    engine.submit_backup(2, pages([3]), pages([3]))
    closer = threading.Thread(target=engine.close, kwargs={"cancel": True})
    closer.start()
    while engine.pending > 1:  # the cancel runs while op 0 is parked
        threading.Event().wait(0.005)
    release.set()
    closer.join(10)
    assert not closer.is_alive()
    done = {c.op_id: c for c in engine.drain_completions()}
    assert done[0].ok and first.done
    assert (done[1].ok, done[1].error, done[2].error) == (False, "cancelled", "cancelled")
    with pytest.raises(TransferError, match="cancelled"):
        queued.wait(0, timeout=1)
    assert bool((host.read_pages(pages([3])).view(torch.uint8) == 0).all())


# -- CUDA -------------------------------------------------------------------------------


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["direct", "kernel"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[m.value for m in LAYOUTS])
@pytest.mark.parametrize("page_size", [1, 4])
def test_cuda_round_trip(layout: MemLayout, backend: str, page_size: int) -> None:
    for attention, dtype in itertools.product(["mha", "mla"], DTYPES):
        spec = spec_for(attention, dtype)
        device = DevicePool(spec, DEVICE_PAGES, page_size, "cuda")
        host = HostPool.create(spec, HOST_PAGES, page_size, layout, "cuda")
        randomize(device)
        src, hp, dst = pages(DEV_SRC), pages(HOST), pages(DEV_DST)
        before = sha(device.read_pages(src))
        for copier in (make_copier(backend), KernelCopier(dma_min_bytes=0)):
            copier.backup(device, host, src, hp)
            torch.cuda.synchronize()
            assert sha(host.read_pages(hp)) == before
            copier.load(device, host, hp, dst)
            torch.cuda.synchronize()
            assert sha(device.read_pages(dst)) == before


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=[m.value for m in LAYOUTS])
def test_cuda_engine_layer_wise(layout: MemLayout) -> None:
    spec = spec_for("mha", "float16", layers=4)
    device = DevicePool(spec, 32, 4, "cuda")
    host = HostPool.create(spec, 32, 4, layout, "cuda")
    randomize(device)
    src, hp, dst = pages([1, 5, 6, 7]), pages([3, 2, 1, 0]), pages([20, 21, 30, 9])
    want = device.read_pages(src)
    with TransferEngine(device, host, KernelCopier()) as engine:
        engine.submit_backup(0, src, hp)
        progress = engine.submit_load(1, hp, dst)
        for layer in range(4):
            progress.wait(layer, timeout=30)
            got = device.kv(0, layer)[dst[0] * 4 : dst[0] * 4 + 4].cpu()  # ordered after the event
            assert sha(got) == sha(want[0, 0, layer])
        engine.wait_idle(timeout=30)
        assert all(c.ok for c in engine.drain_completions())
    assert sha(device.read_pages(dst)) == sha(want)


# -- benchmark smoke test ---------------------------------------------------------------


def test_transfer_bench_main_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from hicache.bench.transfer import main

    out = tmp_path / "bench.json"
    argv = ["--layers", "2", "--heads", "1", "--head-dim", "8", "--pages", "4"]
    argv += ["--repeat", "1", "--page-sizes", "4,1", "--device", "cpu", "--json", str(out)]
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    runs = payload["runs"]
    before, after = payload["loadavg_1min"]
    assert before >= 0 and after >= 0  # the host's load average, stated with the ratios
    assert len(runs) == 2 * len(LAYOUTS) * 2
    assert {(r["layout"], r["io_backend"], r["page_size"]) for r in runs} == {
        (m.value, b, ps) for m in LAYOUTS for b in ("direct", "kernel") for ps in (4, 1)
    }
    keys = {"layout", "io_backend", "page_size", "backup_gbps", "load_gbps", "memcpy_gbps"}
    assert all(set(r) == keys and r["backup_gbps"] > 0 and r["load_gbps"] > 0 for r in runs)
    printed = capsys.readouterr().out
    assert "load/memcpy" in printed and "load average" in printed


def test_transfer_bench_bounds_times_every_pattern(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--bounds``: every pattern timed against the contiguous copy (ratio 1.0 for it),
    each load pattern checked to copy every row (measure_bounds raises otherwise)."""
    import json

    from hicache.bench.transfer import main

    out = tmp_path / "bounds.json"
    argv = ["--bounds", "--layers", "3", "--heads", "2", "--head-dim", "8", "--pages", "3"]
    argv += ["--repeat", "1", "--page-sizes", "4", "--device", "cpu", "--json", str(out)]
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    bounds = {b["pattern"]: b for b in payload["bounds"]}
    assert bounds["contiguous copy"]["ratio"] == 1.0
    assert {"load, one view per layer group", "read only: layer rows -> stage"} <= set(bounds)
    assert all(b["cpu_s"] > 0 and b["gbps"] > 0 and b["ratio"] > 0 for b in bounds.values())
    assert len(payload["loadavg_1min"]) == 2
    assert "contiguous/pattern" in capsys.readouterr().out
