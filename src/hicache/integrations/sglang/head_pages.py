"""An SGLang ``page_head`` KV pool's pages as head-group records (``records="head"``).

In SGLang's ``page_head`` host layout a page is, per kind (K, then V, in two halves of
``kv_buffer``), ``(H, page_size, L, D)`` contiguous, ``H`` the rank's K/V heads: the
``g`` heads of one group are one contiguous span per kind. Record ``j`` of a page
(:func:`hicache.keys.head_key`) holds model K/V heads ``[j * g, (j + 1) * g)``; its
payload is the K span then the V span, so each record is two zero-copy parts of
``kv_buffer`` (ranges from SGLang's ``get_split_heads_page_buffer_meta``), or of a flat
page of the copying calls. :class:`PageHeads` knows which records a rank holds and
writes (:class:`~hicache.storage.headio.HeadRecords`: the lowest rank holding a group
writes it); a page is good only when every record of it the rank reads is. The model's
K/V head count: ``hicache_kv_heads`` when given, else the pool's ``head_num`` times the
TP size, which is unknown (None) when the pool holds one head at TP > 1 (replicas
possible). No sglang import: pools are duck-typed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hicache.heads import HeadSplit, record_group
from hicache.integrations.sglang.pages import ByteParts, Range
from hicache.keys import PageKey
from hicache.storage.headio import HeadRecords, page_outcomes
from hicache.storage.pageio import byte_view
from hicache.storage.stats import SetOutcome

__all__ = ["PageHeads", "model_kv_heads"]


def model_kv_heads(pool_heads: int, tp_size: int, given: int | None) -> int | None:
    """The model's K/V heads for a rank pool of ``pool_heads`` at TP ``tp_size``:
    ``given`` (checked: a rank of that model holds ``pool_heads``), else ``pool_heads *
    tp_size``, or None when that is ambiguous (one head per rank at TP > 1: the model
    may have fewer heads than ranks, each held by several)."""
    if given is not None:
        held = max(1, given // tp_size) if given % tp_size == 0 or tp_size % given == 0 else 0
        if held != pool_heads:
            raise ValueError(
                f"hicache_kv_heads={given} does not match SGLang's host pool: a rank of TP"
                f" size {tp_size} holds {pool_heads} K/V heads (the model's count is"
                f" {pool_heads * tp_size} when ranks do not outnumber heads)"
            )
        return given
    if pool_heads == 1 and tp_size > 1:
        return None
    return pool_heads * tp_size


@dataclass(frozen=True)
class PageHeads:
    """A ``page_head`` pool's records for one rank: ``records`` (the split, the group
    ``g``, the record indices it holds), ``part_bytes`` (one kind's span of a record:
    ``g * page_size * L * D`` values). Build with :meth:`of`."""

    pool: Any
    records: HeadRecords
    part_bytes: int

    @classmethod
    def of(cls, pool: Any, *, kv_heads: int, tp_size: int, tp_rank: int, tp_lcm: int) -> PageHeads:
        """The records of rank ``tp_rank`` of ``tp_size`` for a model of ``kv_heads``
        K/V heads shared by servers whose TP sizes divide ``tp_lcm``. ValueError naming
        the numbers when the pool's heads do not match the split."""
        if tp_lcm % tp_size:
            raise ValueError(f"tp_lcm_size={tp_lcm} is not a multiple of tp_size={tp_size}")
        # Query heads do not change K/V records: any count the split accepts.
        split = HeadSplit(math.lcm(kv_heads, tp_size), kv_heads, tp_size, tp_rank)
        if split.local_kv_heads != int(pool.head_num):
            raise ValueError(
                f"SGLang's host pool holds {pool.head_num} K/V heads, but rank {tp_rank} of"
                f" TP size {tp_size} holds {split.local_kv_heads} of {kv_heads}"
            )
        records = HeadRecords(split, record_group(kv_heads, tp_lcm))
        itemsize = torch.empty((), dtype=pool.dtype).element_size()
        part = records.group * int(pool.page_size) * int(pool.layer_num) * int(pool.head_dim)
        heads = cls(pool, records, part * itemsize)
        meta = heads._meta(torch.arange(int(pool.page_size), dtype=torch.int64))
        if [n for _, n in meta] != [heads.part_bytes] * (2 * records.per_page):
            raise ValueError(
                f"SGLang's page_head meta has parts {[n for _, n in meta]}; expected"
                f" {2 * records.per_page} of {heads.part_bytes} bytes"
            )
        return heads

    @property
    def group(self) -> int:
        """K/V heads per record."""
        return self.records.group

    @property
    def per_page(self) -> int:
        """Records per page this rank reads (its heads' groups)."""
        return self.records.per_page

    @property
    def payload_len(self) -> int:
        """Bytes of one record's payload (its K span and its V span)."""
        return 2 * self.part_bytes

    def written(self) -> list[int]:
        """Positions (of the rank's groups) of the records this rank writes."""
        return self.records.written()

    def keys(
        self, pages: Sequence[PageKey], positions: Sequence[int] | None = None
    ) -> list[PageKey]:
        """The record keys of ``pages``, page-major (the rank's groups, or ``positions``)."""
        return self.records.keys(pages, positions)

    def _meta(self, host_indices: torch.Tensor) -> list[Range]:
        """SGLang's ``(offset, nbytes)`` per page, per group, K then V, in ``kv_buffer``."""
        buf = self.pool.kv_buffer
        ptrs, sizes = self.pool.get_split_heads_page_buffer_meta(host_indices, self.per_page)
        base = int(buf.data_ptr())
        total = buf.numel() * buf.element_size()
        out = [(int(p) - base, int(s)) for p, s in zip(ptrs, sizes, strict=True)]
        for off, n in out:
            if off < 0 or off + n > total:
                raise ValueError(f"page_head range ({off}, {n}) lies outside kv_buffer")
        return out

    def in_pool(
        self, host_indices: torch.Tensor, n: int, positions: Sequence[int] | None = None
    ) -> ByteParts:
        """Zero-copy payloads of ``n`` pages' records (``host_indices``: ``n * page_size``
        host token indices), page-major, the rank's groups or ``positions`` of them."""
        if len(host_indices) != n * int(self.pool.page_size):
            raise ValueError(f"{len(host_indices)} host indices for {n} pages")
        flat = self._meta(host_indices)
        if len(flat) != 2 * n * self.per_page:
            raise ValueError(f"page_head meta has {len(flat)} parts for {n} pages")
        ranges = [
            flat[2 * (i * self.per_page + j) : 2 * (i * self.per_page + j) + 2]
            for i in range(n)
            for j in self._positions(positions)
        ]
        buf = self.pool.kv_buffer
        return ByteParts.over(buf.view(-1).view(torch.uint8), ranges, self.payload_len, owner=buf)

    def in_flat(
        self, pages: Sequence[torch.Tensor], positions: Sequence[int] | None = None
    ) -> ByteParts:
        """Payloads of the records of flat pages (SGLang's ``get_data_page(i, flat=True)``:
        all K heads, then all V heads), page-major, in place in the tensors."""
        half = self.per_page * self.part_bytes
        views: list[list[memoryview]] = []
        for t in pages:
            mv = byte_view(t)
            if mv.nbytes != 2 * half:
                raise ValueError(f"flat page is {mv.nbytes} bytes, expected {2 * half}")
            for j in self._positions(positions):
                k = j * self.part_bytes
                views.append(
                    [mv[k : k + self.part_bytes], mv[half + k : half + k + self.part_bytes]]
                )
        return ByteParts(views, self.payload_len)

    def _positions(self, positions: Sequence[int] | None) -> Sequence[int]:
        return range(self.per_page) if positions is None else positions

    def page_ok(self, ok: Sequence[bool]) -> list[bool]:
        """Per page: every one of its records (the rank's groups) ``ok``."""
        m = self.per_page
        return [all(ok[i : i + m]) for i in range(0, len(ok), m)]

    def set_outcomes(self, per_record: Sequence[SetOutcome], written: int) -> list[SetOutcome]:
        """Per page, from its ``written`` records' outcomes (page-major)."""
        return page_outcomes(per_record, written)
