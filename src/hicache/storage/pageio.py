"""Byte-level access to host (L2) pages in L3 payload order (see :mod:`hicache.storage.record`).

:class:`Payloads` is what a backend's ``_get`` / ``_set`` move: one record payload per key.
:class:`HostPages` serves full-KV pages of a :class:`~hicache.memory.HostPool`; component
records (recurrent-state slots) have their own (:class:`hicache.storage.slotio.StateSlots`).

For ``page_first`` and ``page_first_direct`` pools a page's payload is its
``HostPool.page_view`` slabs, one per kind: backends read and write them in place
(zero-copy). A ``layer_first`` page is spread over ``K x L`` ranges, so it is staged: a set
gathers the pages into a canonical ``(n, K, L, page_size, H, D)`` copy, and a get fills a
staging buffer that :meth:`HostPages.commit` scatters into the pool, for the good pages only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from hicache.config import MemLayout
from hicache.memory import HostPool

__all__ = ["HostPages", "Payloads", "byte_view", "uint8_view"]


def uint8_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat ``uint8`` tensor sharing its memory."""
    if not t.is_contiguous():
        raise ValueError("uint8_view needs a contiguous tensor")
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable ``memoryview`` (format ``B``) of a contiguous CPU tensor's bytes, zero-copy."""
    if t.device.type != "cpu":
        raise ValueError(f"byte_view needs a CPU tensor, got device {t.device}")
    return uint8_view(t).numpy().data.cast("B")


class Payloads(ABC):
    """The payloads of one batch of records, item ``i`` for ``keys[i]``: each exactly
    :attr:`payload_len` bytes, exposed as byte views (:meth:`parts`) that a get writes into
    and a set reads from. After a get, :meth:`commit` delivers the items that passed their
    checks (a staged implementation scatters them then).

    ``zero_copy`` is True when every item's parts lie in :attr:`buffer`, a long-lived
    contiguous CPU tensor (a host pool's buffer) that an address-based backend (Mooncake)
    may register and move bytes into and out of in place, at :meth:`addresses`; False when
    the parts are staging rows or scattered tensors (the backend then stages)."""

    payload_len: int
    zero_copy: bool
    buffer: torch.Tensor | None = None
    """The tensor every item's parts lie in when ``zero_copy`` (None otherwise)."""

    def addresses(self, i: int) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of item ``i``'s parts inside :attr:`buffer`, in record
        order (``zero_copy`` only; ValueError otherwise)."""
        raise ValueError(f"{type(self).__name__} has no zero-copy addresses")

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def parts(self, i: int) -> list[memoryview]:
        """Byte views of item ``i``'s payload, in record order (writable for a get)."""

    def fill(self, i: int, payload: memoryview) -> None:
        """Copy ``payload`` (exactly ``payload_len`` bytes) into item ``i``'s parts."""
        off = 0
        for part in self.parts(i):
            n = part.nbytes
            part[:] = payload[off : off + n]
            off += n
        if off != payload.nbytes:
            raise ValueError(f"payload is {payload.nbytes} bytes, expected {off}")

    def commit(self, ok: Sequence[bool]) -> None:  # noqa: B027 - a no-op by default
        """After a get: deliver the items whose ``ok`` is True (no-op when in place)."""


class HostPages(Payloads):
    """Payload access to ``pages`` of ``host``; item ``i`` belongs to ``pages[i]``.

    Validates the pages (in range; unique for a get, since one page receives one record).
    ``zero_copy`` tells whether :meth:`views` can be used (``page_first*`` layouts).
    """

    def __init__(
        self, host: HostPool, pages: Sequence[int] | torch.Tensor, *, for_get: bool
    ) -> None:
        idx = host.check_pages(
            pages if isinstance(pages, torch.Tensor) else list(pages), unique=for_get
        )
        self.host = host
        self.pages: list[int] = idx.tolist()
        self.payload_len = host.page_bytes
        self.zero_copy = host.layout is not MemLayout.LAYER_FIRST
        self.buffer = host.buffer if self.zero_copy else None
        self._for_get = for_get
        self._stage: torch.Tensor | None = None
        self._parts: list[list[memoryview]] | None = None
        """Every page's byte views, built on the first :meth:`parts` call (zero-copy only)."""
        if not self.zero_copy and self.pages:
            if for_get:
                self._stage = torch.empty((len(self.pages), self.payload_len), dtype=torch.uint8)
            else:
                data = host.read_pages(idx)  # (n, K, L, ps, H, D), contiguous CPU copy
                self._stage = data.view(torch.uint8).reshape(len(self.pages), -1)

    def __len__(self) -> int:
        return len(self.pages)

    def views(self, i: int) -> list[torch.Tensor]:
        """Zero-copy flat ``uint8`` views of page ``i``'s payload parts (``page_first*`` only)."""
        if not self.zero_copy:
            raise ValueError("a layer_first host pool has no zero-copy page views")
        return [uint8_view(v) for v in self.host.page_view(self.pages[i])]

    def addresses(self, i: int) -> list[tuple[int, int]]:
        return [(int(v.data_ptr()), v.numel()) for v in self.views(i)]

    def tensors(self, i: int) -> list[torch.Tensor]:
        """Flat ``uint8`` tensors holding page ``i``'s payload: the views, or its staging row."""
        if self.zero_copy:
            return self.views(i)
        assert self._stage is not None
        return [self._stage[i]]

    def parts(self, i: int) -> list[memoryview]:
        """Byte views of page ``i``'s payload parts, in record order (writable for a get).

        Zero-copy: the first call slices every page of the batch out of one view of the
        pool's buffer (the pages were checked at construction), so a backend's per-page
        loop costs a list lookup here, not a view built and checked per page."""
        if self.zero_copy:
            if self._parts is None:
                self._parts = self._slice_all()
            return self._parts[i]
        return [byte_view(t) for t in self.tensors(i)]

    def _slice_all(self) -> list[list[memoryview]]:
        """:meth:`HostPool.page_bytes_views` of every page, from offsets and strides: a
        page's kind ``k`` slab starts at ``k * kind_stride + page * step`` (elements) and
        is ``step`` long (``page_first``: ``step = page_size * token_stride``;
        ``page_first_direct``: ``step = page_stride``)."""
        buf = self.host.buffer
        whole = byte_view(buf)
        item = buf.element_size()
        step = buf.stride(1) * item
        if self.host.layout is MemLayout.PAGE_FIRST:
            step *= self.host.page_size
        kinds = [k * buf.stride(0) * item for k in range(self.host.spec.num_kv)]
        return [[whole[o + p * step : o + (p + 1) * step] for o in kinds] for p in self.pages]

    def commit(self, ok: Sequence[bool]) -> None:
        """After a get: write staged pages whose ``ok`` is True into the pool (no-op if zero-copy)."""
        if self.zero_copy or not self._for_get or self._stage is None:
            return
        good = [i for i, flag in enumerate(ok) if flag]
        if not good:
            return
        host = self.host
        spec = host.spec
        shape = (len(good), spec.num_kv, spec.num_layers, host.page_size, spec.heads, spec.dim)
        rows = self._stage[torch.tensor(good, dtype=torch.int64)]
        data = rows.view(host.dtype).reshape(shape)
        host.write_pages(torch.tensor([self.pages[i] for i in good], dtype=torch.int64), data)
