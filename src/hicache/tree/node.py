"""Radix tree nodes and their page-id arrays.

A node holds a span of whole pages of tokens. Its key is the span's token ids encoded by
:mod:`hicache.tokens` (``uint32`` little-endian bytes), so comparing page slices is a
``memcmp`` and a child is found by the bytes of its first page. Pure Python: no torch, no
threads, no IO.

``TOKEN_BYTES``, ``TokenIds``, ``encode_tokens`` and ``decode_tokens`` are re-exported from
:mod:`hicache.tokens` for callers that import them from here.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

from hicache.tokens import TOKEN_BYTES, TokenIds, decode_tokens, encode_tokens

__all__ = [
    "TOKEN_BYTES",
    "PageIds",
    "TokenIds",
    "TreeNode",
    "as_page_ids",
    "common_prefix_bytes",
    "decode_tokens",
    "encode_tokens",
    "page_ids",
]


PageIds = array
"""Page ids into a pool: ``array('q')`` (int64). Compact, not traversed by the garbage
collector, and viewable without a copy by ``torch.frombuffer`` / ``numpy.frombuffer``."""


def page_ids(pages: Sequence[int] | array = ()) -> PageIds:
    """Page ids as an ``array('q')`` (a copy)."""
    return array("q", pages)


def as_page_ids(pages: Sequence[int] | array) -> PageIds:
    """``pages`` itself when it already is an ``array('q')``, else a converted copy.

    The result may alias the caller's array: slice it before storing it.
    """
    if isinstance(pages, array) and pages.typecode == "q":
        return pages
    return array("q", pages)


def common_prefix_bytes(a: bytes, b: bytes, unit: int) -> int:
    """Length in bytes of the longest common prefix of ``a`` and ``b`` in whole ``unit``s.

    Binary search over unit boundaries; each probe is one memcmp of a slice.
    """
    hi = min(len(a), len(b)) // unit
    if a[: hi * unit] == b[: hi * unit]:
        return hi * unit
    lo = 0  # a[:lo*unit] == b[:lo*unit] holds; a[:hi*unit] != b[:hi*unit]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * unit] == b[: mid * unit]:
            lo = mid
        else:
            hi = mid
    return lo * unit


class TreeNode:
    """One span of whole pages in the radix tree.

    Attributes:
        id: unique, increasing in creation order (ties in eviction order break on it).
        key: the span's token ids, uint32 LE bytes; ``len(key) == num_pages * page_size * 4``.
        parent: ``None`` only for the root.
        children: child nodes keyed by the bytes of their first page.
        device: L1 page ids, one per page of the span, or ``None`` when evicted from L1.
        host: L2 page ids, one per page of the span, or ``None`` when not backed up.
        lock_ref: device pins on this node (path-wise: a lock on a node pins its ancestors).
        host_ref: host pins, path-wise like ``lock_ref``.
        hit_count: requests that created or reused this span (one each).
        last_access: logical clock of the last match or insert that touched it.
        created: logical clock when the span was first inserted (kept by splits).
        priority: the highest priority of the requests that inserted the span or passed
            through it in an insert (``max``, never lowered; a split copies it to both
            halves), so a node's priority is at least any descendant's. Under the
            ``priority`` eviction policy the lowest goes first, ties least recently used.
        tenant: the tenant salt of the subtree the node lives in (``""``: shared). Each
            tenant has its own root, so requests never match another tenant's spans.
        stored: the span's full KV pages are in L3 as far as this instance knows (a write
            of them landed on every rank, or a prefetch read them from there); a hint the
            backend may have outdated since (it evicts), cleared when the tier detaches.
        extra: per-component values of components other than full attention, by name
            (``None`` until a component stores one: fewer objects for the collector).
    """

    __slots__ = (
        "children",
        "created",
        "device",
        "extra",
        "hit_count",
        "host",
        "host_ref",
        "id",
        "key",
        "last_access",
        "lock_ref",
        "parent",
        "priority",
        "stored",
        "tenant",
    )

    def __init__(
        self,
        node_id: int,
        key: bytes,
        parent: TreeNode | None,
        *,
        device: PageIds | None = None,
        host: PageIds | None = None,
        tick: int = 0,
        priority: int = 0,
    ) -> None:
        self.id = node_id
        self.key = key
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}
        self.device = device
        self.host = host
        self.lock_ref = 0
        self.host_ref = 0
        self.hit_count = 0
        self.last_access = tick
        self.created = tick
        self.priority = priority
        self.tenant = ""
        self.stored = False
        self.extra: dict[str, Any] | None = None

    def __repr__(self) -> str:
        tiers = ("D" if self.device is not None else "") + ("H" if self.host is not None else "")
        tiers += "S" if self.stored else ""
        return (
            f"TreeNode(id={self.id}, tokens={len(self.key) // TOKEN_BYTES}, tiers={tiers or '-'},"
            f" lock={self.lock_ref}, host_ref={self.host_ref})"
        )
