"""The handle a caller holds for one request, and what the cache tells it.

A :class:`CacheRequest` is opaque to the scheduler: it reads the request's page table
(``slots``), how much of the prompt the cache served (``cached``) and whether a copy it
depends on failed (``failed``), and passes the handle back to the facade's verbs. Only
:class:`hicache.cache.HiCache` changes it, on the owner's thread.

Page table invariant: ``pages`` covers token positions ``[0, len(pages) * page_size)``.
Its first ``prefix_pages`` pages belong to the tree and are pinned in L1 through
``node`` (path-wise); the rest belong to the request until it commits or releases them.

A model with sliding-window layers also has a :class:`SlidingTable` (``swa``): the SWA
pool's pages of the sequence pages still in the window of the request's next forward.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import torch

from hicache.cache.prefetch import Prefetch
from hicache.transfer import LayerProgress, TransferError
from hicache.tree import TreeNode
from hicache.tree.node import PageIds, page_ids


class SlidingTable:
    """One request's sliding-window page table.

    ``pages[i]`` is the SWA pool page of sequence page ``first + i``; sequence pages before
    ``first`` have fallen out of the window (their SWA KV is not held: "none"), pages from
    ``end`` on are not allocated yet. Of the held pages, those below the request's
    ``prefix_pages`` belong to the tree (pinned through the request's node; never freed
    by the request), the others to the request. Changed only by the cache's SWA tier.
    """

    __slots__ = ("first", "pages")

    def __init__(self, first: int = 0, pages: PageIds | None = None) -> None:
        self.first = first
        self.pages: PageIds = page_ids() if pages is None else pages

    @property
    def end(self) -> int:
        """One past the last sequence page held."""
        return self.first + len(self.pages)

    def slots(self, page_size: int, upto: int) -> torch.Tensor:
        """SWA pool slots of positions ``[first * page_size, upto)`` (the held tail of the
        first ``upto`` positions), ``(upto - first * page_size,)`` int64 on the CPU."""
        lo = self.first * page_size
        if not lo <= upto <= self.end * page_size:
            raise ValueError(
                f"SWA slots up to {upto}: the table holds positions [{lo}, {self.end * page_size})"
            )
        return _page_slots(self.pages, page_size, upto - lo)

    def __repr__(self) -> str:
        return f"SlidingTable(first={self.first}, pages={list(self.pages)})"


def _page_slots(pages: PageIds, page_size: int, n: int) -> torch.Tensor:
    """Slots ``page * page_size + offset`` of the first ``n`` positions laid over ``pages``."""
    if n == 0:
        return torch.empty(0, dtype=torch.int64)
    table = torch.frombuffer(pages, dtype=torch.int64)
    offsets = torch.arange(page_size, dtype=torch.int64)
    return (table[:, None] * page_size + offsets).reshape(-1)[:n]


@dataclass(frozen=True, slots=True)
class CachedTokens:
    """Prompt tokens served from each tier instead of being prefilled."""

    device: int = 0
    host: int = 0
    storage: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.storage


class RequestState(str, enum.Enum):
    """Where a handle is in its life: opened, admitted (holds pages), released."""

    WAITING = "waiting"
    ADMITTED = "admitted"
    RELEASED = "released"


class CacheRequest:
    """One request's cache state; create with :meth:`HiCache.open`.

    Read-only for callers: ``pages``, ``prefix_pages``, ``cached``, ``failed``,
    ``state``, ``tenant``, ``priority``; :meth:`slots` and :meth:`wait_layer` for the
    forward.
    """

    __slots__ = (
        "_counted",
        "_prefix_tokens",
        "_progress",
        "cacheable",
        "cached",
        "compute_last",
        "failed",
        "node",
        "pages",
        "prefetch",
        "prefix_pages",
        "priority",
        "state",
        "state_slot",
        "storage_tokens",
        "swa",
        "tenant",
    )

    def __init__(self, *, tenant: str, priority: int, cacheable: bool, compute_last: bool) -> None:
        self.tenant = tenant
        self.priority = priority
        self.cacheable = cacheable
        self.compute_last = compute_last
        self.state = RequestState.WAITING
        self.pages: PageIds = page_ids()
        self.prefix_pages = 0
        self._prefix_tokens = 0
        self.node: TreeNode | None = None
        self.cached = CachedTokens()
        self.failed: str | None = None
        """Why the request's KV cannot be trusted (a load it depends on failed); the
        caller must fail the request and release it without keeping its KV."""
        self.prefetch: Prefetch | None = None
        self.storage_tokens = 0
        self.state_slot: int | None = None
        """L1 slot of the recurrent-state snapshot the request resumes from (models with
        recurrent layers; None: zero state). Read it with ``HiCache.read_state``."""
        """Prompt tokens the L3 prefetch brought into L2 for this request."""
        self.swa: SlidingTable | None = None
        """The sliding-window page table while admitted (caches with an SWA tier)."""
        self._progress: tuple[LayerProgress, ...] = ()
        """The layer-wise loads the prefix's L1 pages depend on: the request's own load
        back and the loads other requests started for pages it shares, still in flight
        when it was admitted."""
        self._counted = False

    @property
    def prefix_tokens(self) -> int:
        """Leading token positions whose KV the tree holds for the request (in L1, or
        arriving layer by layer): the forward starts after them."""
        return self._prefix_tokens

    def slots(self, page_size: int, upto: int) -> torch.Tensor:
        """Token slots of positions ``[0, upto)``: ``page * page_size + offset``, (upto,)
        int64 on the CPU."""
        if upto > len(self.pages) * page_size:
            raise ValueError(f"slots up to {upto} but pages cover {len(self.pages) * page_size}")
        return _page_slots(self.pages, page_size, upto)

    def swa_slots(self, page_size: int, upto: int) -> torch.Tensor | None:
        """SWA pool slots of the held tail of positions ``[0, upto)`` (see
        :meth:`SlidingTable.slots`), or None when the cache keeps no SWA pages."""
        return None if self.swa is None else self.swa.slots(page_size, upto)

    @property
    def loading(self) -> bool:
        """Whether part of the prefix is still being copied L2 -> L1 (by this request's
        load back or by another request's load of pages the prefix shares)."""
        return any(not p.done for p in self._progress)

    def wait_layer(self, layer: int, timeout_s: float) -> bool:
        """Block until ``layer`` of the request's whole prefix is in L1 (on CUDA: make
        the current stream wait for it): every load the prefix depends on, its own and
        those of other requests whose pages it shares. False when one of them failed
        (``failed`` is then set); TimeoutError after ``timeout_s`` seconds in all."""
        if self.failed is not None:
            return False
        deadline = time.monotonic() + timeout_s
        for progress in self._progress:
            try:
                progress.wait(layer, max(0.0, deadline - time.monotonic()))
            except TransferError as exc:
                self.failed = f"loading the cached prefix failed: {exc}"
                return False
        return True

    def __repr__(self) -> str:
        return (
            f"CacheRequest(state={self.state.value}, pages={len(self.pages)},"
            f" prefix_pages={self.prefix_pages}, failed={self.failed is not None})"
        )
