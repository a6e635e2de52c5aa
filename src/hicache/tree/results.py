"""Named results of tree operations (no tuples, no sentinel values)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from hicache.tree.node import PageIds, TreeNode


class MatchStop(str, enum.Enum):
    """Why a prefix match stopped."""

    END_OF_KEY = "end_of_key"
    """Every whole page of the query matched (a partial last page is never matched)."""
    NO_CHILD = "no_child"
    """The next page of the query starts no child of the last matched node."""
    DIVERGED = "diverged"
    """The query diverged inside a node; the node was split at the last common page."""


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The cached prefix of a query, found by :meth:`HiRadixTree.match_prefix`.

    ``device_pages`` are the L1 page ids of the device-resident prefix, in token order;
    ``host_tokens`` more tokens follow it in L2 only, up to ``last_host_node``.
    ``last_host_node`` is the deepest matched node (``last_device_node`` when nothing is
    host-only; the root when nothing matched).
    """

    device_pages: PageIds
    last_device_node: TreeNode
    last_host_node: TreeNode
    device_tokens: int
    host_tokens: int
    stop: MatchStop
    limited_by: str | None = None
    """The component whose validator rejected the deepest node walked, when the match
    ends above it (a hybrid tree: e.g. ``"swa"`` with no window there, ``"mamba"`` with
    no snapshot); ``None`` when the match ends where the walk did."""

    @property
    def matched_tokens(self) -> int:
        """Tokens cached in L1 or L2."""
        return self.device_tokens + self.host_tokens


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What :meth:`HiRadixTree.insert` did with the caller's pages.

    ``duplicate_pages`` are caller pages the tree did not take because the tree already
    holds those tokens in other L1 pages: the caller must free them. ``adopted`` are nodes
    that were in L2 only and took the caller's pages as their L1 copy. ``new_node`` is the
    node created for the uncached tail, if any.
    """

    last_node: TreeNode
    cached_tokens: int
    duplicate_pages: PageIds
    adopted: list[TreeNode]
    new_node: TreeNode | None
    component_duplicates: dict[str, PageIds] = field(default_factory=dict)
    """Per extra component: the caller's L1 ids the tree did not take (it holds other
    ids for those values); the caller frees them. Absent: nothing to free."""


@dataclass(frozen=True, slots=True)
class TreeStats:
    """Counts over the whole tree, in pages."""

    nodes: int
    device_pages: int
    host_pages: int
    protected_device_pages: int

    @property
    def evictable_device_pages(self) -> int:
        return self.device_pages - self.protected_device_pages


@dataclass(frozen=True, slots=True)
class NodeEviction:
    """Ids freed by evicting one node's values from one tier: ``full`` pages and, per
    extra component that had a value there, its ids (the cascade)."""

    full: PageIds
    components: dict[str, PageIds]


@dataclass(frozen=True, slots=True)
class ComponentStats:
    """One component's values over the whole tree, in ids (pages, or state slots).

    ``protected_device`` are L1 ids pinned (``lock > 0``); ``tombstones`` are nodes whose
    full KV is in L1 while this component's value is not."""

    name: str
    device_ids: int
    host_ids: int
    protected_device: int
    tombstones: int
