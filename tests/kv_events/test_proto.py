"""KV event batches as smg's protobuf KvEventBatch."""

from __future__ import annotations

from smg_grpc_proto.generated import common_pb2

from hicache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    Medium,
)
from hicache.kv_events.proto import to_proto, to_protos


def test_to_proto_carries_blocks_tiers_and_salt() -> None:
    batch = KvEventBatch(
        7,
        12.5,
        (
            BlockStored((-5, 6), None, (1, 2, 3, 4), 2, Medium.DEVICE),
            BlockStored((8,), 6, (5, 6), 2, Medium.HOST, "acme"),
            BlockRemoved((8,), Medium.HOST),
            AllBlocksCleared(),
        ),
    )
    proto = common_pb2.KvEventBatch.FromString(to_proto(batch).SerializeToString())
    assert proto.sequence_number == 7 and proto.timestamp == 12.5
    assert not proto.HasField("dp_rank")
    e0, e1, e2, e3 = proto.events
    s0 = e0.stored
    assert [(b.block_hash, list(b.token_ids), b.block_size) for b in s0.blocks] == [
        (-5, [1, 2], 2),
        (6, [3, 4], 2),
    ]
    assert not s0.HasField("parent_block_hash") and not s0.blocks[0].HasField("cache_level")
    assert s0.tier == common_pb2.KV_CACHE_TIER_DEVICE and s0.medium == "GPU"
    assert s0.locality == common_pb2.KV_CACHE_LOCALITY_LOCAL and not s0.HasField("cache_salt")
    s1 = e1.stored
    assert s1.parent_block_hash == 6 and s1.cache_salt == "acme"
    assert s1.tier == common_pb2.KV_CACHE_TIER_HOST and s1.blocks[0].cache_level == 1
    assert list(e2.removed.block_hashes) == [8] and e2.removed.tier == common_pb2.KV_CACHE_TIER_HOST
    assert e3.WhichOneof("data") == "cleared"
    assert to_proto(batch, dp_rank=0).dp_rank == 0


def _blocks(protos: list[common_pb2.KvEventBatch]) -> list[tuple[int, int | None, list[int]]]:
    """(hash, parent as the event names it for its first block, tokens) per block."""
    out = []
    for p in protos:
        for e in p.events:
            if e.WhichOneof("data") == "stored":
                s = e.stored
                parent = s.parent_block_hash if s.HasField("parent_block_hash") else None
                for i, b in enumerate(s.blocks):
                    out.append((b.block_hash, parent if i == 0 else None, list(b.token_ids)))
    return out


def test_a_large_snapshot_goes_in_chunks_numbered_up_to_its_sequence() -> None:
    snap = KvEventBatch(
        9,
        1.0,
        (
            AllBlocksCleared(),
            BlockStored((1, 2, 3), None, (1, 2, 3, 4, 5, 6), 2, Medium.DEVICE),
            BlockStored((4,), 1, (7, 8), 2, Medium.HOST),
        ),
        snapshot=True,
    )
    protos = to_protos(snap, max_tokens=4)  # the first event is cut after two pages
    assert [p.sequence_number for p in protos] == [8, 9]
    assert [(p.snapshot.index, p.snapshot.count, p.snapshot.blocks) for p in protos] == [
        (0, 2, 4),
        (1, 2, 4),
    ]
    assert protos[0].events[0].WhichOneof("data") == "cleared"
    assert _blocks(protos) == [
        (1, None, [1, 2]),
        (2, None, [3, 4]),
        (3, 2, [5, 6]),  # the cut's second piece chains on the first
        (4, 1, [7, 8]),
    ]
    one_page_each = to_protos(snap, max_tokens=2)
    assert [p.sequence_number for p in one_page_each] == [6, 7, 8, 9]
    assert _blocks(one_page_each) == [
        (1, None, [1, 2]),
        (2, 1, [3, 4]),
        (3, 2, [5, 6]),
        (4, 1, [7, 8]),
    ]
    # Too few sequence numbers (from 0) for four chunks: the first takes the rest.
    early = to_protos(KvEventBatch(1, 1.0, snap.events, snapshot=True), max_tokens=2)
    assert [(p.sequence_number, p.snapshot.index, p.snapshot.count) for p in early] == [
        (0, 0, 2),
        (1, 1, 2),
    ]
    assert _blocks(early) == _blocks(one_page_each)
    # Small snapshots and live batches go whole, without a chunk record.
    (whole,) = to_protos(snap)
    assert not whole.HasField("snapshot") and len(whole.events) == 3
