"""Recurrent-state snapshots (Mamba2, Gated DeltaNet) as a component store of the one tree.

A model with recurrent layers resumes a cached prefix only from the state its recurrent
layers had at the prefix's end. This store keeps one slot of a
:class:`~hicache.memory.state_pool.StatePool` per cached boundary (the tree's
:class:`~hicache.tree.components.MambaState` component, ``"mamba"``) in L1 and,
hierarchical, backed up to L2 with the node's full KV. A match ends only at a node whose
snapshot is in some tier; admission brings a host-only snapshot to L1 and hands the
request its copy (:meth:`~hicache.cache.request.CacheRequest.take_resume`). Slots are the
tree's once inserted; copies go through the io backend's state copier
(:mod:`hicache.transfer.state`) on the owner's thread; a short pool evicts unpinned
snapshots in their own LRU (the node and its full KV stay: a tombstone). Where snapshots
are taken (``plan``: every ``mamba_track_interval`` tokens, the prompt's last boundary,
the ``max_prefix`` cap, the request's end) and marks vs forward ends:
docs/architecture.md, "Hybrid models" (recurrent state).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hicache.cache.components.base import (
    ChunkPlan,
    ComponentStore,
    NominalSize,
    ServingLimits,
    StoreAdmission,
    StoreContext,
)
from hicache.cache.components.records import ComponentRecords, RecordWrites
from hicache.cache.request import CacheRequest
from hicache.config import CacheConfig
from hicache.extras import KeptState, SequenceExtras
from hicache.memory.allocator import PageAllocator
from hicache.memory.state_pool import StatePool
from hicache.metrics import CacheCounters, ComponentUsage
from hicache.spec import ComponentSpec, KVSpec, SnapshotSpec
from hicache.transfer.state import make_state_copier
from hicache.tree import TreeNode
from hicache.tree.components import ComponentValues, MambaState, Tier, TreeComponent
from hicache.tree.node import PageIds, page_ids

log = logging.getLogger("hicache.cache")

__all__ = [
    "MIN_SNAPSHOT_SLOTS",
    "SNAPSHOT",
    "SnapshotRecords",
    "SnapshotStore",
    "check_snapshot_slots",
]

SNAPSHOT = SnapshotSpec.name
"""The tree component name of recurrent-state snapshots (``"mamba"``)."""

MIN_SNAPSHOT_SLOTS = 2
"""L1 state slots one recurrent request needs: the snapshot it resumes from (pinned while
it runs) plus one free for the snapshot it takes."""


def check_snapshot_slots(
    config: CacheConfig, kv: KVSpec, state: SnapshotSpec, max_running_requests: int
) -> None:
    """Refuse (ValueError with the numbers and the flags) an L1 state pool that cannot
    serve even one recurrent request (:data:`MIN_SNAPSHOT_SLOTS`); warn when it is smaller
    than ``max_running_requests + 1``: each running request pins the snapshot it resumed
    from (or last committed) and taking one needs a free slot, so with fewer slots some
    snapshots are dropped and a request whose prefix needs its snapshot in L1 waits for a
    slot. Both degrade reuse, never correctness."""
    slots = state.device_slots(config, kv)
    full = max_running_requests + 1
    kv_bytes = config.device_bytes(kv)
    if config.max_mamba_cache_size > 0:
        how = f"--max-mamba-cache-size {config.max_mamba_cache_size}"
    else:
        how = (
            f"--mamba-full-memory-ratio {config.mamba_full_memory_ratio:g} x the"
            f" {kv_bytes} B L1 KV pool"
        )

    def fix(need: int) -> str:
        ratio = need * state.slot_bytes / max(1, kv_bytes)
        return f"--max-mamba-cache-size >= {need} or --mamba-full-memory-ratio >= {ratio:.3g}"

    if slots < MIN_SNAPSHOT_SLOTS:
        raise ValueError(
            f"the L1 recurrent-state pool holds {slots} snapshot slot(s) of"
            f" {state.slot_bytes} B ({how}), but one request needs {MIN_SNAPSHOT_SLOTS} (the"
            f" snapshot it resumes from plus the one it takes): set {fix(MIN_SNAPSHOT_SLOTS)}"
        )
    if slots < full:
        log.warning(
            "the L1 recurrent-state pool holds %d snapshot slots (%s), fewer than the %d that"
            " --max-running-requests %d can pin at once: snapshots may be dropped and"
            " requests wait for a slot; set %s for full reuse",
            slots,
            how,
            full,
            max_running_requests,
            fix(full),
        )


@dataclass(slots=True)
class KeptStates:
    """One request's part of the snapshot store: states the runner kept that are still to
    be committed. ``boundaries``: at snapshot boundaries, committed by the next commit that
    covers them; ``end``: the latest past the prompt's last boundary, committed by the
    request's last commit only."""

    boundaries: list[KeptState] = field(default_factory=list)
    end: KeptState | None = None


class SnapshotStore(ComponentStore):
    """L1 (and optional L2) slots of recurrent-state snapshots for one cache."""

    spec_type = SnapshotSpec
    label = "snapshot"
    resumes = True

    def __init__(self, spec: ComponentSpec, ctx: StoreContext) -> None:
        super().__init__(spec, ctx)
        assert isinstance(spec, SnapshotSpec)
        config = ctx.config
        self.spec = spec
        self.page_size = config.page_size
        self.track_pages = spec.track_pages(config)
        self.track_interval = config.mamba_track_interval
        self._device_pool = StatePool.device(spec, spec.device_slots(config, ctx.kv), ctx.device)
        self.copier = make_state_copier(config.io_backend)
        self._host_pool: StatePool | None = None
        if ctx.hierarchical:
            self._host_pool = StatePool.host(
                spec, spec.host_slots(config, ctx.kv), config.mem_layout, ctx.device
            )

    @classmethod
    def tree_component(cls, spec: ComponentSpec) -> TreeComponent:
        return MambaState()

    @classmethod
    def check_limits(
        cls, config: CacheConfig, kv: KVSpec, spec: ComponentSpec, limits: ServingLimits
    ) -> None:
        assert isinstance(spec, SnapshotSpec)
        check_snapshot_slots(config, kv, spec, limits.max_running)

    @property
    def device_pool(self) -> StatePool:
        return self._device_pool

    @property
    def host_pool(self) -> StatePool | None:
        return self._host_pool

    def allocator(self, tier: Tier) -> PageAllocator:
        return self.pool(tier).allocator

    def usage(self, cached_tokens: int) -> ComponentUsage:
        return self._usage(self.spec.slot_bytes, cached_tokens)

    def records(self) -> SnapshotRecords:
        return SnapshotRecords(self)

    def nominal(self) -> NominalSize:
        """One snapshot per ``mamba_track_interval`` tokens."""
        sn, interval = self.spec, self.track_interval
        note = f"{sn.slot_bytes} B per snapshot, interval {interval} tokens"
        return NominalSize(sn.num_layers, sn.slot_bytes / interval, "slots", note)

    def pool(self, tier: Tier) -> StatePool:
        if tier is Tier.DEVICE:
            return self.device_pool
        if self._host_pool is None:
            raise RuntimeError("no L2 snapshot pool without the hierarchical cache")
        return self._host_pool

    # ------------------------------------------------------------------ slots

    def alloc(self, tier: Tier, n: int) -> PageIds | None:
        """``n`` free slots of ``tier``, evicting unpinned snapshots first; None if even
        that cannot make room."""
        alloc = self.pool(tier).allocator
        if alloc.free_pages < n:
            for node in self.tree.component_eviction_order(SNAPSHOT, tier):
                alloc.free(self.tree.evict_component(SNAPSHOT, node, tier))
                if alloc.free_pages >= n:
                    break
        got = alloc.alloc(n)
        return None if got is None else page_ids(got)

    def write(self, data: list[torch.Tensor]) -> int | None:
        """A new L1 slot holding ``data`` (canonical: one ``(1, L, *shape)`` tensor per
        state tensor); None when no slot can be had."""
        slots = self.alloc(Tier.DEVICE, 1)
        if slots is None:
            return None
        self._device_pool.write_slots(slots, data)
        return int(slots[0])

    def read(self, slot: int) -> list[torch.Tensor]:
        """The canonical tensors of L1 ``slot`` (copies)."""
        return self._device_pool.read_slots([slot])

    # ------------------------------------------------------------------ requests

    def _next_boundary(self, req: CacheRequest, pos: int) -> int | None:
        """The next position after ``pos`` at which ``req``'s state is snapshotted (see the
        module docstring), or None."""
        if not req.cacheable:
            return None
        ps = self.page_size
        last = (req.prompt_tokens - 1) // ps * ps
        step = self.track_pages * ps
        nxt = min((pos // step + 1) * step, last)
        hint = req.max_prefix
        if hint is None and req.scores is not None and req.scores.ask.start > 1:
            hint = req.scores.ask.start - 1  # a scoring request's cap without entries
        if hint is not None:  # where a request capped alike resumes
            cap = min(hint, last) // ps * ps
            if cap > pos:
                nxt = min(nxt, cap)
        return nxt if nxt > pos else None

    def _tracks_end(self, req: CacheRequest, pos: int) -> bool:
        """Whether a forward ending at ``pos`` keeps the state for ``req``'s end: a page
        boundary past the prompt's last snapshot boundary."""
        ps = self.page_size
        if not req.cacheable or pos % ps or self._next_boundary(req, pos) is not None:
            return False
        return pos > (req.prompt_tokens - 1) // ps * ps

    def plan(self, req: CacheRequest, start: int, tokens: int) -> ChunkPlan:
        """The first boundary inside ``[start, start + tokens)`` is a mark; the forward ends
        at a second one; the state after the forward is kept when it ends on a boundary or
        on a page boundary past the prompt's last one."""
        keep: list[int] = []
        boundary = self._next_boundary(req, start)
        if boundary is not None and boundary < start + tokens:
            keep.append(boundary - start)
            later = self._next_boundary(req, boundary)
            if later is not None and later < start + tokens:
                tokens = later - start
            boundary = later
        end = start + tokens
        if end == boundary or self._tracks_end(req, end):
            keep.append(tokens)
        return ChunkPlan(tokens, tuple(keep))

    def admit(self, req: CacheRequest, node: TreeNode, prefix_pages: int) -> StoreAdmission:
        """Bring the snapshot a hit at ``node`` needs to L1 (a copy of its L2 slot) and hand
        ``req`` a copy to resume from; not ok when L1 has no slot for it (the hit must not
        be used now)."""
        req.set_part(self.name, KeptStates())
        if node.parent is None:
            req.set_resume(None)
            return StoreAdmission(ok=True)
        nodes = self.tree.component_load_nodes(SNAPSHOT, node)
        if not self._load(nodes):
            req.set_part(self.name, None)
            return StoreAdmission(ok=False, loaded=bool(nodes))
        slot = int(self.tree.hit_ids(SNAPSHOT, node)[0])
        state = KeptState(prefix_pages * self.page_size, tuple(self.read(slot)))
        req.set_resume(SequenceExtras((state,)))
        return StoreAdmission(ok=True, loaded=bool(nodes))

    def _part(self, req: CacheRequest) -> KeptStates:
        part = req.part(self.name)
        assert isinstance(part, KeptStates), "the request is not admitted in the snapshot store"
        return part

    def keep(self, req: CacheRequest, extras: SequenceExtras) -> None:
        """States at snapshot boundaries wait for the commit that covers them; one past the
        prompt's last boundary replaces the request's end state."""
        part = self._part(req)
        last = (req.prompt_tokens - 1) // self.page_size * self.page_size
        for state in extras.states:
            if state.tokens % self.page_size:
                raise ValueError(
                    f"a state snapshot needs whole pages; got one after {state.tokens} tokens"
                )
            if state.tokens <= last:
                part.boundaries.append(state)
            else:
                part.end = state

    def values(self, req: CacheRequest, full: int, final: bool) -> ComponentValues | None:
        """A new L1 slot per kept state the commit covers past the request's prefix (the
        end state on its last commit only); states no slot can be had for are dropped."""
        part = self._part(req)
        due = [s for s in part.boundaries if s.tokens <= full * self.page_size]
        part.boundaries = [s for s in part.boundaries if s.tokens > full * self.page_size]
        if final and part.end is not None:
            if part.end.tokens <= full * self.page_size:
                due.append(part.end)
            part.end = None
        slots: dict[int, int] = {}
        for state in due:
            pages = state.tokens // self.page_size
            if pages <= req.prefix_pages:
                continue  # the tree holds that boundary already
            slot = self.write(list(state.tensors))
            if slot is not None:
                slots[pages] = slot
        return ComponentValues.snapshots(slots) if slots else None

    def release(self, req: CacheRequest) -> None:
        req.set_part(self.name, None)
        req.set_resume(None)

    # ------------------------------------------------------------------ tiers

    def _load(self, nodes: list[TreeNode]) -> bool:
        """Bring the snapshots of ``nodes`` (a hit's, host-only) to L1; False when L1 has no
        room (the caller must not use the hit)."""
        if not nodes:
            return True
        assert self._host_pool is not None
        for n in nodes:
            host = self.tree.component(SNAPSHOT).get(n, Tier.HOST)
            assert host is not None
            slots = self.alloc(Tier.DEVICE, len(host))
            if slots is None:
                return False
            self.copier.load(self._device_pool, self._host_pool, host, slots)
            self.tree.assign_component(SNAPSHOT, n, Tier.DEVICE, slots)
        return True

    def back_up(self, last: TreeNode) -> list[TreeNode]:
        """Copy to L2 the snapshots of the path ending at ``last`` whose full KV has L2
        pages: first the one a hit at ``last`` needs, then every other L1-only one on the
        path (boundaries inside the span, such as the end of a shared system prompt kept
        at a mark of the same forward, stay resumable from L2). A full L2 snapshot pool
        leaves the rest L1-only (such a node then is no L2 boundary). Returns the nodes
        that got an L2 snapshot, top-down."""
        if self._host_pool is None:
            return []
        window = self.tree.component_backup_nodes(SNAPSHOT, last)
        done = self._copy_to_host(window)
        if len(done) < len(window):
            return done
        return self._copy_to_host(self.l1_only_on_path(last)) + done

    def _copy_to_host(self, nodes: list[TreeNode]) -> list[TreeNode]:
        """Copy the L1 snapshots of ``nodes`` to fresh L2 slots, in order, until L2 has no
        room; returns the nodes copied."""
        assert self._host_pool is not None
        done: list[TreeNode] = []
        for n in nodes:
            dev = self.tree.component(SNAPSHOT).get(n, Tier.DEVICE)
            assert dev is not None
            slots = self.alloc(Tier.HOST, len(dev))
            if slots is None:
                break
            self.copier.backup(self._device_pool, self._host_pool, dev, slots)
            self.tree.assign_component(SNAPSHOT, n, Tier.HOST, slots)
            done.append(n)
        return done

    def host_ready(self) -> None:
        """Wait until every L1 -> L2 slot copy issued so far has landed (they may still be
        in flight on the current CUDA stream; on CPU they are done already). Call before
        another thread reads L2 slots (an L3 write)."""
        dev = self._device_pool.torch_device
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()


class SnapshotRecords(ComponentRecords):
    """The ``"mamba"`` component's L3 codec over one cache's snapshot store."""

    name = SNAPSHOT

    def __init__(self, snapshots: SnapshotStore) -> None:
        if snapshots.host_pool is None:
            raise ValueError("L3 snapshot records need the L2 snapshot pool")
        super().__init__(snapshots.tree, reach=0)
        self.snapshots = snapshots

    @property
    def pool(self) -> StatePool:
        assert self.snapshots.host_pool is not None
        return self.snapshots.host_pool

    def needed(self, depth_pages: int) -> range:
        return range(depth_pages, depth_pages + 1)

    def writes(self, nodes: Sequence[TreeNode]) -> RecordWrites | None:
        """The L2 snapshots held by ``nodes``; each node stays pinned (its own slot)."""
        comp = self.tree.component(SNAPSHOT)
        pins: list[TreeNode] = []
        pages: list[int] = []
        slots: list[int] = []
        for n in nodes:
            slot = comp.get(n, Tier.HOST)
            if slot is not None:
                pins.append(n)
                pages.append(self.tree.depth_pages(n))
                slots.append(int(slot[0]))
        return RecordWrites(tuple(pins), tuple(pages), page_ids(slots)) if pins else None

    def host_ready(self) -> None:
        self.snapshots.host_ready()

    def alloc(self, n: int) -> PageIds | None:
        return self.snapshots.alloc(Tier.HOST, n)

    def free(self, ids: PageIds) -> None:
        self.snapshots.free(Tier.HOST, ids)

    def adopt(
        self, last: TreeNode, depth_pages: int, pages: Sequence[int], ids: PageIds
    ) -> PageIds:
        """The one slot becomes ``last``'s L2 snapshot (``pages == [depth_pages]``)."""
        if (
            list(pages) != [depth_pages]
            or last.parent is None
            or last.host is None
            or self.tree.depth_pages(last) != depth_pages
            or self.tree.component(SNAPSHOT).get(last, Tier.HOST) is not None
        ):
            return ids
        self.tree.assign_component(SNAPSHOT, last, Tier.HOST, ids)
        return page_ids()

    def count_written(self, counters: CacheCounters, written: int, failed: int) -> None:
        counters.l3_backup_snapshots_total += written
        counters.l3_backup_snapshots_failed_total += failed
