"""The handle a caller holds for one request, and what the cache tells it.

A :class:`CacheRequest` is opaque to the scheduler: it reads ``slots``, ``cached`` and
``failed`` and passes the handle back to the facade's verbs. Its parts are owned by their
stores: the full KV's (:class:`FullPart`, changed by
:class:`~hicache.cache.full_kv.FullKVStore` only) and each component store's under its
name (:meth:`CacheRequest.part`); the facade sets its life-cycle fields, on the owner's
thread. Page table invariant: ``pages`` covers positions ``[0, len(pages) * page_size)``;
its first ``prefix_pages`` pages belong to the tree, pinned in L1 through ``node``
(path-wise); the rest are the request's until it commits or releases them. A failed load
is not a failed request: the caller requeues the handle (``HiCache.requeue``) and the
prefill recomputes (``CacheCounters.load_fallbacks_total``). Parts that are slot tables
(:class:`SlotTable`) give the forward its slots in their pool
(:meth:`CacheRequest.pool_slots`); the runner's resume state travels opaque
(:meth:`CacheRequest.take_resume`).
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hicache.cache.l3.prefetch import Prefetch
from hicache.extras import SequenceExtras
from hicache.logprob import TokenLogprob
from hicache.transfer import LayerProgress, TransferError
from hicache.tree import TreeNode
from hicache.tree.node import PageIds, page_ids


class SlotTable(ABC):
    """A request's part that maps its positions to slots of a component store's L1 pool
    the model reads and writes (the sliding-window page table). Changed only by its
    store."""

    @abstractmethod
    def slots(self, page_size: int, upto: int) -> torch.Tensor:
        """Pool slots of the positions the table holds of ``[0, upto)`` (its last ones),
        1-D int64 on the CPU."""


def page_slots(pages: PageIds, page_size: int, n: int) -> torch.Tensor:
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


class FullPart:
    """A request's part of the full KV store: its L1 page table, how much of it the tree
    owns (``prefix_pages``, pinned through ``node``), the layer-wise loads that prefix
    depends on (``progress``), and whether its next admission may load from L2
    (``no_load``: not after a failed load). Changed only by the full KV store and, when a
    load under its prefix failed, through :meth:`drop_pin` by the sync's failing of
    holders."""

    __slots__ = ("no_load", "node", "pages", "prefix_pages", "progress")

    def __init__(self) -> None:
        self.pages: PageIds = page_ids()
        self.prefix_pages = 0
        self.node: TreeNode | None = None
        self.progress: tuple[LayerProgress, ...] = ()
        """The layer-wise loads the prefix's L1 pages depend on: the request's own load
        back and the loads other requests started for pages it shares, still in flight
        when it was admitted (or committed over them)."""
        self.no_load = False
        """Requeued after a failed load: the next admission loads nothing from L2 (the
        prefix is what L1 holds; the prefill computes the rest)."""

    def drop_pin(self) -> TreeNode:
        """Forget the node the prefix is pinned through (a load under it failed; the
        caller unpins it); returns it."""
        node, self.node = self.node, None
        if node is None:
            raise RuntimeError("the request holds no pinned prefix")
        return node

    def clear(self) -> None:
        """Hold nothing (the caller freed the pages and unpinned the node)."""
        self.pages = page_ids()
        self.prefix_pages = 0
        self.node = None
        self.progress = ()


@dataclass(frozen=True, slots=True)
class ScoreAsk:
    """What a scoring request asks of its prompt: the logprobs of positions ``start``
    on (``start >= 1``; position 0 has none) with ``top`` alternatives each."""

    start: int
    top: int

    def __post_init__(self) -> None:
        if self.start < 1 or self.top < 0:
            raise ValueError(f"{self!r} is invalid; needs start >= 1 and top >= 0")


class ScoreLog:
    """A scoring request's prompt logprobs as the cache sees them (its handle's
    :attr:`CacheRequest.scores`), set when a store keeps scoring entries of at least
    ``ask.top`` alternatives (``keep``, the store's).

    ``records``: position ``p`` -> the record of prompt token ``p`` (its logprob under
    the logits at ``p - 1``) with ``keep`` alternatives or more, from the caller (what its
    forwards computed) and from the cache (what its cached prefix held, on admission).
    ``limit``: at most this many leading tokens may come from the cache (None: as many as
    the entries allow), lowered by the store when a boundary's entries cannot serve."""

    __slots__ = ("ask", "keep", "limit", "records", "tokens")

    def __init__(self, ask: ScoreAsk, keep: int, tokens: Sequence[int]) -> None:
        self.ask = ask
        self.keep = keep
        self.tokens = tuple(tokens)
        """The prompt (the entry at the last slot of a hit names the token after it)."""
        self.records: dict[int, TokenLogprob] = {}
        self.limit: int | None = None

    def complete(self, first: int, end: int) -> bool:
        """Whether positions ``[first, end)`` all have records."""
        return all(p in self.records for p in range(first, end))

    def __repr__(self) -> str:
        return f"ScoreLog({self.ask!r}, keep={self.keep}, records={len(self.records)})"


class RequestState(str, enum.Enum):
    """Where a handle is in its life: opened, admitted (holds pages), released."""

    WAITING = "waiting"
    ADMITTED = "admitted"
    RELEASED = "released"


class CacheRequest:
    """One request's cache state; create with :meth:`HiCache.open`.

    Read-only for callers: ``pages``, ``prefix_pages``, ``prefix_tokens``, ``cached``,
    ``failed``, ``state``, ``tenant``, ``priority``; :meth:`slots` and :meth:`wait_layer`
    for the forward.
    """

    __slots__ = (
        "_counted",
        "_loaded",
        "_page_size",
        "_parts",
        "_resume",
        "cacheable",
        "cached",
        "compute_last",
        "failed",
        "full",
        "max_load",
        "max_prefix",
        "prefetch",
        "priority",
        "prompt_tokens",
        "scores",
        "state",
        "storage_tokens",
        "tenant",
    )

    def __init__(
        self,
        *,
        tenant: str,
        priority: int,
        cacheable: bool,
        compute_last: bool,
        max_prefix: int | None = None,
        max_load: int | None = None,
        prompt_tokens: int = 0,
        page_size: int = 1,
    ) -> None:
        self.tenant = tenant
        self.priority = priority
        self.cacheable = cacheable
        self.compute_last = compute_last
        self.max_prefix = max_prefix
        """At most this many leading tokens may come from the cache (None: no limit)."""
        self.max_load = max_load
        """At most this many of them may be restored from L2 and L3 (None: no limit);
        what L1 holds does not count."""
        self.state = RequestState.WAITING
        self._page_size = page_size
        self.full = FullPart()
        """The full KV store's part (its page table); read it through :attr:`pages`,
        :attr:`prefix_pages`, :attr:`node`."""
        self.cached = CachedTokens()
        self.failed: str | None = None
        """Why the request's KV cannot be trusted (a load it depends on failed); the
        caller must drop what it computed over the prefix and requeue the handle (the
        next admission recomputes what the load could not bring), or release it without
        keeping its KV."""
        self.prefetch: Prefetch | None = None
        self.storage_tokens = 0
        """Prompt tokens the L3 prefetch brought into L2 for this request."""
        self.prompt_tokens = prompt_tokens
        """Length of the prompt the request was opened with (component stores place
        their boundaries by it)."""
        self._parts: dict[str, object] = {}
        self._resume: SequenceExtras | None = None
        self._loaded: set[str] = set()
        """Stores that copied this request's hit from L2 in an admission not yet counted
        (see ``ComponentStores.component_hits``)."""
        self._counted = False
        self.scores: ScoreLog | None = None
        """Set when the request scores its prompt and a store keeps scoring entries
        (:class:`ScoreLog`); its match is then capped by the entries, not ``max_prefix``."""

    def reusable(self, n: int) -> int:
        """How many leading tokens of an ``n``-token sequence a cached prefix may serve:
        ``n`` less the last one with ``compute_last``, at most ``max_prefix``."""
        upto = n - int(self.compute_last)
        return upto if self.max_prefix is None else max(0, min(upto, self.max_prefix))

    @property
    def pages(self) -> PageIds:
        """The request's L1 page table (the full part's; see the module docstring)."""
        return self.full.pages

    @property
    def prefix_pages(self) -> int:
        """Leading pages of :attr:`pages` the tree owns (pinned through :attr:`node`)."""
        return self.full.prefix_pages

    @property
    def node(self) -> TreeNode | None:
        """The tree node the prefix ends at, pinned while the request holds it."""
        return self.full.node

    @property
    def prefix_tokens(self) -> int:
        """Leading token positions whose KV the tree holds for the request (in L1, or
        arriving layer by layer): the forward starts after them."""
        return self.full.prefix_pages * self._page_size

    def note_loaded(self, store: str) -> None:
        """Component store ``store`` copied this request's hit from L2 (counted at the
        admission that succeeds, ``ComponentStores.component_hits``)."""
        self._loaded.add(store)

    def take_loaded(self) -> set[str]:
        """The stores noted by :meth:`note_loaded` since the last call (then none)."""
        got, self._loaded = self._loaded, set()
        return got

    def count_once(self) -> bool:
        """True the first time only: the request's hits are counted at its first
        admission."""
        first, self._counted = not self._counted, True
        return first

    def slots(self, page_size: int, upto: int) -> torch.Tensor:
        """Token slots of positions ``[0, upto)``: ``page * page_size + offset``, (upto,)
        int64 on the CPU."""
        if upto > len(self.pages) * page_size:
            raise ValueError(f"slots up to {upto} but pages cover {len(self.pages) * page_size}")
        return page_slots(self.pages, page_size, upto)

    def pool_slots(self, page_size: int, upto: int) -> dict[str, torch.Tensor]:
        """Per component store whose pool the model reads and writes, the slots there of
        the positions it holds of ``[0, upto)`` (its last ones; see :class:`SlotTable`),
        keyed by component name; empty for a full-KV-only cache."""
        return {
            name: part.slots(page_size, upto)
            for name, part in self._parts.items()
            if isinstance(part, SlotTable)
        }

    def take_resume(self) -> SequenceExtras | None:
        """What the runner resumes this request from after its last admission (a state
        snapshot at ``prefix_tokens``), once; None: it starts from zero state (or its
        model carries none)."""
        got, self._resume = self._resume, None
        return got

    def part(self, name: str) -> object | None:
        """Component store ``name``'s data for this request (None: none); read and changed
        by that store only."""
        return self._parts.get(name)

    def set_part(self, name: str, value: object | None) -> None:
        """Set (None: drop) store ``name``'s data; for that store only."""
        if value is None:
            self._parts.pop(name, None)
        else:
            self._parts[name] = value

    def set_resume(self, extras: SequenceExtras | None) -> None:
        """Set what the runner resumes from (a component store, at admission)."""
        self._resume = extras

    @property
    def loading(self) -> bool:
        """Whether part of the prefix is still being copied L2 -> L1 (by this request's
        load back or by another request's load of pages the prefix shares)."""
        return any(not p.done for p in self.full.progress)

    def wait_layer(self, layer: int, timeout_s: float) -> bool:
        """Block until ``layer`` of the request's whole prefix is in L1 (on CUDA: make
        the current stream wait for it): every load the prefix depends on, its own and
        those of other requests whose pages it shares. False when one of them failed
        (``failed`` is then set); TimeoutError after ``timeout_s`` seconds in all."""
        if self.failed is not None:
            return False
        deadline = time.monotonic() + timeout_s
        for progress in self.full.progress:
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
