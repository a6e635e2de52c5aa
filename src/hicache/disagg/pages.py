"""Where a pool's pages lie in memory, told to a peer: :class:`PoolGeometry`, and the
copies that move pages, or some columns of their rows (:class:`Columns`: heads, between
ranks of different TP sizes), between two pools: :func:`page_spans`.

A device (L1) pool is one contiguous ``layer_first`` buffer ``(K, L, S, H, D)`` (K kinds, L
layers, S = ``num_pages * page_size`` slots, one row of ``H * D`` elements per slot), so page
``p`` of kind ``k`` in layer ``l`` is one run of ``page_size * row_bytes`` bytes at ``addr + ((k
* L + l) * S + p * page_size) * row_bytes``, and a whole page is ``K * L`` such runs. A
decode instance sends its geometry (:meth:`PoolGeometry.to_dict`, plain JSON); the prefill
instance turns "my pages ``[3, 4, 5]`` into your pages ``[7, 8, 1]``" into
:class:`~hicache.disagg.transport.Span` s. Pure: no torch, no threads, no IO.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from hicache.disagg.transport import Region, Span
from hicache.spec import DTYPES
from hicache.validate import int_at_least, is_int, require

if TYPE_CHECKING:
    from hicache.memory.device_pool import DevicePool

__all__ = ["Columns", "PoolGeometry", "page_spans"]

_MATCHED = ("num_kv", "layers", "page_size", "dtype")
"""The fields two pools must share for a page of one to be copied into the other (and
``row_bytes`` when whole rows are)."""


@dataclass(frozen=True, slots=True)
class Columns:
    """The same bytes of every row: ``nbytes`` from byte ``src`` of a source row to byte
    ``dst`` of a destination row (a range of heads: ``first head x head bytes``)."""

    src: int
    dst: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    """A ``layer_first`` pool buffer as a peer needs to know it (see the module docstring).

    ``addr``: the buffer's first byte in its owner's address space; ``num_kv``: K (2 for
    K and V, 1 for a latent); ``layers``: L; ``slots``: S token slots (a multiple of
    ``page_size``); ``row_bytes``: bytes of one slot of one kind in one layer
    (``H * D * itemsize``); ``page_size``: tokens per page; ``dtype``: the element type's
    name (one of :data:`hicache.spec.DTYPES`); ``cuda``/``device``: device memory of
    CUDA device ``device``, else host RAM.
    """

    addr: int
    num_kv: int
    layers: int
    slots: int
    row_bytes: int
    page_size: int
    dtype: str
    cuda: bool = False
    device: int = 0

    def __post_init__(self) -> None:
        int_at_least("addr", self.addr, 0)
        int_at_least("num_kv", self.num_kv, 1)
        int_at_least("layers", self.layers, 1)
        int_at_least("page_size", self.page_size, 1)
        int_at_least("slots", self.slots, self.page_size)
        require(
            self.slots % self.page_size == 0,
            "slots",
            self.slots,
            f"must be a multiple of page_size={self.page_size}",
        )
        int_at_least("row_bytes", self.row_bytes, 1)
        require(self.dtype in DTYPES, "dtype", self.dtype, f"choose one of {DTYPES}")
        require(isinstance(self.cuda, bool), "cuda", self.cuda, "must be a bool")
        int_at_least("device", self.device, 0)

    @classmethod
    def of(cls, pool: DevicePool) -> PoolGeometry:
        """The geometry of ``pool``'s buffer (which must be contiguous, as built)."""
        buf = pool.buffer
        if not buf.is_contiguous():
            raise ValueError(f"{pool!r}: the buffer is not contiguous; no geometry describes it")
        spec = pool.spec
        return cls(
            addr=int(buf.data_ptr()),
            num_kv=spec.num_kv,
            layers=spec.num_layers,
            slots=pool.size_tokens,
            row_bytes=spec.heads * spec.dim * spec.dtype_bytes,
            page_size=pool.page_size,
            dtype=spec.dtype,
            cuda=buf.device.type == "cuda",
            device=buf.device.index or 0,
        )

    @property
    def num_pages(self) -> int:
        """Pages in the pool: ``slots // page_size``."""
        return self.slots // self.page_size

    @property
    def run_bytes(self) -> int:
        """Bytes of one page of one kind in one layer: ``page_size * row_bytes``."""
        return self.page_size * self.row_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole buffer: ``num_kv * layers * slots * row_bytes``."""
        return self.num_kv * self.layers * self.slots * self.row_bytes

    def page_addr(self, kind: int, layer: int, page: int) -> int:
        """Address of the first byte of ``page`` of ``kind`` in ``layer`` (unchecked)."""
        return self.addr + ((kind * self.layers + layer) * self.slots + page * self.page_size) * (
            self.row_bytes
        )

    def region(self) -> Region:
        """The whole buffer, to register with a transport."""
        return Region(self.addr, self.nbytes, self.cuda, self.device)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields (the inverse of :meth:`from_dict`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PoolGeometry:
        """A geometry from :meth:`to_dict`'s output; ValueError naming a missing or unknown
        key, or a field whose value is invalid."""
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in d and n not in ("cuda", "device")]
        if missing:
            raise ValueError(f"pool geometry: missing {', '.join(missing)}")
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"pool geometry: unknown {', '.join(map(str, unknown))}")
        return cls(**{n: d[n] for n in names if n in d})


def _check_pages(pages: Sequence[int], geo: PoolGeometry, what: str) -> list[int]:
    out = list(pages)
    for p in out:
        if not is_int(p):
            raise ValueError(f"{what}: page {p!r} is not an int")
        if not 0 <= p < geo.num_pages:
            raise ValueError(f"{what}: page {p} out of range [0, {geo.num_pages})")
    return out


def page_spans(
    src: PoolGeometry,
    src_pages: Sequence[int],
    dst: PoolGeometry,
    dst_pages: Sequence[int],
    columns: Columns | None = None,
) -> list[Span]:
    """The copies that put page ``src_pages[i]`` of ``src`` into page ``dst_pages[i]`` of
    ``dst``, for every i, every kind and every layer: whole rows, or only ``columns`` of
    each row (one span per token row then, unless they are the whole rows of both).

    Consecutive pairs whose pages are consecutive on both sides make one span, and spans
    that follow each other on both sides merge too (a whole pool into a whole pool is one
    span). Order: by kind, then layer, then position in the page lists (the order of the
    memory of a ``layer_first`` buffer). Empty lists give no span.

    ValueError, naming both values, when the pools differ in ``num_kv``, ``layers``,
    ``page_size``, ``dtype`` or (whole rows) ``row_bytes``, or ``columns`` do not fit
    both rows; ValueError when the lists differ in length, a page is out of its pool's
    range, or a destination page repeats.
    """
    for name in _MATCHED:
        a, b = getattr(src, name), getattr(dst, name)
        if a != b:
            raise ValueError(f"pools differ: src {name}={a!r}, dst {name}={b!r}")
    if columns is not None:
        c = columns
        if c.nbytes < 1 or c.src < 0 or c.dst < 0:
            raise ValueError(f"columns {c}: offsets must be >= 0 and nbytes >= 1")
        if c.src + c.nbytes > src.row_bytes or c.dst + c.nbytes > dst.row_bytes:
            raise ValueError(
                f"columns {c} do not fit the rows (src row_bytes={src.row_bytes},"
                f" dst row_bytes={dst.row_bytes})"
            )
        if c.src == c.dst == 0 and c.nbytes == src.row_bytes == dst.row_bytes:
            columns = None  # the whole rows
    elif src.row_bytes != dst.row_bytes:
        raise ValueError(
            f"pools differ: src row_bytes={src.row_bytes!r}, dst row_bytes={dst.row_bytes!r}"
        )
    s = _check_pages(src_pages, src, "src_pages")
    d = _check_pages(dst_pages, dst, "dst_pages")
    if len(s) != len(d):
        raise ValueError(f"page lists differ in length: src_pages {len(s)}, dst_pages {len(d)}")
    if len(set(d)) != len(d):
        raise ValueError("dst_pages: a page appears more than once")
    runs: list[tuple[int, int, int]] = []  # (src page, dst page, pages)
    for sp, dp in zip(s, d, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if sp == s0 + n and dp == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((sp, dp, 1))
    if columns is not None:
        return _column_spans(src, dst, runs, columns)
    out: list[Span] = []
    run_bytes = src.run_bytes
    for kind in range(src.num_kv):
        for layer in range(src.layers):
            for s0, d0, n in runs:
                a = src.page_addr(kind, layer, s0)
                b = dst.page_addr(kind, layer, d0)
                nbytes = n * run_bytes
                if out:
                    last = out[-1]
                    if last.src + last.nbytes == a and last.dst + last.nbytes == b:
                        out[-1] = Span(last.src, last.dst, last.nbytes + nbytes)
                        continue
                out.append(Span(a, b, nbytes))
    return out


def _column_spans(
    src: PoolGeometry, dst: PoolGeometry, runs: list[tuple[int, int, int]], c: Columns
) -> list[Span]:
    """One span per token row of every run, kind and layer: ``c`` of the row."""
    out: list[Span] = []
    for kind in range(src.num_kv):
        for layer in range(src.layers):
            for s0, d0, n in runs:
                a = src.page_addr(kind, layer, s0) + c.src
                b = dst.page_addr(kind, layer, d0) + c.dst
                for t in range(n * src.page_size):
                    out.append(Span(a + t * src.row_bytes, b + t * dst.row_bytes, c.nbytes))
    return out
