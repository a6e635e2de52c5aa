"""The L2 tier reports to its peers, given at construction: landed backups to the cache's
:class:`~hicache.cache.sync.CacheSync` (which hands them to L3), issued backups and
released component ids to the component stores. Nothing is patched into it afterwards,
nothing calls up into a facade, and each report comes when its step happens."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hicache.cache.components.stores import ComponentStores
from hicache.cache.host_tier import HostTier
from hicache.cache.sync import CacheSync
from hicache.config import CacheConfig
from hicache.controller import Record
from hicache.controller.agreement import Verdict, Vote
from hicache.memory import DevicePool
from hicache.metrics import CacheCounters
from hicache.spec import KVSpec
from hicache.tree import HiRadixTree, TreeNode
from hicache.tree.components import Tier
from hicache.tree.node import PageIds

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
PAGE = 2

Calls = list[tuple[str, object]]


class RecordingStores(ComponentStores):
    """An empty store list that records what the tier hands it."""

    def __init__(self, calls: Calls) -> None:
        super().__init__([])
        self.calls = calls

    def back_up(self, last: TreeNode) -> list[TreeNode]:
        self.calls.append(("backup_issued", last.id))
        return []

    def free(self, tier: Tier, ids: Mapping[str, PageIds]) -> None:
        self.calls.append(("free_components", (tier, dict(ids))))


class RecordingL3:
    """An L3 party with no ops of its own that records the runs handed to it."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    def claim(self, record: Record) -> bool:
        return False

    def votes(self) -> list[Vote]:
        return []

    def apply_agreed(self, verdict: Verdict) -> bool:  # pragma: no cover
        raise AssertionError("no L3 op is in flight")

    def apply_deferred(self) -> None:
        self.calls.append(("apply_deferred", None))

    def on_host_backup(self, nodes: list[TreeNode]) -> None:
        self.calls.append(("backed_up", [n.id for n in nodes]))


def test_the_host_tier_reports_each_step_to_its_peers() -> None:
    cfg = CacheConfig(page_size=PAGE, device_tokens=16, hicache_ratio=2.0)
    tree = HiRadixTree(PAGE, cfg.eviction_policy)
    pool = DevicePool(SPEC, cfg.device_pages, PAGE)
    calls: Calls = []
    sync = CacheSync(tree=tree, token_bytes=SPEC.token_bytes, wait_timeout_s=10.0)
    l3 = RecordingL3(calls)
    sync.serve(l3)
    sync.serve_backups(l3)
    host = HostTier(
        tree=tree,
        device_pool=pool,
        config=cfg,
        spec=SPEC,
        device=torch.device("cpu"),
        sync=sync,
        stores=RecordingStores(calls),
        counters=CacheCounters(),
    )
    host.start()
    try:
        pages = pool.allocator.alloc(2)
        assert pages is not None
        node = tree.insert([1, 2, 3, 4], pages).last_node
        host.back_up(node, 0, wait=True)
        assert calls == [
            ("backup_issued", node.id),  # its L2 pages are assigned: stores back up now
            ("backed_up", [node.id]),  # applied inside the sync's wait, handed on to L3
        ]  # and nothing deferred applied: a wait applies none (its caller may hold pins)
        assert node.host is not None and node.lock_ref == 0 and not sync.inside
        calls.clear()
        assert sync.sync() == 0 and calls == [("apply_deferred", None)]  # a sync applies it
        calls.clear()
        assert host.evict(2) == 2  # its L2 copy (the node stays in L1)
        assert node.host is None and node.device is not None
        assert calls == [("free_components", (Tier.HOST, {}))]  # no component ids
    finally:
        host.close()
