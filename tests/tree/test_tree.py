"""Exact-state tests of the HiRadixTree (pure Python, tiny sizes)."""

from __future__ import annotations

import pytest

from hicache.config import EvictionPolicy
from hicache.tree import HiRadixTree, MatchStop, decode_tokens, encode_tokens
from hicache.tree.node import PageIds, page_ids


def ids(arr: object) -> list[int]:
    return list(arr)  # type: ignore[call-overload]


def test_encode_roundtrip_and_bad_ids() -> None:
    assert decode_tokens(encode_tokens([0, 1, 2**32 - 1])) == [0, 1, 2**32 - 1]
    with pytest.raises(ValueError, match="token ids"):
        encode_tokens([-1])
    with pytest.raises(ValueError, match="token ids"):
        encode_tokens([2**32])


def test_match_is_page_aligned_and_splits_inside_a_node() -> None:
    t = HiRadixTree(page_size=2)
    r = t.insert([1, 2, 3, 4, 5, 6, 7], [10, 11, 12])  # 7 tokens: 3 whole pages, tail ignored
    assert (
        r.cached_tokens == 0 and r.new_node is not None and ids(r.new_node.device) == [10, 11, 12]
    )
    m = t.match_prefix([1, 2, 3, 4, 9, 9])
    assert ids(m.device_pages) == [10, 11]
    assert m.device_tokens == 4 and m.host_tokens == 0
    assert m.stop is MatchStop.DIVERGED
    # the node was split at the page boundary: [1,2,3,4] -> [5,6]
    head = m.last_device_node
    assert decode_tokens(head.key) == [1, 2, 3, 4] and ids(head.device) == [10, 11]
    (tail,) = head.children.values()
    assert decode_tokens(tail.key) == [5, 6] and ids(tail.device) == [12]
    assert t.check_integrity().nodes == 2
    # a query diverging inside the first page of a node matches nothing
    assert t.match_prefix([1, 9]).stop is MatchStop.NO_CHILD
    assert t.match_prefix([1, 2, 3]).stop is MatchStop.END_OF_KEY
    assert ids(t.match_prefix([1, 2, 3]).device_pages) == [10]


def test_insert_returns_duplicates_and_keeps_tree_pages() -> None:
    t = HiRadixTree(page_size=1)
    t.insert([1, 2, 3], [0, 1, 2])
    r = t.insert([1, 2, 3, 4], [0, 7, 8, 9])  # page 0 is the tree's own; 7, 8 duplicate
    assert ids(r.duplicate_pages) == [7, 8]
    assert r.cached_tokens == 3 and r.new_node is not None and ids(r.new_node.device) == [9]
    assert ids(t.match_prefix([1, 2, 3, 4]).device_pages) == [0, 1, 2, 9]
    assert r.last_node.hit_count == 1 and r.last_node.parent is not None
    assert r.last_node.parent.hit_count == 1  # insert counts no hit on a reused span
    t.count_hit(r.last_node.parent)  # the request that reused it counts once
    assert r.last_node.parent.hit_count == 2 and r.last_node.hit_count == 1
    t.check_integrity()


def test_insert_length_mismatch_raises() -> None:
    t = HiRadixTree(page_size=2)
    with pytest.raises(ValueError, match="2 whole pages"):
        t.insert([1, 2, 3, 4], [0])


def test_lock_protects_path_and_underflow_raises() -> None:
    t = HiRadixTree(page_size=1)
    t.insert([1, 2], [0, 1])
    t.insert([1, 3], [0, 2])  # splits [1,2] into [1] -> {[2], [3]}
    leaf3 = t.match_prefix([1, 3]).last_device_node
    t.inc_lock_ref(leaf3)
    s = t.check_integrity()
    assert (s.device_pages, s.protected_device_pages, s.evictable_device_pages) == (3, 2, 1)
    order = list(t.device_eviction_order())
    assert [decode_tokens(n.key) for n in order] == [[2]]
    t.dec_lock_ref(leaf3)
    with pytest.raises(RuntimeError, match="underflow"):
        t.dec_lock_ref(leaf3)
    assert leaf3.lock_ref == 0 and t.check_integrity().protected_device_pages == 0


def _three_leaves(policy: EvictionPolicy) -> HiRadixTree:
    t = HiRadixTree(page_size=1, eviction_policy=policy)
    t.insert([1], [0])  # a: oldest
    t.insert([2], [1])  # b
    t.insert([3], [2], priority=5)  # c: newest, high priority
    t.count_hit(t.insert([2], [1]).last_node)  # b: a second request reuses it
    t.match_prefix([1])  # a: most recently used
    return t


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (EvictionPolicy.LRU, [[3], [2], [1]]),
        (EvictionPolicy.LFU, [[3], [1], [2]]),
        (EvictionPolicy.FIFO, [[1], [2], [3]]),
        (EvictionPolicy.PRIORITY, [[2], [1], [3]]),
    ],
)
def test_eviction_order_per_policy(policy: EvictionPolicy, expected: list[list[int]]) -> None:
    t = _three_leaves(policy)
    freed = []
    for node in t.device_eviction_order():
        freed.append(decode_tokens(node.key))
        t.evict_device(node)
    assert freed == expected
    assert t.check_integrity().nodes == 0


def test_device_eviction_demotes_backed_up_and_parent_joins_order() -> None:
    t = HiRadixTree(page_size=1)
    t.insert([1, 2], [0, 1])
    t.insert([1, 3], [0, 2])
    head = t.match_prefix([1]).last_device_node
    leaf2 = t.match_prefix([1, 2]).last_device_node
    with pytest.raises(RuntimeError, match="contiguity"):
        t.assign_host(leaf2, encode_pages([6]))  # parent not backed up yet
    t.assign_host(head, encode_pages([5]))
    t.assign_host(leaf2, encode_pages([6]))
    freed = []
    for node in t.device_eviction_order():
        freed += ids(t.evict_device(node))
    # [1,3] not backed up: removed; [1,2] and [1] backed up: demoted; LRU order
    assert sorted(freed) == [0, 1, 2]
    s = t.check_integrity()
    assert (s.nodes, s.device_pages, s.host_pages) == (2, 0, 2)
    m = t.match_prefix([1, 2, 3])
    assert m.device_tokens == 0 and m.host_tokens == 2 and m.stop is MatchStop.NO_CHILD
    assert [decode_tokens(n.key) for n in t.host_only_path(m.last_host_node)] == [[1], [2]]


def test_host_eviction_only_takes_unpinned_host_only_leaves() -> None:
    t = HiRadixTree(page_size=1)
    t.insert([1, 2], [0, 1])
    node = t.match_prefix([1, 2]).last_device_node
    t.assign_host(node, encode_pages([3, 4]))
    assert list(t.host_eviction_order()) == []  # still in L1
    for n in t.device_eviction_order():
        t.evict_device(n)
    t.inc_host_ref(node)
    assert list(t.host_eviction_order()) == []  # pinned
    t.dec_host_ref(node)
    (victim,) = list(t.host_eviction_order())
    assert ids(t.evict_host(victim)) == [3, 4]
    assert t.check_integrity().nodes == 0


def test_insert_over_host_only_node_adopts_pages() -> None:
    t = HiRadixTree(page_size=2)
    t.insert([1, 2, 3, 4], [0, 1])
    node = t.match_prefix([1, 2, 3, 4]).last_device_node
    t.assign_host(node, encode_pages([7, 8]))
    for n in t.device_eviction_order():
        t.evict_device(n)
    r = t.insert([1, 2, 3, 4, 5, 6], [4, 5, 6])
    assert r.adopted == [node] and ids(node.device) == [4, 5] and ids(node.host) == [7, 8]
    assert r.duplicate_pages.tolist() == [] and r.cached_tokens == 4
    assert ids(t.match_prefix([1, 2, 3, 4, 5, 6]).device_pages) == [4, 5, 6]
    t.check_integrity()


def test_nodes_to_back_up_respects_hits_and_contiguity() -> None:
    t = HiRadixTree(page_size=1)
    t.insert([1, 2], [0, 1])
    t.insert([1, 3], [0, 2])
    leaf = t.match_prefix([1, 3]).last_device_node
    assert leaf.parent is not None
    t.count_hit(leaf.parent)  # the second request reused [1]: 2 hits; [2] and [3] one each
    assert [decode_tokens(n.key) for n in t.nodes_to_back_up(leaf, min_hits=2)] == [[1]]
    assert [decode_tokens(n.key) for n in t.nodes_to_back_up(leaf)] == [[1], [3]]


def test_split_copies_pins_so_unlock_balances() -> None:
    t = HiRadixTree(page_size=1)
    t.insert([1, 2, 3], [0, 1, 2])
    node = t.match_prefix([1, 2, 3]).last_device_node
    t.inc_lock_ref(node)
    t.inc_host_ref(node)
    t.match_prefix([1, 9])  # splits [1,2,3] into [1] -> [2,3]
    assert t.check_integrity().nodes == 2
    t.dec_lock_ref(node)
    t.dec_host_ref(node)
    assert all(n.lock_ref == 0 and n.host_ref == 0 for n in t.iter_nodes())
    assert t.check_integrity().protected_device_pages == 0


def encode_pages(pages: list[int]) -> PageIds:
    return page_ids(pages)


def test_tenants_never_match_each_others_spans() -> None:
    t = HiRadixTree(page_size=1)
    t.insert([1, 2, 3], [0, 1, 2])
    t.insert([1, 2, 3], [3, 4, 5], tenant="acme")
    assert list(t.match_prefix([1, 2, 3]).device_pages) == [0, 1, 2]
    assert list(t.match_prefix([1, 2, 3], "acme").device_pages) == [3, 4, 5]
    assert t.match_prefix([1, 2, 3], "globex").matched_tokens == 0
    r = t.insert([1, 2, 9], [3, 4, 6], tenant="acme")  # shares acme's [1, 2] only
    assert r.cached_tokens == 2 and r.last_node.tenant == "acme"
    s = t.check_integrity()
    assert (s.nodes, s.device_pages) == (4, 7)
    order = []
    for node in t.device_eviction_order():
        order.append(node.tenant)
        t.evict_device(node)
    assert sorted(order) == ["", "acme", "acme", "acme"]
    assert t.check_integrity().nodes == 0


def test_parent_of_a_removed_leaf_joins_the_eviction_order() -> None:
    t = HiRadixTree(page_size=1)
    t.insert([1, 2], [0, 1])
    t.insert([1, 3], [0, 2])  # [1] -> {[2], [3]}, nothing backed up: leaves are removed
    freed = []
    for node in t.device_eviction_order():
        freed += ids(t.evict_device(node))
    assert sorted(freed) == [0, 1, 2] and t.check_integrity().nodes == 0


def test_priority_eviction_lowest_first_ties_lru_and_max_of_requests() -> None:
    t = HiRadixTree(page_size=1, eviction_policy=EvictionPolicy.PRIORITY)
    a = t.insert([1, 1], [0, 1], priority=3).last_node
    b = t.insert([2], [2], priority=1).last_node
    c = t.insert([3], [3], priority=1).last_node
    d = t.insert([4], [4], priority=0).last_node
    t.insert([1, 1], [0, 1], priority=0)  # a reused by a lower-priority request: stays 3
    t.insert([2], [2], priority=-5)
    assert (a.priority, b.priority, c.priority, d.priority) == (3, 1, 1, 0)
    t.match_prefix([2])  # b and c tie on priority 1: b is now the more recently used
    e = t.insert([1, 5], [0, 5], priority=9).last_node  # splits a: [1] -> {[1], [5]}
    head = e.parent
    assert head is not None and decode_tokens(head.key) == [1]
    assert head.priority == 9 and a.priority == 3  # max of the requests that passed
    order = []
    for node in t.device_eviction_order():
        order.append(decode_tokens(node.key))
        t.evict_device(node)
    # d (0), then c before b (tie on 1, c least recently used), a (3), e (9), then the
    # head (9) once both its children are gone
    assert order == [[4], [3], [2], [1], [5], [1]]
    assert t.check_integrity().nodes == 0
    with pytest.raises(TypeError, match="priority"):
        t.insert([7], [7], priority=1.5)  # type: ignore[arg-type]


def test_split_gives_both_halves_the_priority() -> None:
    t = HiRadixTree(page_size=1, eviction_policy="priority")
    t.insert([1, 2, 3], [0, 1, 2], priority=4)
    m = t.match_prefix([1, 2, 9])  # splits [1,2,3] into [1,2] -> [3]
    (tail,) = m.last_device_node.children.values()
    assert m.last_device_node.priority == tail.priority == 4
    h = t.insert_host([6], page_ids([0]), 0, priority=2).new_node  # an L3 hit into L2
    assert h is not None and h.priority == 2
    t.check_integrity()
