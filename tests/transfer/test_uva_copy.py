"""The one-launch page-copy kernel (:mod:`hicache.transfer.uva`) against index copies.

On a machine without CUDA it runs in Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, set by ``tests/conftest.py``); on CUDA the ``gpu`` test runs it
compiled between the device pool and pinned host memory, through :class:`KernelCopier`.

* For every host layout: a layer-wise load (host -> device, one layer per launch) and a
  backup (device -> host, all layers in one launch) of shuffled pages leave exactly the
  bytes an index copy leaves, and nothing else changes.
* Odd sizes: a row that is not a power of two of words, a page of 1 token, bf16.
"""

from __future__ import annotations

import pytest
import torch

from hicache.config import MemLayout
from hicache.memory import DevicePool, HostPool
from hicache.spec import KVSpec
from hicache.transfer.rows import row_ids, rows

pytest.importorskip("triton")

from hicache.transfer.uva import copy_pages, row_strides, uva_usable


def filled(pool: DevicePool | HostPool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    words = rows(pool, torch.int16)
    words.copy_(torch.randint(-(2**15), 2**15, words.shape, generator=gen, dtype=torch.int16))


def expected(
    src: DevicePool | HostPool,
    dst: DevicePool | HostPool,
    src_pages: list[int],
    dst_pages: list[int],
    layers: range,
) -> torch.Tensor:
    """``dst``'s rows after the copy, computed with index_select / index_copy_."""
    out = rows(dst, torch.int16).clone()
    ps = src.page_size
    k = torch.arange(src.spec.num_kv).view(-1, 1, 1)
    lay = torch.tensor(list(layers)).view(1, -1, 1)
    j = torch.arange(ps)
    st = (torch.tensor(src_pages)[:, None] * ps + j).reshape(1, 1, -1)
    dt = (torch.tensor(dst_pages)[:, None] * ps + j).reshape(1, 1, -1)
    out.index_copy_(
        0,
        row_ids(dst, k, lay, dt).reshape(-1),
        rows(src, torch.int16).index_select(0, row_ids(src, k, lay, st).reshape(-1)),
    )
    return out


@pytest.mark.parametrize("layout", list(MemLayout))
@pytest.mark.parametrize(
    ("heads", "dim", "page", "dtype"),
    [(2, 8, 4, "float16"), (3, 5, 1, "float32"), (1, 16, 8, "bfloat16")],
)
def test_loads_and_backups_equal_index_copies(
    layout: MemLayout, heads: int, dim: int, page: int, dtype: str
) -> None:
    spec = KVSpec(num_layers=3, num_kv_heads=heads, head_dim=dim, dtype=dtype)
    dev = DevicePool(spec, 6, page, "cpu")
    host = HostPool.create(spec, 7, page, layout, "cpu")
    filled(dev, 1)
    filled(host, 2)
    host_pages, dev_pages = [5, 0, 3], [2, 4, 1]
    for layer in range(spec.num_layers):  # a layer-wise load: one launch per layer
        want = expected(host, dev, host_pages, dev_pages, range(layer, layer + 1))
        copy_pages(
            host, dev, torch.tensor(host_pages), torch.tensor(dev_pages), range(layer, layer + 1)
        )
        assert torch.equal(rows(dev, torch.int16), want)
    filled(dev, 3)
    want = expected(dev, host, [0, 5], [6, 1], range(0, 3))
    copy_pages(dev, host, torch.tensor([0, 5]), torch.tensor([6, 1]), range(0, 3))
    assert torch.equal(rows(host, torch.int16), want)


def test_row_strides_match_the_row_ids() -> None:
    spec = KVSpec(num_layers=3, num_kv_heads=1, head_dim=4)
    for layout in MemLayout:
        pool = HostPool.create(spec, 5, 4, layout, "cpu")
        rk, rp, rl, rj = row_strides(pool)
        for k, p, layer, j in [(0, 0, 0, 0), (1, 3, 2, 1), (1, 4, 1, 3)]:
            got = k * rk + p * rp + layer * rl + j * rj
            want = row_ids(pool, torch.tensor(k), torch.tensor(layer), torch.tensor(p * 4 + j))
            assert got == int(want)


def test_bad_arguments_are_refused() -> None:
    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4)
    dev = DevicePool(spec, 4, 2, "cpu")
    host = HostPool.create(spec, 4, 2, MemLayout.PAGE_FIRST, "cpu")
    other = HostPool.create(
        KVSpec(num_layers=3, num_kv_heads=1, head_dim=4), 4, 2, MemLayout.PAGE_FIRST, "cpu"
    )
    with pytest.raises(ValueError, match="one spec"):
        copy_pages(other, dev, torch.tensor([0]), torch.tensor([0]), range(0, 1))
    with pytest.raises(ValueError, match="equal length"):
        copy_pages(host, dev, torch.tensor([0, 1]), torch.tensor([0]), range(0, 1))
    with pytest.raises(ValueError, match="within the pools"):
        copy_pages(host, dev, torch.tensor([0]), torch.tensor([0]), range(1, 3))


def test_the_probe_passes_under_the_interpreter() -> None:
    assert uva_usable(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(MemLayout))
def test_kernel_copier_on_cuda_uses_the_kernel_byte_exactly(layout: MemLayout) -> None:
    from hicache.transfer import make_copier

    device = torch.device("cuda")
    assert uva_usable(device)
    spec = KVSpec(num_layers=4, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    dev = DevicePool(spec, 32, 64, device)
    host = HostPool.create(spec, 40, 64, layout, device)
    filled(host, 5)
    copier = make_copier("kernel")
    hp, dp = torch.tensor([7, 3, 30, 12]), torch.tensor([0, 9, 4, 31])
    for layer in range(spec.num_layers):
        copier.load_layer(dev, host, hp, dp, layer)
    torch.cuda.synchronize()
    want = expected(host, DevicePool(spec, 32, 64, "cpu"), hp.tolist(), dp.tolist(), range(0, 4))
    got = rows(dev, torch.int16).cpu()
    sel = row_ids(dev, torch.arange(2).view(-1, 1, 1), torch.arange(4).view(1, -1, 1),
                  (dp[:, None] * 64 + torch.arange(64)).reshape(1, 1, -1)).reshape(-1).cpu()  # fmt: skip
    assert torch.equal(got[sel], want[sel])
