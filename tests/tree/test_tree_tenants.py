"""Tenant state in the tree is bounded: a tenant's root lives only while it caches something.

Issue 8, defect 6 (tree side): each distinct ``cache_salt`` kept a root for ever.
"""

from __future__ import annotations

from typing import Any

import pytest

from hicache.tree import HiRadixTree
from hicache.tree.node import page_ids


def test_300_tenants_inserted_then_evicted_leave_only_the_shared_root() -> None:
    t = HiRadixTree(page_size=2)
    for i in range(300):
        tenant = f"salt-{i}" * 50
        t.insert([1, 2, 3, 4], [2 * i, 2 * i + 1], tenant=tenant)
        assert t.match_prefix([1, 2, 3, 4], tenant).device_tokens == 4
    assert len(t.tenants) == 300 and len(t.roots) == 301
    assert t.check_integrity().nodes == 300
    freed = [p for node in t.device_eviction_order() for p in t.evict_device(node)]
    assert sorted(freed) == list(range(600))
    assert t.tenants == [] and t.roots == [t.root]
    assert t.check_integrity().nodes == 0


def test_a_backed_up_tenant_lives_until_its_last_host_copy_goes() -> None:
    t = HiRadixTree(page_size=1)
    t.insert([1, 2], [0, 1], tenant="acme")
    node = t.match_prefix([1, 2], "acme").last_device_node
    t.assign_host(node, page_ids([5, 6]))
    for n in t.device_eviction_order():
        t.evict_device(n)
    assert t.tenants == ["acme"] and t.check_integrity().host_pages == 2
    assert not t.prune_tenant("acme")  # still caches something
    (victim,) = t.host_eviction_order()
    assert list(t.evict_host(victim)) == [5, 6]
    assert t.tenants == [] and not t.has_tenant("acme") and t.has_tenant("")
    t.check_integrity()


def test_misses_and_sub_page_inserts_create_no_tenant() -> None:
    t = HiRadixTree(page_size=4)
    assert t.match_prefix([1, 2, 3, 4, 5], "nobody").matched_tokens == 0
    r = t.insert([1, 2, 3], [], tenant="short")  # shorter than a page: nothing stored
    assert r.new_node is None
    r = t.insert_host([1, 2, 3], page_ids(), 0, "short-host")
    assert r.new_node is None
    assert t.tenants == [] and t.roots == [t.root]
    t.check_integrity()


def test_a_partly_evicted_tenant_keeps_its_root_and_pruning_is_idempotent() -> None:
    t = HiRadixTree(page_size=1)
    t.insert([1], [0], tenant="a")
    t.insert([2], [1], tenant="a")
    first = next(iter(t.device_eviction_order()))
    t.evict_device(first)
    assert t.tenants == ["a"] and not t.prune_tenant("a")
    for n in t.device_eviction_order():
        t.evict_device(n)
    assert t.prune_tenant("a") and t.prune_tenant("never-seen") and t.prune_tenant("")
    assert t.root.parent is None and t.roots == [t.root]


def test_reset_drops_every_tenant() -> None:
    t = HiRadixTree(page_size=1)
    for i in range(5):
        t.insert([1], [i], tenant=str(i))
    t.reset()
    assert t.tenants == [] and t.check_integrity().nodes == 0


def test_a_tenant_comes_back_after_pruning() -> None:
    t = HiRadixTree(page_size=1)
    t.insert([7, 8], [0, 1], tenant="x")
    for n in t.device_eviction_order():
        t.evict_device(n)
    assert t.tenants == []
    t.insert([7, 8], [2, 3], tenant="x")
    assert list(t.match_prefix([7, 8], "x").device_pages) == [2, 3]
    assert t.match_prefix([7, 8]).matched_tokens == 0  # still apart from the shared root
    assert t.tenants == ["x"]
    t.check_integrity()


@pytest.mark.parametrize("bad", [None, 1, b"salt", ["a"]])
def test_non_str_tenants_are_rejected(bad: Any) -> None:
    t = HiRadixTree(page_size=1)
    with pytest.raises(TypeError, match="tenant"):
        t.insert([1], [0], tenant=bad)
    with pytest.raises(TypeError, match="tenant"):
        t.match_prefix([1], bad)
    with pytest.raises(TypeError, match="tenant"):
        t.insert_host([1], page_ids([0]), 0, bad)
    assert t.check_integrity().nodes == 0 and t.tenants == []
