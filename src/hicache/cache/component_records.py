"""L3 records of a tree component other than full KV: what the storage tier writes and reads.

The key spec (``docs/l3-keys.md``, version 2) stores a component's records under the same
chained keys as full-KV pages, in the namespace with ``component`` set to the component's
name: the record at page ``i`` commits to the whole prefix up to page ``i``. A component's
*codec* says, for the storage tier:

* which records a hit needs (:meth:`ComponentRecords.needed`): for a match of ``d`` pages,
  the 1-based page indices whose records must be present besides the full-KV pages;
* which records to write when a run of nodes reaches L2 (:meth:`ComponentRecords.writes`);
* where a record read from L3 goes (an L2 id of the component's pool) and how the tree
  adopts it (:meth:`ComponentRecords.adopt`).

Implemented for recurrent-state snapshots (:class:`SnapshotRecords`, component
``"mamba"``): a hit of ``d`` pages needs the one snapshot after page ``d``; its payload
is one L2 state slot. A sliding-window component would need the run of pages
``d - ceil(window / page_size) + 1 .. d`` of its namespace, read into its own L2 page
pool and adopted as the node path's SWA values, with the same prefetch flow.

:func:`agree_boundary` makes tensor-parallel ranks agree on the deepest boundary whose
records every rank has, with all-reduce(min) calls only (the same sequence on every rank).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from hicache.cache.snapshot_tier import SNAPSHOT, SnapshotTier
from hicache.tree import HiRadixTree, TreeNode
from hicache.tree.components import Tier
from hicache.tree.node import page_ids

__all__ = ["RecordWrite", "SnapshotRecords", "agree_boundary"]


def agree_boundary(rank_min: Callable[[int], int], present: Iterable[int], limit: int) -> int:
    """The deepest boundary ``b <= limit`` in every rank's ``present`` set, or 0.

    ``rank_min`` is the group's all-reduce(min). Each round proposes every rank's deepest
    candidate and takes the minimum, then checks that every rank has it; the loop's
    control depends on reduced values only, so every rank makes the same calls.
    """
    have = set(present)

    def deepest(upto: int) -> int:
        return max((b for b in have if b <= upto), default=0)

    cand = rank_min(deepest(limit))
    while cand > 0:
        if rank_min(int(cand in have)) == 1:
            return cand
        cand = rank_min(deepest(cand - 1))
    return 0


@dataclass(frozen=True, slots=True)
class RecordWrite:
    """One component record to write: ``node``'s L2 ``slot``, the state after
    ``depth_pages`` pages of its path."""

    node: TreeNode
    depth_pages: int
    slot: int


class SnapshotRecords:
    """The ``"mamba"`` component's L3 codec over one cache's snapshot tier."""

    name = SNAPSHOT

    def __init__(self, tree: HiRadixTree, snapshots: SnapshotTier) -> None:
        if snapshots.host_pool is None:
            raise ValueError("L3 snapshot records need the L2 snapshot pool")
        self.tree = tree
        self.snapshots = snapshots

    @staticmethod
    def needed(depth_pages: int) -> range:
        """Page indices (1-based) whose records a hit of ``depth_pages`` pages needs."""
        return range(depth_pages, depth_pages + 1)

    def writes(self, nodes: Sequence[TreeNode]) -> list[RecordWrite]:
        """The L2 snapshots held by ``nodes`` (one path, top-down), to write to L3."""
        out: list[RecordWrite] = []
        comp = self.tree.component(SNAPSHOT)
        for n in nodes:
            slot = comp.get(n, Tier.HOST)
            if slot is not None:
                out.append(RecordWrite(n, self.tree.depth_pages(n), int(slot[0])))
        if out:
            self.snapshots.host_ready()  # the L1 -> L2 slot copies have landed
        return out

    def alloc(self) -> int | None:
        """An L2 slot to read one record into (evicting unpinned L2 snapshots); None when
        none can be had."""
        got = self.snapshots.alloc(Tier.HOST, 1)
        return None if got is None else int(got[0])

    def free(self, slot: int) -> None:
        self.snapshots.free(Tier.HOST, page_ids([slot]))

    def adopt(self, node: TreeNode, depth_pages: int, slot: int) -> bool:
        """Make ``slot`` (read from L3) the L2 snapshot of ``node``, which must end after
        ``depth_pages`` pages and be in L2; False (the caller frees the slot) when it does
        not fit or the node has an L2 snapshot already."""
        if node.parent is None or node.host is None:
            return False
        if self.tree.depth_pages(node) != depth_pages:
            return False
        if self.tree.component(SNAPSHOT).get(node, Tier.HOST) is not None:
            return False
        self.tree.assign_component(SNAPSHOT, node, Tier.HOST, page_ids([slot]))
        return True
