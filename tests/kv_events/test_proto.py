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
from hicache.kv_events.proto import to_proto


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
