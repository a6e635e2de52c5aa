"""The component contract: what one kind of per-token state keeps in the tree, and its rules.

Each kind of state (full KV, sliding-window KV, recurrent-state snapshots, indexer keys) is
a stateless :class:`TreeComponent` (one per tree); the tree calls the same methods on every
component, and per-node values live on the nodes. Shapes: per node and tier (L1, L2) a
component holds a :data:`~hicache.tree.node.PageIds` array into its own pool or nothing:
one id per page for :attr:`Granularity.PAGE`, one state slot (the state at the span's end)
for :attr:`Granularity.BOUNDARY`; the full component's values are ``node.device`` /
``node.host``, the others a :class:`ComponentData` in ``node.extra[name]``. Invariants
(:meth:`TreeComponent.check`): a node lives while its full KV is in some tier, and a
component value is present in a tier only where the full value is (evicting full KV
cascades); a match ends only where every validator (stateful over one top-down walk)
accepts, counting both tiers or, with ``device_only``, L1 alone; an extra component pins
its :meth:`TreeComponent.hit_span` in its own counters and is evictable on its own only
while that counter is 0. The rules argued: ``docs/architecture.md``, "Hybrid models".
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from hicache.tree.node import PageIds, TreeNode, as_page_ids

__all__ = [
    "ComponentData",
    "ComponentValues",
    "Granularity",
    "MatchValidator",
    "PathAccess",
    "Span",
    "Tier",
    "TreeComponent",
]


class Tier(str, enum.Enum):
    """Where a value lives: ``device`` (L1, accelerator) or ``host`` (L2, RAM)."""

    DEVICE = "device"
    HOST = "host"


class Granularity(str, enum.Enum):
    """What one id of a component value stands for."""

    PAGE = "page"
    """One id per page of the node's span (full and sliding-window KV)."""
    BOUNDARY = "boundary"
    """One id for the state at the end of the node's span (Mamba / linear attention)."""


MatchValidator = Callable[[TreeNode], bool]
"""Called on each node of one walk, top-down: may a match end at the end of this node?
Stateful (one per walk): it must be called on every node walked, in order."""


class ComponentData:
    """One extra component's value on one node (``node.extra[name]``).

    Attributes:
        device: ids into the component's L1 pool, or ``None`` (not in L1: a tombstone
            when the full KV is still there).
        host: ids into the component's L2 pool, or ``None``.
        lock: L1 pins by requests and in-flight copies (>= 0); not evictable while > 0.
        host_lock: L2 pins (>= 0); the L2 value is not evictable while > 0.
        last_access: the tree's logical clock when a hit last needed this value (the
            component's own LRU; not the node's ``last_access``).
    """

    __slots__ = ("device", "host", "host_lock", "last_access", "lock")

    def __init__(self, last_access: int = 0) -> None:
        self.device: PageIds | None = None
        self.host: PageIds | None = None
        self.lock = 0
        self.host_lock = 0
        self.last_access = last_access

    @property
    def empty(self) -> bool:
        """No value in any tier and no pin: the entry can be dropped."""
        return self.device is None and self.host is None and self.lock == 0 and not self.host_lock

    def __repr__(self) -> str:
        dev = None if self.device is None else list(self.device)
        host = None if self.host is None else list(self.host)
        return f"ComponentData(device={dev}, host={host}, lock={self.lock}, host_lock={self.host_lock})"


@dataclass(frozen=True, slots=True)
class Span:
    """Ids a caller hands to the tree for token pages ``[start_page, end_page)``.

    A :attr:`Granularity.PAGE` component takes one id per page (``len(ids) ==
    end_page - start_page``). A :attr:`Granularity.BOUNDARY` component takes one id for the
    state after page ``end_page - 1`` and uses ``start_page == end_page`` (a point).
    """

    start_page: int
    end_page: int
    ids: PageIds


@dataclass(frozen=True, slots=True)
class ComponentValues:
    """One component's L1 ids for :meth:`~hicache.tree.radix.HiRadixTree.insert`."""

    spans: tuple[Span, ...] = field(default=())

    @classmethod
    def pages(cls, start_page: int, ids: Sequence[int] | PageIds) -> ComponentValues:
        """Per-page ids for pages ``[start_page, start_page + len(ids))`` (sliding window:
        ``start_page`` is the first page whose KV the request still holds)."""
        arr = as_page_ids(ids)[:]
        return cls((Span(start_page, start_page + len(arr), arr),))

    @classmethod
    def snapshots(cls, slots: dict[int, int]) -> ComponentValues:
        """State slots by the page count they follow: ``{end_page: slot}`` (Mamba: a
        snapshot taken after ``end_page`` pages of tokens)."""
        return cls(tuple(Span(p, p, as_page_ids([s])[:]) for p, s in sorted(slots.items())))


class PathAccess(Protocol):
    """What a component may ask of the tree (:class:`hicache.tree.paths.Paths` implements
    it)."""

    page_size: int

    def num_pages(self, node: TreeNode) -> int: ...

    def depth_pages(self, node: TreeNode) -> int: ...

    def path_tail(self, node: TreeNode, num_pages: int) -> list[TreeNode]: ...

    def ensure_boundary(self, node: TreeNode, pages_back: int) -> None: ...


class TreeComponent(ABC):
    """Rules for one component's per-node values. Stateless; one instance per tree.

    Subclasses set :attr:`name` and :attr:`granularity` and implement the abstract
    methods; the defaults here serve extra components kept in ``node.extra``.
    """

    name: ClassVar[str]
    optional: ClassVar[bool] = False
    """Whether a match never depends on this component (its validator accepts every
    node): the tree's match then leaves it out (scoring entries)."""
    granularity: ClassVar[Granularity] = Granularity.PAGE
    base: ClassVar[bool] = False
    """True only for the full component, whose presence is the node's lifecycle."""

    # -- node data ---------------------------------------------------------------------
    def ids_for(self, num_pages: int) -> int:
        """Ids a value holds on a node of ``num_pages`` pages."""
        return num_pages if self.granularity is Granularity.PAGE else 1

    def data(self, node: TreeNode) -> ComponentData | None:
        """The node's :class:`ComponentData`, or ``None``."""
        return node.extra.get(self.name) if node.extra else None

    def data_for(self, node: TreeNode) -> ComponentData:
        """The node's :class:`ComponentData`, created if missing."""
        if node.extra is None:
            node.extra = {}
        d = node.extra.get(self.name)
        if d is None:
            d = node.extra[self.name] = ComponentData()
        assert isinstance(d, ComponentData)
        return d

    def prune(self, node: TreeNode) -> None:
        """Drop the node's entry when it holds nothing (fewer objects to keep)."""
        d = self.data(node)
        if d is not None and d.empty and node.extra is not None:
            del node.extra[self.name]
            if not node.extra:
                node.extra = None

    def get(self, node: TreeNode, tier: Tier) -> PageIds | None:
        """The node's value in ``tier``, or ``None``."""
        d = self.data(node)
        if d is None:
            return None
        return d.device if tier is Tier.DEVICE else d.host

    def set(self, node: TreeNode, tier: Tier, ids: PageIds | None) -> None:
        """Set (or clear with ``None``) the node's value in ``tier``; no checks."""
        if ids is None and self.data(node) is None:
            return
        d = self.data_for(node)
        if tier is Tier.DEVICE:
            d.device = ids
        else:
            d.host = ids
        if ids is None:
            self.prune(node)

    def present(self, node: TreeNode, *, device_only: bool) -> bool:
        """Whether the node has a value in L1 (or, unless ``device_only``, in L2)."""
        if self.get(node, Tier.DEVICE) is not None:
            return True
        return not device_only and self.get(node, Tier.HOST) is not None

    # -- match -------------------------------------------------------------------------
    @abstractmethod
    def validator(self, *, device_only: bool) -> MatchValidator:
        """A fresh validator for one walk from a root (see the module docstring)."""

    @abstractmethod
    def hit_span(self, depth_pages: int, page_size: int) -> int:
        """Pages back from the end of a boundary node whose values a hit there needs.

        ``depth_pages``: pages from the root to the boundary's end. 0 means only the
        boundary node itself (a :attr:`Granularity.BOUNDARY` component). A function of
        the depth only (splits never change a node's depth), so a pin and its release
        walk the same span.
        """

    def hit_nodes(self, tree: PathAccess, node: TreeNode) -> list[TreeNode]:
        """The nodes whose values a hit ending at ``node`` needs, top-down.

        May split a node so that the span starts on a node boundary (every invariant
        holds across a split)."""
        if node.parent is None:
            return []
        span = self.hit_span(tree.depth_pages(node), tree.page_size)
        if span == 0:
            return [node]
        tree.ensure_boundary(node, span)
        return tree.path_tail(node, span)

    def touch(self, tree: PathAccess, node: TreeNode, tick: int) -> None:
        """A hit ended at ``node`` at time ``tick``: refresh the component's own LRU on
        what the hit needs (read-only walk; never splits)."""
        if node.parent is None:
            return
        span = self.hit_span(tree.depth_pages(node), tree.page_size)
        n: TreeNode | None = node
        covered = 0
        while n is not None and n.parent is not None:
            d = self.data(n)
            if d is not None:
                d.last_access = tick
            covered += tree.num_pages(n)
            if covered >= span:
                break
            n = n.parent

    # -- split -------------------------------------------------------------------------
    def split(self, head: TreeNode, child: TreeNode, at_page: int, num_pages: int) -> None:
        """``child`` (``num_pages`` pages) was cut after ``at_page`` pages into ``head``
        (the new parent, pages ``[0, at_page)``) and ``child`` (the rest): move values.

        PAGE values are sliced; pins and the access time are copied to both halves.
        BOUNDARY values stay on ``child`` (its end is the state's position); ``head``
        gets nothing."""
        d = self.data(child)
        if d is None or self.granularity is Granularity.BOUNDARY:
            return
        h = self.data_for(head)
        h.lock, h.host_lock, h.last_access = d.lock, d.host_lock, d.last_access
        if d.device is not None:
            h.device, d.device = d.device[:at_page], d.device[at_page:]
        if d.host is not None:
            h.host, d.host = d.host[:at_page], d.host[at_page:]

    # -- pins --------------------------------------------------------------------------
    def pin(self, tree: PathAccess, node: TreeNode, tier: Tier, delta: int) -> None:
        """Add ``delta`` (+1 or -1) to the ``tier`` pins of what a hit at ``node`` needs.

        Raises RuntimeError (and changes nothing) when a count would go negative."""
        nodes = self.hit_nodes(tree, node)
        attr = "lock" if tier is Tier.DEVICE else "host_lock"
        if delta < 0:
            for n in nodes:
                d = self.data(n)
                if d is None or getattr(d, attr) + delta < 0:
                    raise RuntimeError(f"{self.name} {attr} underflow at {n!r}")
        for n in nodes:
            d = self.data_for(n)
            setattr(d, attr, getattr(d, attr) + delta)
            self.prune(n)

    def pinned(self, node: TreeNode, tier: Tier) -> bool:
        d = self.data(node)
        if d is None:
            return False
        return (d.lock if tier is Tier.DEVICE else d.host_lock) > 0

    # -- eviction ----------------------------------------------------------------------
    def evictable(self, node: TreeNode, tier: Tier) -> bool:
        """Whether the component's own eviction may drop the ``tier`` value now: it is
        there and unpinned (an L2 value also needs no L1 pin: an in-flight backup)."""
        d = self.data(node)
        if d is None or node.parent is None:
            return False
        if tier is Tier.DEVICE:
            return d.device is not None and d.lock == 0
        return d.host is not None and d.host_lock == 0 and d.lock == 0

    def eviction_key(self, node: TreeNode) -> tuple[int, ...]:
        """Own-LRU order: least recently needed by a hit first, then the older node."""
        d = self.data(node)
        return (d.last_access if d is not None else 0, node.id)

    def take(self, node: TreeNode, tier: Tier) -> PageIds:
        """Remove and return the ``tier`` value (empty if none); no pin checks."""
        ids = self.get(node, tier)
        self.set(node, tier, None)
        return ids if ids is not None else as_page_ids(())[:]

    # -- integrity ---------------------------------------------------------------------
    def check(self, node: TreeNode, num_pages: int) -> None:
        """Raise AssertionError if the node's values break the contract: wrong length, a
        value in a tier where the full KV is not, a negative pin, or a pin with no base
        pin under it."""
        d = self.data(node)
        if d is None:
            return
        want = self.ids_for(num_pages)
        for tier, ids, full in (
            (Tier.DEVICE, d.device, node.device),
            (Tier.HOST, d.host, node.host),
        ):
            if ids is None:
                continue
            assert len(ids) == want, (
                f"{self.name} {tier.value} value of {node!r}: {len(ids)} ids, want {want}"
            )
            assert full is not None, (
                f"{self.name} {tier.value} value on {node!r} without full KV there"
            )
        assert d.lock >= 0 and d.host_lock >= 0, f"{self.name}: negative pin on {node!r}"
        assert d.lock == 0 or node.lock_ref > 0, f"{self.name} lock on {node!r} without lock_ref"
        assert d.host_lock == 0 or node.host_ref > 0, (
            f"{self.name} host_lock on {node!r} without host_ref"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
