"""Record payloads over rows of vLLM's primary-tier buffer (:class:`Rows`).

vLLM hands a secondary tier ``primary_kv_view``, a writable ``memoryview`` of shape
``(num_chunks, row_bytes)`` over the primary tier's shared CPU region, and per job the rows
(``TransferJob.chunk_ids``) to read or fill; one row is one record's payload, byte for
byte. Invariants: a store reads the rows in place (every backend is done reading a payload
when its ``batch_set`` returns, and vLLM keeps the rows pinned until the job finished); a
load is staged, and :meth:`Rows.commit` copies only the rows whose record passed every
check, so a late write of an overrun get lands in this object's buffer, never in a row
vLLM gave to another chunk, and a failed row is left exactly as it was. Pure: no vllm
import.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.storage.pageio import Payloads

__all__ = ["Rows", "flat_rows"]


def flat_rows(view: memoryview) -> tuple[memoryview, int, int]:
    """``(flat bytes, rows, row bytes)`` of vLLM's 2-D primary view (format ``b`` or ``B``,
    C-contiguous, writable). Raises ValueError saying what is wrong with another view."""
    if view.ndim != 2 or view.strides is None or view.shape is None:
        raise ValueError(f"primary_kv_view must be 2-D (chunks, bytes), got ndim={view.ndim}")
    if view.itemsize != 1 or not view.c_contiguous:
        raise ValueError(
            f"primary_kv_view must be C-contiguous bytes, got format {view.format!r}, "
            f"strides {view.strides}"
        )
    if view.readonly:
        raise ValueError("primary_kv_view must be writable (loads fill its rows)")
    rows, row_bytes = view.shape
    return view.cast("B"), rows, row_bytes


class Rows(Payloads):
    """Item ``i`` is row ``chunk_ids[i]`` of ``flat`` (rows of ``row_bytes``).

    ``for_get``: a load (staged; rows must be distinct, since one row receives one record).
    Raises ValueError for a row out of range or a repeated row of a load.
    """

    zero_copy = False

    def __init__(
        self, flat: memoryview, row_bytes: int, chunk_ids: Sequence[int], *, for_get: bool
    ) -> None:
        rows = flat.nbytes // row_bytes
        ids = [int(c) for c in chunk_ids]
        bad = [c for c in ids if not 0 <= c < rows]
        if bad:
            raise ValueError(f"chunk ids {bad} are outside the primary tier's [0, {rows}) rows")
        if for_get and len(set(ids)) != len(ids):
            raise ValueError(f"chunk ids {ids} repeat a row; a load fills each row once")
        self._flat = flat
        self.payload_len = row_bytes
        self.chunk_ids: tuple[int, ...] = tuple(ids)
        self._for_get = for_get
        self._stage = bytearray(row_bytes * len(ids)) if for_get else None

    def __len__(self) -> int:
        return len(self.chunk_ids)

    def row(self, i: int) -> memoryview:
        """Item ``i``'s row of vLLM's buffer."""
        off = self.chunk_ids[i] * self.payload_len
        return self._flat[off : off + self.payload_len]

    def parts(self, i: int) -> list[memoryview]:
        """The row itself (a store) or its staging slot (a load)."""
        if self._stage is None:
            return [self.row(i)]
        n = self.payload_len
        return [memoryview(self._stage)[i * n : (i + 1) * n]]

    def commit(self, ok: Sequence[bool]) -> None:
        """After a load: copy the staged rows whose ``ok`` is True into vLLM's buffer."""
        if self._stage is None:
            return
        n = self.payload_len
        stage = memoryview(self._stage)
        for i, good in enumerate(ok):
            if good:
                self.row(i)[:] = stage[i * n : (i + 1) * n]
