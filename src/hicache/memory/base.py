"""The contract shared by the device (L1) and host (L2) pools.

A pool is one preallocated tensor ``buffer`` holding ``num_pages`` pages of ``page_size``
tokens of a :class:`~hicache.spec.KVSpec`, plus a :class:`PageAllocator` over its pages.
Page lists are 1-D integer tensors (CPU preferred); page ``p`` holds token slots
``[p * page_size, (p + 1) * page_size)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from hicache.config import MemLayout
from hicache.memory.allocator import PageAllocator
from hicache.memory.layout import gather_pages, scatter_pages, torch_dtype
from hicache.spec import KVSpec
from hicache.validate import int_at_least

__all__ = ["KVPool", "PageList", "check_pages", "check_sizes", "row_words"]

_SMALL = 256
"""Page lists up to this length are validated in Python rather than with torch ops."""

PageList = torch.Tensor | Sequence[int]
"""Page ids: a 1-D integer tensor (preferred) or a sequence of ints."""


def check_pages(
    pages: PageList, num_pages: int, what: str = "pages", *, unique: bool = False
) -> torch.Tensor:
    """Validate page ids and return them as a contiguous 1-D int64 CPU tensor.

    Raises TypeError for a non-integer or non-1-D input, IndexError naming the first page
    out of ``[0, num_pages)``, and ValueError when ``unique`` and a page repeats.
    """
    if isinstance(pages, torch.Tensor):
        t = pages
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{what} must be an integer tensor, got dtype {t.dtype}")
        if t.dim() != 1:
            raise TypeError(f"{what} must be 1-D, got shape {tuple(t.shape)}")
        t = t.to(device="cpu", dtype=torch.int64).contiguous()
    else:
        t = torch.tensor(list(pages), dtype=torch.int64)
        if t.dim() != 1:
            raise TypeError(f"{what} must be a flat sequence of ints")
    n = t.numel()
    if n == 0:
        return t
    if n <= _SMALL:  # Python is faster than a handful of tiny torch ops
        vals = t.tolist()
        lo, hi = min(vals), max(vals)
        if lo < 0 or hi >= num_pages:
            page = next(v for v in vals if v < 0 or v >= num_pages)
            raise IndexError(f"{what}: page {page} out of range [0, {num_pages})")
        if unique and len(set(vals)) != n:
            raise ValueError(f"{what}: a page appears more than once")
        return t
    bad = (t < 0) | (t >= num_pages)
    if bool(bad.any()):
        page = int(t[bad][0])
        raise IndexError(f"{what}: page {page} out of range [0, {num_pages})")
    if unique and torch.unique(t).numel() != n:
        raise ValueError(f"{what}: a page appears more than once")
    return t


def check_sizes(num_pages: int, page_size: int) -> None:
    """Require ``num_pages`` and ``page_size`` to be ints >= 1 (ValueError naming them)."""
    int_at_least("num_pages", num_pages, 1)
    int_at_least("page_size", page_size, 1)


def row_words(t: torch.Tensor, word: torch.dtype = torch.int16) -> torch.Tensor:
    """Reinterpret the last two dims ``(H, D)`` of ``t`` as one row of integer words.

    Returns a view of shape ``t.shape[:-2] + (H * D * itemsize / word_itemsize,)`` with
    dtype ``word``; copying words copies the bytes exactly (no float semantics). Requires
    the last two dims to be contiguous and the row bytes to be a multiple of the word size.
    """
    if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
        raise ValueError("row_words needs the last two dims to be contiguous")
    return t.flatten(-2).view(word)


class KVPool(ABC):
    """A page pool: ``buffer`` + allocator. Subclasses fix the layout and device."""

    def __init__(self, spec: KVSpec, num_pages: int, page_size: int, layout: MemLayout) -> None:
        check_sizes(num_pages, page_size)
        self._spec = spec
        self._num_pages = num_pages
        self._page_size = page_size
        self._layout = MemLayout(layout)
        self._dtype = torch_dtype(spec.dtype)
        self.allocator = PageAllocator(num_pages)
        self.buffer: torch.Tensor  # set by the subclass

    # -- sizes ---------------------------------------------------------------------------
    @property
    def spec(self) -> KVSpec:
        return self._spec

    @property
    def layout(self) -> MemLayout:
        """Buffer layout; the device pool is always ``layer_first``."""
        return self._layout

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._page_size

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def size_tokens(self) -> int:
        """Token slots: ``num_pages * page_size``."""
        return self._num_pages * self._page_size

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers and kinds: ``page_size * spec.token_bytes``."""
        return self._page_size * self._spec.token_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole buffer."""
        return self.buffer.numel() * self.buffer.element_size()

    # -- pages ---------------------------------------------------------------------------
    def check_pages(
        self, pages: PageList, what: str = "pages", *, unique: bool = False
    ) -> torch.Tensor:
        """:func:`check_pages` against this pool's page count."""
        return check_pages(pages, self._num_pages, what, unique=unique)

    def read_pages(self, pages: PageList) -> torch.Tensor:
        """CPU copy of ``pages`` in canonical order ``(n, K, L, ps, H, D)``, pool dtype."""
        idx = self.check_pages(pages).to(self.device)
        out = gather_pages(self.buffer, self._layout, idx, self._page_size)
        return out.cpu()

    def write_pages(self, pages: PageList, data: torch.Tensor) -> None:
        """Write canonical ``data`` ``(n, K, L, ps, H, D)`` into ``pages`` (inverse of read).

        ``data`` must have the pool's dtype (no conversion: bytes stay exact); ``pages``
        must not repeat.
        """
        idx = self.check_pages(pages, unique=True)
        spec = self._spec
        want = (idx.numel(), spec.num_kv, spec.num_layers, self._page_size, spec.heads, spec.dim)
        if tuple(data.shape) != want:
            raise ValueError(f"data has shape {tuple(data.shape)}; expected {want}")
        if data.dtype != self._dtype:
            raise ValueError(f"data has dtype {data.dtype}; expected {self._dtype}")
        if idx.numel() == 0:
            return
        scatter_pages(
            self.buffer,
            self._layout,
            idx.to(self.device),
            self._page_size,
            data.to(self.device),
        )

    @abstractmethod
    def __repr__(self) -> str: ...
