"""Recurrent-state snapshots (Mamba2, Gated DeltaNet) as a component of the one tree.

A model with recurrent layers can resume a cached prefix only from the state its
recurrent layers had at the prefix's end. This tier keeps such snapshots: one slot of a
:class:`~hicache.memory.state_pool.StatePool` per cached boundary (the tree's
:class:`~hicache.tree.components.MambaState` component, ``"mamba"``), in L1 and, when the
hierarchical cache is on, backed up to L2 with the node's full KV. A match can end only at
a node whose snapshot is in some tier (the component's validator); load back brings a
host-only snapshot to L1.

Slots are owned by the tree once inserted. Copies between the tiers go through the state
copier of the cache's io backend (:mod:`hicache.transfer.state`), issued on the owner's
thread (a snapshot is small next to a node's KV; on CUDA they are stream-ordered before
the forward that reads them); a snapshot pool that runs short evicts unpinned snapshots in
their own LRU order, leaving the node and its full KV (a tombstone).
"""

from __future__ import annotations

import torch

from hicache.config import CacheConfig, KVSpec, StateSpec
from hicache.memory.state_pool import StatePool
from hicache.transfer.state import make_state_copier
from hicache.tree import HiRadixTree, TreeNode
from hicache.tree.components import Tier
from hicache.tree.node import PageIds, page_ids

__all__ = ["SNAPSHOT", "SnapshotTier"]

SNAPSHOT = "mamba"
"""The tree component name of recurrent-state snapshots."""


class SnapshotTier:
    """L1 (and optional L2) slots of recurrent-state snapshots for one cache."""

    def __init__(
        self,
        *,
        tree: HiRadixTree,
        config: CacheConfig,
        kv: KVSpec,
        state: StateSpec,
        device: torch.device,
        hierarchical: bool,
    ) -> None:
        self.tree = tree
        self.spec = state
        self.device_pool = StatePool.device(state, config.mamba_device_slots(kv, state), device)
        self.copier = make_state_copier(config.io_backend)
        self.host_pool: StatePool | None = None
        if hierarchical:
            self.host_pool = StatePool.host(
                state, config.mamba_host_slots(kv, state), config.mem_layout, device
            )

    def pool(self, tier: Tier) -> StatePool:
        if tier is Tier.DEVICE:
            return self.device_pool
        if self.host_pool is None:
            raise RuntimeError("no L2 snapshot pool without the hierarchical cache")
        return self.host_pool

    # ------------------------------------------------------------------ slots

    def alloc(self, tier: Tier, n: int) -> PageIds | None:
        """``n`` free slots of ``tier``, evicting unpinned snapshots first; None if even
        that cannot make room."""
        alloc = self.pool(tier).allocator
        if alloc.free_pages < n:
            for node in self.tree.component_eviction_order(SNAPSHOT, tier):
                alloc.free(self.tree.evict_component(SNAPSHOT, node, tier))
                if alloc.free_pages >= n:
                    break
        got = alloc.alloc(n)
        return None if got is None else page_ids(got)

    def free(self, tier: Tier, ids: PageIds) -> None:
        if len(ids):
            self.pool(tier).allocator.free(ids)

    def write(self, data: list[torch.Tensor]) -> int | None:
        """A new L1 slot holding ``data`` (canonical: one ``(1, L, *shape)`` tensor per
        state tensor); None when no slot can be had."""
        slots = self.alloc(Tier.DEVICE, 1)
        if slots is None:
            return None
        self.device_pool.write_slots(slots, data)
        return int(slots[0])

    def read(self, slot: int) -> list[torch.Tensor]:
        """The canonical tensors of L1 ``slot`` (copies)."""
        return self.device_pool.read_slots([slot])

    # ------------------------------------------------------------------ tiers

    def load(self, node: TreeNode) -> bool:
        """Bring the snapshot a hit at ``node`` needs to L1 (a copy of its L2 slot);
        False when L1 has no room (the caller must not use the hit)."""
        nodes = self.tree.component_load_nodes(SNAPSHOT, node)
        if not nodes:
            return True
        assert self.host_pool is not None
        for n in nodes:
            host = self.tree.component(SNAPSHOT).get(n, Tier.HOST)
            assert host is not None
            slots = self.alloc(Tier.DEVICE, len(host))
            if slots is None:
                return False
            self.copier.load(self.device_pool, self.host_pool, host, slots)
            self.tree.assign_component(SNAPSHOT, n, Tier.DEVICE, slots)
        return True

    def back_up(self, last: TreeNode) -> list[TreeNode]:
        """Copy the snapshot a hit at ``last`` needs to L2 (once its full KV has L2 pages);
        a full L2 snapshot pool leaves it L1-only (the node then is no L2 boundary).
        Returns the nodes that got an L2 snapshot."""
        done: list[TreeNode] = []
        if self.host_pool is None:
            return done
        for n in self.tree.component_backup_nodes(SNAPSHOT, last):
            dev = self.tree.component(SNAPSHOT).get(n, Tier.DEVICE)
            assert dev is not None
            slots = self.alloc(Tier.HOST, len(dev))
            if slots is None:
                break
            self.copier.backup(self.device_pool, self.host_pool, dev, slots)
            self.tree.assign_component(SNAPSHOT, n, Tier.HOST, slots)
            done.append(n)
        return done

    def host_ready(self) -> None:
        """Wait until every L1 -> L2 slot copy issued so far has landed (they may still be
        in flight on the current CUDA stream; on CPU they are done already). Call before
        another thread reads L2 slots (an L3 write)."""
        dev = self.device_pool.torch_device
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()

    def owned(self, tier: Tier) -> list[int]:
        """Every slot of ``tier`` the tree owns (for the ownership check)."""
        return self.tree.component_ids(SNAPSHOT, tier)
