"""Exact-state tests of the component contract on the tree (pure Python, tiny sizes)."""

from __future__ import annotations

import pytest

from hicache.tree import (
    ComponentValues,
    HiRadixTree,
    MambaState,
    SlidingWindow,
    Tier,
    TreeNode,
    decode_tokens,
)
from hicache.tree.node import page_ids

D, H = Tier.DEVICE, Tier.HOST


def ids(arr: object) -> list[int] | None:
    return None if arr is None else list(arr)  # type: ignore[call-overload]


def swa_tree(window: int = 2, page_size: int = 1) -> HiRadixTree:
    return HiRadixTree(page_size, components=[SlidingWindow(window)])


def toks(node: TreeNode) -> list[int]:
    return decode_tokens(node.key)


def test_component_names_are_checked() -> None:
    with pytest.raises(ValueError, match="unique"):
        HiRadixTree(1, components=[MambaState(), MambaState()])
    with pytest.raises(ValueError, match="window"):
        SlidingWindow(0)
    with pytest.raises(KeyError, match="no component"):
        swa_tree().component("mamba")


def test_swa_insert_tombstones_pages_outside_the_window() -> None:
    t = swa_tree(window=2)
    swa = t.component("swa")
    r = t.insert(
        [1, 2, 3, 4, 5, 6],
        [0, 1, 2, 3, 4, 5],
        components={"swa": ComponentValues.pages(4, [100, 101])},
    )
    tail = r.last_node
    head = tail.parent
    assert head is not None and toks(head) == [1, 2, 3, 4] and toks(tail) == [5, 6]
    assert ids(head.device) == [0, 1, 2, 3] and swa.get(head, D) is None  # tombstone
    assert ids(swa.get(tail, D)) == [100, 101] and r.component_duplicates == {}
    m = t.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert m.last_device_node is tail and m.device_tokens == 6 and m.limited_by is None
    m = t.match_prefix([1, 2, 3, 4])  # no window before token 4
    assert m.matched_tokens == 0 and m.limited_by == "swa" and m.last_host_node.parent is None
    assert t.component_stats("swa").tombstones == 1
    t.check_integrity()


def test_swa_window_up_to_the_root_is_enough() -> None:
    t = swa_tree(window=4)
    t.insert([1, 2, 3], [0, 1, 2], components={"swa": ComponentValues.pages(0, [7, 8, 9])})
    assert t.match_prefix([1, 2]).device_tokens == 2  # split at 2: its window is the whole path
    assert t.match_prefix([1, 2, 3]).device_tokens == 3


def test_evicted_but_backed_up_nodes_stay_boundaries_and_load_back_plans() -> None:
    t = swa_tree(window=2)
    swa = t.component("swa")
    r = t.insert(
        [1, 2, 3, 4, 5, 6],
        [0, 1, 2, 3, 4, 5],
        components={"swa": ComponentValues.pages(4, [100, 101])},
    )
    tail = r.last_node
    head = tail.parent
    assert head is not None
    t.assign_host(head, page_ids([40, 41, 42, 43]))
    t.assign_host(tail, page_ids([50, 51]))
    assert [n.id for n in t.component_backup_nodes("swa", tail)] == [tail.id]
    t.assign_component("swa", tail, H, page_ids([60, 61]))
    assert t.component_backup_nodes("swa", tail) == []
    with pytest.raises(RuntimeError, match="use evict_node_device"):
        t.evict_device(tail)
    ev = t.evict_node_device(tail)
    assert ids(ev.full) == [4, 5] and {k: ids(v) for k, v in ev.components.items()} == {
        "swa": [100, 101]
    }
    assert swa.get(tail, D) is None and ids(swa.get(tail, H)) == [60, 61]
    m = t.match_prefix([1, 2, 3, 4, 5, 6])
    # L1: head has no SWA window -> no L1 hit at all; L2: tail is a valid boundary
    assert m.device_tokens == 0 and m.host_tokens == 6 and m.last_host_node is tail
    assert t.host_only_path(tail) == [tail]
    t.assign_device(tail, page_ids([8, 9]))
    assert t.component_load_nodes("swa", tail) == [tail]
    t.assign_component("swa", tail, D, page_ids([102, 103]))
    assert ids(t.hit_ids("swa", tail)) == [102, 103] and ids(t.hit_ids("swa", tail, H)) == [60, 61]
    assert t.match_prefix([1, 2, 3, 4, 5, 6]).device_tokens == 6
    t.check_integrity()
    assert sorted(t.component_ids("swa", D)) == [102, 103]


def test_swa_pins_cover_the_window_only_and_survive_splits() -> None:
    t = swa_tree(window=3, page_size=2)  # window: 2 pages
    swa = t.component("swa")
    r = t.insert(
        list(range(1, 11)),
        [0, 1, 2, 3, 4],
        components={"swa": ComponentValues.pages(0, [10, 11, 12, 13, 14])},
    )
    leaf = r.last_node
    t.inc_lock_ref(leaf)  # splits so the window [3, 5) is whole nodes
    win = t.hit_nodes("swa", leaf)
    assert [toks(n) for n in win] == [[7, 8, 9, 10]] and swa.pinned(leaf, D)
    above = leaf.parent
    assert above is not None and not swa.pinned(above, D) and above.lock_ref == 1
    # evictable on its own: the SWA pages above the window (own LRU), not the window
    assert [n.id for n in t.component_eviction_order("swa", D)] == [above.id]
    # a split inside the pinned window keeps the counts consistent
    t.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 99, 99])
    assert [toks(n) for n in t.hit_nodes("swa", leaf)] == [[7, 8], [9, 10]]
    assert all(swa.pinned(n, D) for n in t.hit_nodes("swa", leaf))
    t.check_integrity()
    assert ids(t.evict_component("swa", above, D)) == [10, 11, 12]
    with pytest.raises(RuntimeError, match="pinned"):
        t.evict_component("swa", leaf, D)
    t.dec_lock_ref(leaf)
    assert not any(swa.pinned(n, D) for n in t.iter_nodes())
    t.check_integrity()
    with pytest.raises(RuntimeError, match="underflow"):
        t.dec_lock_ref(leaf)


def test_swa_insert_adopts_tombstones_and_returns_duplicates() -> None:
    t = swa_tree(window=2)
    swa = t.component("swa")
    t.insert([1, 2, 3, 4], [0, 1, 2, 3], components={"swa": ComponentValues.pages(2, [20, 21])})
    r = t.insert(
        [1, 2, 3, 4, 5],
        [0, 1, 2, 3, 4],
        components={"swa": ComponentValues.pages(1, [30, 31, 32, 33])},
    )
    # page 1 (token 2) was a tombstone: adopted; pages 2, 3 held 20, 21: 31, 32 come back
    assert ids(r.component_duplicates["swa"]) == [31, 32]
    assert sorted(t.component_ids("swa", D)) == [20, 21, 30, 33]
    first = t.match_prefix([1]).last_host_node
    assert swa.get(first, D) is None
    t.check_integrity()


def test_mamba_snapshots_are_the_only_boundaries() -> None:
    t = HiRadixTree(2, components=[MambaState()])
    mamba = t.component("mamba")
    r = t.insert(
        list(range(8)), [0, 1, 2, 3], components={"mamba": ComponentValues.snapshots({2: 7, 4: 9})}
    )
    leaf = r.last_node
    mid = leaf.parent
    assert mid is not None and toks(mid) == [0, 1, 2, 3] and ids(mamba.get(mid, D)) == [7]
    assert ids(mamba.get(leaf, D)) == [9]
    m = t.match_prefix([*range(6), 50, 51])  # diverges after 3 pages: split, no snapshot
    assert m.device_tokens == 4 and m.last_device_node is mid and m.limited_by == "mamba"
    split_head = mid.children[next(iter(mid.children))]
    assert mamba.get(split_head, D) is None and ids(mamba.get(leaf, D)) == [9]  # stays on tail
    with pytest.raises(ValueError, match="does not fit"):
        t.insert(
            list(range(8)), [0, 1, 2, 3], components={"mamba": ComponentValues.snapshots({5: 1})}
        )
    # own eviction: L1 snapshot goes, node and KV stay; the boundary moves up
    t.inc_lock_ref(leaf)
    assert [n.id for n in t.component_eviction_order("mamba", D)] == [mid.id]
    t.dec_lock_ref(leaf)
    order = [n.id for n in t.component_eviction_order("mamba", D)]
    assert order == [leaf.id, mid.id]  # the last hit needed mid, not leaf
    assert ids(t.evict_component("mamba", leaf, D)) == [9]
    assert t.match_prefix(list(range(8))).device_tokens == 4
    t.check_integrity()


def test_mamba_backup_and_host_eviction_cascade() -> None:
    t = HiRadixTree(1, components=[MambaState()])
    mamba = t.component("mamba")
    leaf = t.insert(
        [1, 2], [0, 1], components={"mamba": ComponentValues.snapshots({2: 5})}
    ).last_node
    t.assign_host(leaf, page_ids([3, 4]))
    assert t.component_backup_nodes("mamba", leaf) == [leaf]
    t.assign_component("mamba", leaf, H, page_ids([6]))
    with pytest.raises(RuntimeError, match="already has"):
        t.assign_component("mamba", leaf, H, page_ids([7]))
    t.inc_host_ref(leaf)
    assert list(t.component_eviction_order("mamba", H)) == []
    t.dec_host_ref(leaf)
    ev = t.evict_node_device(leaf)
    assert ids(ev.components["mamba"]) == [5]
    assert t.match_prefix([1, 2]).host_tokens == 2  # snapshot in L2 only: still a boundary
    with pytest.raises(RuntimeError, match="use evict_node_host"):
        t.evict_host(leaf)
    ev = t.evict_node_host(leaf)
    assert ids(ev.full) == [3, 4] and ids(ev.components["mamba"]) == [6]
    assert t.stats().nodes == 0 and mamba.data(leaf) is None
    t.check_integrity()


def test_integrity_catches_a_component_value_without_full_kv() -> None:
    t = HiRadixTree(1, components=[MambaState()])
    leaf = t.insert([1], [0], components={"mamba": ComponentValues.snapshots({1: 5})}).last_node
    t.component("mamba").set(leaf, H, page_ids([5]))
    with pytest.raises(AssertionError, match="without full KV"):
        t.check_integrity()


def test_full_only_tree_behaves_as_before() -> None:
    t = HiRadixTree(1)
    t.insert([1, 2, 3], [0, 1, 2])
    m = t.match_prefix([1, 2, 9])
    assert m.device_tokens == 2 and m.limited_by is None and t.components[0].name == "full"
