"""Page allocator, device (L1) pool and host (L2) pool: exact state on tiny sizes."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.config import CacheConfig, MemLayout
from hicache.memory import (
    AllocatorError,
    DevicePool,
    HostPool,
    PageAllocator,
    check_host_memory,
)
from hicache.spec import AttentionKind, KVSpec

MHA = KVSpec(num_layers=3, num_kv_heads=2, head_dim=4, dtype="float32")
MLA = KVSpec(
    num_layers=2,
    attention=AttentionKind.MLA,
    kv_lora_rank=5,
    qk_rope_head_dim=3,
    dtype="bfloat16",
)
LAYOUTS = list(MemLayout)
gpu = pytest.mark.gpu  # skipped without CUDA by conftest.py


def free_list(a: PageAllocator) -> list[int]:
    """The free list in order, read through the public API (then restored)."""
    pages = a.alloc(a.free_pages)
    assert pages is not None
    a.free(pages)
    return pages


# -- PageAllocator ----------------------------------------------------------------------


def test_alloc_takes_from_front_in_ascending_order() -> None:
    a = PageAllocator(6)
    assert a.alloc(2) == [0, 1]
    assert a.alloc(3) == [2, 3, 4]
    assert (a.free_pages, a.used_pages, a.num_pages) == (1, 5, 6)
    assert [a.is_used(p) for p in range(6)] == [True] * 5 + [False]


def test_free_appends_to_back_in_given_order() -> None:
    a = PageAllocator(5)
    assert a.alloc(4) == [0, 1, 2, 3]
    a.free([2, 0])
    a.free(iter([3]))
    assert a.alloc(4) == [4, 2, 0, 3]
    a.check_integrity()


def test_free_accepts_tensor_elements() -> None:
    a = PageAllocator(4)
    a.alloc(3)
    a.free(torch.tensor([1, 2]))
    assert not a.is_used(1) and not a.is_used(2) and a.is_used(0)


def test_alloc_zero_and_exhaustion() -> None:
    a = PageAllocator(3)
    assert a.alloc(0) == []
    assert a.alloc(4) is None
    assert (a.free_pages, a.used_pages) == (3, 0)
    assert a.alloc(3) == [0, 1, 2]
    assert a.alloc(1) is None
    assert a.alloc(0) == []
    with pytest.raises(ValueError, match="n=-1"):
        a.alloc(-1)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        ([1, 1], "double free of page 1: it appears twice"),
        ([0, 5], "double free of page 5: it is not allocated"),
        ([0, 9], "free of page 9: out of range"),
        ([-1], "free of page -1: out of range"),
    ],
)
def test_bad_free_raises_and_frees_nothing(call: list[int], match: str) -> None:
    a = PageAllocator(8)
    a.alloc(3)  # 0, 1, 2 used
    before = (a.free_pages, a.used_pages, [a.is_used(p) for p in range(8)])
    with pytest.raises(AllocatorError, match=match):
        a.free(call)
    assert (a.free_pages, a.used_pages, [a.is_used(p) for p in range(8)]) == before
    assert free_list(a) == [3, 4, 5, 6, 7]
    a.check_integrity()


def test_double_free_after_valid_free() -> None:
    a = PageAllocator(4)
    a.alloc(2)
    a.free([1])
    with pytest.raises(AllocatorError, match="double free of page 1"):
        a.free([1])
    assert a.used_pages == 1


def test_double_allocation_detected_before_mutation() -> None:
    a = PageAllocator(4)
    a._used[1] = 1  # corrupt: page 1 is in the free list but flagged used
    with pytest.raises(AllocatorError, match="double allocation of page 1"):
        a.alloc(2)
    assert a.free_pages == 4
    with pytest.raises(AllocatorError, match="page 1 is in the free list but flagged used"):
        a.check_integrity()


def test_check_integrity_detects_violations() -> None:
    a = PageAllocator(4)
    a.check_integrity()
    a._free.append(0)
    with pytest.raises(AllocatorError, match="page 0 is in the free list twice"):
        a.check_integrity()
    a.reset()
    a.alloc(2)
    a._free.popleft()  # page 2 vanishes: neither free nor used
    with pytest.raises(AllocatorError, match="free \\(1\\) \\+ used \\(2\\) != total \\(4\\)"):
        a.check_integrity()
    a.reset()
    a._used_count = 3
    with pytest.raises(AllocatorError, match="used count 3 disagrees"):
        a.check_integrity()


def test_reset_restores_initial_order() -> None:
    a = PageAllocator(4)
    a.alloc(3)
    a.free([2, 0])
    a.reset()
    assert (a.free_pages, a.used_pages) == (4, 0)
    assert a.alloc(4) == [0, 1, 2, 3]


def test_is_used_out_of_range_and_bad_size() -> None:
    a = PageAllocator(2)
    with pytest.raises(IndexError):
        a.is_used(2)
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(-1)
    assert PageAllocator(0).alloc(1) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=40))
def test_allocator_matches_fifo_model(ops: list[tuple[bool, int]]) -> None:
    n = 8
    a = PageAllocator(n)
    model_free = list(range(n))
    held: list[int] = []
    for is_alloc, k in ops:
        if is_alloc:
            got = a.alloc(k)
            if k > len(model_free):
                assert got is None
            else:
                want, model_free = model_free[:k], model_free[k:]
                assert got == want
                held += want
        else:
            give, held = held[:k], held[k:]
            give.reverse()
            a.free(give)
            model_free += give
        a.check_integrity()
        assert a.free_pages == len(model_free) and a.used_pages == len(held)
    assert free_list(a) == model_free


# -- DevicePool -------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [MHA, MLA], ids=["mha", "mla"])
def test_device_pool_shape_and_sizes(spec: KVSpec) -> None:
    pool = DevicePool(spec, num_pages=5, page_size=4)
    k, heads, dim = spec.num_kv, spec.heads, spec.dim
    assert pool.buffer.shape == (k, spec.num_layers, 20, heads, dim)
    assert pool.buffer.dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec.dtype]
    assert pool.buffer.is_contiguous() and bool((pool.buffer == 0).all())
    assert (pool.num_pages, pool.page_size, pool.size_tokens) == (5, 4, 20)
    assert pool.page_bytes == 4 * spec.token_bytes
    assert pool.nbytes == 5 * pool.page_bytes
    assert pool.device == torch.device("cpu") and pool.layout is MemLayout.LAYER_FIRST
    assert pool.allocator.num_pages == 5 and pool.spec is spec


def test_device_pool_kv_views() -> None:
    pool = DevicePool(MHA, num_pages=2, page_size=2)
    assert pool.kv(1, 2).shape == (4, 2, 4)
    pool.k_buffer(1)[3, 1, 2] = 7.0
    pool.v_buffer(2)[0, 0, 0] = 9.0
    assert pool.buffer[0, 1, 3, 1, 2] == 7.0 and pool.buffer[1, 2, 0, 0, 0] == 9.0
    assert pool.k_buffer(0).data_ptr() == pool.buffer.data_ptr()
    with pytest.raises(ValueError, match="no latent"):
        pool.latent_buffer(0)
    with pytest.raises(IndexError):
        pool.kv(2, 0)
    with pytest.raises(IndexError):
        pool.kv(0, 3)
    mla = DevicePool(MLA, num_pages=2, page_size=2)
    assert mla.latent_buffer(1).shape == (4, 1, 8)
    with pytest.raises(ValueError, match="no V buffer"):
        mla.v_buffer(0)


def _encoded(pool: DevicePool) -> None:
    """Fill a layer_first float32 buffer with value = 1000*k + 100*l + token."""
    k, nl, s = pool.buffer.shape[:3]
    code = (
        torch.arange(k).view(-1, 1, 1) * 1000
        + torch.arange(nl).view(1, -1, 1) * 100
        + torch.arange(s).view(1, 1, -1)
    ).float()
    pool.buffer.copy_(code.view(k, nl, s, 1, 1).expand_as(pool.buffer))


def test_device_read_pages_canonical_order() -> None:
    pool = DevicePool(MHA, num_pages=4, page_size=2)
    _encoded(pool)
    out = pool.read_pages(torch.tensor([3, 1]))
    assert out.shape == (2, 2, 3, 2, 2, 4) and out.device.type == "cpu"
    for i, page in enumerate([3, 1]):
        for k, layer, j in itertools.product(range(2), range(3), range(2)):
            assert bool((out[i, k, layer, j] == 1000 * k + 100 * layer + page * 2 + j).all())


# -- HostPool ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [MHA, MLA], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[m.value for m in LAYOUTS])
def test_host_pool_shapes(spec: KVSpec, layout: MemLayout) -> None:
    pool = HostPool(spec, 5, 4, layout, pin_memory=False)
    k, nl, h, d = spec.num_kv, spec.num_layers, spec.heads, spec.dim
    want = {
        MemLayout.LAYER_FIRST: (k, nl, 20, h, d),
        MemLayout.PAGE_FIRST: (k, 20, nl, h, d),
        MemLayout.PAGE_FIRST_DIRECT: (k, 5, nl, 4, h, d),
    }[layout]
    assert tuple(pool.buffer.shape) == want
    assert pool.layout is layout and not pool.pinned
    assert pool.page_bytes == 4 * spec.token_bytes and pool.nbytes == 5 * pool.page_bytes
    assert bool((pool.buffer == 0).all())


def _random_pages(n: int, spec: KVSpec, ps: int, seed: int = 0) -> torch.Tensor:
    """Canonical ``(n, K, L, ps, H, D)`` pages of random bytes (NaN bit patterns included)."""
    g = torch.Generator().manual_seed(seed)
    shape = (n, spec.num_kv, spec.num_layers, ps, spec.heads, spec.dim)
    dt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
        spec.dtype
    ]
    nbytes = torch.Size(shape).numel() * dt.itemsize
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dt).view(shape)


@pytest.mark.parametrize("spec", [MHA, MLA], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", [*LAYOUTS, None], ids=[*(m.value for m in LAYOUTS), "device"])
def test_read_write_pages_round_trip(spec: KVSpec, layout: MemLayout | None) -> None:
    pool: DevicePool | HostPool
    pool = (
        DevicePool(spec, 6, 2) if layout is None else HostPool(spec, 6, 2, layout, pin_memory=False)
    )
    data = _random_pages(3, spec, 2)
    pages = torch.tensor([4, 0, 2])
    pool.write_pages(pages, data)
    back = pool.read_pages(pages)
    assert back.dtype == data.dtype and back.view(torch.uint8).equal(data.view(torch.uint8))
    others = pool.read_pages(torch.tensor([1, 3, 5]))
    assert bool((others.view(torch.uint8) == 0).all())
    assert pool.read_pages(torch.tensor([0])).view(torch.uint8).equal(data[1:2].view(torch.uint8))


def test_host_write_pages_lands_in_layout_positions() -> None:
    data = _random_pages(2, MHA, 2, seed=3)
    pages = [2, 0]
    lf = HostPool(MHA, 3, 2, MemLayout.LAYER_FIRST, pin_memory=False)
    pf = HostPool(MHA, 3, 2, MemLayout.PAGE_FIRST, pin_memory=False)
    pfd = HostPool(MHA, 3, 2, MemLayout.PAGE_FIRST_DIRECT, pin_memory=False)
    for pool in (lf, pf, pfd):
        pool.write_pages(torch.tensor(pages), data)
    for i, p in enumerate(pages):
        for k, layer, j in itertools.product(range(2), range(3), range(2)):
            t = p * 2 + j
            assert lf.buffer[k, layer, t].equal(data[i, k, layer, j])
            assert pf.buffer[k, t, layer].equal(data[i, k, layer, j])
            assert pfd.buffer[k, p, layer, j].equal(data[i, k, layer, j])


def test_read_write_pages_validation() -> None:
    pool = HostPool(MHA, 4, 2, MemLayout.PAGE_FIRST, pin_memory=False)
    data = _random_pages(2, MHA, 2)
    with pytest.raises(IndexError, match="page 4 out of range"):
        pool.read_pages(torch.tensor([0, 4]))
    with pytest.raises(IndexError, match="page -1 out of range"):
        pool.write_pages(torch.tensor([-1, 0]), data)
    with pytest.raises(ValueError, match="more than once"):
        pool.write_pages(torch.tensor([1, 1]), data)
    with pytest.raises(ValueError, match="shape"):
        pool.write_pages(torch.tensor([1]), data)
    with pytest.raises(ValueError, match="dtype"):
        pool.write_pages(torch.tensor([0, 1]), data.to(torch.float64))
    with pytest.raises(TypeError, match="integer"):
        pool.read_pages(torch.tensor([0.0]))
    with pytest.raises(TypeError, match="1-D"):
        pool.read_pages(torch.tensor([[0]]))
    assert bool((pool.buffer == 0).all())  # nothing was written by the failed calls
    assert pool.read_pages(torch.zeros(0, dtype=torch.int64)).shape == (0, 2, 3, 2, 2, 4)
    assert pool.read_pages([1, 2]).shape == (2, 2, 3, 2, 2, 4)


@pytest.mark.parametrize("spec", [MHA, MLA], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", [MemLayout.PAGE_FIRST, MemLayout.PAGE_FIRST_DIRECT])
def test_page_view_is_a_contiguous_view(spec: KVSpec, layout: MemLayout) -> None:
    pool = HostPool(spec, 4, 2, layout, pin_memory=False)
    pool.write_pages(torch.tensor([0, 1, 2, 3]), _random_pages(4, spec, 2, seed=1))
    views = pool.page_view(2)
    assert len(views) == spec.num_kv
    want = (2, spec.num_layers) if layout is MemLayout.PAGE_FIRST else (spec.num_layers, 2)
    base = pool.buffer.data_ptr()
    end = base + pool.nbytes
    for k, v in enumerate(views):
        assert v.is_contiguous() and tuple(v.shape) == (*want, spec.heads, spec.dim)
        assert base <= v.data_ptr() < end  # shares the pool's memory
        canon = pool.read_pages(torch.tensor([2]))[0, k]  # (L, ps, H, D)
        expect = canon.transpose(0, 1) if layout is MemLayout.PAGE_FIRST else canon
        assert v.view(torch.uint8).equal(expect.contiguous().view(torch.uint8))
        v.fill_(3.0)
        assert bool((pool.read_pages(torch.tensor([2]))[0, k] == 3.0).all())
    assert not bool((pool.read_pages(torch.tensor([1])) == 3.0).all())
    with pytest.raises(IndexError):
        pool.page_view(4)


def test_page_view_layer_first_raises() -> None:
    pool = HostPool(MHA, 2, 2, MemLayout.LAYER_FIRST, pin_memory=False)
    with pytest.raises(NotImplementedError, match="no zero-copy page view"):
        pool.page_view(0)


def test_host_ram_check_is_helpful_and_allocates_nothing() -> None:
    huge = KVSpec(num_layers=4096, num_kv_heads=128, head_dim=256, dtype="float32")
    # 10**6 pages x 64 tokens x 1 GiB per token: far beyond any RAM; raises before allocating
    with pytest.raises(ValueError) as info:
        HostPool(huge, 10**6, 64, MemLayout.PAGE_FIRST, pin_memory=False)
    msg = str(info.value)
    assert "GB" in msg and "available" in msg and "--hicache-size" in msg
    assert "hicache_ratio" in msg and "hicache_size" in msg
    assert f"{info.value.requested:,} bytes" in msg  # type: ignore[attr-defined]
    assert info.value.requested >= 10**6 * 64 * huge.token_bytes  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="hicache_size"):
        HostPool.for_config(huge, CacheConfig(page_size=64, hicache_size=10**9), "cpu")
    check_host_memory(1024)  # small sizes pass


def test_host_pool_for_config_and_create() -> None:
    cfg = CacheConfig(
        page_size=4, device_tokens=64, hicache_ratio=2.5, mem_layout="page_first_direct"
    )
    pool = HostPool.for_config(MHA, cfg, "cpu")
    assert (pool.num_pages, pool.page_size, pool.layout) == (40, 4, MemLayout.PAGE_FIRST_DIRECT)
    assert not pool.pinned
    tiny = CacheConfig(page_size=64, hicache_size=1e-9)
    with pytest.raises(ValueError, match="0 pages"):
        HostPool.for_config(MHA, tiny, "cpu")
    assert not HostPool.create(MLA, 2, 1, "layer_first", torch.device("cpu")).pinned


@gpu
@pytest.mark.gpu
def test_cuda_pools() -> None:
    host = HostPool.create(MHA, 4, 2, MemLayout.PAGE_FIRST, "cuda")
    assert host.pinned and host.buffer.is_pinned()
    dev = DevicePool(MHA, 4, 2, "cuda")
    data = _random_pages(2, MHA, 2)
    dev.write_pages(torch.tensor([3, 1]), data)
    assert dev.read_pages(torch.tensor([3, 1])).view(torch.uint8).equal(data.view(torch.uint8))


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_page_bytes_views_are_the_page_view_bytes(layout: str) -> None:
    spec = KVSpec(num_layers=3, num_kv_heads=2, head_dim=4, dtype="bfloat16")
    host = HostPool.create(spec, 5, 2, layout, "cpu")
    host.buffer.copy_(torch.randn(host.buffer.shape).to(torch.bfloat16))
    for page in range(5):
        views = host.page_bytes_views(page)
        slabs = host.page_view(page)
        assert [bytes(v) for v in views] == [
            s.contiguous().view(torch.uint8).numpy().tobytes() for s in slabs
        ]
    host.page_bytes_views(3)[1][0:2] = b"\x01\x02"  # writable, into the pool itself
    assert host.page_view(3)[1].reshape(-1).view(torch.uint8)[:2].tolist() == [1, 2]


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_page_ranges_are_the_page_view_slabs(layout: str) -> None:
    spec = KVSpec(num_layers=3, num_kv_heads=2, head_dim=4, dtype="bfloat16")
    host = HostPool.create(spec, 5, 2, layout, "cpu")
    for page in range(5):
        slabs = host.page_view(page)
        assert host.page_ranges(page) == [
            (s.data_ptr(), s.numel() * s.element_size()) for s in slabs
        ]
    with pytest.raises(IndexError):
        host.page_ranges(5)
    with pytest.raises(NotImplementedError):
        HostPool.create(spec, 5, 2, "layer_first", "cpu").page_ranges(0)
