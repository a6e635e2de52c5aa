"""The contract of a component store: one kind of cached state above the tree.

The tree keeps one value per node and component (:mod:`hicache.tree.components`). Above
it each extra component (the full KV's :class:`~hicache.cache.full_kv.FullKVStore` is the
first store and the tree's spine) has a *store*: its L1 (and L2) pools, its part of each
request verb, what it does when the full KV moves between tiers, and its L3 codec. The
facade holds the list (:class:`~hicache.cache.components.stores.ComponentStores`) and calls
each hook on every store in turn; it never names one. All hooks run on the owner's thread:
request hooks :meth:`~ComponentStore.plan` (:class:`ChunkPlan`), :meth:`~ComponentStore.admit`
(may refuse), :meth:`~ComponentStore.grow`, :meth:`~ComponentStore.keep`,
:meth:`~ComponentStore.values` / :meth:`~ComponentStore.committed`,
:meth:`~ComponentStore.release`; tier hooks :meth:`~ComponentStore.back_up`,
:meth:`~ComponentStore.free`, ``owned`` / ``check`` / ``usage``, ``records``. A store is built
from its :class:`~hicache.spec.ComponentSpec` and a :class:`StoreContext`, its type picked
by :attr:`ComponentStore.spec_type` (:data:`hicache.cache.components.STORE_TYPES`).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from hicache.cache.components.records import ComponentRecords
from hicache.cache.pool_audit import check_owned, component_usage
from hicache.cache.request import CacheRequest
from hicache.cache.sync import CacheSync
from hicache.config import CacheConfig
from hicache.extras import SequenceExtras
from hicache.memory import DevicePool
from hicache.memory.allocator import PageAllocator
from hicache.metrics import ComponentUsage
from hicache.spec import ComponentSpec, KVSpec
from hicache.tree import HiRadixTree, TreeNode
from hicache.tree.components import ComponentValues, Tier, TreeComponent
from hicache.tree.node import PageIds
from hicache.validate import int_at_least

__all__ = [
    "ChunkPlan",
    "ComponentStore",
    "HeldPages",
    "NominalSize",
    "ServingLimits",
    "StoreAdmission",
    "StoreContext",
]


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """Where one forward of a request must end, and what the runner keeps in it.

    ``tokens``: the new tokens to run (``1 <= tokens``, at most what was asked);
    ``keep``: offsets ``k`` (``1 <= k <= tokens``, ascending) after whose ``k``-th new token
    the runner keeps the sequence's extras (``k == tokens``: after the forward)."""

    tokens: int
    keep: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        int_at_least("tokens", self.tokens, 1)
        if list(self.keep) != sorted(set(self.keep)) or any(
            not 1 <= k <= self.tokens for k in self.keep
        ):
            raise ValueError(
                f"keep={self.keep} must be distinct ascending offsets in [1, {self.tokens}]"
            )


@dataclass(frozen=True, slots=True)
class HeldPages:
    """The L1 pages of one store's pool that a request's positions occupy: ``pages[i]``
    holds sequence page ``first + i`` (pages before ``first`` are not held: a sliding
    window's fallen-out pages). What a transfer of the request's KV to another instance
    reads here and writes into the pages the other side allocated, per store.

    ``name``: the store (``"full"`` for the full KV, else the component's name);
    ``pool``: its L1 pool, whose :meth:`~hicache.memory.base.KVPool.read_pages` and
    ``write_pages`` move the pages' bytes (canonical ``(n, K, L, page, H, D)``);
    ``stable``: the request holds each of these pages until it is released or requeued
    (False for a sliding window, which frees its early pages as the request advances:
    only its last pages may be read after the request's last forward)."""

    name: str
    pool: DevicePool
    first: int
    pages: PageIds
    stable: bool = True

    def read(self) -> torch.Tensor:
        """A CPU copy of the held pages, ``(len(pages), K, L, page_size, H, D)``."""
        return self.pool.read_pages(self.pages)

    def write(self, data: torch.Tensor) -> None:
        """Write ``data`` (as :meth:`read` returns it) into the held pages."""
        self.pool.write_pages(self.pages, data)


@dataclass(frozen=True, slots=True)
class NominalSize:
    """What a store costs by its design rule, for reports: its model ``layers``, bytes per
    cached token without any window or eviction (``bytes_per_token``), the ``unit`` its
    pools count in (``pages``, ``slots``) and a short ``note``."""

    layers: int
    bytes_per_token: float
    unit: str
    note: str = ""


@dataclass(frozen=True, slots=True)
class StoreAdmission:
    """A store's answer to an admission: ``ok`` False when it has no room now (the
    request must wait); ``loaded`` when it copied the hit's values from L2 to L1."""

    ok: bool
    loaded: bool = False


@dataclass(frozen=True, kw_only=True)
class ServingLimits:
    """What one forward and one batch may hold, for the stores' up-front checks: a
    forward adds at most ``chunk_tokens`` positions per request; at most ``max_running``
    requests are admitted at once."""

    chunk_tokens: int
    max_running: int

    def __post_init__(self) -> None:
        int_at_least("chunk_tokens", self.chunk_tokens, 1, "(tokens)")
        int_at_least("max_running", self.max_running, 1)


@dataclass(frozen=True, slots=True)
class StoreContext:
    """What every store is built with: the cache's tree, config, full KV shape, device,
    whether L2 exists, and the cache's :class:`~hicache.cache.sync.CacheSync` (the owner
    of asynchronous results: a store that must wait for backups in flight asks it)."""

    tree: HiRadixTree
    config: CacheConfig
    kv: KVSpec
    device: torch.device
    sync: CacheSync

    @property
    def hierarchical(self) -> bool:
        return self.config.enable_hierarchical_cache


class ComponentStore(ABC):
    """One extra component's pools and hooks for one cache (see the module docstring).

    Subclasses set :attr:`spec_type` and implement the abstract hooks; the others default
    to "nothing to do". ``name`` is the spec's component name. Per-request data lives in
    the request's part (:meth:`CacheRequest.part`), under ``name``.
    """

    spec_type: ClassVar[type[ComponentSpec]]
    label: ClassVar[str]
    """How integrity errors name this store's pools (``"L1 <label>"``)."""
    optional: ClassVar[bool] = False
    """Whether a hit needs none of this store's values (scoring entries): what a hit in
    L1 needs, a restore's load to L1 included, ignores such a store."""
    resumes: ClassVar[bool] = False
    """Whether admission hands requests a state to resume from
    (:meth:`CacheRequest.take_resume`): a model carrying state between forwards can
    resume cached prefixes only with such a store."""

    def __init__(self, spec: ComponentSpec, ctx: StoreContext) -> None:
        if not isinstance(spec, self.spec_type):
            raise TypeError(f"{type(self).__name__} needs a {self.spec_type.__name__}")
        self.name = spec.name
        self.tree = ctx.tree
        self.sync = ctx.sync

    # ------------------------------------------------------------------ building

    @classmethod
    @abstractmethod
    def tree_component(cls, spec: ComponentSpec) -> TreeComponent:
        """The tree's component for ``spec`` (its node values, validator, split)."""

    @classmethod
    def check_limits(
        cls, config: CacheConfig, kv: KVSpec, spec: ComponentSpec, limits: ServingLimits
    ) -> None:
        """Refuse (ValueError naming the flags and numbers) pools too small to serve one
        request under ``limits``; may warn when they degrade reuse."""
        return None

    # ------------------------------------------------------------------ pools

    @property
    @abstractmethod
    def device_pool(self) -> object:
        """The L1 pool."""

    @property
    @abstractmethod
    def host_pool(self) -> object | None:
        """The L2 pool (None without the hierarchical cache)."""

    @abstractmethod
    def allocator(self, tier: Tier) -> PageAllocator:
        """The allocator of the ``tier`` pool (RuntimeError when it does not exist)."""

    @property
    def runner_pool(self) -> DevicePool | None:
        """The L1 pool the model reads and writes during a forward (the request's part is
        then a :class:`~hicache.cache.request.SlotTable` giving its slots there), or None when the model does not use this store's pool directly."""
        return None

    @property
    def scoring_top(self) -> int | None:
        """The alternatives this store keeps per scored prompt position (scoring
        entries), or None when it keeps none."""
        return None

    def cap(self, req: CacheRequest, wanted: Sequence[int]) -> int:
        """How many leading tokens of ``wanted`` (what ``req`` may reuse otherwise) its
        admission may take from the cache, as far as this store can serve them; default:
        all. Called before the match; copies nothing."""
        return len(wanted)

    def free(self, tier: Tier, ids: PageIds) -> None:
        """Return ``ids`` to the ``tier`` pool."""
        if len(ids):
            self.allocator(tier).free(ids)

    def owned(self, tier: Tier) -> list[int]:
        """Every id of ``tier`` the tree owns (for the ownership check)."""
        return self.tree.component_ids(self.name, tier)

    def l1_only_on_path(self, last: TreeNode) -> list[TreeNode]:
        """Nodes from the root to ``last`` (top-down) whose full KV is in L2 and whose value
        of this component is in L1 only: what a backup of the path still has to copy so
        that boundaries inside it stay valid from L2."""
        c = self.tree.component(self.name)
        out: list[TreeNode] = []
        node: TreeNode | None = last
        while node is not None and node.parent is not None and node.host is not None:
            if c.get(node, Tier.DEVICE) is not None and c.get(node, Tier.HOST) is None:
                out.append(node)
            node = node.parent
        out.reverse()
        return out

    # ------------------------------------------------------------------ requests

    def plan(self, req: CacheRequest, start: int, tokens: int) -> ChunkPlan:
        """Where a forward of ``req`` over ``[start, start + tokens)`` ends and what it
        keeps; default: all of it, nothing kept."""
        return ChunkPlan(tokens)

    @abstractmethod
    def admit(self, req: CacheRequest, node: TreeNode, prefix_pages: int) -> StoreAdmission:
        """Set ``req`` up for a hit of ``prefix_pages`` pages ending at ``node`` (pinned,
        its full KV in L1 or arriving; the root: no hit)."""

    def grow(self, req: CacheRequest, tokens: int, computed: int | None) -> bool:
        """Cover positions up to ``tokens`` (the next forward starts at ``computed``);
        False when there is no room (what was added stays)."""
        return True

    def keep(self, req: CacheRequest, extras: SequenceExtras) -> None:  # noqa: B027
        """Take the runner's ``extras`` of ``req``'s last forward (used at commits)."""

    def values(self, req: CacheRequest, full: int, final: bool) -> ComponentValues | None:
        """What a commit of ``req``'s first ``full`` pages hands the tree (``final``: the
        request's last commit, at its release); None: nothing."""
        return None

    def committed(  # noqa: B027 - nothing to update by default
        self, req: CacheRequest, last: TreeNode, full: int, computed: int
    ) -> None:
        """After a commit of ``full`` pages ending at ``last`` (``req.prefix_pages`` is
        ``full`` now; ``computed`` positions are done)."""

    def take_added(self) -> bool:
        """Whether values were added, since the last call, at nodes whose full KV was in
        L2 already, which no backup carries (scoring entries placed after their pages'
        commit): the facade then copies them to L2 and writes them to L3
        (``L3Slot.back_up_added``). Default: never."""
        return False

    def late(self, req: CacheRequest, last: TreeNode, full: int) -> None:  # noqa: B027
        """``req``'s last commit brought no new page (its ``full`` pages end at ``last``):
        place what it learnt of them since their commit (scoring entries, whose records
        come after the forward's commit). Default: nothing."""

    @abstractmethod
    def release(self, req: CacheRequest) -> None:
        """Give back what ``req`` holds of this store and drop its part. Idempotent."""

    def request_ids(self, requests: Sequence[CacheRequest]) -> list[int]:
        """L1 ids ``requests`` own (not the tree's), for the ownership check."""
        return []

    def held(self, req: CacheRequest) -> HeldPages | None:
        """The L1 pages of this store's pool that admitted ``req``'s positions occupy
        (the tree's and its own), or None when the store holds none per position (a
        state store: the live state is the runner's and travels with its extras)."""
        return None

    # ------------------------------------------------------------------ tiers

    @abstractmethod
    def back_up(self, last: TreeNode) -> list[TreeNode]:
        """The full KV of the run ending at ``last`` got L2 pages: copy to L2 what a hit
        there needs; returns the nodes that got L2 values."""

    @abstractmethod
    def records(self) -> ComponentRecords:
        """The L3 codec of this store (the cache needs L2: ValueError without)."""

    @abstractmethod
    def nominal(self) -> NominalSize:
        """This store's nominal size (see :class:`NominalSize`)."""

    @abstractmethod
    def usage(self, cached_tokens: int) -> ComponentUsage:
        """Pool use of this store; ``cached_tokens``: tokens whose full KV is in L1."""

    def usage_with_holders(
        self, cached_tokens: int, requests: Sequence[CacheRequest]
    ) -> ComponentUsage:
        """:meth:`usage` with who holds the ids (the :class:`ComponentUsage` holder
        fields): L1 ids the admitted ``requests`` own, L1 and L2 ids the tree owns."""
        host = len(self.owned(Tier.HOST)) if self.host_pool is not None else 0
        return dataclasses.replace(
            self.usage(cached_tokens),
            device_requests=len(self.request_ids(requests)),
            device_cached=len(self.owned(Tier.DEVICE)),
            host_cached=host,
        )

    def _usage(self, unit_bytes: int, cached_tokens: int) -> ComponentUsage:
        host = self.allocator(Tier.HOST) if self.host_pool is not None else None
        return component_usage(
            self.name, self.allocator(Tier.DEVICE), host, unit_bytes, cached_tokens
        )

    def check(self, requests: Sequence[CacheRequest], held: Mapping[str, list[int]]) -> None:
        """Every used id of each pool is owned exactly once: by the tree, by an admitted
        request (:meth:`request_ids`) or, in L2, by an L3 op (``held[name]``). Raises
        AssertionError."""
        label = self.label
        mine = self.request_ids(requests)
        check_owned(f"L1 {label}", self.allocator(Tier.DEVICE), self.owned(Tier.DEVICE) + mine)
        if self.host_pool is not None:
            owned = [*self.owned(Tier.HOST), *held.get(self.name, [])]
            check_owned(f"L2 {label}", self.allocator(Tier.HOST), owned)
