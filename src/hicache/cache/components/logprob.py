"""Scoring entries as a component store: prompt logprobs kept with the cached pages.

A request that scores its prompt (``echo`` with ``logprobs``) needs, at every scored
position, the logprob of the prompt token there under the logits of the position before
it. Those logits are not in the KV, so until now such a request recomputed its whole
prompt. This store keeps, per token slot of a page, the entry of the position's logits
(:class:`~hicache.spec.LogprobSpec`: the next prompt token's id and logprob, and the
``top`` most likely tokens) in an fp32 pool on the full KV's page ids, in L1 and L2, and
as one ``"logprob"`` L3 record per page, like the DSA indexer's keys
(:class:`~hicache.cache.components.indexer.IndexerStore`, whose copies and codec it
reuses). Slot ``p`` serves position ``p + 1``: a hit of ``m`` tokens holds the entries of
positions ``1..m``, the forward computes the rest.

Entries are optional (:class:`~hicache.tree.components.LogprobEntries`): only scoring
requests compute them, so they never cut other requests' matches; a scoring request's
match is capped where the entries it needs stop (:meth:`LogprobStore.cap`). The entry at
a page's last slot names the token that followed in the request that computed it (a
later page's token, outside the page's key); a hit ending there serves a request with
another token only when that token is among the entry's alternatives, else the hit ends a
page earlier. The flow and the argument: docs/architecture.md, "Scoring requests".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hicache.cache.components.base import HeldPages, NominalSize, StoreAdmission, StoreContext
from hicache.cache.components.indexer import IndexerRecords, IndexerStore
from hicache.cache.components.paged import PagedStore
from hicache.cache.components.records import ComponentRecords
from hicache.cache.request import CacheRequest, ScoreLog
from hicache.logprob import TokenLogprob
from hicache.memory import DevicePool
from hicache.metrics import CacheCounters, ComponentUsage
from hicache.spec import ComponentSpec, LogprobSpec
from hicache.tree import TreeNode
from hicache.tree.components import LogprobEntries, Tier, TreeComponent
from hicache.tree.node import page_ids

__all__ = ["LOGPROB", "LogprobRecords", "LogprobStore", "decode_row", "encode_rows"]

LOGPROB = LogprobSpec.name
"""The tree component name of the scoring entries (``"logprob"``)."""


def encode_rows(records: Sequence[TokenLogprob], top: int) -> np.ndarray:
    """The fp32 rows of consecutive slots, ``(len(records), 2 + 2 * top)``: each ``[next
    id, logprob, top ids.., top logprobs..]`` (ids bit-cast from int32) from the next
    position's record (with ``>= top`` alternatives, of which the first ``top`` are kept)."""
    n = len(records)
    if any(r.k < top for r in records):
        raise ValueError(f"a record with fewer than {top} alternatives cannot fill a row")
    rows = np.empty((n, 2 + 2 * top), dtype=np.float32)
    rows[:, 0] = np.array([r.token_id for r in records], dtype=np.int32).view(np.float32)
    rows[:, 1] = np.array([r.logprob for r in records], dtype=np.float32)
    if top:
        ids = b"".join(r.top_id_bytes[: 4 * top] for r in records)
        values = b"".join(r.top_logprob_bytes[: 4 * top] for r in records)
        rows[:, 2 : 2 + top] = np.frombuffer(ids, dtype=np.float32).reshape(n, top)
        rows[:, 2 + top :] = np.frombuffer(values, dtype=np.float32).reshape(n, top)
    return rows


def decode_row(row: np.ndarray, token_id: int, top: int) -> TokenLogprob | None:
    """The record of ``token_id`` from a slot's ``row`` (fp32, as :func:`encode_rows`
    wrote): its logprob is the row's own when the row names ``token_id``, else the
    alternative's; None when neither holds it."""
    ids = row[2 : 2 + top].view(np.int32)
    values = row[2 + top : 2 + 2 * top]
    if int(row[:1].view(np.int32)[0]) == token_id:
        logprob = float(row[1])
    else:
        where = np.flatnonzero(ids == token_id)
        if not len(where):
            return None
        logprob = float(values[int(where[0])])
    return TokenLogprob(token_id, logprob, ids.tobytes(), values.tobytes())


class LogprobStore(IndexerStore):
    """Scoring entries of one cache, on the full KV's page ids (see the module doc)."""

    spec_type = LogprobSpec
    label = "logprob"
    optional = True

    def __init__(self, spec: ComponentSpec, ctx: StoreContext) -> None:
        PagedStore.__init__(self, spec, ctx)
        assert isinstance(spec, LogprobSpec)
        self.entry = spec
        self.keeps = spec.top
        """Alternatives kept per slot: a request asking more recomputes its prompt."""
        self.kv = spec.kv
        self._added = False
        config = ctx.config
        self._build_pools(spec.kv, ctx, config.device_pages, config.host_pages(ctx.kv))

    @classmethod
    def tree_component(cls, spec: ComponentSpec) -> TreeComponent:
        assert isinstance(spec, LogprobSpec)
        return LogprobEntries()

    @property
    def scoring_top(self) -> int | None:
        return self.keeps

    @property
    def runner_pool(self) -> DevicePool | None:
        """None: the model never reads the entries (the cache writes and reads them)."""
        return None

    def usage(self, cached_tokens: int) -> ComponentUsage:
        """L1 and L2: the pages whose entries the tree holds there."""
        ps = self.page_size
        host = self._host_pool
        return ComponentUsage(
            name=self.name,
            device_used=len(self.owned(Tier.DEVICE)),
            device_total=self._device_pool.num_pages,
            host_used=0 if host is None else len(self.owned(Tier.HOST)),
            host_total=0 if host is None else host.num_pages,
            unit_bytes=self.kv.token_bytes * ps,
            bytes_per_cached_token=float(self.kv.token_bytes) if cached_tokens else 0.0,
        )

    def nominal(self) -> NominalSize:
        return NominalSize(1, float(self.kv.token_bytes), "pages", "on the full KV's page ids")

    def records(self) -> LogprobRecords:
        return LogprobRecords(self)

    # ------------------------------------------------------------------ rows

    def _rows(self, tier: Tier, page_list: Sequence[int]) -> np.ndarray:
        """The rows of ``page_list`` in ``tier``'s pool, ``(len * page_size, width)`` fp32."""
        pool = self.pool(tier)
        data = pool.read_pages(torch.tensor(list(page_list), dtype=torch.int64))
        return data[:, 0, 0, :, 0, :].reshape(-1, self.entry.width).numpy()

    def _write(self, page_list: Sequence[int], rows: np.ndarray) -> None:
        """Write ``rows`` (``(len * page_size, width)`` fp32) into L1 pages ``page_list``."""
        ps = self.page_size
        data = torch.from_numpy(rows).reshape(len(page_list), 1, 1, ps, 1, self.entry.width)
        self._device_pool.write_pages(torch.tensor(list(page_list), dtype=torch.int64), data)

    # ------------------------------------------------------------------ requests

    def cap(self, req: CacheRequest, wanted: Sequence[int]) -> int:
        """How many leading tokens of ``wanted`` a scoring request may take from the
        cache: the deepest page boundary ``b`` such that every page from the one holding
        slot ``start - 1`` (the logits before its first scored position) up to ``b``
        holds its entries in some tier and the last slot's entry serves the prompt's
        token at ``b``; at least ``start - 1`` (no entry needed below). Copies nothing."""
        log = req.scores
        if log is None:
            return len(wanted)
        limit = len(wanted) if log.limit is None else min(len(wanted), log.limit)
        floor = min(limit, max(0, log.ask.start - 1))
        ps = self.page_size
        first = (log.ask.start - 1) // ps  # the page of slot start - 1, position start's
        match = self.tree.match_prefix(wanted[:limit], req.tenant)
        node = match.last_host_node
        path: list[TreeNode] = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        comp = self.tree.component(self.name)
        at = 0
        spans: list[tuple[TreeNode, int]] = []  # (node, first page) with entries
        for n in path:
            k = self.tree.num_pages(n)
            if at + k > first and not comp.present(n, device_only=False):
                break
            spans.append((n, at))
            at += k
        for n, start_page in reversed(spans):
            for b in range(start_page + self.tree.num_pages(n), start_page, -1):
                if b * ps <= floor or b <= first:
                    return floor
                if self._serves(n, b - start_page - 1, log, b * ps):
                    return b * ps
        return floor

    def _serves(self, node: TreeNode, page: int, log: ScoreLog, token_pos: int) -> bool:
        """Whether the entry at the last slot of ``node``'s ``page``-th page names the
        prompt token at ``token_pos`` or holds it among its alternatives."""
        comp = self.tree.component(self.name)
        tier = Tier.DEVICE if comp.get(node, Tier.DEVICE) is not None else Tier.HOST
        ids = comp.get(node, tier)
        assert ids is not None
        row = self._rows(tier, [int(ids[page])])[-1]
        return decode_row(row, log.tokens[token_pos], self.keeps) is not None

    def admit(self, req: CacheRequest, node: TreeNode, prefix_pages: int) -> StoreAdmission:
        """The indexer's admission (the hit's L2-only entries copied to L1); then, for a
        scoring request, the records of the positions its hit serves (``start ..
        prefix``) into :attr:`ScoreLog.records`, read from L1. Refuses, lowering the
        request's limit a page, only if the last entry cannot serve (never after
        :meth:`cap`)."""
        got = super().admit(req, node, prefix_pages)
        log = req.scores
        m = prefix_pages * self.page_size
        lo = max(1, log.ask.start) if log is not None else 0
        if log is None or m < lo:
            return got
        rows = self._rows(Tier.DEVICE, list(req.pages[:prefix_pages]))
        out: dict[int, TokenLogprob] = {}
        for pos in range(lo, m + 1):
            rec = decode_row(rows[pos - 1], log.tokens[pos], self.keeps)
            if rec is None:
                log.limit = m - self.page_size
                req.set_part(self.name, None)
                return StoreAdmission(ok=False, loaded=got.loaded)
            out[pos] = rec
        log.records.update(out)
        return got

    def committed(self, req: CacheRequest, last: TreeNode, full: int, computed: int) -> None:
        """A scoring request's committed path: every node without L1 entries whose L1
        pages the request's path holds and whose slots' records it has (the next
        position's, for each) gets its rows written and marked in L1; then the L2 copies
        as the indexer's (:meth:`IndexerStore.back_up`), unless a node marked now had its
        full KV in L2 already (its L3 write may be past): :meth:`take_added` tells the
        facade, which backs them up and writes them to L3."""
        part = self.part_of(req)
        assert part is not None
        part.pending = page_ids()
        log = req.scores
        if log is not None and self._mark(req, log, last, full):
            self._added = True
        else:
            self.back_up(last)

    def late(self, req: CacheRequest, last: TreeNode, full: int) -> None:
        """The records of the request's last pages came after their commit: place them
        (as :meth:`committed`)."""
        if req.scores is not None and self.part_of(req) is not None:
            if self._mark(req, req.scores, last, full):
                self._added = True
            else:
                self.back_up(last)

    def take_added(self) -> bool:
        added, self._added = self._added, False
        return added

    def _mark(self, req: CacheRequest, log: ScoreLog, last: TreeNode, full: int) -> bool:
        """Write and mark the rows of the path's nodes that lack them and whose records
        are all in; whether one of them had its full KV in L2 already."""
        in_l2 = False
        ps = self.page_size
        comp = self.tree.component(self.name)
        ok = [
            (j + 1) * ps < len(log.tokens) and log.complete(j * ps + 1, (j + 1) * ps + 1)
            for j in range(full)
        ]
        ends = [d for d in range(1, full) if ok[d - 1] and not ok[d]]
        if ends:  # a node ends where the records do (the prompt's last page has none)
            self.tree.ensure_boundary(last, full - ends[-1])
        at = 0
        for n in self.tree.path_tail(last, full):
            k = self.tree.num_pages(n)
            lo, hi = at * ps + 1, (at + k) * ps + 1  # positions of the slots' records
            at += k
            if n.device is None or comp.get(n, Tier.DEVICE) is not None:
                continue
            if hi > len(log.tokens) or not log.complete(lo, hi):
                continue
            rows = encode_rows([log.records[p] for p in range(lo, hi)], self.keeps)
            self._write(list(n.device), rows)
            self.tree.assign_component(self.name, n, Tier.DEVICE, n.device)
            in_l2 = in_l2 or n.host is not None
        return in_l2

    def held(self, req: CacheRequest) -> HeldPages | None:
        """None: the entries do not travel with a request's pages to another instance
        (its cache rebuilds them when a request there scores)."""
        return None


class LogprobRecords(IndexerRecords):
    """The ``"logprob"`` component's L3 codec: one record per page (its slots' rows); a
    hit needs none (entries are optional: :meth:`needed` is empty): a prefetch reads
    those its lookup found among the pages it reads, into those pages' L2 ids, and never
    cuts its boundary by them."""

    name = LOGPROB
    optional = True
    whole = True  # one fp32 row per token, no K/V heads to split by

    def __init__(self, store: LogprobStore) -> None:
        if store.host_pool is None:
            raise ValueError("L3 logprob records need the L2 logprob pool")
        ComponentRecords.__init__(self, store.tree, reach=0)
        self.store = store

    def needed(self, depth_pages: int) -> range:
        return range(0)

    def count_written(self, counters: CacheCounters, written: int, failed: int) -> None:
        counters.l3_backup_logprob_pages_total += written
        counters.l3_backup_logprob_pages_failed_total += failed
