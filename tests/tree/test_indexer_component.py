"""The DSA indexer's tree component (pure Python, tiny sizes, exact state): ALL_PAGES
matches, values on the full KV's ids, no pins or eviction of its own."""

from __future__ import annotations

import pytest

from hicache.tree import ComponentValues, HiRadixTree, Tier
from hicache.tree.components import IndexerKeys
from hicache.tree.node import page_ids

D, H = Tier.DEVICE, Tier.HOST
KEYS = IndexerKeys.name


def tree_with(tokens: list[int], pages: list[int]) -> HiRadixTree:
    """A tree holding ``tokens`` (page size 1) on L1 ``pages``, with their keys there."""
    tree = HiRadixTree(1, components=[IndexerKeys()])
    tree.insert(tokens, pages, components={KEYS: ComponentValues.pages(0, pages)})
    return tree


def test_a_match_ends_before_the_first_node_without_its_keys() -> None:
    tree = tree_with([1, 2, 3, 4], [7, 5, 6, 2])
    tree.insert([1, 2, 9], [7, 5, 3])  # splits [1, 2 | 3, 4]; [9] without keys
    comp = tree.component(KEYS)
    m = tree.match_prefix([1, 2, 9])
    assert (m.device_tokens, m.limited_by) == (2, KEYS)
    assert list(m.device_pages) == [7, 5]
    head = m.last_device_node
    assert list(comp.get(head, D) or []) == [7, 5]  # the split sliced the keys with the KV
    assert tree.match_prefix([1, 2, 3, 4]).device_tokens == 4
    comp.set(head, D, None)  # the top's keys gone: nothing below can be a boundary
    assert tree.match_prefix([1, 2, 3, 4]).matched_tokens == 0


def test_l2_keys_make_an_l2_boundary() -> None:
    tree = tree_with([1, 2, 3], [4, 5, 6])
    (node,) = tree.root.children.values()
    tree.assign_host(node, page_ids([10, 11, 12]))
    tree.assign_component(KEYS, node, H, page_ids([10, 11, 12]))
    tree.evict_node_device(node)  # the keys leave L1 with the KV
    assert tree.component(KEYS).get(node, D) is None
    m = tree.match_prefix([1, 2, 3])
    assert (m.device_tokens, m.host_tokens) == (0, 3)
    tree.check_integrity()


def test_keys_have_no_pins_or_eviction_of_their_own() -> None:
    tree = tree_with([1, 2], [3, 4])
    (node,) = tree.root.children.values()
    comp = tree.component(KEYS)
    tree.inc_lock_ref(node)
    data = comp.data(node)
    assert data is not None and data.lock == 0  # the full KV's lock_ref pins them
    assert comp.pinned(node, D) and not comp.evictable(node, D)
    tree.dec_lock_ref(node)
    assert not comp.evictable(node, D)
    assert list(tree.component_eviction_order(KEYS, D)) == []


def test_check_refuses_keys_on_other_ids_than_the_full_kvs() -> None:
    tree = tree_with([1, 2], [3, 4])
    (node,) = tree.root.children.values()
    tree.component(KEYS).set(node, D, page_ids([4, 3]))
    with pytest.raises(
        AssertionError, match=r"indexer device ids .* are \[4, 3\], the full KV's \[3, 4\]"
    ):
        tree.check_integrity()
