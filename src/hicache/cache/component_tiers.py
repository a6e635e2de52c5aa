"""The tiers of a cache's extra tree components, handled together.

A hybrid model's cache keeps, besides full KV, recurrent-state snapshots
(:class:`~hicache.cache.snapshot_tier.SnapshotTier`, component ``"mamba"``) and/or
sliding-window K/V (:class:`~hicache.cache.swa_tier.SwaTier`, component ``"swa"``), each
with its own L1 (and L2) pools. The facade runs some operations on all of them at once:
back up what a hit needs when a span reaches L2, return ids the tree released, empty them,
check their ownership, build their L3 codecs. This object holds those tiers and does exactly that, so the facade
names no component where it needs none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from hicache.cache.component_records import ComponentRecords, SnapshotRecords, SwaRecords
from hicache.cache.inspect import check_owned
from hicache.cache.request import CacheRequest
from hicache.cache.snapshot_tier import SNAPSHOT, SnapshotTier
from hicache.cache.swa_tier import SWA, SwaTier
from hicache.config import CacheConfig, KVSpec, SlidingWindowSpec, StateSpec
from hicache.tree import HiRadixTree, TreeNode
from hicache.tree.components import MambaState, SlidingWindow, Tier, TreeComponent
from hicache.tree.node import PageIds, page_ids

__all__ = ["ComponentTiers", "tree_components"]


def tree_components(state: StateSpec | None, swa: SlidingWindowSpec | None) -> list[TreeComponent]:
    """The tree's extra components for a model with recurrent ``state`` and/or sliding
    windows ``swa`` (empty for a full-attention model)."""
    out: list[TreeComponent] = [MambaState()] if state is not None else []
    if swa is not None:
        out.append(SlidingWindow(swa.window))
    return out


class ComponentTiers:
    """The snapshot and sliding-window tiers of one cache (each None when the model has
    no such state)."""

    def __init__(
        self,
        *,
        tree: HiRadixTree,
        config: CacheConfig,
        kv: KVSpec,
        device: torch.device,
        state: StateSpec | None,
        swa: SlidingWindowSpec | None,
    ) -> None:
        hierarchical = config.enable_hierarchical_cache
        self.snapshots: SnapshotTier | None = None
        if state is not None:
            self.snapshots = SnapshotTier(
                tree=tree,
                config=config,
                kv=kv,
                state=state,
                device=device,
                hierarchical=hierarchical,
            )
        self.swa: SwaTier | None = None
        if swa is not None:
            self.swa = SwaTier(
                tree=tree,
                config=config,
                full=kv,
                spec=swa,
                device=device,
                hierarchical=hierarchical,
            )

    @property
    def names(self) -> list[str]:
        """The component names present (``"mamba"``, ``"swa"``)."""
        return [n for n, t in ((SNAPSHOT, self.snapshots), (SWA, self.swa)) if t is not None]

    def records(self, tree: HiRadixTree) -> list[ComponentRecords]:
        """The L3 codecs of the components present (an L3 tier writes and reads them)."""
        codecs: list[ComponentRecords] = []
        if self.snapshots is not None:
            codecs.append(SnapshotRecords(tree, self.snapshots))
        if self.swa is not None:
            codecs.append(SwaRecords(tree, self.swa))
        return codecs

    def back_up(self, last: TreeNode) -> list[TreeNode]:
        """The full pages of a run ending at ``last`` are in L2: copy to L2 what a hit
        there needs of each component; returns the nodes that got L2 values."""
        backed: list[TreeNode] = []
        if self.snapshots is not None:
            backed += self.snapshots.back_up(last)
        if self.swa is not None:
            backed += self.swa.back_up(last)
        return backed

    def free(self, tier: Tier, ids: Mapping[str, PageIds]) -> None:
        """Return ids the tree released, per component, to their ``tier`` pools."""
        for name, got in ids.items():
            if name == SNAPSHOT and self.snapshots is not None:
                self.snapshots.free(tier, got)
            elif name == SWA and self.swa is not None:
                self.swa.free(tier, got)
            elif len(got):  # pragma: no cover - every component has a pool above
                raise RuntimeError(f"no pool for component {name!r}")

    def reset(self, tiers: Sequence[Tier]) -> None:
        """Free every id the tree owns in ``tiers`` (the tree is reset next)."""
        for tier in tiers:
            for t in (self.snapshots, self.swa):
                if t is not None:
                    t.free(tier, page_ids(t.owned(tier)))

    def check(self, requests: list[CacheRequest], held: Mapping[str, list[int]]) -> None:
        """Every used id of every pool is owned exactly once: by the tree, by an admitted
        request (SWA L1 pages) or, in L2, by an L3 op (``held[name]``). Raises
        AssertionError."""
        if self.snapshots is not None:
            sn = self.snapshots
            check_owned("L1 snapshot", sn.device_pool.allocator, sn.owned(Tier.DEVICE))
            if sn.host_pool is not None:
                owned = [*sn.owned(Tier.HOST), *held.get(SNAPSHOT, [])]
                check_owned("L2 snapshot", sn.host_pool.allocator, owned)
        if self.swa is not None:
            sw = self.swa
            mine = sw.request_pages(requests)
            check_owned("L1 SWA", sw.device_pool.allocator, sw.owned(Tier.DEVICE) + mine)
            if sw.host_pool is not None:
                owned = [*sw.owned(Tier.HOST), *held.get(SWA, [])]
                check_owned("L2 SWA", sw.host_pool.allocator, owned)
