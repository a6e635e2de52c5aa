"""HiRadixTree: one radix tree recording which tier (L1 device, L2 host) holds each page.

Metadata only (page ids into the device and host pools, pins, access statistics): it never
allocates, copies or frees memory; the owner (the cache facade) does and tells the tree.
Pure Python: no torch, no threads, no IO. Invariants (:meth:`HiRadixTree.check_integrity`):
every non-root node spans a whole, non-zero number of pages, sits in its parent's
``children`` under the bytes of its first page, and is held by at least one tier;
contiguity: a node has a device (host) copy only if its parent has one, so along a path
the device-resident part is a prefix, then a host-only part, then nothing; ``lock_ref`` and
``host_ref`` are path-wise pins (a node's count >= the sum of its children's); every page id
is owned by one node only. Extra components (:mod:`hicache.tree.components`) keep their
values in ``node.extra``: a match ends only where every validator accepts, a split moves
every component's values, evicting a node's full KV from a tier drops its extras there,
and each extra component is evicted under its own budget. The class is a facade over parts
sharing one :class:`~hicache.tree.store.NodeStore` (``docs/architecture.md``, Modules).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from hicache.config import EvictionPolicy
from hicache.tokens import TOKEN_BYTES, TokenIds
from hicache.tree.components import ComponentValues, FullComponent, Tier, TreeComponent
from hicache.tree.eviction import Eviction, eviction_key
from hicache.tree.extras import ExtraComponents
from hicache.tree.insert import Inserter
from hicache.tree.integrity import check_tree
from hicache.tree.match import Matcher
from hicache.tree.node import PageIds, TreeNode
from hicache.tree.paths import Paths
from hicache.tree.pins import Pins
from hicache.tree.residency import ResidencyObserver
from hicache.tree.results import ComponentStats, InsertResult, MatchResult, NodeEviction, TreeStats
from hicache.tree.store import NodeStore
from hicache.validate import int_at_least

__all__ = ["HiRadixTree"]


def _extra_components(components: Sequence[TreeComponent]) -> tuple[TreeComponent, ...]:
    """``components`` as the tree's extras (ValueError unless each is an extra
    :class:`TreeComponent` with a name of its own, not ``"full"``)."""
    extras = tuple(components)
    names = [c.name for c in extras]
    for c in extras:
        if not isinstance(c, TreeComponent) or c.base:
            raise ValueError(f"components: {c!r} is not an extra TreeComponent")
    if len(set(names)) != len(names) or FullComponent.name in names:
        raise ValueError(f"components: names {names} must be unique and not 'full'")
    return extras


class HiRadixTree:
    """The radix tree over L1 and L2 page ids; see the module docstring for invariants.

    Args:
        page_size: tokens per page; keys are matched and stored in whole pages.
        eviction_policy: order of :meth:`device_eviction_order` and
            :meth:`host_eviction_order`.
        components: extra per-node components (full attention is always present and
            must not be listed); names must be unique.
    """

    def __init__(
        self,
        page_size: int,
        eviction_policy: EvictionPolicy | str = EvictionPolicy.LRU,
        components: Sequence[TreeComponent] = (),
    ) -> None:
        int_at_least("page_size", page_size, 1)
        self.page_size = page_size
        self.eviction_policy = EvictionPolicy(eviction_policy)
        self._extra = _extra_components(components)
        self._required = tuple(c for c in self._extra if not c.optional)
        """The extra components a match depends on (an optional one's validator accepts
        every node)."""
        self._components: tuple[TreeComponent, ...] = (FullComponent(), *self._extra)
        store = self._store = NodeStore(page_size, self._components)
        paths = self._paths = Paths(store)
        self._matcher = Matcher(store, paths)
        self._extras = ExtraComponents(store, paths, self._extra)
        self._inserter = Inserter(store, self._matcher, self._extras)
        self._pins = Pins(store, paths, self._extra)
        self._eviction = Eviction(store, self._extra, eviction_key(self.eviction_policy))

    @property
    def components(self) -> tuple[TreeComponent, ...]:
        """Every component: the full one first, then the extras."""
        return self._components

    # ------------------------------------------------------------------ roots and tenants

    def reset(self) -> None:
        """Drop every node. The owner frees the pages it had handed to the tree."""
        self._store.reset()

    def observe_residency(self, observer: ResidencyObserver | None) -> None:
        """Tell ``observer`` of every change of a node's residency from now on (see
        :mod:`hicache.tree.residency`); ``None`` stops. Called in the owner's thread."""
        self._store.observer = observer

    @property
    def root(self) -> TreeNode:
        """The shared root (tenant ``""``)."""
        return self._store.root

    def root_of(self, tenant: str = "") -> TreeNode:
        """The root of ``tenant``'s subtree (created on first use); ``""`` is the shared one.

        A tenant's root lives only while it has children: the calls of this class that
        may leave it empty (a match or an insert that stored nothing, the eviction of its
        last node) drop it again, so the tree's state per tenant is bounded by what it
        caches. Raises TypeError for a ``tenant`` that is not a ``str``.
        """
        return self._store.root_of(tenant)

    @property
    def roots(self) -> list[TreeNode]:
        """The shared root, then each tenant's (every tenant root has children)."""
        return self._store.roots

    @property
    def tenants(self) -> list[str]:
        """The tenants (cache salts) with something cached, in order of first use."""
        return list(self._store.tenant_roots)

    def has_tenant(self, tenant: str) -> bool:
        """Whether ``tenant`` (``""``: shared, always true) has a root in the tree."""
        return not tenant or tenant in self._store.tenant_roots

    def prune_tenant(self, tenant: str) -> bool:
        """Drop ``tenant``'s root if it has no children; return whether it is gone now.

        Normally automatic (see :meth:`root_of`); the shared root is never dropped.
        """
        root = self._store.tenant_roots.get(tenant)
        if root is not None:
            self._store.drop_if_empty_root(root)
        return tenant not in self._store.tenant_roots

    def num_pages(self, node: TreeNode) -> int:
        """Pages of ``node``'s span (0 for a root)."""
        return self._store.num_pages(node)

    def num_tokens(self, node: TreeNode) -> int:
        """Tokens of ``node``'s span (0 for a root)."""
        return len(node.key) // TOKEN_BYTES

    # ------------------------------------------------------------------ match / insert

    def match_prefix(self, tokens: TokenIds, tenant: str = "") -> MatchResult:
        """Find the longest cached prefix of ``tokens`` in whole pages; copies no data.

        Splits a node when the match ends inside it, so the result ends on a node boundary.
        Marks every matched node as accessed (for LRU). Only ``tenant``'s spans match.
        With extra components the match ends at the deepest node every component accepts
        (in L1 or L2; the L1 part at the deepest node accepted with L1 values only).
        """
        return self._matcher.match(tokens, tenant, self._required)

    def match_full(self, tokens: TokenIds, tenant: str = "") -> MatchResult:
        """The longest prefix of ``tokens`` whose full KV the tree holds, in any tier,
        whatever the other components' validators say (so not necessarily a valid match
        boundary): where an L3 fetch of the pages that follow starts. Splits and marks
        like :meth:`match_prefix`; equal to it in a tree of full KV only."""
        return self._matcher.match(tokens, tenant, ())

    def within(self, tokens: TokenIds, tenant: str = "") -> TreeNode | None:
        """The deepest node whose path is a prefix of ``tokens``' whole pages, without
        splitting or touching anything (None: nothing cached); see :meth:`Matcher.within`."""
        return self._matcher.within(self._store.page_key(tokens), tenant)

    def insert(
        self,
        tokens: TokenIds,
        device_pages: Sequence[int] | PageIds,
        *,
        priority: int = 0,
        tenant: str = "",
        components: Mapping[str, ComponentValues] | None = None,
    ) -> InsertResult:
        """Record that ``tokens`` (whole pages; a partial tail is ignored) have KV in the
        L1 pages ``device_pages`` (one per whole page).

        ``components``: L1 ids of extra components by name (sliding window: the pages
        the request still holds, from its first page in the window; Mamba: snapshot slots
        by page count). Each value goes to the node its span covers (nodes are split so
        spans start and end on boundaries); a node that has a value already keeps it and
        the caller's differing ids come back in ``component_duplicates``; nodes outside
        every span keep what they have (a sliding-window tombstone stays one).

        Spans already in L1 keep their pages (the caller's different pages come back as
        ``duplicate_pages``); spans held only in L2 adopt the caller's pages; the uncached
        tail becomes a new leaf. A new node starts with one hit; existing nodes count no
        hit here (a request reuses a span once, counted by :meth:`count_hit`).

        ``priority`` (an int; higher stays longer under the ``priority`` eviction policy):
        the new leaf gets it, and every existing span passed is raised to it if lower, so
        a span's priority is the max over the requests that inserted or reused it.
        """
        return self._inserter.insert(tokens, device_pages, priority, tenant, components)

    def insert_host(
        self,
        tokens: TokenIds,
        host_pages: PageIds,
        start_page: int,
        tenant: str = "",
        *,
        priority: int = 0,
    ) -> InsertResult:
        """Record L2 copies (fetched from L3) of pages ``start_page ..`` of ``tokens``.

        Pages before ``start_page`` must be cached already. Spans that are cached by now keep
        their pages (the caller's come back in ``duplicate_pages``); the rest becomes one
        L2-only leaf, only if its parent is in L2 (contiguity), else all are returned.
        ``priority`` is the new leaf's and raises the spans passed, as in :meth:`insert`.
        """
        return self._inserter.insert_host(tokens, host_pages, start_page, tenant, priority)

    def count_hit(self, node: TreeNode) -> None:
        """One more request reused the path to ``node``: add a hit to it and each
        ancestor (``write_through_selective`` and ``lfu`` read the counts)."""
        self._paths.count_hit(node)

    # ------------------------------------------------------------------ paths

    def nodes_to_back_up(self, node: TreeNode, *, min_hits: int = 0) -> list[TreeNode]:
        """Nodes on the path to ``node`` without an L2 copy, top-down, that may be backed up
        now: the run just below the backed-up prefix whose hit counts reach ``min_hits``."""
        return self._paths.nodes_to_back_up(node, min_hits=min_hits)

    def host_only_path(self, node: TreeNode) -> list[TreeNode]:
        """The L1-evicted nodes on the path to ``node``, top-down (what a load back copies)."""
        return self._paths.host_only_path(node)

    def path_tail(self, node: TreeNode, num_pages: int) -> list[TreeNode]:
        """The nodes holding the last ``num_pages`` pages of the path to ``node``, top-down
        (``num_pages`` must end on a node boundary)."""
        return self._paths.path_tail(node, num_pages)

    def mark_stored(self, node: TreeNode, num_pages: int) -> int:
        """Mark the nodes wholly inside the last ``num_pages`` pages of the path to
        ``node`` as in L3; returns the pages marked."""
        return self._paths.mark_stored(node, num_pages)

    def clear_stored(self) -> None:
        """Forget every L3 mark (the tier they refer to is gone)."""
        for node in self._store.iter_nodes():
            node.stored = False

    def path_key(self, node: TreeNode) -> bytes:
        """The encoded tokens from the root to the end of ``node``."""
        return self._paths.path_key(node)

    def depth_pages(self, node: TreeNode) -> int:
        """Pages from the root to the end of ``node`` (0 for a root)."""
        return self._paths.depth_pages(node)

    def ensure_boundary(self, node: TreeNode, pages_back: int) -> None:
        """Split the path so that a node boundary lies ``pages_back`` pages above the end
        of ``node`` (nothing to do on a boundary, at or beyond the root)."""
        self._paths.ensure_boundary(node, pages_back)

    # ------------------------------------------------------------------ pins

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors in L1 (and each extra component's hit span)."""
        self._pins.inc_lock_ref(node)

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one :meth:`inc_lock_ref`; raises before changing anything on underflow."""
        self._pins.dec_lock_ref(node)

    def inc_host_ref(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors in L2 (and each extra component's hit span)."""
        self._pins.inc_host_ref(node)

    def dec_host_ref(self, node: TreeNode) -> None:
        """Undo one :meth:`inc_host_ref`; raises before changing anything on underflow."""
        self._pins.dec_host_ref(node)

    # ------------------------------------------------------------------ full-KV tiers

    def assign_device(self, node: TreeNode, pages: PageIds) -> None:
        """Give an L1-evicted node its L1 pages (after a load back or a recompute)."""
        self._store.assign_device(node, pages)

    def assign_host(self, node: TreeNode, pages: PageIds) -> None:
        """Give a node its L2 pages (a backup was issued for it)."""
        self._store.assign_host(node, pages)

    def device_eviction_order(self) -> Iterator[TreeNode]:
        """Unpinned L1 leaves (no child in L1) in policy order, lazily; evict each yielded
        node (or skip it) before asking for the next. See :class:`Eviction`."""
        return self._eviction.device_eviction_order()

    def host_eviction_order(self) -> Iterator[TreeNode]:
        """Unpinned L2-only leaves in policy order, lazily."""
        return self._eviction.host_eviction_order()

    def stored_host_eviction_order(self) -> Iterator[TreeNode]:
        """Unpinned L2-only leaves whose pages are in L3 (``stored``), in policy order,
        lazily."""
        return self._eviction.stored_host_eviction_order()

    def host_eviction_forecast(self, released: Mapping[int, int]) -> Iterator[TreeNode]:
        """The L2-only nodes in the order L2 eviction would take them, disregarding the
        host pins in ``released`` (by ``id(node)``), lazily; evicts nothing. See
        :meth:`Eviction.host_eviction_forecast`."""
        return self._eviction.host_eviction_forecast(released)

    def host_copy_eviction_order(self) -> Iterator[TreeNode]:
        """Unpinned spans in L1 and L2 whose children have no L2 copy, in policy order,
        lazily (their L2 copy can go: :meth:`drop_node_host`)."""
        return self._eviction.host_copy_eviction_order()

    def evict_device(self, node: TreeNode) -> PageIds:
        """Drop ``node``'s L1 copy; return its L1 pages (RuntimeError if an extra component
        has an L1 value there: use :meth:`evict_node_device`)."""
        return self._eviction.evict_device(node)

    def evict_node_device(self, node: TreeNode) -> NodeEviction:
        """Drop ``node``'s L1 copy with every extra component's L1 value (cascade)."""
        return self._eviction.evict_node_device(node)

    def unmap_device(self, node: TreeNode) -> NodeEviction:
        """Take ``node``'s L1 copy out of the tree even while pinned (a load into its pages
        failed: they do not hold the span's KV); see :meth:`Eviction.unmap_device`."""
        return self._eviction.unmap_device(node)

    def evict_host(self, node: TreeNode) -> PageIds:
        """Remove an unpinned L2-only leaf; return its L2 pages (RuntimeError if an extra
        component has an L2 value there: use :meth:`evict_node_host`)."""
        return self._eviction.evict_host(node)

    def evict_node_host(self, node: TreeNode) -> NodeEviction:
        """Remove an unpinned L2-only leaf with every extra component's L2 value."""
        return self._eviction.evict_node_host(node)

    def drop_node_host(self, node: TreeNode) -> NodeEviction:
        """Forget ``node``'s L2 copy (every component's) while it stays in L1."""
        return self._eviction.drop_node_host(node)

    # ------------------------------------------------------------------ extra components

    def component(self, name: str) -> TreeComponent:
        """The extra component called ``name`` (KeyError naming the known ones)."""
        return self._extras.component(name)

    def assign_component(self, name: str, node: TreeNode, tier: Tier, ids: PageIds) -> None:
        """Give ``node`` its ``name`` value in ``tier`` (it must hold its full KV there)."""
        self._extras.assign_component(name, node, tier, ids)

    def hit_nodes(self, name: str, node: TreeNode) -> list[TreeNode]:
        """The nodes whose ``name`` values a hit ending at ``node`` needs, top-down."""
        return self._extras.hit_nodes(name, node)

    def hit_ids(self, name: str, node: TreeNode, tier: Tier = Tier.DEVICE) -> PageIds:
        """The ``tier`` ids of what a hit at ``node`` needs, in token order (LookupError
        if one is not in that tier)."""
        return self._extras.hit_ids(name, node, tier)

    def component_load_nodes(self, name: str, node: TreeNode) -> list[TreeNode]:
        """Nodes whose ``name`` value a hit at ``node`` needs from L2 (in L2, not in L1)."""
        return self._extras.component_load_nodes(name, node)

    def component_backup_nodes(self, name: str, node: TreeNode) -> list[TreeNode]:
        """Nodes whose ``name`` value to copy L1 -> L2 so a hit at ``node`` works from L2."""
        return self._extras.component_backup_nodes(name, node)

    def component_eviction_order(self, name: str, tier: Tier) -> Iterator[TreeNode]:
        """Nodes whose ``name`` value in ``tier`` may be evicted on its own, least recently
        needed first, lazily."""
        return self._extras.component_eviction_order(name, tier)

    def evict_component(self, name: str, node: TreeNode, tier: Tier) -> PageIds:
        """Drop ``node``'s ``name`` value in ``tier``; return its ids for the owner to free."""
        return self._extras.evict_component(name, node, tier)

    def component_ids(self, name: str, tier: Tier) -> list[int]:
        """Every ``tier`` id of ``name`` the tree owns (for allocator ownership checks)."""
        return self._extras.component_ids(name, tier)

    def component_stats(self, name: str) -> ComponentStats:
        """``name``'s ids per tier, pinned L1 ids and L1 tombstones over the tree."""
        return self._extras.component_stats(name)

    # ------------------------------------------------------------------ inspection

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node but the roots, parents before children."""
        return self._store.iter_nodes()

    def stats(self) -> TreeStats:
        """Nodes and full-KV pages per tier, as counted incrementally."""
        return self._store.stats()

    def device_page_ids(self) -> list[int]:
        """Every L1 page id the tree owns."""
        return [p for n in self.iter_nodes() if n.device is not None for p in n.device]

    def host_page_ids(self) -> list[int]:
        """Every L2 page id the tree owns."""
        return [p for n in self.iter_nodes() if n.host is not None for p in n.host]

    def check_integrity(self) -> TreeStats:
        """Verify every invariant of the module docstring; raise AssertionError naming the
        first violation. Returns the recomputed stats."""
        return check_tree(self._store)
