"""Head records: a page of a ``records="head"`` namespace as one L3 record per group of K/V heads.

The seam between one logical key per page (what the cache and controller use) and the
records a backend stores (``docs/l3-keys.md``, "Head records"): page key ``k`` maps to the
records :func:`hicache.keys.head_key` ``(k, j)`` of the groups ``j`` of ``g``
(``Namespace.head_group``) K/V heads a rank holds, in page-major order, so a run of present
records from the first covers ``run // groups`` whole pages. Group ``j``'s payload: the
page's values of heads ``[j * g, (j + 1) * g)`` alone, per kind (K then V) in the host
layout's order (``page_first`` ``(page_size, L, g, D)``; ``page_first_direct`` and
``layer_first`` ``(L, page_size, g, D)``), ``K * L * page_size * g * D`` values in the
pool's dtype: byte for byte the page payload of a pool holding those heads, so every TP
size whose ranks hold whole groups agrees. A rank holding one group per page moves its
pages as page records do (:class:`~hicache.storage.pageio.HostPages`, zero-copy in the
``page_first*`` layouts); one holding several is staged by :class:`HeadPages` (a group
is a strided slice of a page): a set copies each run of consecutive pages into one row
per record (:func:`run_views`), a get reads rows and :meth:`HeadPages.commit` copies back
only pages whose every record was good.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

from hicache.config import MemLayout
from hicache.heads import HeadSplit
from hicache.keys import PageKey, head_key
from hicache.memory import HostPool
from hicache.storage.pageio import Payloads, byte_view
from hicache.storage.stats import SetOutcome

__all__ = [
    "HeadPages",
    "HeadRecords",
    "StageCache",
    "check_split",
    "head_record_bytes",
    "kind_views",
    "page_outcomes",
    "record_keys",
]


def head_record_bytes(host: HostPool, group: int = 1) -> int:
    """Payload bytes of one record of ``group`` heads of ``host``'s pages."""
    return host.page_bytes // host.spec.heads * group


@dataclass(frozen=True, slots=True)
class HeadRecords:
    """A rank's records of each page under a ``records="head"`` namespace: ``split`` the
    heads it holds, ``group`` K/V heads per record. ValueError (from
    :meth:`HeadSplit.record_groups`) unless the rank holds whole groups."""

    split: HeadSplit
    group: int
    records: range = field(init=False)
    """The record indices (model numbering of groups) the rank holds, ascending."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "records", self.split.record_groups(self.group))

    @property
    def per_page(self) -> int:
        """Records per page this rank reads."""
        return len(self.records)

    def written(self) -> list[int]:
        """Positions in :attr:`records` of those this rank writes (no lower rank holds
        their heads)."""
        return [j for j, r in enumerate(self.records) if self.split.writes_record(r, self.group)]

    def keys(
        self, keys: Sequence[PageKey], positions: Sequence[int] | None = None
    ) -> list[PageKey]:
        """The record keys of ``keys``, page-major: the rank's records, or those at
        ``positions`` of :attr:`records`."""
        held = self.records if positions is None else [self.records[j] for j in positions]
        return record_keys(keys, held)


_MEMO_CAP = 1 << 14
"""Head record keys remembered (about 350 bytes each with the entry, so some 6 MB at
most): a page's records are named by its lookup, its prefetch and its backup, each a
SHA-256 per record otherwise; 16384 records are 32 batches of 64 pages x 8 heads."""
_memo: dict[tuple[PageKey, int], PageKey] = {}


def record_keys(keys: Sequence[PageKey], kv_heads: Sequence[int]) -> list[PageKey]:
    """The head records of ``keys``, page-major: ``head_key(keys[i], kv_heads[j])`` at
    ``i * len(kv_heads) + j``. Memoized (at most :data:`_MEMO_CAP` keys, then forgotten
    all at once; dict reads and writes are atomic, so threads may share it)."""
    out: list[PageKey] = []
    memo = _memo
    for k in keys:
        for h in kv_heads:
            rk = memo.get((k, h))
            if rk is None:
                if len(memo) >= _MEMO_CAP:
                    memo.clear()
                rk = memo[(k, h)] = head_key(k, h)
            out.append(rk)
    return out


def page_outcomes(per_record: Sequence[SetOutcome], heads: int) -> list[SetOutcome]:
    """One outcome per page from its ``heads`` records' (page-major): FAILED when any
    failed, else WRITTEN when any was written, else SKIPPED (every record present)."""
    out: list[SetOutcome] = []
    for i in range(0, len(per_record), heads):
        got = per_record[i : i + heads]
        if SetOutcome.FAILED in got:
            out.append(SetOutcome.FAILED)
        elif SetOutcome.WRITTEN in got:
            out.append(SetOutcome.WRITTEN)
        else:
            out.append(SetOutcome.SKIPPED)
    return out


def _words(t: torch.Tensor) -> np.ndarray:
    """``t`` (a CPU tensor, last dim contiguous) as a numpy array of the widest integer
    words that divide its last dim's bytes: the same memory. Copies go through numpy
    (one thread, plain words): torch's strided copy of ``bfloat16`` values runs some
    thousand times slower than of integer words on CPU, and its intra-op threads, when
    the cores are busy, some ten times slower than one thread."""
    raw = t.view(torch.uint8)
    width = raw.shape[-1]
    for word, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if width % size == 0:
            return raw.view(word).numpy()
    return raw.numpy()


def kind_views(host: HostPool, page: int) -> list[torch.Tensor]:
    """Views of ``page`` of ``host``, one per kind, ``(A, B, H, D)`` with ``(A, B)`` the
    layout's order of a head record (``page_first`` ``(page_size, L)``, else
    ``(L, page_size)``): each a strided window of the pool's buffer, no copy."""
    ps = host.page_size
    buf = host.buffer
    kinds = range(host.spec.num_kv)
    if host.layout is MemLayout.PAGE_FIRST:
        return [buf[k, page * ps : (page + 1) * ps] for k in kinds]
    if host.layout is MemLayout.PAGE_FIRST_DIRECT:
        return [buf[k, page] for k in kinds]
    return [buf[k, :, page * ps : (page + 1) * ps] for k in kinds]


def _runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(i, page)`` pairs grouped into maximal runs where both go up by one: ``(i0,
    page0, length)`` each. Pages a pool allocated together are mostly such runs, so a
    batch is copied in a few array operations rather than one per page."""
    out: list[tuple[int, int, int]] = []
    for i, page in pairs:
        if out:
            i0, p0, m = out[-1]
            if i == i0 + m and page == p0 + m:
                out[-1] = (i0, p0, m + 1)
                continue
        out.append((i, page, 1))
    return out


def run_views(host: HostPool, page: int, count: int) -> list[np.ndarray]:
    """Pages ``page .. page + count - 1`` of ``host``, one word array per kind shaped
    ``(count, A, B, H, D)`` with ``(A, B)`` as in :func:`kind_views`: strided windows of
    the pool's buffer, no copy."""
    ps = host.page_size
    buf = host.buffer
    out = []
    for k in range(host.spec.num_kv):
        if host.layout is MemLayout.PAGE_FIRST:
            w = _words(buf[k, page * ps : (page + count) * ps])  # (count*ps, L, H, D)
            out.append(w.reshape(count, ps, *w.shape[1:]))
        elif host.layout is MemLayout.PAGE_FIRST_DIRECT:
            out.append(_words(buf[k, page : page + count]))  # (count, L, ps, H, D)
        else:
            w = _words(buf[k, :, page * ps : (page + count) * ps])  # (L, count*ps, H, D)
            w = w.reshape(w.shape[0], count, ps, *w.shape[2:])
            out.append(w.transpose(1, 0, 2, 3, 4))
    return out


def _grouped(v: np.ndarray, group: int) -> np.ndarray:
    """``v`` ``(m, A, B, H, D)`` as ``(m, H / group, A, B, group, D)``: the same memory,
    groups of heads first (a strided view, never a copy, so a copy into it lands in
    the pool)."""
    m, a, b, h, d = v.shape
    sm, sa, sb, sh, sd = v.strides
    shape = (m, h // group, a, b, group, d)
    return as_strided(v, shape, (sm, sh * group, sa, sb, sh, sd), writeable=v.flags.writeable)


class StageCache:
    """Staging buffers kept for reuse (at most ``keep``; the largest kept): a fresh buffer
    of a batch's size costs its page faults on first touch, several times the copy
    itself. A buffer goes back only once no backend call can still touch it (the caller
    asks :meth:`HiCacheStorage.host_writes_settled` first)."""

    def __init__(self, keep: int = 2) -> None:
        self._keep = keep
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat ``uint8`` buffer of exactly ``nbytes`` (a view of a kept one, or new)."""
        with self._lock:
            for i, t in enumerate(self._free):
                if t.numel() >= nbytes:
                    return self._free.pop(i)[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, t: torch.Tensor) -> None:
        """Keep ``t``'s whole buffer for a later :meth:`take`."""
        base = t if t._base is None else t._base
        with self._lock:
            self._free.append(base)
            self._free.sort(key=lambda b: -b.numel())
            del self._free[self._keep :]


class HeadPages(Payloads):
    """The records of ``pages`` of ``host`` by groups of ``group`` heads: item
    ``i * len(local) + j`` is local group ``local[j]`` (heads ``[local[j] * group,
    (local[j] + 1) * group)`` of the pool's ``H``) of ``pages[i]``.

    A get must cover every group of the pool (a page is usable only whole); a set may name
    a subset (the groups this rank writes). ``zero_copy`` is False: items are rows of one
    staging buffer, copied from / to the pool's pages a run of pages and a kind at a time.
    """

    def __init__(
        self,
        host: HostPool,
        pages: Sequence[int] | torch.Tensor,
        local: Sequence[int],
        *,
        for_get: bool,
        group: int = 1,
        stages: StageCache | None = None,
    ) -> None:
        idx = host.check_pages(
            pages if isinstance(pages, torch.Tensor) else list(pages), unique=for_get
        )
        heads = host.spec.heads
        if group < 1 or heads % group:
            raise ValueError(f"a record of {group} heads does not divide the pool's {heads}")
        groups = heads // group
        if not all(0 <= j < groups for j in local) or len(set(local)) != len(local):
            raise ValueError(f"local groups {list(local)} must be distinct, in [0, {groups})")
        if for_get and sorted(local) != list(range(groups)):
            raise ValueError(f"a get reads every group of the pool ({groups}), got {list(local)}")
        self.host = host
        self.group = group
        self.pages: list[int] = idx.tolist()
        self.local = list(local)
        self.payload_len = head_record_bytes(host, group)
        self.zero_copy = False
        self._for_get = for_get
        n, nh = len(self.pages), len(self.local)
        size = n * nh * self.payload_len
        flat = torch.empty(size, dtype=torch.uint8) if stages is None else stages.take(size)
        self.stage = flat
        """The flat staging buffer (give it back to its cache once no call touches it)."""
        self._stage = flat.view(n * nh, self.payload_len)
        self._bytes: memoryview | None = None
        if for_get or not n or not nh:
            return
        rows = self._rows()
        sel = None if self.local == list(range(groups)) else np.asarray(self.local)
        for i0, page, m in _runs(list(enumerate(self.pages))):
            for k, v in enumerate(run_views(host, page, m)):  # (m, A, B, H, D)
                by_group = _grouped(v, group)  # (m, G, A, B, g, D)
                np.copyto(rows[i0 : i0 + m, :, k], by_group if sel is None else by_group[:, sel])

    def _rows(self) -> np.ndarray:
        """The staging buffer as ``(n, G, K, A, B, g, D)`` values of the pool's dtype."""
        host, spec = self.host, self.host.spec
        ps, nl = host.page_size, spec.num_layers
        inner = (ps, nl) if host.layout is MemLayout.PAGE_FIRST else (nl, ps)
        shape = (len(self.pages), len(self.local), spec.num_kv, *inner, self.group, spec.dim)
        return _words(self._stage.view(host.dtype).view(shape))

    @property
    def heads(self) -> int:
        """Records per page."""
        return len(self.local)

    def __len__(self) -> int:
        return len(self.pages) * len(self.local)

    def tensors(self, i: int) -> list[torch.Tensor]:
        """Item ``i``'s staging row (flat ``uint8``)."""
        return [self._stage[i]]

    def parts(self, i: int) -> list[memoryview]:
        """Item ``i``'s staging row as bytes: a slice of one view of the staging buffer
        (made on the first call), not a view built per record."""
        if self._bytes is None:
            self._bytes = byte_view(self.stage)
        n = self.payload_len
        return [self._bytes[i * n : (i + 1) * n]]

    def page_ok(self, ok: Sequence[bool]) -> list[bool]:
        """Per page: every one of its records ``ok``."""
        nh = len(self.local)
        return [all(ok[i * nh : (i + 1) * nh]) for i in range(len(self.pages))]

    def commit(self, ok: Sequence[bool]) -> None:
        """After a get: copy the pages whose every record is good into the pool."""
        if not self._for_get or not self.pages:
            return
        rows = self._rows()  # (n, G, K, A, B, g, D)
        if self.local != list(range(len(self.local))):  # record j of a page is group local[j]
            rows = rows[:, np.argsort(self.local)]
        good = [(i, self.pages[i]) for i, flag in enumerate(self.page_ok(ok)) if flag]
        for i0, page, m in _runs(good):
            for k, v in enumerate(run_views(self.host, page, m)):  # (m, A, B, H, D)
                np.copyto(_grouped(v, self.group), rows[i0 : i0 + m, :, k])


def check_split(heads: HeadSplit, host: HostPool) -> None:
    """ValueError unless ``host`` holds the ``heads.local_kv_heads`` heads of the split."""
    if heads.local_kv_heads != host.spec.heads:
        raise ValueError(
            f"the host pool holds {host.spec.heads} K/V heads but the rank's head split"
            f" {heads} holds {heads.local_kv_heads}"
        )
