"""HiRadixTree: one radix tree recording which tier (L1 device, L2 host) holds each page.

The tree stores metadata only: page ids into the device and host pools, pins and access
statistics. It never allocates, copies or frees memory; the owner (the cache facade) does,
and tells the tree through the methods here. Pure Python: no torch, no threads, no IO.

Invariants (checked by :meth:`HiRadixTree.check_integrity`):

* every non-root node spans a whole, non-zero number of pages and sits in its parent's
  ``children`` under the bytes of its first page;
* every non-root node is held by at least one tier (``device`` or ``host`` is not None);
* contiguity: a node has a device copy only if its parent has one, and a host copy only if
  its parent has one; so along any root-to-leaf path the device-resident part is a prefix,
  then comes a host-only part, then nothing;
* ``lock_ref`` and ``host_ref`` are path-wise pins: a node's count is at least the sum of
  its children's; every page id is owned by one node only.

Components (hybrid models): full-attention KV is the base component (``device`` /
``host``); extra components (:mod:`hicache.tree.components`: sliding window, Mamba
state) keep their values in ``node.extra`` and follow the contract there: a match ends
only at a node every component's validator accepts, a split moves every component's
values, pins pin every component's hit span, evicting a node's full KV from a tier drops
its extra values in that tier (:meth:`HiRadixTree.evict_node_device`), and each extra
component is evicted on its own under its own pool's budget
(:meth:`~hicache.tree.hybrid.ComponentOps.component_eviction_order`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from hicache.config import EvictionPolicy
from hicache.tokens import TOKEN_BYTES, TokenIds, encode_tokens
from hicache.tree.components import ComponentValues, FullComponent, TreeComponent
from hicache.tree.eviction import EvictionOps, eviction_key
from hicache.tree.hybrid import ComponentOps
from hicache.tree.integrity import check_tree
from hicache.tree.node import PageIds, TreeNode, as_page_ids, common_prefix_bytes, page_ids
from hicache.tree.paths import PathQueries
from hicache.tree.pins import PathPins
from hicache.tree.results import InsertResult, MatchResult, MatchStop, TreeStats
from hicache.validate import int_at_least, is_int


def check_priority(priority: int) -> None:
    """Require an int priority (TypeError otherwise; any sign is allowed)."""
    if not is_int(priority):
        raise TypeError(f"priority={priority!r} is invalid; must be an int")


class HiRadixTree(PathQueries, PathPins, EvictionOps, ComponentOps):
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
        self._page_bytes = page_size * TOKEN_BYTES
        self._evict_key = eviction_key(self.eviction_policy)
        self._full = FullComponent()
        self._extra = tuple(components)
        names = [c.name for c in self._extra]
        for c in self._extra:
            if not isinstance(c, TreeComponent) or c.base:
                raise ValueError(f"components: {c!r} is not an extra TreeComponent")
        if len(set(names)) != len(names) or FullComponent.name in names:
            raise ValueError(f"components: names {names} must be unique and not 'full'")
        self._components: tuple[TreeComponent, ...] = (self._full, *self._extra)
        self.reset()

    @property
    def components(self) -> tuple[TreeComponent, ...]:
        """Every component: the full one first, then the extras."""
        return self._components

    # ------------------------------------------------------------------ basics

    def reset(self) -> None:
        """Drop every node. The owner frees the pages it had handed to the tree."""
        self._next_id = 0
        self._tick = 0
        self.root = self._new_root("")
        self._tenant_roots: dict[str, TreeNode] = {}
        self._device_pages = 0
        self._host_pages = 0
        self._protected_pages = 0
        self._num_nodes = 0

    def _new_node(
        self,
        key: bytes,
        parent: TreeNode | None,
        *,
        device: PageIds | None = None,
        host: PageIds | None = None,
        priority: int = 0,
    ) -> TreeNode:
        node = TreeNode(
            self._next_id, key, parent, device=device, host=host, tick=self._tick, priority=priority
        )
        self._next_id += 1
        return node

    def _new_root(self, tenant: str) -> TreeNode:
        root = self._new_node(b"", None, device=page_ids(), host=page_ids())
        root.tenant = tenant
        return root

    def root_of(self, tenant: str = "") -> TreeNode:
        """The root of ``tenant``'s subtree (created on first use); ``""`` is the shared one.

        A tenant's root lives only while it has children: the calls of this class that
        may leave it empty (a match or an insert that stored nothing, the eviction of its
        last node) drop it again, so the tree's state per tenant is bounded by what it
        caches. Raises TypeError for a ``tenant`` that is not a ``str``.
        """
        if not isinstance(tenant, str):
            raise TypeError(f"tenant={tenant!r} is invalid; must be a str (a cache salt)")
        if not tenant:
            return self.root
        root = self._tenant_roots.get(tenant)
        if root is None:
            root = self._tenant_roots[tenant] = self._new_root(tenant)
        return root

    @property
    def roots(self) -> list[TreeNode]:
        """The shared root, then each tenant's (every tenant root has children)."""
        return [self.root, *self._tenant_roots.values()]

    @property
    def tenants(self) -> list[str]:
        """The tenants (cache salts) with something cached, in order of first use."""
        return list(self._tenant_roots)

    def has_tenant(self, tenant: str) -> bool:
        """Whether ``tenant`` (``""``: shared, always true) has a root in the tree."""
        return not tenant or tenant in self._tenant_roots

    def prune_tenant(self, tenant: str) -> bool:
        """Drop ``tenant``'s root if it has no children; return whether it is gone now.

        Normally automatic (see :meth:`root_of`); the shared root is never dropped.
        """
        root = self._tenant_roots.get(tenant)
        if root is not None:
            self._after_remove(root)
        return tenant not in self._tenant_roots

    def _after_remove(self, parent: TreeNode) -> None:
        """``parent`` may have lost its last child: drop it if it is an empty tenant root."""
        tenant = parent.tenant
        if (
            parent.parent is None
            and not parent.children
            and self._tenant_roots.get(tenant) is parent
        ):
            del self._tenant_roots[tenant]

    def num_pages(self, node: TreeNode) -> int:
        return len(node.key) // self._page_bytes

    def num_tokens(self, node: TreeNode) -> int:
        return len(node.key) // TOKEN_BYTES

    def _page_key(self, tokens: TokenIds) -> bytes:
        key = encode_tokens(tokens)
        return key[: len(key) - len(key) % self._page_bytes]

    # ------------------------------------------------------------------ match / insert

    def match_prefix(self, tokens: TokenIds, tenant: str = "") -> MatchResult:
        """Find the longest cached prefix of ``tokens`` in whole pages; copies no data.

        Splits a node when the match ends inside it, so the result ends on a node boundary.
        Marks every matched node as accessed (for LRU). Only ``tenant``'s spans match.
        With extra components the match ends at the deepest node every component accepts
        (in L1 or L2; the L1 part at the deepest node accepted with L1 values only).
        """
        if self._extra:
            return self._match_components(tokens, tenant)
        return self._match_full(tokens, tenant)

    def match_held(self, tokens: TokenIds, tenant: str = "") -> MatchResult:
        """The longest prefix of ``tokens`` whose full KV the tree holds, in any tier,
        whatever the other components' validators say (so not necessarily a valid match
        boundary): where an L3 fetch of the pages that follow starts. Splits and marks
        like :meth:`match_prefix`; equal to it in a tree of full KV only."""
        return self._match_full(tokens, tenant)

    def _match_full(self, tokens: TokenIds, tenant: str) -> MatchResult:
        """:meth:`match_prefix` over the full component alone."""
        key = self._page_key(tokens)
        pb = self._page_bytes
        self._tick += 1
        tick = self._tick
        node = last_device = self.root_of(tenant)
        device_pages = page_ids()
        host_bytes = 0
        pos = 0
        end = len(key)
        stop = MatchStop.END_OF_KEY
        while pos < end:
            child = node.children.get(key[pos : pos + pb])
            if child is None:
                stop = MatchStop.NO_CHILD
                break
            klen = len(child.key)
            diverged = False
            if key[pos : pos + klen] != child.key:
                klen = common_prefix_bytes(key[pos:], child.key, pb)
                child = self._split(child, klen // pb)
                diverged = pos + klen < end
            child.last_access = tick
            if child.device is not None:
                device_pages += child.device
                last_device = child
            else:
                host_bytes += klen
            pos += klen
            node = child
            if diverged:
                stop = MatchStop.DIVERGED
                break
        if node.parent is None:
            self._after_remove(node)  # a miss must not keep a tenant root alive
        return MatchResult(
            device_pages=device_pages,
            last_device_node=last_device,
            last_host_node=node,
            device_tokens=len(device_pages) * self.page_size,
            host_tokens=host_bytes // TOKEN_BYTES,
            stop=stop,
        )

    def _match_components(self, tokens: TokenIds, tenant: str) -> MatchResult:
        """:meth:`match_prefix` through every component's validators (same walk)."""
        key = self._page_key(tokens)
        pb = self._page_bytes
        self._tick += 1
        tick = self._tick
        comps = self._components
        any_ok = [c.validator(device_only=False) for c in comps]
        dev_ok = [c.validator(device_only=True) for c in comps]
        node = best_any = best_dev = self.root_of(tenant)
        device_pages = page_ids()
        n_dev = 0  # device pages up to best_dev
        pos_any = 0  # bytes of key up to best_any
        limited_by: str | None = None
        pos = 0
        end = len(key)
        stop = MatchStop.END_OF_KEY
        while pos < end:
            child = node.children.get(key[pos : pos + pb])
            if child is None:
                stop = MatchStop.NO_CHILD
                break
            klen = len(child.key)
            diverged = False
            if key[pos : pos + klen] != child.key:
                klen = common_prefix_bytes(key[pos:], child.key, pb)
                child = self._split(child, klen // pb)
                diverged = pos + klen < end
            child.last_access = tick
            if child.device is not None:
                device_pages += child.device
            pos += klen
            node = child
            oks = [v(child) for v in any_ok]  # every validator sees every node
            devs = [v(child) for v in dev_ok]
            if all(devs):
                best_dev, n_dev = child, len(device_pages)
            if all(oks):
                best_any, pos_any, limited_by = child, pos, None
            else:
                limited_by = comps[oks.index(False)].name
            if diverged:
                stop = MatchStop.DIVERGED
                break
        for c in self._extra:
            c.touch(self, best_any, tick)
            if best_dev is not best_any:
                c.touch(self, best_dev, tick)
        if node.parent is None:
            self._after_remove(node)  # a miss must not keep a tenant root alive
        device_tokens = n_dev * self.page_size
        return MatchResult(
            device_pages=device_pages[:n_dev],
            last_device_node=best_dev,
            last_host_node=best_any,
            device_tokens=device_tokens,
            host_tokens=pos_any // TOKEN_BYTES - device_tokens,
            stop=stop,
            limited_by=limited_by,
        )

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
        check_priority(priority)
        key = self._page_key(tokens)
        pb = self._page_bytes
        n_pages = len(key) // pb
        pages = as_page_ids(device_pages)
        if len(pages) != n_pages:
            raise ValueError(
                f"insert got {len(device_pages)} device pages for {n_pages} whole pages of tokens"
            )
        if components:
            self._check_values(components, n_pages)
        self._tick += 1
        tick = self._tick
        node = self.root_of(tenant)
        pos = 0
        page = 0
        cached_pages = 0
        duplicates = page_ids()
        adopted: list[TreeNode] = []
        new_node: TreeNode | None = None
        while pos < len(key):
            child = node.children.get(key[pos : pos + pb])
            if child is None:
                new_node = self._new_node(key[pos:], node, device=pages[page:], priority=priority)
                new_node.hit_count = 1
                new_node.tenant = node.tenant
                node.children[key[pos : pos + pb]] = new_node
                self._num_nodes += 1
                self._device_pages += n_pages - page
                node = new_node
                break
            klen = len(child.key)
            if key[pos : pos + klen] != child.key:
                klen = common_prefix_bytes(key[pos:], child.key, pb)
                child = self._split(child, klen // pb)
            k = klen // pb
            chunk = pages[page : page + k]
            child.last_access = tick
            child.priority = max(child.priority, priority)
            cached_pages += k
            if child.device is None:
                self.assign_device(child, chunk)
                adopted.append(child)
            elif child.device != chunk:
                duplicates.extend(p for p, q in zip(chunk, child.device, strict=True) if p != q)
            pos += klen
            page += k
            node = child
        comp_dups = self._insert_components(node, n_pages, components) if components else {}
        if node.parent is None:
            self._after_remove(node)  # nothing stored (shorter than a page)
        return InsertResult(
            last_node=node,
            cached_tokens=cached_pages * self.page_size,
            duplicate_pages=duplicates,
            adopted=adopted,
            new_node=new_node,
            component_duplicates=comp_dups,
        )

    def count_hit(self, node: TreeNode) -> None:
        """One more request reused the path to ``node``: add a hit to it and each
        ancestor (``write_through_selective`` and ``lfu`` read the counts)."""
        while node.parent is not None:
            node.hit_count += 1
            node = node.parent

    def _split(self, child: TreeNode, at_page: int) -> TreeNode:
        """Split ``child`` after ``at_page`` pages; return the new head (child's new parent)."""
        parent = child.parent
        assert parent is not None and 0 < at_page < self.num_pages(child)
        n = self.num_pages(child)
        cut = at_page * self._page_bytes
        head = self._new_node(child.key[:cut], parent, priority=child.priority)
        for comp in self._components:
            comp.split(head, child, at_page, n)
        head.lock_ref = child.lock_ref
        head.host_ref = child.host_ref
        head.hit_count = child.hit_count
        head.last_access = child.last_access
        head.created = child.created
        head.tenant = child.tenant
        child.key = child.key[cut:]
        child.parent = head
        head.children[child.key[: self._page_bytes]] = child
        parent.children[head.key[: self._page_bytes]] = head
        self._num_nodes += 1
        return head

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
        check_priority(priority)
        key = self._page_key(tokens)
        pb = self._page_bytes
        if len(key) // pb != start_page + len(host_pages):
            raise ValueError(
                f"insert_host got {len(host_pages)} pages from page {start_page} for"
                f" {len(key) // pb} whole pages of tokens"
            )
        self._tick += 1
        node, pos = self.root_of(tenant), 0
        while pos < len(key):
            child = node.children.get(key[pos : pos + pb])
            if child is None:
                break
            klen = len(child.key)
            if key[pos : pos + klen] != child.key:
                klen = common_prefix_bytes(key[pos:], child.key, pb)
                child = self._split(child, klen // pb)
            child.last_access = self._tick
            child.priority = max(child.priority, priority)
            pos += klen
            node = child
        page = pos // pb
        if page < start_page:
            raise ValueError(f"insert_host: pages before {start_page} are not cached")
        new_node: TreeNode | None = None
        taken = page - start_page
        if pos < len(key) and node.host is not None:
            new_node = self._new_node(key[pos:], node, host=host_pages[taken:], priority=priority)
            new_node.tenant = node.tenant
            node.children[key[pos : pos + pb]] = new_node
            self._num_nodes += 1
            self._host_pages += len(host_pages) - taken
            node = new_node
            dup = host_pages[:taken]
        else:
            dup = host_pages[:]
        if node.parent is None:
            self._after_remove(node)  # nothing stored
        return InsertResult(
            last_node=node,
            cached_tokens=taken * self.page_size,
            duplicate_pages=dup,
            adopted=[],
            new_node=new_node,
        )

    # ------------------------------------------------------------------ tier changes

    def assign_device(self, node: TreeNode, pages: PageIds) -> None:
        """Give an L1-evicted node its L1 pages (after a load back or a recompute)."""
        if node.device is not None:
            raise RuntimeError(f"{node!r} already has device pages")
        if node.parent is None or node.parent.device is None:
            raise RuntimeError(f"{node!r}: parent not in L1; load back top-down (contiguity)")
        if len(pages) != self.num_pages(node):
            raise ValueError(f"{node!r} needs {self.num_pages(node)} pages, got {len(pages)}")
        node.device = pages
        self._device_pages += len(pages)
        if node.lock_ref > 0:
            self._protected_pages += len(pages)

    def assign_host(self, node: TreeNode, pages: PageIds) -> None:
        """Give a node its L2 pages (a backup was issued for it)."""
        if node.host is not None:
            raise RuntimeError(f"{node!r} already has host pages")
        if node.parent is None or node.parent.host is None:
            raise RuntimeError(f"{node!r}: parent not in L2; back up top-down (contiguity)")
        if len(pages) != self.num_pages(node):
            raise ValueError(f"{node!r} needs {self.num_pages(node)} pages, got {len(pages)}")
        node.host = pages
        self._host_pages += len(pages)

    # ------------------------------------------------------------------ inspection

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before children."""
        stack = [c for r in self.roots for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def stats(self) -> TreeStats:
        return TreeStats(
            nodes=self._num_nodes,
            device_pages=self._device_pages,
            host_pages=self._host_pages,
            protected_device_pages=self._protected_pages,
        )

    def device_page_ids(self) -> list[int]:
        """Every L1 page id the tree owns."""
        return [p for n in self.iter_nodes() if n.device is not None for p in n.device]

    def host_page_ids(self) -> list[int]:
        """Every L2 page id the tree owns."""
        return [p for n in self.iter_nodes() if n.host is not None for p in n.host]

    def check_integrity(self) -> TreeStats:
        """Verify every invariant of the module docstring; raise AssertionError naming the
        first violation. Returns the recomputed stats."""
        stats = check_tree(
            self.root, self._tenant_roots, self.page_size, self._components, self.stats()
        )
        self._check_extras(self._extra)
        return stats
