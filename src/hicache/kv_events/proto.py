"""KV event batches as smg's protobuf ``KvEventBatch`` (``smg_grpc_proto`` common.proto).

What smg's event-driven indexer reads: per stored event the blocks (``block_hash``,
``token_ids``, ``block_size``), ``parent_block_hash``, the ``tier`` (device or host; the
host tier also as ``cache_level`` 1 for older readers), the raw ``medium`` string,
``locality`` local and the tenant's ``cache_salt`` (smg folds it into its content hash
seed, so a tenant's pages match only that tenant's requests); per removal the hashes and
the same tier. A snapshot batch is sent as one message.
"""

from __future__ import annotations

from smg_grpc_proto.generated import common_pb2

from hicache.kv_events.records import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    Medium,
)

__all__ = ["event_to_proto", "to_proto"]

_TIER = {
    Medium.DEVICE: common_pb2.KV_CACHE_TIER_DEVICE,
    Medium.HOST: common_pb2.KV_CACHE_TIER_HOST,
    Medium.STORAGE: common_pb2.KV_CACHE_TIER_DISK,
}
_CACHE_LEVEL = {Medium.DEVICE: None, Medium.HOST: 1, Medium.STORAGE: 2}


def event_to_proto(event: KvEvent) -> common_pb2.KvCacheEvent:
    """One event as a ``KvCacheEvent`` (``event_id`` left 0)."""
    if isinstance(event, BlockStored):
        level = _CACHE_LEVEL[event.medium]
        size = event.block_size
        blocks = []
        for i, h in enumerate(event.block_hashes):
            block = common_pb2.KvBlock(
                block_hash=h, token_ids=event.token_ids[i * size : (i + 1) * size], block_size=size
            )
            if level is not None:
                block.cache_level = level
            blocks.append(block)
        stored = common_pb2.KvBlocksStored(
            blocks=blocks,
            tier=_TIER[event.medium],
            medium=event.medium.value,
            locality=common_pb2.KV_CACHE_LOCALITY_LOCAL,
        )
        if event.parent_block_hash is not None:
            stored.parent_block_hash = event.parent_block_hash
        if event.cache_salt:
            stored.cache_salt = event.cache_salt
        return common_pb2.KvCacheEvent(stored=stored)
    if isinstance(event, BlockRemoved):
        removed = common_pb2.KvBlocksRemoved(
            block_hashes=event.block_hashes,
            tier=_TIER[event.medium],
            medium=event.medium.value,
            locality=common_pb2.KV_CACHE_LOCALITY_LOCAL,
        )
        level = _CACHE_LEVEL[event.medium]
        if level is not None:
            removed.cache_level = level
        return common_pb2.KvCacheEvent(removed=removed)
    assert isinstance(event, AllBlocksCleared)
    return common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared())


def to_proto(batch: KvEventBatch, dp_rank: int | None = None) -> common_pb2.KvEventBatch:
    """``batch`` as smg's ``KvEventBatch``; ``dp_rank`` set when given."""
    proto = common_pb2.KvEventBatch(
        sequence_number=batch.sequence_number,
        timestamp=batch.timestamp,
        events=[event_to_proto(e) for e in batch.events],
    )
    if dp_rank is not None:
        proto.dp_rank = dp_rank
    return proto
