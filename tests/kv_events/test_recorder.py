"""The tree's residency as KV events: exact sequences on a tree of 2-token pages."""

from __future__ import annotations

import hashlib
import struct

from hicache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Medium,
    ResidencyRecorder,
)
from hicache.tree import HiRadixTree
from hicache.tree.node import page_ids

P = 2


def _page_hash(prior: bytes | None, *tokens: int) -> tuple[bytes, int]:
    """SGLang's event hash written out: SHA-256(prior + u32 LE tokens), top 8 bytes signed."""
    digest = hashlib.sha256((prior or b"") + struct.pack(f"<{len(tokens)}I", *tokens)).digest()
    return digest, int.from_bytes(digest[:8], "big", signed=True)


def _tree() -> tuple[HiRadixTree, ResidencyRecorder]:
    tree = HiRadixTree(P)
    recorder = ResidencyRecorder(P)
    tree.observe_residency(recorder)
    return tree, recorder


def test_insert_reports_pages_with_sglang_hashes_and_tokens() -> None:
    tree, rec = _tree()
    tree.insert([1, 2, 3, 4, 9], [10, 11])  # the partial page (9) is never cached
    d1, h1 = _page_hash(None, 1, 2)
    _, h2 = _page_hash(d1, 3, 4)
    assert rec.drain() == (BlockStored((h1, h2), None, (1, 2, 3, 4), P, Medium.DEVICE),)
    assert rec.drain() == ()
    # A branch splits the node (no event) and stores only its new page, chained on page 1.
    tree.insert([1, 2, 5, 6], [10, 12])
    _, h3 = _page_hash(d1, 5, 6)
    assert rec.drain() == (BlockStored((h3,), h1, (5, 6), P, Medium.DEVICE),)
    # Reinserting what is cached reports nothing.
    tree.insert([1, 2, 3, 4], [13, 14])
    assert rec.drain() == ()


def test_l1_eviction_keeps_pages_backed_up_in_l2_until_they_leave_l2() -> None:
    tree, rec = _tree()
    tree.insert([1, 2, 3, 4], [10, 11])
    tree.insert([1, 2, 5, 6], [10, 12])
    d1, h1 = _page_hash(None, 1, 2)
    _, h2 = _page_hash(d1, 3, 4)
    _, h3 = _page_hash(d1, 5, 6)
    rec.drain()
    head = tree.within([1, 2])
    leaf = tree.within([1, 2, 3, 4])
    other = tree.within([1, 2, 5, 6])
    assert head is not None and leaf is not None and other is not None
    tree.assign_host(head, page_ids([0]))
    tree.assign_host(leaf, page_ids([1]))
    assert rec.drain() == ()  # a backup of resident pages changes nothing
    tree.evict_device(leaf)
    assert rec.drain() == ()  # left L1, still in L2: still resident
    tree.evict_device(other)  # no L2 copy: it leaves the instance
    assert rec.drain() == (BlockRemoved((h3,), Medium.DEVICE),)
    tree.evict_host(leaf)  # leaves L2 too: removed, with the medium it was stored with
    assert rec.drain() == (BlockRemoved((h2,), Medium.DEVICE),)
    assert rec.resident_pages == 1
    assert head.device is not None and h1 != h2


def test_pages_fetched_into_l2_are_stored_as_host_and_removed_as_host() -> None:
    tree, rec = _tree()
    tree.insert([1, 2], [10])
    head = tree.within([1, 2])
    assert head is not None
    tree.assign_host(head, page_ids([0]))
    rec.drain()
    tree.insert_host([1, 2, 3, 4], page_ids([1]), 1)
    d1, h1 = _page_hash(None, 1, 2)
    _, h2 = _page_hash(d1, 3, 4)
    assert rec.drain() == (BlockStored((h2,), h1, (3, 4), P, Medium.HOST),)
    leaf = tree.within([1, 2, 3, 4])
    assert leaf is not None
    tree.evict_host(leaf)
    assert rec.drain() == (BlockRemoved((h2,), Medium.HOST),)


def test_tenant_pages_are_salted_and_carry_the_salt() -> None:
    tree, rec = _tree()
    tree.insert([1, 2], [10], tenant="acme")
    seed = hashlib.sha256(b"sglang-cache-salt-v1\0acme").digest()
    _, h = _page_hash(seed, 1, 2)
    _, plain = _page_hash(None, 1, 2)
    assert h != plain
    assert rec.drain() == (BlockStored((h,), None, (1, 2), P, Medium.DEVICE, "acme"),)


def test_reset_is_all_blocks_cleared() -> None:
    tree, rec = _tree()
    tree.insert([1, 2], [10])
    rec.drain()
    tree.reset()
    assert rec.drain() == (AllBlocksCleared(),)
    assert rec.resident_pages == 0
    tree.insert([1, 2], [10])
    _, h = _page_hash(None, 1, 2)
    assert rec.drain() == (BlockStored((h,), None, (1, 2), P, Medium.DEVICE),)
