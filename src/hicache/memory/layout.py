"""Buffer shapes of the KV layouts and conversion to/from the canonical page order.

Notation: K = ``spec.num_kv`` (2 for MHA: K and V; 1 for MLA: the latent), L = layers,
P = pages, ps = page size, S = P * ps token slots, H = heads, D = dim.

| layout              | buffer shape              |
|---------------------|---------------------------|
| ``layer_first``     | ``(K, L, S, H, D)``       |  (also the device pool's layout)
| ``page_first``      | ``(K, S, L, H, D)``       |
| ``page_first_direct`` | ``(K, P, L, ps, H, D)`` |

The *canonical page order* used by ``read_pages`` / ``write_pages`` of every pool is
``(n, K, L, ps, H, D)`` for ``n`` pages, whatever the layout.
"""

from __future__ import annotations

import torch

from hicache.config import MemLayout
from hicache.spec import KVSpec

__all__ = [
    "TORCH_DTYPES",
    "buffer_shape",
    "from_canonical",
    "gather_pages",
    "scatter_pages",
    "to_canonical",
    "token_indices",
    "torch_dtype",
]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a :data:`hicache.spec.DTYPES` name."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(
            f"dtype={name!r} is not allowed; choose one of {tuple(TORCH_DTYPES)}"
        ) from None


def buffer_shape(
    spec: KVSpec, num_pages: int, page_size: int, layout: MemLayout
) -> tuple[int, ...]:
    """Shape of a pool buffer of ``num_pages`` pages in ``layout`` (see module table)."""
    k, nl, h, d = spec.num_kv, spec.num_layers, spec.heads, spec.dim
    s = num_pages * page_size
    if layout is MemLayout.LAYER_FIRST:
        return (k, nl, s, h, d)
    if layout is MemLayout.PAGE_FIRST:
        return (k, s, nl, h, d)
    if layout is MemLayout.PAGE_FIRST_DIRECT:
        return (k, num_pages, nl, page_size, h, d)
    raise ValueError(f"unknown layout {layout!r}")


def token_indices(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token slots of ``pages`` (int64, 1-D), page by page: ``(len(pages) * page_size,)``."""
    if page_size == 1:
        return pages
    offs = torch.arange(page_size, dtype=torch.int64, device=pages.device)
    return (pages.unsqueeze(1) * page_size + offs).reshape(-1)


def to_canonical(x: torch.Tensor, layout: MemLayout, n: int, page_size: int) -> torch.Tensor:
    """Reorder pages gathered in ``layout`` order into canonical ``(n, K, L, ps, H, D)`` (a view).

    ``x`` is what :func:`gather_pages` selected: ``(K, L, n*ps, H, D)`` for layer_first,
    ``(K, n*ps, L, H, D)`` for page_first, ``(K, n, L, ps, H, D)`` for page_first_direct.
    """
    if layout is MemLayout.LAYER_FIRST:
        k, nl, _, h, d = x.shape
        return x.view(k, nl, n, page_size, h, d).permute(2, 0, 1, 3, 4, 5)
    if layout is MemLayout.PAGE_FIRST:
        k, _, nl, h, d = x.shape
        return x.view(k, n, page_size, nl, h, d).permute(1, 0, 3, 2, 4, 5)
    return x.permute(1, 0, 2, 3, 4, 5)


def from_canonical(data: torch.Tensor, layout: MemLayout) -> torch.Tensor:
    """Inverse of :func:`to_canonical`: canonical ``(n, K, L, ps, H, D)`` to layout order.

    Returns a contiguous tensor of the gathered shape described in :func:`to_canonical`.
    """
    n, k, nl, ps, h, d = data.shape
    if layout is MemLayout.LAYER_FIRST:
        return data.permute(1, 2, 0, 3, 4, 5).reshape(k, nl, n * ps, h, d)
    if layout is MemLayout.PAGE_FIRST:
        return data.permute(1, 0, 3, 2, 4, 5).reshape(k, n * ps, nl, h, d)
    return data.permute(1, 0, 2, 3, 4, 5).contiguous()


def _page_dim(layout: MemLayout) -> int:
    return 2 if layout is MemLayout.LAYER_FIRST else 1


def _select_index(pages: torch.Tensor, page_size: int, layout: MemLayout) -> torch.Tensor:
    if layout is MemLayout.PAGE_FIRST_DIRECT:
        return pages
    return token_indices(pages, page_size)


def gather_pages(
    buffer: torch.Tensor, layout: MemLayout, pages: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Canonical ``(n, K, L, ps, H, D)`` copy of ``pages`` of ``buffer`` (on buffer's device).

    ``pages`` must be validated int64 on ``buffer.device``.
    """
    idx = _select_index(pages, page_size, layout)
    x = buffer.index_select(_page_dim(layout), idx)
    return to_canonical(x, layout, pages.numel(), page_size).contiguous()


def scatter_pages(
    buffer: torch.Tensor,
    layout: MemLayout,
    pages: torch.Tensor,
    page_size: int,
    data: torch.Tensor,
) -> None:
    """Write canonical ``data`` ``(n, K, L, ps, H, D)`` into ``pages`` of ``buffer``.

    ``pages`` must be validated, duplicate-free int64 on ``buffer.device``; ``data`` must
    be on ``buffer.device`` with ``buffer.dtype``.
    """
    idx = _select_index(pages, page_size, layout)
    buffer.index_copy_(_page_dim(layout), idx, from_canonical(data, layout))
