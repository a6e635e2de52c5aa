"""The L1 tier on its own: built with what it needs (no host tier here), it evicts in
policy order, returns the component values a node held to the component stores, counts
what it dropped, and keeps reserved pages out of circulation."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from hicache.cache.components.stores import ComponentStores
from hicache.cache.device_tier import DeviceTier
from hicache.cache.no_host_tier import NoHostTier
from hicache.config import CacheConfig
from hicache.controller import write_rule
from hicache.memory import DevicePool
from hicache.metrics import CacheCounters
from hicache.spec import KVSpec
from hicache.tree import HiRadixTree
from hicache.tree.components import ComponentValues, SlidingWindow, Tier
from hicache.tree.node import PageIds

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32")
PAGE = 2


class FreedStores(ComponentStores):
    """An empty store list that records the component ids handed back to it."""

    def __init__(self) -> None:
        super().__init__([])
        self.freed: list[tuple[Tier, dict[str, list[int]]]] = []

    def free(self, tier: Tier, ids: Mapping[str, PageIds]) -> None:
        self.freed.append((tier, {k: list(v) for k, v in ids.items() if len(v)}))


def make_tier() -> tuple[DeviceTier, list[tuple[Tier, dict[str, list[int]]]]]:
    cfg = CacheConfig(page_size=PAGE, device_tokens=8, enable_hierarchical_cache=False)
    tree = HiRadixTree(PAGE, cfg.eviction_policy, [SlidingWindow(2)])
    stores = FreedStores()
    tier = DeviceTier(
        tree=tree,
        pool=DevicePool(SPEC, cfg.device_pages, PAGE),
        rule=write_rule(cfg),
        counters=CacheCounters(),
        host=NoHostTier(),
        stores=stores,
    )
    return tier, stores.freed


def test_allocation_evicts_cached_pages_and_returns_their_component_values() -> None:
    tier, freed = make_tier()
    pages = tier.alloc(4)
    assert pages is not None and list(pages) == [0, 1, 2, 3] and tier.allocator.free_pages == 0
    swa = ComponentValues.pages(0, [10, 11])  # ids of another pool: the tier only hands on
    tier.tree.insert([1, 2, 3, 4], pages[:2], components={"swa": swa})
    tier.free(pages[2:])
    got = tier.alloc(4)  # 2 free, the cached node's 2 evicted
    assert got is not None and sorted(got) == [0, 1, 2, 3]
    assert freed == [(Tier.DEVICE, {"swa": [10, 11]})]
    assert tier.counters.device_evicted_tokens_total == 4
    assert tier.counters.device_demoted_tokens_total == 0
    assert list(tier.tree.iter_nodes()) == []
    assert tier.alloc(1) is None  # nothing left to evict


def test_reserved_pages_are_out_of_circulation_until_unreserved() -> None:
    tier, _ = make_tier()
    assert tier.pages == 4
    reserved = tier.reserve(1)
    assert reserved is not None and tier.reserved == list(reserved) and tier.pages == 3
    assert tier.alloc(4) is None
    with pytest.raises(ValueError, match="L1 page 3 is not reserved"):
        tier.unreserve([int(reserved[0]), 3])
    assert tier.reserved == list(reserved)  # nothing freed by the refused call
    tier.unreserve(reserved)
    assert tier.reserved == [] and tier.pages == 4 and tier.allocator.free_pages == 4
