"""Record payloads over SGLang host-pool pages (:class:`~hicache.storage.pageio.Payloads`).

An SGLang KV page's payload is exactly the bytes of ``host_pool.get_data_page(i,
flat=True)`` for the pool's layout (``page_unified``: its page block): per kind (K then V;
MLA's one latent) the page in the layout's own order, so the zero-copy (``batch_*_v1``)
and the copying calls read and write the same records. :class:`KVPoolGeometry` is checked
once, at registration (a contiguous CPU ``kv_buffer``, a known layout, a page's parts from
SGLang's ``get_page_buffer_meta`` inside the buffer and adding up to a page);
:meth:`KVPoolGeometry.page_parts` turns ``host_indices`` into ``(offset, nbytes)`` ranges
per page (``layer_first`` MHA reordered from (layer, kind) to (kind, layer));
:class:`ByteParts` exposes them as zero-copy byte views and addresses in ``kv_buffer``.
:class:`FlatPages` serves v2 side pools through ``get_data_page`` /
``set_from_flat_data_page`` (a get stages, :meth:`FlatPages.commit` writes the good pages).
No sglang import: pools are duck-typed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hicache.storage.pageio import Payloads, byte_view, uint8_view

__all__ = ["ByteParts", "FlatFormat", "FlatPages", "KVPoolGeometry", "page_starts"]

Range = tuple[int, int]
"""``(offset, nbytes)`` into a pool buffer's bytes."""


def _check_count(count: int, page_size: int, n: int) -> None:
    if count != n * page_size:
        raise ValueError(
            f"{count} host indices for {n} pages of {page_size} tokens; expected {n * page_size}"
        )


def page_starts(host_indices: torch.Tensor | Sequence[int], page_size: int, n: int) -> list[int]:
    """The first host token index of each of ``n`` pages in ``host_indices`` (``n *
    page_size`` token indices, SGLang's convention). ValueError when the count is off."""
    idx = host_indices.tolist() if isinstance(host_indices, torch.Tensor) else list(host_indices)
    _check_count(len(idx), page_size, n)
    return [int(i) for i in idx[::page_size]]


@dataclass(frozen=True)
class KVPoolGeometry:
    """Where an SGLang KV host pool's pages lie in its ``kv_buffer``.

    ``owner``: the pool's ``kv_buffer`` itself (what an address-based backend registers).
    ``buffer``: its bytes, flat ``uint8`` (shares its memory). ``page_bytes``:
    one page's payload. ``parts_per_page``: ranges per page in SGLang's meta (1 for
    ``page_unified``). ``reorder``: MHA ``layer_first``, whose meta alternates K and V per
    layer, is read kinds-first.
    """

    pool: Any
    layout: str
    page_size: int
    page_bytes: int
    parts_per_page: int
    owner: torch.Tensor
    buffer: torch.Tensor
    base_ptr: int
    reorder: bool
    unified_page_bytes: int

    @classmethod
    def of(cls, pool: Any, *, mla: bool) -> KVPoolGeometry:
        """Check ``pool`` and measure one page; ValueError naming what cannot be stored."""
        layout = getattr(pool, "layout", None)
        buf = getattr(pool, "kv_buffer", None)
        if not isinstance(buf, torch.Tensor):
            raise ValueError(
                f"SGLang host pool {type(pool).__name__} (layout {layout!r}) has no single "
                "kv_buffer tensor; hicache stores pools whose pages lie in one buffer"
            )
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError(
                f"SGLang host pool layout {layout!r}: kv_buffer must be a contiguous CPU "
                f"tensor (device {buf.device}, contiguous {buf.is_contiguous()})"
            )
        page_size = int(pool.page_size)
        flat = uint8_view(buf)
        expected = int(pool.get_size_per_token()) * page_size
        unified = 0
        if layout == "page_unified":
            unified = int(pool.page_unified_layout.bytes_per_page)
            parts: list[Range] = [(0, unified)]
        else:
            ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
            parts = [(int(p) - buf.data_ptr(), int(s)) for p, s in zip(ptrs, sizes, strict=True)]
        geo = cls(
            pool=pool,
            layout=str(layout),
            page_size=page_size,
            page_bytes=sum(n for _, n in parts),
            parts_per_page=len(parts),
            owner=buf,
            buffer=flat,
            base_ptr=buf.data_ptr(),
            reorder=layout == "layer_first" and not mla,
            unified_page_bytes=unified,
        )
        if geo.page_bytes != expected:
            raise ValueError(
                f"SGLang host pool layout {layout!r}: a page's buffer parts add up to "
                f"{geo.page_bytes} bytes, but a page holds {expected}; cannot store it"
            )
        geo._check(parts)
        return geo

    def _check(self, parts: Sequence[Range]) -> None:
        total = self.buffer.numel()
        for off, n in parts:
            if off < 0 or n <= 0 or off + n > total:
                raise ValueError(
                    f"SGLang host pool layout {self.layout!r}: page range ({off}, {n}) lies "
                    f"outside its kv_buffer ({total} bytes)"
                )

    def page_parts(self, host_indices: torch.Tensor, n: int) -> list[list[Range]]:
        """Per page of the call (``n`` pages), its payload ranges in record order."""
        m = self.parts_per_page
        if self.layout == "page_unified":
            out = []
            for s in page_starts(host_indices, self.page_size, n):
                if s % self.page_size:
                    raise ValueError(f"host index {s} is not at a page boundary")
                p = s // self.page_size
                out.append([(p * self.unified_page_bytes, self.unified_page_bytes)])
        else:  # SGLang's meta reads the indices itself: only their count is checked here
            _check_count(len(host_indices), self.page_size, n)
            ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
            if len(ptrs) != n * m or len(sizes) != n * m:
                raise ValueError(f"pool meta has {len(ptrs)} parts for {n} pages of {m}")
            flat = [(int(p) - self.base_ptr, int(s)) for p, s in zip(ptrs, sizes, strict=True)]
            out = [flat[i * m : (i + 1) * m] for i in range(n)]
            if self.reorder:  # (layer, kind) -> (kind, layer): the flat page's order
                out = [page[0::2] + page[1::2] for page in out]
        for page in out:
            self._check(page)
        return out


class ByteParts(Payloads):
    """Payloads whose item ``i`` is the byte views ``views[i]`` (a get writes the pool's
    pages, or the caller's tensors, in place). Build with :meth:`over` (zero-copy: the
    pages of one long-lived buffer, which an address-based backend registers and moves
    bytes into and out of by address) or :meth:`of_tensors` (not zero-copy: an
    address-based backend stages)."""

    def __init__(
        self,
        views: Sequence[Sequence[memoryview]],
        payload_len: int,
        *,
        owner: torch.Tensor | None = None,
        ranges: Sequence[Sequence[Range]] = (),
    ) -> None:
        self.payload_len = payload_len
        self.zero_copy = owner is not None
        self.buffer = owner
        self._base = 0 if owner is None else int(owner.data_ptr())
        self._ranges = [list(r) for r in ranges]
        self._views = [list(v) for v in views]
        for i, v in enumerate(self._views):
            got = sum(m.nbytes for m in v)
            if got != payload_len:
                raise ValueError(f"page {i} covers {got} bytes, expected {payload_len}")

    @classmethod
    def over(
        cls,
        buffer: torch.Tensor,
        ranges: Sequence[Sequence[Range]],
        payload_len: int,
        *,
        owner: torch.Tensor | None = None,
    ) -> ByteParts:
        """Item ``i``: the ranges ``ranges[i]`` (byte offsets) of ``buffer`` (a contiguous
        CPU tensor). ``owner``: the long-lived tensor whose memory ``buffer`` is, from its
        first byte (a pool's ``kv_buffer``): the items are then zero-copy at its addresses;
        None: not zero-copy."""
        if owner is not None and int(owner.data_ptr()) != int(buffer.data_ptr()):
            raise ValueError("owner must start where buffer starts")
        mv = byte_view(buffer)
        views = [[mv[off : off + n] for off, n in r] for r in ranges]
        return cls(views, payload_len, owner=owner, ranges=ranges if owner is not None else ())

    @classmethod
    def of_tensors(cls, tensors: Sequence[torch.Tensor], payload_len: int) -> ByteParts:
        """Item ``i``: all of contiguous CPU tensor ``tensors[i]`` (a legacy flat page)."""
        return cls([[byte_view(t)] for t in tensors], payload_len)

    def __len__(self) -> int:
        return len(self._views)

    def parts(self, i: int) -> list[memoryview]:
        return self._views[i]

    def addresses(self, i: int) -> list[tuple[int, int]]:
        if not self.zero_copy:
            raise ValueError("ByteParts over separate tensors have no zero-copy addresses")
        return [(self._base + off, n) for off, n in self._ranges[i]]


@dataclass(frozen=True)
class FlatFormat:
    """A side pool's flat page: its ``dtype`` and ``nbytes``, measured once from the
    pool's ``get_dummy_flat_data_page()`` (:meth:`of`)."""

    dtype: torch.dtype
    nbytes: int

    @classmethod
    def of(cls, pool: Any) -> FlatFormat:
        dummy = pool.get_dummy_flat_data_page()
        return cls(dummy.dtype, dummy.numel() * dummy.element_size())


class FlatPages(Payloads):
    """Side-pool pages through the pool's flat-page copies; item ``i`` is the page at
    host index ``starts[i]``, of format ``fmt`` (staged both ways)."""

    def __init__(self, pool: Any, fmt: FlatFormat, starts: Sequence[int], *, for_get: bool) -> None:
        self.pool = pool
        self.starts = list(starts)
        self.zero_copy = False
        self._dtype = fmt.dtype
        self.payload_len = fmt.nbytes
        self._for_get = for_get
        if for_get:
            self._stage = torch.empty((len(self.starts), self.payload_len), dtype=torch.uint8)
            self._rows = [self._stage[i] for i in range(len(self.starts))]
        else:
            rows = []
            for s in self.starts:
                page = pool.get_data_page(s, flat=True).contiguous()
                row = uint8_view(page)
                if row.numel() != self.payload_len:
                    raise ValueError(
                        f"flat page is {row.numel()} bytes, expected {self.payload_len}"
                    )
                rows.append(row)
            self._rows = rows

    def __len__(self) -> int:
        return len(self.starts)

    def parts(self, i: int) -> list[memoryview]:
        return [byte_view(self._rows[i])]

    def commit(self, ok: Sequence[bool]) -> None:
        """After a get: write the good staged pages into the pool."""
        if not self._for_get:
            return
        for i, flag in enumerate(ok):
            if flag:
                self.pool.set_from_flat_data_page(self.starts[i], self._rows[i].view(self._dtype))
