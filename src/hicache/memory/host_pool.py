"""The host (L2) KV pool: one preallocated, touched (and, for CUDA, pinned) CPU tensor.

Layouts (K = ``spec.num_kv``, L = layers, P = pages, ps = page size, S = P * ps,
H = heads, D = dim):

- ``layer_first``: ``(K, L, S, H, D)``; same as the device pool.
- ``page_first``: ``(K, S, L, H, D)``; one kind of one page over all layers is one
  contiguous ``(ps, L, H, D)`` slab.
- ``page_first_direct``: ``(K, P, L, ps, H, D)``; one kind of one page is one contiguous
  ``(L, ps, H, D)`` slab, and one (page, layer) is one contiguous ``(ps, H, D)`` block.
"""

from __future__ import annotations

import math

import torch

from hicache.config import CacheConfig, MemLayout
from hicache.memory.base import KVPool, check_sizes
from hicache.memory.budget import HOST_FLAGS, MEMORY_FRACTION, check_fits, pool_bytes
from hicache.memory.hugepages import advise_huge_pages
from hicache.memory.layout import buffer_shape
from hicache.spec import KVSpec

__all__ = ["HOST_RAM_FRACTION", "HostPool", "check_host_memory"]

HOST_RAM_FRACTION = MEMORY_FRACTION
"""A host pool may take at most this fraction of the RAM available when it is created."""


def check_host_memory(nbytes: int, what: str = "the host (L2) KV pool") -> None:
    """Raise :class:`~hicache.memory.budget.PoolSizeError` (a ValueError) if ``nbytes``
    exceed ``HOST_RAM_FRACTION`` of the RAM available now."""
    check_fits(nbytes, "cpu", what=what, flags=HOST_FLAGS)


class HostPool(KVPool):
    """Paged KV cache in host RAM.

    The buffer is allocated and zero-filled in the constructor, so every OS page is touched
    once up front (first touch is slow; it must not happen on the transfer path). An
    unpinned buffer is first advised to use transparent huge pages
    (:mod:`hicache.memory.hugepages`; fewer TLB misses in page copies). A buffer
    over ``HOST_RAM_FRACTION`` of the available RAM raises
    :class:`~hicache.memory.budget.PoolSizeError` before anything is allocated. With
    ``pin_memory`` the buffer is page-locked for asynchronous DMA; that needs a CUDA build
    and device (torch raises otherwise), so prefer :meth:`create`, which pins only for CUDA.
    """

    def __init__(
        self,
        spec: KVSpec,
        num_pages: int,
        page_size: int,
        layout: MemLayout | str,
        *,
        pin_memory: bool,
    ) -> None:
        check_sizes(num_pages, page_size)
        shape = buffer_shape(spec, num_pages, page_size, MemLayout(layout))
        check_host_memory(pool_bytes(math.prod(shape) * spec.dtype_bytes, num_pages))
        super().__init__(spec, num_pages, page_size, MemLayout(layout))
        self._pinned = bool(pin_memory)
        self.buffer = torch.empty(shape, dtype=self.dtype, pin_memory=self._pinned)
        self._huge_pages = advise_huge_pages(self.buffer)  # before the first touch
        self.buffer.zero_()
        self._bytes = self.buffer.reshape(-1).view(torch.uint8).numpy().data.cast("B")
        self._geometry: tuple[int, int, int] | None = None
        """:meth:`page_ranges`' byte geometry of the buffer, once computed."""

    @classmethod
    def create(
        cls,
        spec: KVSpec,
        num_pages: int,
        page_size: int,
        layout: MemLayout | str,
        device: torch.device | str,
    ) -> HostPool:
        """A host pool backing a device pool on ``device``: pinned iff ``device`` is CUDA."""
        pin = torch.device(device).type == "cuda"
        return cls(spec, num_pages, page_size, layout, pin_memory=pin)

    @classmethod
    def for_config(cls, spec: KVSpec, config: CacheConfig, device: torch.device | str) -> HostPool:
        """A host pool sized by ``config.host_pages(spec)`` with its page size and layout."""
        num_pages = config.host_pages(spec)
        if num_pages < 1:
            raise ValueError(
                f"the host pool would hold {num_pages} pages of {config.page_size * spec.token_bytes} "
                "bytes; raise hicache_size or hicache_ratio"
            )
        return cls.create(spec, num_pages, config.page_size, config.mem_layout, device)

    @property
    def huge_pages(self) -> bool:
        """Whether the kernel accepted the transparent-huge-page advice for the buffer."""
        return self._huge_pages

    @property
    def pinned(self) -> bool:
        """Whether the buffer is page-locked."""
        return self._pinned

    def page_view(self, page: int) -> tuple[torch.Tensor, ...]:
        """Zero-copy views of one page over all layers: one contiguous view per kind.

        ``page_first``: K views ``(ps, L, H, D)``; ``page_first_direct``: K views
        ``(L, ps, H, D)``. Kind is the outermost buffer dim, so for MHA the K and V slabs
        are not adjacent; a storage backend stores the views concatenated in kind order
        (K then V). Their byte order is layout-specific (not the canonical order), so the
        layout belongs in the L3 namespace. ``layer_first`` raises NotImplementedError.
        """
        if self.layout is MemLayout.LAYER_FIRST:
            raise NotImplementedError(
                "layer_first host pool: a page is spread over num_layers x num_kv separate "
                "ranges, so there is no zero-copy page view; use read_pages (a copy) or a "
                "page_first / page_first_direct layout"
            )
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} out of range [0, {self.num_pages})")
        ps = self.page_size
        if self.layout is MemLayout.PAGE_FIRST:
            return tuple(
                self.buffer[k, page * ps : (page + 1) * ps] for k in range(self.spec.num_kv)
            )
        return tuple(self.buffer[k, page] for k in range(self.spec.num_kv))

    def page_ranges(self, page: int) -> list[tuple[int, int]]:
        """``(address, bytes)`` of each of :meth:`page_view`'s slabs, in kind order: where an
        address-based mover (NIXL, a transfer engine) finds the page's bytes, no tensor
        built. Valid while the pool's buffer lives."""
        if self.layout is MemLayout.LAYER_FIRST:
            raise NotImplementedError("layer_first host pool: no zero-copy page ranges")
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} out of range [0, {self.num_pages})")
        geometry = self._geometry
        if geometry is None:  # bytes: buffer address, kind stride, page stride, page length
            item = self.buffer.element_size()
            kind_stride, page_stride = self.buffer.stride(0), self.buffer.stride(1)
            per_page = page_stride * (self.page_size if self.layout is MemLayout.PAGE_FIRST else 1)
            geometry = (self.buffer.data_ptr(), kind_stride * item, per_page * item)
            self._geometry = geometry
        base, kind_bytes, page_bytes = geometry
        start = base + page * page_bytes
        return [(start + k * kind_bytes, page_bytes) for k in range(self.spec.num_kv)]

    def page_bytes_views(self, page: int) -> list[memoryview]:
        """The bytes of :meth:`page_view`'s slabs as writable memoryviews (no tensor is
        built: offsets are computed from the strides, which is what byte-level backends
        need per page)."""
        if self.layout is MemLayout.LAYER_FIRST:
            raise NotImplementedError("layer_first host pool: no zero-copy page bytes")
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} out of range [0, {self.num_pages})")
        item = self.buffer.element_size()
        kind_stride, page_stride = self.buffer.stride(0), self.buffer.stride(1)
        if self.layout is MemLayout.PAGE_FIRST:
            start, length = page * self.page_size * page_stride, self.page_size * page_stride
        else:
            start, length = page * page_stride, page_stride
        return [
            self._bytes[
                (k * kind_stride + start) * item : (k * kind_stride + start + length) * item
            ]
            for k in range(self.spec.num_kv)
        ]

    def __repr__(self) -> str:
        return (
            f"HostPool(layout={self.layout.value}, pages={self.num_pages}, "
            f"page_size={self.page_size}, shape={tuple(self.buffer.shape)}, dtype={self.dtype}, "
            f"pinned={self._pinned})"
        )
