"""The DSA indexer's key cache as a component store: pools on the full KV's page ids.

DeepSeek-V3.2 scores every cached token with a small indexer (one key of
``index_head_dim`` values per token and layer) and attends to the top-k. This store keeps
an L1 pool (``config.device_pages`` pages) and, hierarchical, an L2 pool (as many pages as
the full KV's, same layout), each indexed by **the full KV's page ids**: the keys of the
token in full-KV slot ``s`` of a tier are at slot ``s`` of this store's pool there. So it
has no allocator and frees nothing: it follows the full KV's allocations, evictions (the
tree's cascade) and L3 records. The tree's :class:`~hicache.tree.components.IndexerKeys`
makes the hit policy ALL_PAGES. Copies run beside the full KV's, on the owner's thread, at
:meth:`IndexerStore.back_up` and :meth:`IndexerStore.admit`; :meth:`IndexerStore.committed`
marks keys only on nodes whose L1 pages are the request's. L3: one ``"indexer"`` record per
page; a hit of ``d`` pages needs pages ``1..d`` (:class:`IndexerRecords`, read into the L2
pages of the same pages' full KV). The worked example and why the copies sit beside the
full KV's: docs/architecture.md, "Hybrid models".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch

from hicache.cache.components.base import (
    HeldPages,
    NominalSize,
    StoreAdmission,
    StoreContext,
)
from hicache.cache.components.paged import PagedStore, ids_tensor
from hicache.cache.components.records import ComponentRecords, RecordWrites
from hicache.cache.request import CacheRequest, SlotTable
from hicache.memory import DevicePool, HostPool
from hicache.memory.allocator import PageAllocator
from hicache.metrics import CacheCounters, ComponentUsage
from hicache.spec import ComponentSpec, IndexerSpec
from hicache.tree import TreeNode
from hicache.tree.components import IndexerKeys, Tier, TreeComponent
from hicache.tree.node import PageIds, page_ids

__all__ = ["INDEXER", "IndexerRecords", "IndexerSlots", "IndexerStore"]

INDEXER = IndexerSpec.name
"""The tree component name of the indexer's keys (``"indexer"``)."""

ALL_PAGES_REACH = 1 << 40
""":attr:`ComponentRecords.reach` of ALL_PAGES: a hit needs the records of every page
from the first, however far before a fetch's first page. So a prefetch also checks the
presence of the records of the prefix the tree holds (one presence check per held page,
on the prefetch thread), though it reads none of those: the tree holds their keys."""


class IndexerSlots(SlotTable):
    """A request's part of the indexer store: its slots are its full-KV slots (the keys of
    every position it holds), and what a commit of its pages hands the tree."""

    __slots__ = ("pending", "request")

    def __init__(self, request: CacheRequest) -> None:
        self.request = request
        self.pending: PageIds = page_ids()
        """The request's L1 pages of its last commit, before the insert (whose pages
        the request computed the keys of)."""

    def slots(self, page_size: int, upto: int) -> torch.Tensor:
        return self.request.slots(page_size, upto)

    def __repr__(self) -> str:
        return f"IndexerSlots(pages={len(self.request.pages)})"


class IndexerStore(PagedStore):
    """The indexer's keys of one cache, on the full KV's page ids (see the module doc)."""

    spec_type: ClassVar[type[ComponentSpec]] = IndexerSpec
    label = "indexer"

    def __init__(self, spec: ComponentSpec, ctx: StoreContext) -> None:
        super().__init__(spec, ctx)
        assert isinstance(spec, IndexerSpec)
        config = ctx.config
        self.spec = spec
        # as many pages as the full KV's pools (the same page ids)
        self._build_pools(spec.kv, ctx, config.device_pages, config.host_pages(ctx.kv))

    @classmethod
    def tree_component(cls, spec: ComponentSpec) -> TreeComponent:
        assert isinstance(spec, IndexerSpec)
        return IndexerKeys()

    # ------------------------------------------------------------------ pools

    @property
    def runner_pool(self) -> DevicePool | None:
        """The sparse layers' indexer reads and writes its keys here."""
        return self._device_pool

    def allocator(self, tier: Tier) -> PageAllocator:
        raise RuntimeError(
            "the indexer has no allocator: its pages are the full KV's (same page ids)"
        )

    def free(self, tier: Tier, ids: PageIds) -> None:
        """Nothing to free: the full KV's allocators own these page ids."""

    def usage(self, cached_tokens: int) -> ComponentUsage:
        """The full KV's L1 pages are this pool's used pages (``cached_tokens`` of them,
        over the page size); L2: the pages whose keys the tree holds there."""
        ps = self.page_size
        host = self._host_pool
        return ComponentUsage(
            name=self.name,
            device_used=cached_tokens // ps,
            device_total=self._device_pool.num_pages,
            host_used=0 if host is None else len(self.owned(Tier.HOST)),
            host_total=0 if host is None else host.num_pages,
            unit_bytes=self.spec.kv.token_bytes * ps,
            bytes_per_cached_token=float(self.spec.kv.token_bytes) if cached_tokens else 0.0,
        )

    def nominal(self) -> NominalSize:
        kv = self.spec.kv
        return NominalSize(
            kv.num_layers, float(kv.token_bytes), "pages", "on the full KV's page ids"
        )

    def records(self) -> IndexerRecords:
        return IndexerRecords(self)

    # ------------------------------------------------------------------ copies

    def _copy(self, nodes: Sequence[TreeNode], to: Tier) -> None:
        """Copy the keys of ``nodes`` from the other tier to ``to``, page for page between
        the node's full-KV ids of the two tiers, and mark them present in ``to``."""
        if not nodes:
            return
        assert self._host_pool is not None
        host = page_ids()
        device = page_ids()
        for n in nodes:
            assert n.host is not None and n.device is not None
            host += n.host
            device += n.device
        if to is Tier.DEVICE:
            self.copier.load(
                self._device_pool, self._host_pool, ids_tensor(host), ids_tensor(device)
            )
        else:
            self.copier.backup(
                self._device_pool, self._host_pool, ids_tensor(device), ids_tensor(host)
            )
        for n in nodes:
            ids = n.device if to is Tier.DEVICE else n.host
            assert ids is not None
            self.tree.assign_component(self.name, n, to, ids)

    def back_up(self, last: TreeNode) -> list[TreeNode]:
        """The full KV of the run ending at ``last`` got L2 pages: copy the keys of every
        node on the path with L2 full KV whose keys are in L1 only (the run, and any node
        above it that lacks them) to the same L2 pages."""
        if self._host_pool is None:
            return []
        nodes = self.l1_only_on_path(last)
        self._copy(nodes, Tier.HOST)
        return nodes

    # ------------------------------------------------------------------ requests

    def part_of(self, req: CacheRequest) -> IndexerSlots | None:
        part = req.part(self.name)
        assert part is None or isinstance(part, IndexerSlots)
        return part

    def admit(self, req: CacheRequest, node: TreeNode, prefix_pages: int) -> StoreAdmission:
        """The hit ending at ``node`` has its full KV in L1 (or arriving): copy the keys
        of its nodes whose keys are in L2 only (the chain being loaded back) to their new
        L1 pages. Never refuses: the pages are the full KV's, allocated already."""
        nodes = self.tree.component_load_nodes(self.name, node) if node.parent is not None else []
        self._copy(nodes, Tier.DEVICE)
        req.set_part(self.name, IndexerSlots(req))
        return StoreAdmission(ok=True, loaded=bool(nodes))

    def values(self, req: CacheRequest, full: int, final: bool) -> None:
        """Nothing for the insert to place (it would give a node whose L1 pages are not
        the request's the request's ids); the request's pages are noted for
        :meth:`committed`."""
        part = self.part_of(req)
        assert part is not None, "the request holds no indexer part"
        part.pending = req.pages[:full]
        return None

    def committed(self, req: CacheRequest, last: TreeNode, full: int, computed: int) -> None:
        """Mark the keys present in L1 on the committed path's nodes that lack them and
        whose L1 pages are the ones the request computed its keys into; then copy to L2
        those whose full KV is in L2 already (a span recomputed over its L2 copy)."""
        part = self.part_of(req)
        assert part is not None
        pending, part.pending = part.pending, page_ids()
        comp = self.tree.component(self.name)
        at = full
        for n in reversed(self.tree.path_tail(last, full)):
            k = self.tree.num_pages(n)
            at -= k
            if (
                n.device is not None
                and comp.get(n, Tier.DEVICE) is None
                and n.device == pending[at : at + k]
            ):
                self.tree.assign_component(self.name, n, Tier.DEVICE, n.device)
        self.back_up(last)

    def release(self, req: CacheRequest) -> None:
        req.set_part(self.name, None)

    def held(self, req: CacheRequest) -> HeldPages | None:
        """The keys' pages: the full KV's page ids of every position."""
        if self.part_of(req) is None:
            return None
        return HeldPages(self.name, self.device_pool, 0, req.pages[:])

    def request_ids(self, requests: Sequence[CacheRequest]) -> list[int]:
        """The L1 pages ``requests`` own (their full-KV pages beyond the tree's): their keys
        are written there."""
        out: list[int] = []
        for r in requests:
            if self.part_of(r) is not None:
                out += r.pages[r.prefix_pages :]
        return out

    # ------------------------------------------------------------------ integrity

    def check(self, requests: Sequence[CacheRequest], held: Mapping[str, list[int]]) -> None:
        """Every node's keys, per tier, are absent or on the full KV's ids there (the tree
        component's check); L3 reads hold only full-KV L2 pages (the ids they read records
        into are those pages). Raises AssertionError."""
        comp = self.tree.component(self.name)
        for n in self.tree.iter_nodes():
            comp.check(n, self.tree.num_pages(n))
        for r in requests:
            part = self.part_of(r)
            assert part is None or part.request is r, "an indexer part of another request"


class IndexerRecords(ComponentRecords):
    """The ``"indexer"`` component's L3 codec: one record per page (the keys of its
    tokens in every layer); a hit of ``d`` pages needs the records of pages ``1..d``."""

    name = INDEXER

    def __init__(self, store: IndexerStore) -> None:
        if store.host_pool is None:
            raise ValueError("L3 indexer records need the L2 indexer pool")
        super().__init__(store.tree, reach=ALL_PAGES_REACH)
        self.store = store

    @property
    def pool(self) -> HostPool:
        assert self.store.host_pool is not None
        return self.store.host_pool

    def needed(self, depth_pages: int) -> range:
        return range(1, depth_pages + 1)

    def writes(self, nodes: Sequence[TreeNode]) -> RecordWrites | None:
        """The keys of every node of the run that holds them in L2, from those L2 pages;
        the run's last node stays pinned in L2 (its path-wise pin holds every node's full
        KV, so every node's keys) until the write's record arrives."""
        comp = self.tree.component(self.name)
        pages: list[int] = []
        ids = page_ids()
        for n in nodes:
            host = comp.get(n, Tier.HOST)
            if host is None:
                continue
            first = self.tree.depth_pages(n) - self.tree.num_pages(n) + 1
            pages.extend(range(first, first + len(host)))
            ids += host
        return RecordWrites((nodes[-1],), tuple(pages), ids) if pages else None

    def host_ready(self) -> None:
        self.store.host_ready()

    def alloc(self, n: int) -> PageIds | None:
        """None: records are read only into the L2 pages of the full KV they go with
        (:meth:`alloc_read`), never into ids of their own."""
        return None

    def alloc_read(
        self, pages: Sequence[int], start_page: int, host_pages: PageIds
    ) -> PageIds | None:
        """The L2 pages a prefetch reads the full KV of pages ``start_page + 1 ..`` into,
        at ``pages``; None when one of ``pages`` is not among them (the tree holds that
        page's full KV without its keys: no read of this kind can serve it)."""
        end = start_page + len(host_pages)
        if not all(start_page < j <= end for j in pages):
            return None
        return page_ids([host_pages[j - start_page - 1] for j in pages])

    def free(self, ids: PageIds) -> None:
        """Nothing to free: the ids are full-KV L2 pages, which the storage tier frees."""

    def adopt(
        self, last: TreeNode, depth_pages: int, pages: Sequence[int], ids: PageIds
    ) -> PageIds:
        """Mark the keys present in L2 on each node of the path to ``last`` whose pages
        were all read into its own L2 pages and which has no L2 keys yet (a node the tree
        held already keeps what it had: its pages were not the ones read into)."""
        if last.parent is None or self.tree.depth_pages(last) != depth_pages:
            return ids
        comp = self.tree.component(self.name)
        where = {p: i for i, p in enumerate(pages)}
        used: set[int] = set()
        end = depth_pages
        for n in reversed(self.tree.path_tail(last, depth_pages)):
            k = self.tree.num_pages(n)
            idx = [where.get(p) for p in range(end - k + 1, end + 1)]
            end -= k
            if any(i is None for i in idx) or n.host is None or comp.get(n, Tier.HOST) is not None:
                continue
            got = page_ids([int(ids[i]) for i in idx if i is not None])
            if got == n.host:
                self.tree.assign_component(self.name, n, Tier.HOST, got)
                used.update(i for i in idx if i is not None)
        return page_ids([int(x) for i, x in enumerate(ids) if i not in used])

    def count_written(self, counters: CacheCounters, written: int, failed: int) -> None:
        counters.l3_backup_indexer_pages_total += written
        counters.l3_backup_indexer_pages_failed_total += failed
