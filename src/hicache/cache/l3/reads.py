"""What a prefetch asks L3 besides its full-KV run, and what an agreed lookup reads.

:class:`Reads` says which component records a prefetch's lookup covers (those within
reach of the boundaries it considers) and turns the lookup, applied with the hit every
rank agreed on, into a read: the deepest boundary every component serves on every rank
(:func:`~hicache.cache.components.records.agree_boundary`), then L2 pages and component
ids reserved, agreed (all-reduce(min)) and committed or aborted on every rank together,
then the read queued on the controller. It also says how long a lookup may wait for
announced pages (:meth:`Reads.wait_gain`), by the rule that reads the hit. Every collective
here depends on agreed values alone. The flow: ``docs/architecture.md`` (L3).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from hicache.cache.components.records import ComponentRecords, agree_boundary, usable_boundaries
from hicache.cache.host_tier import HostTier
from hicache.cache.l3.keys import TierKeys
from hicache.cache.l3.prefetch import ComponentFetch, Prefetch
from hicache.cache.l3.worth import RestoreCosts
from hicache.config import DEFAULT_PREFETCH_THRESHOLD, PrefetchConfig, PrefetchPolicy
from hicache.controller import L3Lookup
from hicache.controller.announced import ANY_GAIN, WaitGain
from hicache.controller.rank_group import RankGroup
from hicache.controller.storage_controller import (
    ComponentLookup,
    ComponentRead,
    StorageController,
)
from hicache.metrics import CacheCounters
from hicache.tree import TreeNode
from hicache.tree.node import PageIds, page_ids

__all__ = ["Reads"]

_ANY_NS = 1 << 62
"""A :class:`WaitGain`'s infinite ``per_page_s`` in the nanoseconds the ranks agree on."""


class Reads:
    """The lookups' component keys and the reads of one attached tier's prefetches."""

    def __init__(
        self,
        *,
        controller: StorageController,
        keys: TierKeys,
        host: HostTier,
        prefetch: PrefetchConfig,
        ranks: RankGroup,
        codecs: Mapping[str, ComponentRecords],
        costs: Callable[[], RestoreCosts],
        counters: CacheCounters,
    ) -> None:
        """``costs``: this rank's measured cost lines now (:mod:`hicache.cache.l3.worth`)."""
        self._controller = controller
        self._costs = costs
        self._counters = counters
        self._keys = keys
        self._host = host
        self._prefetch = prefetch
        self._ranks = ranks
        self._codecs = codecs
        self._components = tuple(codecs.values())
        self._page_size = host.page_size

    def lookups(self, p: Prefetch, attach: TreeNode, run: int) -> list[ComponentLookup]:
        """Each component's keys within reach of the boundaries ``p`` considers (from the
        valid match when held boundaries count, else from the start, to ``run`` pages
        past it), with the pages before the start whose values the tree holds."""
        start, inner_to = p.start_page, p.inner_to
        lo = p.valid_pages if inner_to else start  # boundaries considered: (lo, start + hit]
        lookups: list[ComponentLookup] = []
        for c in self._components:
            if c.optional and not p.optional:
                continue  # nobody asked: no lookup, no read
            keys = self._keys.of(p.key, p.tenant, c.name)
            first = max(1, lo - c.reach + 1)  # records of pages first.. may be needed
            p.component_keys[c.name] = keys
            p.component_first[c.name] = first
            p.local[c.name] = c.local_pages(attach, start, first)
            lookups.append(
                ComponentLookup(
                    c.name,
                    tuple(keys[first - 1 : start + run]),
                    start - first + 1,
                    held=max(0, inner_to - first + 1) if inner_to else 0,
                )
            )
        return lookups

    def deadline(self, p: Prefetch, tokens: int) -> float:
        """When the policy stops waiting for ``p``, a prefetch of up to ``tokens`` tokens
        (whole pages): its configured timeout after its start; its start when the measured
        rates decide (:attr:`_by_rates`; ``tokens`` > 0; not for a restore's prefetch,
        which runs ahead of its request) and say no wait can pay. Each rank's own: the
        policy's verdict is agreed."""
        deadline = p.started + self._prefetch.timeout_s(tokens)
        if not tokens or p.any_hit or not self._by_rates:
            return deadline
        return p.started if self._costs().worth_waiting(tokens) is False else deadline

    def _rule(self, p: Prefetch) -> tuple[WaitGain, bool]:
        """This rank's rule for reading a hit of ``p`` and for waiting for its announced
        pages, one line for both (:class:`~hicache.controller.announced.WaitGain`: a run of
        ``n`` pages is read when ``gain.seconds(n) > 0``, and waited for that long at most),
        and whether the measured rates decide it. A restore's: any run (read ahead of its
        request, never too late). By the rates (:attr:`_by_rates`), when this rank's rates
        are known: what reading the run saves over recomputing it
        (:meth:`~hicache.cache.l3.worth.RestoreCosts.read_gain`); when the prefill is
        measured but this L3's reads are not (yet, or any more): any run (the read measures
        them). Else the threshold's pages."""
        ps = self._page_size
        if not p.any_hit and self._by_rates:
            costs = self._costs()
            line = costs.read_gain()
            if line is not None:
                return WaitGain(fixed_s=line[0], per_page_s=line[1] * ps), True
            if costs.prefill is not None and costs.read is None:
                return ANY_GAIN, False
        return WaitGain(min_pages=math.ceil(self._threshold(p) / ps)), False

    def wait_gain(self, p: Prefetch) -> WaitGain:
        """How long ``p``'s lookup may wait for announced pages, by the run it could reach:
        :meth:`_rule`'s line, the one that will read the hit (a run it would not read is
        not waited for, and a wait ends once the read would no longer pay). With several
        ranks deciding by their own rates, agreed (one all-reduce(min): the smallest gain
        of any rank, so every rank waits alike); the call is made on every rank alike
        (``p.keys``, ``p.any_hit`` and the configuration are agreed)."""
        if not p.keys:  # no run to wait for: no pages looked up
            return ANY_GAIN
        local, _ = self._rule(p)
        same = p.any_hit or not self._by_rates  # a rule the same on every rank
        if same or not self._ranks.multi or self._prefetch.announced_wait_s <= 0:
            return local
        per_ns = _ANY_NS if local.per_page_s == math.inf else math.floor(local.per_page_s * 1e9)
        agreed = self._ranks.all_reduce_min(
            torch.tensor(
                [-local.min_pages, -math.ceil(local.fixed_s * 1e9), min(per_ns, _ANY_NS)],
                dtype=torch.int64,
            )
        ).tolist()
        return WaitGain(
            min_pages=-agreed[0],
            fixed_s=-agreed[1] / 1e9,
            per_page_s=math.inf if agreed[2] >= _ANY_NS else agreed[2] / 1e9,
        )

    def _worth(self, p: Prefetch, tokens: int) -> bool:
        """Whether to read the agreed hit of ``tokens`` (> 0, whole pages) of ``p``: by
        :meth:`_rule`, agreed over the ranks (every rank runs this with the same hit:
        all-reduce(min)); counted when the rates decided."""
        gain, decided = self._rule(p)
        local = gain.seconds(tokens // self._page_size) > 0
        agreed = bool(self._ranks.min(int(local)))
        if decided:
            if agreed:
                self._counters.l3_decided_read_tokens_total += tokens
            else:
                self._counters.l3_decided_recompute_tokens_total += tokens
        return agreed

    def _threshold(self, p: Prefetch) -> int:
        """Tokens a read of ``p`` must bring at least: ``prefetch_threshold`` (unset:
        :data:`DEFAULT_PREFETCH_THRESHOLD`), or one page for a restore (``p.any_hit``: read
        ahead of its request, never too late)."""
        if p.any_hit:
            return self._page_size
        t = self._prefetch.prefetch_threshold
        return DEFAULT_PREFETCH_THRESHOLD if t is None else t

    @property
    def _by_rates(self) -> bool:
        """Whether the measured rates decide: the ``timeout`` policy with
        ``prefetch_threshold`` left unset."""
        pf = self._prefetch
        return pf.policy is PrefetchPolicy.TIMEOUT and pf.prefetch_threshold is None

    def plan(self, p: Prefetch, r: L3Lookup, hit: int) -> None:
        """Read what lookup ``r`` of ``p`` found, ``hit`` pages agreed (the minimum over
        ranks), up to the deepest usable boundary; ``p.finished`` when nothing is read."""
        start = p.start_page
        boundary = self._boundary(p, r, hit)
        if boundary <= start:
            self._read_records(p, boundary)
            return
        if boundary <= p.cached_to:  # L3 has nothing past what L1 holds: no read
            p.finished = True
            return
        hit = boundary - start
        host_pages = None
        if hit and self._worth(p, hit * self._page_size):
            host_pages = self._host.alloc(hit)  # agreed by every rank (HostTier.alloc)
        reads: list[ComponentFetch] = []
        if host_pages is not None:
            reads, got_all = self._alloc(p, start + hit, host_pages)
            if self._components and self._ranks.min(int(got_all)) == 0:
                self._host.allocator.free(host_pages)  # abort on every rank together
                host_pages = None
                self.free(reads)
                reads = []
        if host_pages is None:
            p.finished = True
            return
        p.host_pages = host_pages
        p.reads = reads
        p.boundary = boundary
        p.deadline = self.deadline(p, hit * self._page_size)
        self._submit(p, hit, host_pages)

    def _boundary(self, p: Prefetch, r: L3Lookup, hit: int) -> int:
        """The deepest boundary (a page of the prompt) every rank can use: with extra
        components, one every component serves; the same calls on every rank."""
        start = p.start_page
        found = {f.name: {p.component_first[f.name] + i for i in f.present} for f in r.components}
        p.found = found
        required = [c for c in self._components if not c.optional]
        if not required:  # none cuts the boundary (optional records ride along)
            return start + hit
        lo = p.valid_pages if p.inner_to else start
        usable = [
            d
            for d in usable_boundaries(required, lo, start + hit, p.local, found)
            if d > start or d <= p.inner_to  # held pages: only those with L2 full KV
        ]
        return agree_boundary(self._ranks.min, usable, start + hit)

    def _read_records(self, p: Prefetch, boundary: int) -> None:
        """Read only the component records that make the held boundary ``boundary``
        (``valid_pages < boundary <= inner_to``; 0: none) usable, into L2 ids the held
        nodes adopt when taken. Worth it when the tokens it makes usable beyond the
        local valid match reach ``prefetch_threshold``."""
        gain = boundary - p.valid_pages
        if not p.valid_pages < boundary <= p.inner_to or gain * self._page_size < self._threshold(
            p
        ):
            p.finished = True
            return
        reads, got_all = self._alloc(p, boundary, page_ids())
        if self._ranks.min(int(got_all)) == 0:  # reserve -> agree -> commit or abort
            self.free(reads)
            p.finished = True
            return
        if not reads:  # pragma: no cover - a boundary past the valid match needs a record
            p.finished = True
            return
        p.reads = reads
        p.boundary = boundary
        p.deadline = p.started + self._prefetch.timeout_s(0)
        self._submit(p, 0, page_ids())

    def _alloc(
        self, p: Prefetch, depth: int, host_pages: PageIds
    ) -> tuple[list[ComponentFetch], bool]:
        """L2 ids for the component records a boundary at ``depth`` needs that the tree
        does not hold; and whether every component got them (else no use: the caller
        frees those reserved)."""
        reads: list[ComponentFetch] = []
        for c in self._components:
            if c.optional:  # what the lookup found among the pages read, nothing more
                have = p.found.get(c.name, set())
                local = p.local.get(c.name, ())
                span = range(p.start_page + 1, p.start_page + len(host_pages) + 1)
                pages = [j for j in span if j in have and j not in local]
            else:
                pages = c.reads(depth, p.local.get(c.name, ()))
            if not pages:
                continue
            ids = c.alloc_read(pages, p.start_page, host_pages)
            if ids is None:  # no L2 room for the records a boundary needs: no use
                return reads, False
            reads.append(ComponentFetch(c.name, tuple(pages), ids))
        return reads, True

    def _submit(self, p: Prefetch, hit: int, host_pages: PageIds) -> None:
        """Queue the read of ``p``'s first ``hit`` pages into ``host_pages`` after its
        component records ``p.reads``."""
        component_reads = [
            ComponentRead(f.name, tuple(p.component_keys[f.name][j - 1] for j in f.pages), f.ids)
            for f in p.reads
        ]
        self._controller.read(p.op_id, p.keys[:hit], host_pages, component_reads)

    def free(self, fetches: list[ComponentFetch]) -> None:
        """Return the L2 ids of component reads to their pools."""
        for f in fetches:
            if len(f.ids):
                self._codecs[f.name].free(f.ids)
