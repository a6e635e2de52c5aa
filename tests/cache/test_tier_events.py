"""The L2 tier reports to the :class:`~hicache.cache.events.TierEvents` it is built with:
nothing is patched into it afterwards, and each event comes when its step happens."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hicache.cache.host_tier import HostTier
from hicache.config import CacheConfig, KVSpec
from hicache.controller import CompletionQueue
from hicache.memory import DevicePool
from hicache.metrics import CacheCounters
from hicache.transfer import Completion
from hicache.tree import HiRadixTree, TreeNode
from hicache.tree.components import Tier
from hicache.tree.node import PageIds

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
PAGE = 2


class Recorder:
    """TierEvents that record each call; ``drain`` applies the copies that landed."""

    def __init__(self, completions: CompletionQueue) -> None:
        self.completions = completions
        self.host: HostTier | None = None
        self.calls: list[tuple[str, object]] = []

    def drain(self) -> object:
        assert self.host is not None
        records = self.completions.drain()
        self.calls.append(("drain", len(records)))
        for r in records:
            assert isinstance(r, Completion)
            self.host.apply(r)
        return len(records)

    def backed_up(self, nodes: list[TreeNode]) -> None:
        self.calls.append(("backed_up", [n.id for n in nodes]))

    def backup_issued(self, last: TreeNode) -> None:
        self.calls.append(("backup_issued", last.id))

    def free_components(self, tier: Tier, ids: Mapping[str, PageIds]) -> None:
        self.calls.append(("free_components", (tier, dict(ids))))

    def fail_holders(self, top: TreeNode, reason: str) -> None:
        self.calls.append(("fail_holders", (top.id, reason)))

    def wait_backups(self) -> bool:  # pragma: no cover - the host tier never asks
        raise AssertionError("the host tier waits for its own copies")


def test_the_host_tier_reports_each_step_to_its_events() -> None:
    cfg = CacheConfig(page_size=PAGE, device_tokens=16, hicache_ratio=2.0)
    tree = HiRadixTree(PAGE, cfg.eviction_policy)
    pool = DevicePool(SPEC, cfg.device_pages, PAGE)
    completions = CompletionQueue()
    events = Recorder(completions)
    host = HostTier(
        tree=tree,
        device_pool=pool,
        config=cfg,
        spec=SPEC,
        device=torch.device("cpu"),
        completions=completions,
        counters=CacheCounters(),
        events=events,
        wait_timeout_s=10.0,
    )
    events.host = host
    host.start()
    try:
        pages = pool.allocator.alloc(2)
        assert pages is not None
        node = tree.insert([1, 2, 3, 4], pages).last_node
        host.back_up(node, 0, wait=True)
        assert events.calls == [
            ("backup_issued", node.id),  # its L2 pages are assigned: stores back up now
            ("drain", 1),  # waiting applies what landed, through the owner
            ("backed_up", [node.id]),  # the landed run, for L3
        ]
        assert node.host is not None and node.lock_ref == 0
        events.calls.clear()
        assert host.evict(2) == 2  # its L2 copy (the node stays in L1)
        assert node.host is None and node.device is not None
        assert events.calls == [("free_components", (Tier.HOST, {}))]  # no component ids
    finally:
        host.close()
