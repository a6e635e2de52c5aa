"""hicache's KV event block hashes equal SGLang's own (``compute_node_event_hash_values``),
shared and salted, across a parent and a child node."""

from __future__ import annotations

from array import array

import pytest
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode
from sglang.srt.mem_cache.utils import compute_node_event_hash_values, hash_str_to_int64

from hicache.kv_events import BlockStored, ResidencyRecorder
from hicache.tree import HiRadixTree

PAGE = 2


def _sglang_hashes(salt: str | None) -> list[list[int]]:
    """SGLang's event hashes of a node [1, 2, 3, 4] and its child [5, 6]."""
    root = TreeNode()
    root.key = RadixKey(array("q"), cache_salt=salt)
    parent = TreeNode()
    parent.key = RadixKey(array("q", [1, 2, 3, 4]), cache_salt=salt)
    parent.parent = root
    child = TreeNode()
    child.key = RadixKey(array("q", [5, 6]), cache_salt=salt)
    child.parent = parent
    out = []
    for node in (parent, child):
        values = compute_node_event_hash_values(node, PAGE)
        node.hash_value = values  # what SGLang keeps on the node for its children
        out.append([hash_str_to_int64(v) for v in values])
    return out


@pytest.mark.parametrize("salt", [None, "acme"])
def test_block_hashes_equal_sglangs(salt: str | None) -> None:
    tree = HiRadixTree(PAGE)
    rec = ResidencyRecorder(PAGE)
    tree.observe_residency(rec)
    tree.insert([1, 2, 3, 4], [10, 11], tenant=salt or "")
    tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12], tenant=salt or "")
    events = rec.drain()
    assert all(isinstance(e, BlockStored) for e in events)
    ours = [list(e.block_hashes) for e in events if isinstance(e, BlockStored)]
    assert ours == _sglang_hashes(salt)


def test_sglangs_event_classes_decode_our_wire() -> None:
    """The ZMQ payload decodes with SGLang's own ``KVEventBatch`` (its salt field too)."""
    import msgspec
    from sglang.srt.disaggregation import kv_events as sk

    from hicache.kv_events import AllBlocksCleared, BlockRemoved, KvEventBatch, Medium
    from hicache.kv_events.wire import encode_batch

    batch = KvEventBatch(
        3,
        5.0,
        (
            BlockStored((-1, 2), None, (1, 2, 3, 4), PAGE, Medium.DEVICE, "acme"),
            BlockRemoved((2,), Medium.HOST),
            AllBlocksCleared(),
        ),
    )
    got = msgspec.msgpack.Decoder(type=sk.KVEventBatch).decode(encode_batch(batch))
    assert (got.ts, got.attn_dp_rank) == (5.0, 0)
    stored, removed, cleared = got.events
    assert isinstance(stored, sk.BlockStored) and isinstance(removed, sk.BlockRemoved)
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids) == (
        [-1, 2],
        None,
        [1, 2, 3, 4],
    )
    assert (stored.block_size, stored.medium, stored.cache_salt) == (PAGE, "GPU", "acme")
    assert (removed.block_hashes, removed.medium) == ([2], "CPU")
    assert isinstance(cleared, sk.AllBlocksCleared)
