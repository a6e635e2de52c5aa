"""One request's L3 prefetch as the owner records it (the storage tier changes it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hicache.keys import PageKey
from hicache.tree import TreeNode
from hicache.tree.node import PageIds


@dataclass(eq=False)
class Prefetch:
    """One request's prefetch, owner-side: pages ``start_page ..`` of ``key``.

    ``host_pages`` is set once the lookup found a hit worth reading; ``done_pages`` of
    them hold intact records (only grows); ``finished`` once no more will arrive;
    ``taken`` once the request took what arrived (or gave it up).

    With recurrent-state snapshots, ``component_keys[i]`` keys the snapshot after page
    ``start_page + i + 1``; ``state_slot`` is the L2 slot the snapshot after all
    ``host_pages`` is read into (the usable hit ends at that snapshot, so
    the read is usable only once ``done_pages == len(host_pages)``).
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
    component_keys: list[PageKey] = field(default_factory=list)
    state_slot: int | None = None
