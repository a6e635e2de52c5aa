"""Address-based block copies and the huge-page advice of the CPU pools."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import pytest
import torch

from hicache.config import MemLayout
from hicache.memory import DevicePool, HostPool
from hicache.memory.hugepages import HUGE_PAGE_MIN_BYTES, advise_huge_pages
from hicache.spec import KVSpec
from hicache.transfer import KernelCopier
from hicache.transfer.blocks import MIN_SPLIT_BYTES, BlockPlan, copy_blocks, copy_layers
from hicache.transfer.workers import copy_threads, host_busy, run_steps, serial_torch_threads


def test_copy_blocks_moves_exactly_the_listed_blocks() -> None:
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    plan = BlockPlan.build([0, 10], [4, 30], [3, 2], dst_layer_stride=20, src_layer_stride=1)
    copy_blocks(dst, src, plan, layer=1)
    want = torch.zeros(64, dtype=torch.uint8)
    want[20:23] = src[5:8]
    want[30:32] = src[31:33]
    assert torch.equal(dst, want)


def test_copy_blocks_refuses_out_of_bounds_before_copying() -> None:
    src = torch.arange(16, dtype=torch.uint8)
    dst = torch.zeros(16, dtype=torch.uint8)
    plan = BlockPlan.build([0, 12], [0, 0], [4, 4], dst_layer_stride=4, src_layer_stride=0)
    copy_blocks(dst, src, plan, layer=0)  # block 2 ends at 16: fits
    dst.zero_()
    with pytest.raises(IndexError, match="outside its buffer"):
        copy_blocks(dst, src, plan, layer=1)  # block 2 would end at 20
    assert not bool(dst.any())
    with pytest.raises(ValueError, match="negative"):
        BlockPlan.build([-1], [0], [1], 0, 0)
    with pytest.raises(ValueError, match="contiguous"):
        copy_blocks(dst.view(4, 4).t(), src, plan, 0)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copy_blocks_split_over_threads_is_exact(threads: int) -> None:
    """A copy over MIN_SPLIT_BYTES goes to helper threads; every byte lands once."""
    block = 64 * 1024
    n = 2 * MIN_SPLIT_BYTES // block + 3
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (n * block,), dtype=torch.uint8, generator=g)
    dst = torch.zeros_like(src)
    perm = torch.randperm(n, generator=g).tolist()
    plan = BlockPlan.build(
        [p * block for p in perm], [i * block for i in range(n)], [block] * n, 0, 0
    )
    copy_blocks(dst, src, plan, 0, threads=threads)
    for i, p in enumerate(perm):
        assert torch.equal(dst[p * block : (p + 1) * block], src[i * block : (i + 1) * block])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copy_layers_copies_every_layer_and_reports_them_in_order(threads: int) -> None:
    """Five layers of 4 blocks (layer stride 4 blocks on both sides), up to ``threads`` at
    once: every byte lands, and ``done`` sees 0..4 in order, each after its layer."""
    block, layers = 4096, 5
    g = torch.Generator().manual_seed(2)
    src = torch.randint(0, 256, (layers * 4 * block,), dtype=torch.uint8, generator=g)
    dst = torch.zeros_like(src)
    perm = [2, 0, 3, 1]
    plan = BlockPlan.build(
        [p * block for p in perm], [i * block for i in range(4)], [block] * 4, 4 * block, 4 * block
    )
    seen: list[int] = []

    def done(layer: int) -> None:
        lo = layer * 4 * block
        for i, p in enumerate(perm):  # this layer has landed
            d, s = lo + p * block, lo + i * block
            assert torch.equal(dst[d : d + block], src[s : s + block])
        seen.append(layer)

    copy_layers(dst, src, plan, layers, done, threads=threads)
    assert seen == list(range(layers))


def test_copy_layers_refuses_a_layer_out_of_bounds_before_copying() -> None:
    """A layer out of bounds: the error comes before any byte moves or layer is reported."""
    src = torch.ones(3 * 1024, dtype=torch.uint8)
    dst = torch.zeros(2 * 1024, dtype=torch.uint8)  # room for layers 0 and 1 only
    plan = BlockPlan.build([0], [0], [1024], 1024, 1024)
    seen: list[int] = []
    with pytest.raises(IndexError, match="outside its buffer"):
        copy_layers(dst, src, plan, 3, seen.append, threads=2)
    assert seen == []
    assert not bool(dst.any())


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_run_steps_reports_steps_in_order_and_raises_a_units_error(threads: int) -> None:
    """Units of later steps may run before earlier ones end; ``done`` still sees each step
    in order once all its units have run. A failing unit stops the claiming and is raised
    after the units already started have ended; the steps before it were reported."""
    ran: list[tuple[int, int]] = []
    seen: list[int] = []

    def unit(s: int, u: int) -> None:
        ran.append((s, u))

    def done(s: int) -> None:
        assert all((s, u) in ran for u in range(3))
        seen.append(s)

    steps = [[partial(unit, s, u) for u in range(3)] for s in range(4)]
    run_steps(steps, done, threads=threads)
    assert seen == [0, 1, 2, 3] and sorted(ran) == [(s, u) for s in range(4) for u in range(3)]

    def boom() -> None:
        raise RuntimeError("unit failed")

    seen.clear()
    bad = [[partial(unit, 0, 0)], [boom], [partial(unit, 2, 0)]]
    with pytest.raises(RuntimeError, match="unit failed"):
        run_steps(bad, done=seen.append, threads=threads)
    assert seen == [0]


def test_copy_threads_run_torch_serially() -> None:
    """Where torch's OpenMP runtime is libgomp, a torch op on a copy thread sees one thread
    (it never opens an OpenMP team); the caller's thread count is unchanged."""
    before = torch.get_num_threads()
    if not serial_torch_threads():
        pytest.skip("torch's OpenMP runtime is not libgomp here")
    assert copy_threads(2).submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == before


def _with_run(perm: torch.Tensor, run: range, n: int) -> torch.Tensor:
    """``n`` distinct pages: ``run`` first (consecutive), then ``perm`` without it."""
    rest = [p for p in perm.tolist() if p not in run]
    return torch.tensor([*run, *rest][:n])


@pytest.mark.parametrize("layout", list(MemLayout))
def test_kernel_load_by_blocks_matches_direct_reads(layout: MemLayout) -> None:
    """The slab load paths (memmove blocks, several layers at once; page_first's groups of
    layers) against read_pages, on a pool big enough to split."""
    spec = KVSpec(num_layers=5, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    device = DevicePool(spec, 80, 16)
    host = HostPool(spec, 64, 16, layout, pin_memory=False)
    g = torch.Generator().manual_seed(1)
    raw = host.buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    hp = _with_run(torch.randperm(64, generator=g), range(10, 15), 40)
    dp = _with_run(torch.randperm(80, generator=g), range(50, 55), 40)
    KernelCopier(slab_min_bytes=0).load(device, host, hp, dp)
    assert torch.equal(
        device.read_pages(dp).view(torch.uint8), host.read_pages(hp).view(torch.uint8)
    )


def test_huge_page_advice() -> None:
    small = torch.empty(1024)
    assert not advise_huge_pages(small)
    assert not advise_huge_pages(torch.empty(HUGE_PAGE_MIN_BYTES, dtype=torch.uint8)[::2])
    spec = KVSpec(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16")
    device = DevicePool(spec, 16, 64)  # 16 MiB
    host = HostPool(spec, 16, 64, MemLayout.PAGE_FIRST, pin_memory=False)
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = "[never]" not in f.read()
    except OSError:
        thp = False
    assert device.huge_pages == thp and host.huge_pages == thp
    assert not bool(device.buffer.any()) and not bool(host.buffer.any())


@pytest.mark.parametrize("layout", list(MemLayout))
def test_kernel_copies_in_one_view_units_are_exact(
    layout: MemLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every strided view pair its own unit on the copy threads (page_first loads,
    backups) and every block range of a layer its own unit (block loads): a backup then a
    load round-trips every byte, and nothing outside the op's pages changes."""
    import hicache.transfer.blocks as blocks
    import hicache.transfer.kernel as kernel

    monkeypatch.setattr(kernel, "STRIDED_UNIT_BYTES", 1)
    monkeypatch.setattr(blocks, "UNIT_BYTES", 1)
    spec = KVSpec(num_layers=6, num_kv_heads=2, head_dim=64, dtype="float16")
    device = DevicePool(spec, 48, 8)
    host = HostPool(spec, 40, 8, layout, pin_memory=False)
    g = torch.Generator().manual_seed(3)
    raw = device.buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    hp = _with_run(torch.randperm(40, generator=g), range(4, 9), 24)
    dp = _with_run(torch.randperm(48, generator=g), range(30, 35), 24)
    copier = KernelCopier(slab_min_bytes=0, cpu_copy="threads")
    copier.backup(device, host, dp, hp)
    assert torch.equal(
        host.read_pages(hp).view(torch.uint8), device.read_pages(dp).view(torch.uint8)
    )
    before = device.buffer.clone()
    dst = torch.tensor([p for p in range(48) if p not in set(dp.tolist())][:24])
    seen: list[int] = []
    copier.load_layers(device, host, hp, dst, seen.append)
    assert seen == list(range(spec.num_layers))
    assert torch.equal(
        device.read_pages(dst).view(torch.uint8), host.read_pages(hp).view(torch.uint8)
    )
    untouched = torch.ones(48, dtype=torch.bool)
    untouched[dst] = False
    keep = torch.arange(48)[untouched]
    assert torch.equal(
        device.buffer.view(torch.int16).view(2, spec.num_layers, 48, 8, -1)[:, :, keep],
        before.view(torch.int16).view(2, spec.num_layers, 48, 8, -1)[:, :, keep],
    )


def test_cpu_copy_is_validated_and_host_busy_reads_the_run_queue(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cpu_copy='gpu'"):
        KernelCopier(cpu_copy="gpu")  # type: ignore[arg-type]
    assert "cpu_copy='caller'" in repr(KernelCopier(cpu_copy="caller"))
    assert isinstance(host_busy(), bool)
    cpus = len(os.sched_getaffinity(0))
    f = tmp_path / "loadavg"
    f.write_text(f"0.50 0.40 0.30 {cpus}/300 4242\n")  # as many runnable as CPUs: quiet
    assert not host_busy(str(f))
    f.write_text(f"9.00 8.00 7.00 {cpus + 1}/300 4242\n")
    assert host_busy(str(f))
    f.write_text("garbage\n")
    assert not host_busy(str(f))
    assert not host_busy(str(tmp_path / "missing"))


def test_copy_threads_are_restarted_in_a_forked_child() -> None:
    """A child forked after the pool started gets its own copy threads (the inherited pool
    has none): a split copy there finishes instead of waiting forever. (The child runs no
    torch parallel op: GNU OpenMP itself is not fork-safe.)"""
    import multiprocessing as mp

    block = 2 * 2**20
    src = torch.randint(0, 256, (4 * block,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    plan = BlockPlan.build(
        [3 * block, 0, block, 2 * block], [0, block, 2 * block, 3 * block], [block] * 4, 0, 0
    )
    copy_blocks(dst, src, plan, 0, threads=2)  # the pool is up in the parent
    dst.zero_()
    proc = mp.get_context("fork").Process(target=_child_copy, args=(dst, src, plan))
    proc.start()
    proc.join(timeout=20)
    if proc.is_alive():
        proc.kill()
    assert proc.exitcode == 0


def _child_copy(dst: torch.Tensor, src: torch.Tensor, plan: BlockPlan) -> None:
    import ctypes

    copy_blocks(dst, src, plan, 0, threads=2)
    ok = all(
        ctypes.string_at(dst.data_ptr() + d, n) == ctypes.string_at(src.data_ptr() + s, n)
        for d, s, n in zip(plan.dst, plan.src, plan.nbytes, strict=True)
    )
    raise SystemExit(0 if ok else 1)
