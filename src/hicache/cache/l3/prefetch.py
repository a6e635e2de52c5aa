"""One request's L3 prefetch as the owner records it (:class:`Prefetch`; the prefetches
party, :mod:`hicache.cache.l3.prefetches`, changes it) and the component records a read
brings (:class:`ComponentFetch`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hicache.keys import PageKey
from hicache.tree import TreeNode
from hicache.tree.node import PageIds


@dataclass(frozen=True, slots=True)
class ComponentFetch:
    """Component records read from L3: component ``name``'s records of pages ``pages``
    (1-based, on the prompt's path) into L2 ids ``ids`` (same order) of its pool."""

    name: str
    pages: tuple[int, ...]
    ids: PageIds


@dataclass(eq=False)
class Prefetch:
    """One request's prefetch, owner-side: pages ``start_page ..`` of ``key``.

    ``start_page`` is the full-KV prefix the tree held at the start (``attach`` ends it);
    ``host_pages`` is set once the lookup found a usable hit worth reading; ``done_pages``
    of them hold intact records (only grows); ``finished`` once no more will arrive;
    ``taken`` once the request took what arrived (or gave it up); ``looking`` until its
    lookup's result is applied; ``agreed_ready`` once some rank's policy let it in, as
    agreed; ``held`` once taken before its read's final record (what it did not hand to
    the tree is quarantined until that record is agreed).

    Hybrid models, per extra component ``name``: ``component_keys[name][j - 1]`` keys the
    record of page ``j``; the lookup covered pages from ``component_first[name]`` on;
    ``local[name]``: pages before the start whose value the tree held (no record needed).
    ``reads``: the component records read with the pages (the boundary after all
    ``host_pages`` needs them, so the read is usable only once ``done_pages ==
    len(host_pages)``).

    Boundaries inside the held prefix: ``valid_pages`` is the local valid match at the
    start (what a match could use without L3); ``inner_to`` (0: none) the deepest held
    page whose node has its full KV in L2, so boundaries in ``(valid_pages, inner_to]``
    may be served by component records alone. ``boundary`` (pages; 0 until the lookup
    agreed on one) is the usable boundary the read ends at: ``> start_page`` for a read
    of pages (``start_page + len(host_pages)``), ``<= start_page`` for a read of
    component records alone (``host_pages`` stays None, ``reads`` is not empty).
    ``records_read`` turns True once every record of ``reads`` is in its L2 id.
    ``attach`` is the node pinned in L2 (``inc_host_ref``) until the request takes the
    prefetch: the held prefix's end, or, when that is not in L2, its deepest ancestor
    that is (only records are read then).
    """

    op_id: int
    key: bytes
    keys: list[PageKey]
    start_page: int
    attach: TreeNode
    tenant: str
    started: float
    deadline: float
    host_pages: PageIds | None = None
    done_pages: int = 0
    finished: bool = False
    taken: bool = False
    read_final: bool = False
    component_keys: dict[str, list[PageKey]] = field(default_factory=dict)
    component_first: dict[str, int] = field(default_factory=dict)
    local: dict[str, frozenset[int]] = field(default_factory=dict)
    optional: bool = False
    """Whether the records of optional components are looked up and read too (a scoring
    request's prefetch: ``ComponentRecords.optional``)."""
    found: dict[str, set[int]] = field(default_factory=dict)
    """Per component, the pages whose records the lookup found (what an optional
    component's read takes: ``ComponentRecords.optional``)."""
    reads: list[ComponentFetch] = field(default_factory=list)
    cached_to: int = 0
    """The page where the prefix the tree held at the start ends (``start_page`` unless
    that prefix ends on a span in L1 alone: a read pays off only past ``cached_to``)."""
    valid_pages: int = 0
    inner_to: int = 0
    boundary: int = 0
    records_read: bool = False
    looking: bool = True
    agreed_ready: bool = False
    held: bool = False
    any_hit: bool = False
    """A restore's prefetch: any hit of a whole page is read, whatever ``prefetch_threshold``."""
    lookup_failed: bool = False
    """The lookup failed on some rank (a backend error or overrun, not a miss), as agreed."""
    lookup_error: str = ""
    """Why this rank's lookup failed (the backend's reason; empty: it did not)."""
