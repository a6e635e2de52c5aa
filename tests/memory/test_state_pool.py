"""State pools and state-slot copies: exact bytes D->H->D for every layout and io backend."""

from __future__ import annotations

import hashlib

import pytest
import torch

from hicache.config import CacheConfig, MemLayout
from hicache.memory import DevicePool, HostPool, StatePool
from hicache.spec import KVSpec, SlidingWindowSpec, SnapshotSpec, StateTensor
from hicache.transfer import (
    DirectStateCopier,
    KernelStateCopier,
    make_copier,
    make_state_copier,
)

SPEC = SnapshotSpec(
    num_layers=3,
    tensors=(
        StateTensor(name="conv", shape=(4, 3), dtype="bfloat16"),
        StateTensor(name="ssm", shape=(2, 3, 5), dtype="float32"),
    ),
)
LAYOUTS = [m.value for m in MemLayout]
IOS = ["direct", "kernel"]


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def random_state(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in SPEC.tensors:
        x = torch.randn((n, SPEC.num_layers, *t.shape), generator=g)
        out.append(x.to(getattr(torch, t.dtype)))
    # NaN payloads and -0.0 must survive too: copies move bytes, not values
    out[1].view(torch.int32)[0, 0, 0, 0, 0] = 0x7FC00001
    out[1][0, 0, 0, 0, 1] = -0.0
    return out


def zeros(n: int) -> list[torch.Tensor]:
    return [
        torch.zeros((n, SPEC.num_layers, *t.shape), dtype=getattr(torch, t.dtype))
        for t in SPEC.tensors
    ]


def test_sizes_and_read_write_roundtrip() -> None:
    pool = StatePool.device(SPEC, 4, "cpu")
    assert pool.slot_bytes == 3 * (4 * 3 * 2 + 2 * 3 * 5 * 4)
    assert pool.nbytes == 4 * pool.slot_bytes
    assert tuple(pool.buffers[0].shape) == (3, 4, 4, 3)
    assert tuple(pool.layer("ssm", 1).shape) == (4, 2, 3, 5)
    data = random_state(2, 0)
    pool.write_slots([3, 1], data)
    assert digest(pool.read_slots([3, 1])) == digest(data)
    assert digest(pool.read_slots([0])) == digest(zeros(1))
    with pytest.raises(IndexError):
        pool.read_slots([4])
    with pytest.raises(ValueError, match="more than once"):
        pool.write_slots([1, 1], data)
    with pytest.raises(ValueError, match="expected"):
        pool.write_slots([1, 2], [data[0], data[1].to(torch.float64)])


def test_copy_slots_forks_a_snapshot() -> None:
    pool = StatePool.device(SPEC, 4, "cpu")
    data = random_state(1, 1)
    pool.write_slots([2], data)
    pool.copy_slots([2], [0])
    assert digest(pool.read_slots([0])) == digest(data)
    with pytest.raises(ValueError, match="overlap"):
        pool.copy_slots([0], [0])


def test_host_layouts_have_slots_first() -> None:
    host = StatePool.host(SPEC, 5, "page_first", "cpu")
    assert tuple(host.buffers[1].shape) == (5, 3, 2, 3, 5) and not host.pinned
    with pytest.raises(ValueError, match="per-layer"):
        host.layer(0, 0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("io", IOS)
@pytest.mark.parametrize("layerwise", [False, True])
def test_state_d_h_d_is_byte_exact(layout: str, io: str, layerwise: bool) -> None:
    dev = StatePool.device(SPEC, 6, "cpu")
    host = StatePool.host(SPEC, 7, layout, "cpu")
    copier = make_state_copier(io)
    assert copier.name == io
    data = random_state(3, 2)
    dev.write_slots([5, 0, 2], data)
    want = digest(data)
    copier.backup(dev, host, [5, 0, 2], [6, 1, 3])
    assert digest(host.read_slots([6, 1, 3])) == want
    assert digest(host.read_slots([0, 2, 4, 5])) == digest(zeros(4))  # untouched
    fresh = StatePool.device(SPEC, 6, "cpu")
    if layerwise:
        for layer in range(SPEC.num_layers):
            copier.load_layer(fresh, host, [6, 1, 3], [1, 4, 3], layer)
    else:
        copier.load(fresh, host, [6, 1, 3], [1, 4, 3])
    assert digest(fresh.read_slots([1, 4, 3])) == want
    assert digest(fresh.read_slots([0, 2, 5])) == digest(zeros(3))


@pytest.mark.parametrize("copier", [DirectStateCopier(), KernelStateCopier()])
def test_bad_ops_copy_nothing(copier: DirectStateCopier | KernelStateCopier) -> None:
    dev = StatePool.device(SPEC, 2, "cpu")
    host = StatePool.host(SPEC, 2, "layer_first", "cpu")
    dev.write_slots([0, 1], random_state(2, 3))
    with pytest.raises(ValueError, match="more than once"):
        copier.backup(dev, host, [0, 1], [1, 1])
    with pytest.raises(IndexError):
        copier.backup(dev, host, [0, 1], [0, 2])
    with pytest.raises(ValueError, match="device slots vs"):
        copier.backup(dev, host, [0, 1], [0])
    with pytest.raises(IndexError):
        copier.load_layer(dev, host, [0], [0], 3)
    assert all(int(b.count_nonzero()) == 0 for b in host.buffers)
    one = SnapshotSpec(num_layers=3, tensors=(StateTensor(name="conv", shape=(4, 3)),))
    other = StatePool.host(one, 2, "page_first", "cpu")
    with pytest.raises(ValueError, match="differ in spec"):
        copier.backup(dev, other, [0], [0])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("io", IOS)
def test_swa_pool_pages_d_h_d_is_byte_exact(layout: str, io: str) -> None:
    """The sliding-window layers' pools are ordinary KV pools of their own spec and size."""
    swa = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16")
    full = KVSpec(num_layers=4, num_kv_heads=2, head_dim=4, dtype="bfloat16")
    cfg = CacheConfig(
        page_size=2,
        device_tokens=16,
        swa_full_tokens_ratio=0.5,
        mem_layout=layout,
    )
    sizes = SlidingWindowSpec(kv=swa, window=2)
    assert sizes.device_pages(cfg) == 4 and sizes.host_pages(cfg, full) == 8
    dev = DevicePool(swa, sizes.device_pages(cfg), 2)
    host = HostPool(swa, sizes.host_pages(cfg, full), 2, layout, pin_memory=False)
    g = torch.Generator().manual_seed(4)
    data = torch.randn((3, 2, 2, 2, 2, 4), generator=g).to(torch.bfloat16)
    dev.write_pages([3, 0, 1], data)
    copier = make_copier(io)
    copier.backup(dev, host, torch.tensor([3, 0, 1]), torch.tensor([7, 2, 5]))
    fresh = DevicePool(swa, sizes.device_pages(cfg), 2)
    copier.load(fresh, host, torch.tensor([7, 2, 5]), torch.tensor([0, 2, 3]))
    assert digest([fresh.read_pages([0, 2, 3])]) == digest([data])


def test_state_config_sizes() -> None:
    kv = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4)
    cfg = CacheConfig(page_size=4, device_tokens=64, hicache_ratio=3.0)
    # L1 KV: 16 pages x 4 tokens x 64 bytes = 4096 bytes; 0.9 of it in 432-byte slots
    assert SPEC.slot_bytes == 432
    assert SPEC.device_slots(cfg, kv) == int(0.9 * 4096 // 432) == 8
    assert SPEC.host_slots(cfg, kv) == 24
    fixed = CacheConfig(page_size=4, device_tokens=64, max_mamba_cache_size=5)
    assert SPEC.device_slots(fixed, kv) == 5 and SPEC.track_pages(fixed) == 64
    for field, value in (
        ("swa_full_tokens_ratio", 0),
        ("max_mamba_cache_size", -1),
        ("mamba_full_memory_ratio", float("nan")),
        ("mamba_track_interval", 0),
    ):
        with pytest.raises(ValueError, match=field):
            CacheConfig(**{field: value})
    with pytest.raises(ValueError, match="shape"):
        StateTensor(name="x", shape=(0,))
    with pytest.raises(ValueError, match="unique"):
        SnapshotSpec(num_layers=1, tensors=(StateTensor(name="x", shape=(1,)),) * 2)
