"""What L3 writes ahead of eviction take: the ``watermark`` policy's choice, and the runs
of a path not in L3 yet (the write-now primitive, :meth:`Writes.write_path`).

Both read the tree only (agreed state: the same on every rank, no clock) and the writes
in flight (:class:`InFlight`, the same on every rank too: every rank tracks every write).
A span is *clean* when L3 holds it (``stored``) or a write of it is in flight; the others
are written as runs: top-down nodes of one path, each run one write op (its keys chain
along the path). :func:`ahead_runs`: once the tree's L2 pages pass the high mark by
``excess`` pages, the ``excess`` coldest L2-only pages (in the order L2 eviction would
take them, :meth:`~hicache.tree.HiRadixTree.host_eviction_forecast`) are made clean, so
that what eviction takes next is in L3 already and eviction never waits on a write.
Pure: no torch, no threads, no IO.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from hicache.tree import HiRadixTree, TreeNode

__all__ = ["InFlight", "ahead_runs", "path_runs"]


@dataclass(frozen=True, slots=True)
class InFlight:
    """The L3 writes in flight as the tree sees them: ``nodes``, the ids (``id(node)``) of
    the spans whose full KV is being written; ``pins``, the L2 pins (``host_ref``) the
    writes hold, by node id (they end when the writes land)."""

    nodes: frozenset[int] = frozenset()
    pins: Mapping[int, int] = field(default_factory=dict)


def ahead_runs(tree: HiRadixTree, mark: int, writing: InFlight) -> list[list[TreeNode]]:
    """The runs to write now so that the coldest ``excess`` L2-only pages are clean, where
    ``excess`` is how far the tree's L2 pages pass ``mark`` (none at or below it): those
    pages' spans in L2 eviction order (forecast), less the clean ones, as runs."""
    excess = tree.stats().host_pages - mark
    chosen: list[TreeNode] = []
    seen = 0
    if excess > 0:
        for n in tree.host_eviction_forecast(writing.pins):
            if seen >= excess:
                break
            seen += tree.num_pages(n)
            if not n.stored and id(n) not in writing.nodes:
                chosen.append(n)
    return _runs(chosen)


def path_runs(
    tree: HiRadixTree, node: TreeNode, writing: InFlight
) -> tuple[list[list[TreeNode]], bool]:
    """The runs of the path to ``node`` that are in L2 and not clean, top-down, and
    whether the rest of the path is clean (False: a span on it is in L1 alone, which no
    write from L2 can take)."""
    path: list[TreeNode] = []
    n: TreeNode | None = node
    while n is not None and n.parent is not None:
        path.append(n)
        n = n.parent
    path.reverse()
    runs: list[list[TreeNode]] = []
    run: list[TreeNode] = []
    whole = True
    for n in path:
        if not n.stored and id(n) not in writing.nodes and n.host is not None:
            run.append(n)
            continue
        whole = whole and (n.stored or id(n) in writing.nodes)
        if run:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    return runs, whole


def _runs(chosen: Iterable[TreeNode]) -> list[list[TreeNode]]:
    """``chosen`` (children before parents, as eviction takes them) cut into runs: from
    each node not in a run yet, up through its parents while they are chosen and not in
    a run; each run top-down, in the order of its deepest node."""
    nodes = list(chosen)
    left = {id(n) for n in nodes}
    runs: list[list[TreeNode]] = []
    for n in nodes:
        if id(n) not in left:
            continue
        run: list[TreeNode] = []
        x: TreeNode | None = n
        while x is not None and id(x) in left:
            left.discard(id(x))
            run.append(x)
            x = x.parent
        run.reverse()
        runs.append(run)
    return runs
