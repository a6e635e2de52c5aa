"""Inserts: recording that a key's pages are held in L1 (computed) or in L2 (fetched).

Both kinds walk the key with the match walk (:meth:`Matcher.descend`: the node where the
key diverges is split), update the spans the key passes, and store the uncached rest as
one new leaf. Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hicache.tokens import TokenIds
from hicache.tree.components import ComponentValues
from hicache.tree.extras import ExtraComponents
from hicache.tree.match import Matcher
from hicache.tree.node import PageIds, TreeNode, as_page_ids, page_ids
from hicache.tree.results import InsertResult
from hicache.tree.store import NodeStore
from hicache.validate import is_int

__all__ = ["Inserter", "check_priority"]


def check_priority(priority: int) -> None:
    """Require an int priority (TypeError otherwise; any sign is allowed)."""
    if not is_int(priority):
        raise TypeError(f"priority={priority!r} is invalid; must be an int")


class Inserter:
    """Inserts into the nodes of ``store``, walking with ``matcher``; extra components'
    insert-time values go through ``extras``."""

    def __init__(self, store: NodeStore, matcher: Matcher, extras: ExtraComponents) -> None:
        self._store = store
        self._matcher = matcher
        self._extras = extras

    def insert(
        self,
        tokens: TokenIds,
        device_pages: Sequence[int] | PageIds,
        priority: int,
        tenant: str,
        components: Mapping[str, ComponentValues] | None,
    ) -> InsertResult:
        """:meth:`HiRadixTree.insert <hicache.tree.radix.HiRadixTree.insert>` (its
        docstring has the contract)."""
        if type(priority) is not int:  # a plain int passes without a call
            check_priority(priority)
        store = self._store
        key = store.page_key(tokens)
        n_pages = len(key) // store.page_bytes
        pages = as_page_ids(device_pages)
        if len(pages) != n_pages:
            raise ValueError(
                f"insert got {len(device_pages)} device pages for {n_pages} whole pages of tokens"
            )
        if components:
            self._extras.check_values(components, n_pages)
        walk = self._matcher.descend(store.root_of(tenant), key)
        duplicates = page_ids()
        adopted = self._reuse(walk.nodes, pages, priority, duplicates) if walk.nodes else []
        cached_pages = walk.end // store.page_bytes
        last, new_node = walk.last, None
        if walk.end < len(key):
            new_node = last = store.add_leaf(
                walk.last, key[walk.end :], device=pages[cached_pages:], priority=priority
            )
            new_node.hit_count = 1
        comp_dups = self._extras.place(last, n_pages, components, store.tick) if components else {}
        if last.parent is None:
            store.drop_if_empty_root(last)  # nothing stored (shorter than a page)
        return InsertResult(
            last_node=last,
            cached_tokens=cached_pages * store.page_size,
            duplicate_pages=duplicates,
            adopted=adopted,
            new_node=new_node,
            component_duplicates=comp_dups,
        )

    def insert_host(
        self, tokens: TokenIds, host_pages: PageIds, start_page: int, tenant: str, priority: int
    ) -> InsertResult:
        """:meth:`HiRadixTree.insert_host <hicache.tree.radix.HiRadixTree.insert_host>`
        (its docstring has the contract)."""
        if type(priority) is not int:  # a plain int passes without a call
            check_priority(priority)
        store = self._store
        key = store.page_key(tokens)
        n_pages = len(key) // store.page_bytes
        if n_pages != start_page + len(host_pages):
            raise ValueError(
                f"insert_host got {len(host_pages)} pages from page {start_page} for"
                f" {n_pages} whole pages of tokens"
            )
        walk = self._matcher.descend(store.root_of(tenant), key)
        _raise_priority(walk.nodes, priority)
        cached_pages = walk.end // store.page_bytes
        if cached_pages < start_page:
            raise ValueError(f"insert_host: pages before {start_page} are not cached")
        taken = cached_pages - start_page
        adopted = self._adopt_host(walk.nodes, host_pages, start_page)
        last, new_node = walk.last, None
        if walk.end < len(key) and last.host is not None:  # else: contiguity forbids it
            new_node = last = store.add_leaf(
                last, key[walk.end :], host=host_pages[taken:], priority=priority
            )
            duplicates = _without(host_pages[:taken], adopted)
        else:
            duplicates = _without(host_pages[:], adopted)
        if last.parent is None:
            store.drop_if_empty_root(last)  # nothing stored
        return InsertResult(
            last_node=last,
            cached_tokens=taken * store.page_size,
            duplicate_pages=duplicates,
            adopted=[],
            new_node=new_node,
        )

    def _adopt_host(self, nodes: list[TreeNode], host_pages: PageIds, start_page: int) -> set[int]:
        """Give the cached nodes at or past ``start_page`` that have no L2 copy (their
        KV in L1 alone: a ``write_back`` span) the fetched copy of their pages, top-down
        while contiguity allows (each one's parent in L2), so that a fetched run past
        them can hang there; returns the host pages adopted."""
        store = self._store
        adopted: set[int] = set()
        depth = 0
        for node in nodes:
            n = store.num_pages(node)
            lo, depth = depth, depth + n
            if lo < start_page or node.host is not None:
                continue
            if node.parent is None or node.parent.host is None:
                break  # contiguity: an L2 copy hangs under an L2 copy (a root has one)
            if depth - start_page > len(host_pages):
                break
            pages = host_pages[lo - start_page : depth - start_page]
            store.assign_host(node, pages)
            adopted.update(pages)
        return adopted

    def _reuse(
        self, nodes: list[TreeNode], pages: PageIds, priority: int, duplicates: PageIds
    ) -> list[TreeNode]:
        """Update the cached spans an insert passed: ``nodes``, top-down from the root,
        with ``pages`` the caller's L1 pages from the root on.

        Raises each span's priority to ``priority`` if lower; a span held in L2 only takes
        the caller's pages for it as its L1 copy (those spans are returned, top-down); for
        a span in L1, the caller's pages that differ from its own are appended to
        ``duplicates`` (the caller frees them)."""
        adopted: list[TreeNode] = []
        page_bytes = self._store.page_bytes
        at = 0
        for node in nodes:
            if node.priority < priority:
                node.priority = priority
            k = len(node.key) // page_bytes
            chunk = pages[at : at + k]
            held = node.device
            if held is None:
                self._store.assign_device(node, chunk)
                adopted.append(node)
            elif held != chunk:
                duplicates.extend(p for p, q in zip(chunk, held, strict=True) if p != q)
            at += k
        return adopted


def _raise_priority(nodes: list[TreeNode], priority: int) -> None:
    """Raise each node's priority to ``priority`` if lower (a span's priority is the max
    over the requests that inserted or reused it)."""
    for node in nodes:
        if node.priority < priority:
            node.priority = priority


def _without(pages: PageIds, drop: set[int]) -> PageIds:
    """``pages`` less those in ``drop``."""
    return pages if not drop else page_ids([p for p in pages if p not in drop])
