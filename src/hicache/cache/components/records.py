"""L3 records of tree components other than full KV: one codec per component.

The key spec (``docs/l3-keys.md``) stores a component's records under the same chained
keys as full-KV pages, in the namespace with ``component`` set to its name: the record at
page ``i`` commits to the whole prefix up to page ``i``. A codec (:class:`ComponentRecords`)
says which 1-based pages a match of ``d`` pages needs (:meth:`~ComponentRecords.needed`;
met by a tree value, :meth:`~ComponentRecords.local_pages`, or an L3 record;
:attr:`~ComponentRecords.reach` bounds how far back a prefetch looks), what to write when
a run reaches L2 (:meth:`~ComponentRecords.writes`, and which nodes stay pinned in L2),
and where a read record goes (:attr:`~ComponentRecords.pool`, an L2 id) and how the tree
adopts it (:meth:`~ComponentRecords.adopt`). Snapshots (``"mamba"``): a hit of ``d`` pages
needs the snapshot after page ``d``; SWA (``"swa"``): pages
``max(1, d - ceil(window / page_size) + 1) .. d``. :func:`usable_boundaries` combines them;
:func:`agree_boundary` makes ranks agree on the deepest usable boundary with
all-reduce(min) only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from hicache.memory import HostPool
from hicache.memory.state_pool import StatePool
from hicache.metrics import CacheCounters
from hicache.tree import HiRadixTree, TreeNode
from hicache.tree.components import Granularity
from hicache.tree.node import PageIds

__all__ = [
    "ComponentRecords",
    "RecordWrites",
    "agree_boundary",
    "usable_boundaries",
]


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
class RecordWrites:
    """One component's records to write for a run: record ``pages[i]`` (1-based page
    index on the run's path; its key is that page's key in the component namespace) from
    L2 id ``ids[i]``. ``pins``: the nodes to pin in L2 (``inc_host_ref``) until the write's
    record arrives; that pin covers every id written (a node's pin covers what a hit there
    needs)."""

    pins: tuple[TreeNode, ...]
    pages: tuple[int, ...]
    ids: PageIds


class ComponentRecords(ABC):
    """One component's L3 codec over one cache's tree (see the module docstring)."""

    name: ClassVar[str]
    optional: ClassVar[bool] = False
    """Whether a hit needs none of this component's records (scoring entries): a
    prefetch then never waits for them or cuts its boundary by them, and reads those its
    lookup found among the pages it reads."""

    whole: ClassVar[bool] = False
    """Whether a record is one per key whatever the rank's K/V head split (its payload
    does not follow the KV's heads, as a state slot's or a scoring entry page's): under
    ``records="head"`` it is keyed per rank (:meth:`~hicache.keys.Namespace.for_slots`)
    and never split per head. State-slot components are whole by their pool."""

    def __init__(self, tree: HiRadixTree, reach: int) -> None:
        self.tree = tree
        self.reach = reach
        """Pages before a boundary ``d`` that :meth:`needed` may name, less one: a fetch
        past page ``s`` needs values of pages ``> s - reach`` only (0: the boundary's own
        page, a snapshot; ``ceil(window / page_size) - 1`` for a sliding window)."""

    @property
    @abstractmethod
    def pool(self) -> HostPool | StatePool:
        """The component's L2 pool (records are read into and written from it)."""

    @abstractmethod
    def needed(self, depth_pages: int) -> range:
        """Page indices (1-based) whose values a hit of ``depth_pages`` pages needs."""

    @abstractmethod
    def writes(self, nodes: Sequence[TreeNode]) -> RecordWrites | None:
        """The records to write when the run ``nodes`` (one path, top-down, in L2) is
        written to L3: the values this component holds in L2 that a hit needs there;
        None when there is none."""

    @abstractmethod
    def alloc(self, n: int) -> PageIds | None:
        """``n`` L2 ids to read records into (evicting unpinned L2 values); None when
        they cannot be had."""

    def alloc_read(
        self, pages: Sequence[int], start_page: int, host_pages: PageIds
    ) -> PageIds | None:
        """L2 ids to read the records of ``pages`` into, for a prefetch that reads the
        full KV of pages ``start_page + 1 ..`` into the L2 pages ``host_pages`` (empty: a
        read of records alone); None when they cannot be had. Default: ``len(pages)``
        fresh ids (:meth:`alloc`); a component on the full KV's page ids (the DSA indexer)
        takes those pages."""
        return self.alloc(len(pages))

    @abstractmethod
    def free(self, ids: PageIds) -> None:
        """Return L2 ids (read into, not adopted) to the pool."""

    @abstractmethod
    def adopt(
        self, last: TreeNode, depth_pages: int, pages: Sequence[int], ids: PageIds
    ) -> PageIds:
        """Make ``ids`` (read from L3: the records of ``pages``) the L2 values of the nodes
        that hold those pages on the path to ``last``, which must end after
        ``depth_pages`` pages and be in L2. Returns the ids not adopted (the caller frees
        them): a page whose node has an L2 value already, or no L2 full KV."""

    @abstractmethod
    def count_written(self, counters: CacheCounters, written: int, failed: int) -> None:
        """Count a finished write of this component's records."""

    def host_ready(self) -> None:  # noqa: B027 - nothing to wait for by default
        """Wait until every L1 -> L2 copy of this component issued so far has landed
        (before another thread reads its L2 ids)."""

    def local_pages(
        self, node: TreeNode, depth_pages: int, first: int | None = None
    ) -> frozenset[int]:
        """The pages in ``[first, depth_pages]`` (default ``first``: ``depth_pages -
        reach + 1``) of the path to ``node`` (which ends after ``depth_pages`` pages)
        whose value the tree holds in some tier (a boundary component: the page a node's
        snapshot follows)."""
        comp = self.tree.component(self.name)
        lo = depth_pages - self.reach if first is None else first - 1
        out: set[int] = set()
        end = depth_pages
        n = node
        while n.parent is not None and end > lo:
            k = self.tree.num_pages(n)
            if comp.present(n, device_only=False):
                if comp.granularity is Granularity.PAGE:
                    out.update(range(max(end - k, lo) + 1, end + 1))
                else:
                    out.add(end)
            end -= k
            n = n.parent
        return frozenset(out)

    def usable(self, depth_pages: int, local: Collection[int], found: Collection[int]) -> bool:
        """Whether every value a hit of ``depth_pages`` pages needs is held or found."""
        return all(j in local or j in found for j in self.needed(depth_pages))

    def reads(self, depth_pages: int, local: Collection[int]) -> list[int]:
        """The records to read for a hit of ``depth_pages`` pages (needed, not held)."""
        return [j for j in self.needed(depth_pages) if j not in local]


def usable_boundaries(
    codecs: Sequence[ComponentRecords],
    start: int,
    end: int,
    local: Mapping[str, Collection[int]],
    found: Mapping[str, Collection[int]],
) -> list[int]:
    """The boundaries ``d`` in ``(start, end]`` every component can serve, ascending."""
    return [
        d
        for d in range(start + 1, end + 1)
        if all(c.usable(d, local.get(c.name, ()), found.get(c.name, ())) for c in codecs)
    ]
