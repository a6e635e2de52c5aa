"""PoolGeometry and page_spans: exact spans on tiny pools, and spans applied as memcpy
between two CPU pools equal write_pages(read_pages)."""

from __future__ import annotations

import ctypes
import json
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.disagg.pages import PoolGeometry, page_spans
from hicache.disagg.transport import Region, Span
from hicache.memory.device_pool import DevicePool
from hicache.spec import AttentionKind, KVSpec

MHA = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32")  # row 32 bytes
MLA = KVSpec(
    num_layers=3,
    attention=AttentionKind.MLA,
    kv_lora_rank=4,
    qk_rope_head_dim=2,
    dtype="bfloat16",
)  # row 12 bytes


def geo(addr: int, slots: int = 16, **kw: Any) -> PoolGeometry:
    """2 kinds x 2 layers x ``slots`` slots of 32 bytes, pages of 2 slots (64 bytes)."""
    base: dict[str, Any] = dict(
        addr=addr, num_kv=2, layers=2, slots=slots, row_bytes=32, page_size=2, dtype="float32"
    )
    return PoolGeometry(**{**base, **kw})


def test_geometry_of_a_pool() -> None:
    pool = DevicePool(MHA, num_pages=6, page_size=4)
    g = PoolGeometry.of(pool)
    assert g == PoolGeometry(
        addr=pool.buffer.data_ptr(),
        num_kv=2,
        layers=2,
        slots=24,
        row_bytes=32,
        page_size=4,
        dtype="float32",
        cuda=False,
        device=0,
    )
    assert g.num_pages == 6 and g.run_bytes == 128
    assert g.nbytes == pool.nbytes
    assert g.region() == Region(pool.buffer.data_ptr(), pool.nbytes, False, 0)
    # page 5 of V (kind 1) in layer 1 is where the buffer's view says
    assert g.page_addr(1, 1, 5) == pool.buffer[1, 1, 20].data_ptr()
    mla = PoolGeometry.of(DevicePool(MLA, num_pages=2, page_size=1))
    assert (mla.num_kv, mla.layers, mla.row_bytes, mla.dtype) == (1, 3, 12, "bfloat16")


def test_geometry_round_trips_through_json() -> None:
    g = geo(4096, cuda=True, device=3)
    d = json.loads(json.dumps(g.to_dict()))
    assert PoolGeometry.from_dict(d) == g
    with pytest.raises(ValueError, match="missing slots"):
        PoolGeometry.from_dict({k: v for k, v in d.items() if k != "slots"})
    with pytest.raises(ValueError, match="unknown extra"):
        PoolGeometry.from_dict({**d, "extra": 1})
    with pytest.raises(ValueError, match="slots=15 is invalid; must be a multiple of page_size=2"):
        PoolGeometry.from_dict({**d, "slots": 15})
    with pytest.raises(ValueError, match="dtype='int8' is invalid"):
        PoolGeometry.from_dict({**d, "dtype": "int8"})
    with pytest.raises(ValueError, match="addr=-1 is invalid"):
        PoolGeometry.from_dict({**d, "addr": -1})


def test_spans_merge_runs_consecutive_on_both_sides() -> None:
    src, dst = geo(0, slots=24), geo(100_000)  # 12 and 8 pages of 64 bytes
    # slab (kind k, layer l) starts at (2k + l) * slots * 32: 768 bytes apart in src, 512 in dst
    spans = page_spans(src, [3, 4, 5, 9], dst, [7, 0, 1, 2])
    want = []
    for slab in range(4):
        s, d = 768 * slab, 100_000 + 512 * slab
        want += [
            Span(s + 3 * 64, d + 7 * 64, 64),  # 3 -> 7
            Span(s + 4 * 64, d + 0 * 64, 128),  # 4, 5 -> 0, 1
            Span(s + 9 * 64, d + 2 * 64, 64),  # 9 -> 2 (9 follows 5 on neither side)
        ]
    assert spans == want


def test_spans_merge_across_layers_and_kinds_when_memory_follows() -> None:
    src, dst = geo(0), geo(1 << 20)  # 8 pages of 64 bytes; slabs 512 bytes apart
    # every page in order: the whole buffer is one span
    assert page_spans(src, range(8), dst, range(8)) == [Span(0, 1 << 20, 4 * 512)]
    # [0, 7]: a slab's page 7 is followed in memory by the next slab's page 0
    spans = page_spans(src, [0, 7], dst, [0, 7])
    assert [(s.src, s.dst - (1 << 20), s.nbytes) for s in spans] == [
        (0, 0, 64),
        (448, 448, 128),
        (960, 960, 128),
        (1472, 1472, 128),
        (1984, 1984, 64),
    ]
    # one side contiguous, the other not: no merge
    assert len(page_spans(src, [0, 7], dst, [1, 7])) == 8


def test_empty_lists_give_no_span() -> None:
    assert page_spans(geo(0), [], geo(64), []) == []


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_kv", 1, "src num_kv=2, dst num_kv=1"),
        ("layers", 3, "src layers=2, dst layers=3"),
        ("row_bytes", 16, "src row_bytes=32, dst row_bytes=16"),
        ("page_size", 4, "src page_size=2, dst page_size=4"),
        ("dtype", "bfloat16", "src dtype='float32', dst dtype='bfloat16'"),
    ],
)
def test_pools_that_differ_are_refused(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        page_spans(geo(0), [0], geo(0, **{field: value}), [0])


def test_bad_page_lists_are_refused() -> None:
    with pytest.raises(ValueError, match="src_pages 2, dst_pages 1"):
        page_spans(geo(0), [0, 1], geo(0), [0])
    with pytest.raises(ValueError, match=r"src_pages: page 8 out of range \[0, 8\)"):
        page_spans(geo(0), [8], geo(0), [0])
    with pytest.raises(ValueError, match=r"dst_pages: page -1 out of range \[0, 16\)"):
        page_spans(geo(0), [0], geo(0, slots=32), [-1])
    with pytest.raises(ValueError, match="dst_pages: a page appears more than once"):
        page_spans(geo(0), [0, 1], geo(0), [2, 2])
    with pytest.raises(ValueError, match=r"src_pages: page 1\.0 is not an int"):
        page_spans(geo(0), [1.0], geo(0), [2])  # type: ignore[list-item]


def _random_pool(spec: KVSpec, num_pages: int, page_size: int, seed: int) -> DevicePool:
    pool = DevicePool(spec, num_pages, page_size)
    g = torch.Generator().manual_seed(seed)
    words = pool.buffer.view(torch.uint8)
    words.copy_(torch.randint(0, 256, words.shape, dtype=torch.uint8, generator=g))
    return pool


@st.composite
def _pairs(draw: st.DrawFn) -> tuple[int, int, list[int], list[int]]:
    src_n = draw(st.integers(1, 10))
    dst_n = draw(st.integers(1, 10))
    n = draw(st.integers(0, min(src_n, dst_n)))
    src = draw(st.lists(st.integers(0, src_n - 1), min_size=n, max_size=n))
    dst = draw(st.permutations(range(dst_n)))[:n]
    return src_n, dst_n, src, list(dst)


@settings(max_examples=60, deadline=None)
@given(pairs=_pairs(), mla=st.booleans(), page_size=st.sampled_from([1, 2, 3]))
def test_spans_as_memcpy_equal_write_pages_of_read_pages(
    pairs: tuple[int, int, list[int], list[int]], mla: bool, page_size: int
) -> None:
    src_n, dst_n, src_pages, dst_pages = pairs
    spec = MLA if mla else MHA
    src = _random_pool(spec, src_n, page_size, 1)
    dst = _random_pool(spec, dst_n, page_size, 2)
    want = _random_pool(spec, dst_n, page_size, 2)
    want.write_pages(dst_pages, src.read_pages(src_pages))
    spans = page_spans(PoolGeometry.of(src), src_pages, PoolGeometry.of(dst), dst_pages)
    for s in spans:
        ctypes.memmove(s.dst, s.src, s.nbytes)
    assert torch.equal(dst.buffer.view(torch.uint8), want.buffer.view(torch.uint8))
