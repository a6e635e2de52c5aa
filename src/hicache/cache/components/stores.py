"""The component stores of one cache, as one list the facade loops over.

A hybrid model's cache keeps, besides full KV, one store per
:class:`~hicache.spec.ComponentSpec` of its :class:`~hicache.spec.CacheSpec` (say
sliding-window K/V, or recurrent-state snapshots), each with its own L1 (and L2) pools.
:class:`ComponentStores` builds them from the spec (by each store type's ``spec_type``)
and runs every hook on each in turn, so the facade names no component: a full-attention
model's cache simply has an empty list.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from hicache.cache.components.base import ChunkPlan, ComponentStore, StoreContext
from hicache.cache.components.records import ComponentRecords
from hicache.cache.request import CacheRequest
from hicache.extras import SequenceExtras
from hicache.memory import DevicePool
from hicache.metrics import ComponentUsage
from hicache.spec import CacheSpec, ComponentSpec
from hicache.tree import TreeNode
from hicache.tree.components import ComponentValues, Tier, TreeComponent
from hicache.tree.node import PageIds, page_ids

__all__ = ["ComponentHits", "ComponentStores", "store_type"]

S = TypeVar("S", bound=ComponentStore)


def store_type(spec: ComponentSpec, types: Sequence[type[ComponentStore]]) -> type[ComponentStore]:
    """The store type of ``types`` that takes ``spec`` (ValueError when none does)."""
    for t in types:
        if type(spec) is t.spec_type:
            return t
    known = ", ".join(t.spec_type.__name__ for t in types)
    raise ValueError(f"no component store takes a {type(spec).__name__} (stores take: {known})")


@dataclass(frozen=True, slots=True)
class ComponentHits:
    """Admissions that reused a prefix, per component store: ``l1`` with the hit's values
    of the component in L1 already, ``l2`` with them copied from L2 (counted at the
    admission that succeeded, also when an earlier attempt did the copy)."""

    name: str
    l1: int
    l2: int


class ComponentStores:
    """The stores of one cache, in the spec's order; every method loops over them."""

    def __init__(self, stores: Sequence[ComponentStore]) -> None:
        self._stores = tuple(stores)
        self._by_name = {s.name: s for s in self._stores}
        self._hits = {s.name: [0, 0] for s in self._stores}

    @staticmethod
    def tree_components(
        spec: CacheSpec, types: Sequence[type[ComponentStore]]
    ) -> list[TreeComponent]:
        """The tree's extra components for ``spec`` (empty for a full-KV-only model)."""
        return [store_type(c, types).tree_component(c) for c in spec.components]

    @classmethod
    def build(
        cls, spec: CacheSpec, ctx: StoreContext, types: Sequence[type[ComponentStore]]
    ) -> ComponentStores:
        """One store per component of ``spec``."""
        return cls([store_type(c, types)(c, ctx) for c in spec.components])

    # ------------------------------------------------------------------ the list

    def __iter__(self) -> Iterator[ComponentStore]:
        return iter(self._stores)

    def __len__(self) -> int:
        return len(self._stores)

    @property
    def names(self) -> list[str]:
        """The component names present, in order."""
        return [s.name for s in self._stores]

    def get(self, name: str) -> ComponentStore | None:
        """The store of component ``name``, or None."""
        return self._by_name.get(name)

    def of_type(self, kind: type[S]) -> S | None:
        """The store of type ``kind``, or None."""
        return next((s for s in self._stores if isinstance(s, kind)), None)

    @property
    def resumes(self) -> bool:
        """Whether a store hands requests a state to resume from (a model that carries
        state between forwards can then resume cached prefixes)."""
        return any(s.resumes for s in self._stores)

    def runner_pools(self) -> dict[str, DevicePool]:
        """The L1 pools the model reads and writes directly, by component name."""
        return {s.name: p for s in self._stores if (p := s.runner_pool) is not None}

    # ------------------------------------------------------------------ requests

    def plan(self, req: CacheRequest, start: int, tokens: int) -> ChunkPlan:
        """The shortest end any store asks for, and every store's kept offsets there."""
        for s in self._stores:
            tokens = min(tokens, s.plan(req, start, tokens).tokens)
        keep: set[int] = set()
        for s in self._stores:
            plan = s.plan(req, start, tokens)
            if plan.tokens != tokens:  # pragma: no cover - a store's plan is monotone
                raise RuntimeError(f"store {s.name!r} shortened a forward it had accepted")
            keep.update(plan.keep)
        return ChunkPlan(tokens, tuple(sorted(keep)))

    def admit(self, req: CacheRequest, node: TreeNode, prefix_pages: int) -> bool:
        """Every store's admission; on a refusal the stores already admitted release
        ``req`` again and False is returned. Stores that loaded the hit from L2 are noted
        in the handle (kept across refused attempts, for the hit counts)."""
        done: list[ComponentStore] = []
        for s in self._stores:
            got = s.admit(req, node, prefix_pages)
            if got.loaded:
                req.note_loaded(s.name)
            if not got.ok:
                for d in reversed(done):
                    d.release(req)
                return False
            done.append(s)
        return True

    def count_hit(self, loaded: set[str]) -> None:
        """An admission reused a prefix; the stores in ``loaded`` copied its values from
        L2 (the others had them in L1)."""
        for name, hits in self._hits.items():
            hits[1 if name in loaded else 0] += 1

    def component_hits(self) -> tuple[ComponentHits, ...]:
        """Admissions that reused a prefix, per store, since the cache was built (see
        :class:`ComponentHits`)."""
        return tuple(ComponentHits(n, h[0], h[1]) for n, h in self._hits.items())

    @property
    def needed_on_hit(self) -> bool:
        """Whether a hit needs values of some store besides the full KV (one that is not
        :attr:`ComponentStore.optional`)."""
        return any(not s.optional for s in self._stores)

    def scoring_top(self) -> int | None:
        """The most alternatives per scored prompt position any store keeps (None: no
        store keeps scoring entries)."""
        tops = [t for s in self._stores if (t := s.scoring_top) is not None]
        return max(tops) if tops else None

    def cap(self, req: CacheRequest, wanted: Sequence[int]) -> int:
        """The fewest leading tokens of ``wanted`` any store lets ``req`` reuse."""
        n = len(wanted)
        for s in self._stores:
            n = min(n, s.cap(req, wanted[:n]))
        return n

    def grow(self, req: CacheRequest, tokens: int, computed: int | None) -> bool:
        return all(s.grow(req, tokens, computed) for s in self._stores)

    def keep(self, req: CacheRequest, extras: SequenceExtras) -> None:
        for s in self._stores:
            s.keep(req, extras)

    def values(self, req: CacheRequest, full: int, final: bool) -> dict[str, ComponentValues]:
        """What a commit of ``full`` pages hands the tree, by component."""
        out: dict[str, ComponentValues] = {}
        for s in self._stores:
            v = s.values(req, full, final)
            if v is not None:
                out[s.name] = v
        return out

    def committed(self, req: CacheRequest, last: TreeNode, full: int, computed: int) -> None:
        for s in self._stores:
            s.committed(req, last, full, computed)

    def late(self, req: CacheRequest, last: TreeNode, full: int) -> None:
        for s in self._stores:
            s.late(req, last, full)

    def take_added(self) -> bool:
        """Whether any store added values at nodes already in L2 (each store's flag is
        taken: see :meth:`ComponentStore.take_added`)."""
        return any([s.take_added() for s in self._stores])

    def release(self, req: CacheRequest) -> None:
        for s in self._stores:
            s.release(req)

    # ------------------------------------------------------------------ tiers

    def records(self) -> list[ComponentRecords]:
        """The L3 codecs of the stores (an L3 tier writes and reads them)."""
        return [s.records() for s in self._stores]

    def back_up(self, last: TreeNode) -> list[TreeNode]:
        """The full pages of a run ending at ``last`` are in L2: copy to L2 what a hit
        there needs of each component; returns the nodes that got L2 values."""
        backed: list[TreeNode] = []
        for s in self._stores:
            backed += s.back_up(last)
        return backed

    def free(self, tier: Tier, ids: Mapping[str, PageIds]) -> None:
        """Return ids the tree released, per component, to their ``tier`` pools."""
        for name, got in ids.items():
            store = self._by_name.get(name)
            if store is not None:
                store.free(tier, got)
            elif len(got):  # pragma: no cover - every tree component has a store
                raise RuntimeError(f"no store for component {name!r}")

    def reset(self, tiers: Sequence[Tier]) -> None:
        """Free every id the tree owns in ``tiers`` (the tree is reset next)."""
        for tier in tiers:
            for s in self._stores:
                s.free(tier, page_ids(s.owned(tier)))

    def check(self, requests: Sequence[CacheRequest], held: Mapping[str, list[int]]) -> None:
        """Every store's ownership check (AssertionError)."""
        for s in self._stores:
            s.check(requests, held)

    def usages(
        self, cached_tokens: int, requests: Sequence[CacheRequest] = ()
    ) -> list[ComponentUsage]:
        """Each store's pool use, with who holds its ids (``requests``: the admitted
        ones)."""
        return [s.usage_with_holders(cached_tokens, requests) for s in self._stores]
