"""One request's L3 prefetch as the owner records it (the storage tier changes it)."""

from __future__ import annotations

from dataclasses import dataclass

from hicache.keys import PageKey
from hicache.tree import TreeNode
from hicache.tree.node import PageIds


@dataclass(eq=False)
class Prefetch:
    """One request's prefetch, owner-side: pages ``start_page ..`` of ``key``.

    ``host_pages`` is set once the lookup found a hit worth reading; ``done_pages`` of
    them hold intact records (only grows); ``finished`` once no more will arrive;
    ``taken`` once the request took what arrived (or gave it up).
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
