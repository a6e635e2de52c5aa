"""KV event batches as smg's protobuf ``KvEventBatch`` (``smg_grpc_proto`` common.proto).

What smg's event-driven indexer reads: per stored event the blocks (``block_hash``,
``token_ids``, ``block_size``), ``parent_block_hash``, the ``tier`` (device or host; the
host tier also as ``cache_level`` 1 for older readers), the raw ``medium`` string,
``locality`` local and the tenant's ``cache_salt`` (smg folds it into its content hash
seed, so a tenant's pages match only that tenant's requests); per removal the hashes and
the same tier. :func:`to_protos` sends a large snapshot as ``KvSnapshotChunk`` chunks
(consecutive sequence numbers ending at the snapshot's, the first opening with
``AllBlocksCleared``), so no message nears gRPC's 4 MiB default limit.
"""

from __future__ import annotations

from dataclasses import replace

from smg_grpc_proto.generated import common_pb2

from hicache.kv_events.records import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    Medium,
)

__all__ = ["SNAPSHOT_CHUNK_TOKENS", "event_to_proto", "to_proto", "to_protos"]

SNAPSHOT_CHUNK_TOKENS = 131_072
"""Token ids per snapshot chunk at most (about 0.5 MiB of message)."""

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


def to_protos(
    batch: KvEventBatch, dp_rank: int | None = None, *, max_tokens: int = SNAPSHOT_CHUNK_TOKENS
) -> list[common_pb2.KvEventBatch]:
    """``batch`` as the messages to send: one for a live batch; for a snapshot, one per
    ``max_tokens`` token ids as ``KvSnapshotChunk`` chunks numbered up to the snapshot's
    sequence (when that sequence is too small to number them all, the first chunk takes
    the rest: a snapshot has more chunks than batches published only after a batch of
    more than ``max_tokens`` tokens)."""
    if not batch.snapshot:
        return [to_proto(batch, dp_rank)]
    chunks = _chunk(batch.events, max_tokens)
    if len(chunks) <= 1:
        return [to_proto(batch, dp_rank)]
    keep = min(len(chunks), batch.sequence_number + 1)  # sequence numbers from 0 on
    chunks = [
        [e for c in chunks[: len(chunks) - keep + 1] for e in c],
        *chunks[len(chunks) - keep + 1 :],
    ]
    blocks = sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockStored))
    first_seq = batch.sequence_number - len(chunks) + 1
    out = []
    for i, events in enumerate(chunks):
        part = replace(batch, sequence_number=first_seq + i, events=tuple(events))
        proto = to_proto(part, dp_rank)
        proto.snapshot.CopyFrom(
            common_pb2.KvSnapshotChunk(index=i, count=len(chunks), blocks=blocks)
        )
        out.append(proto)
    return out


def _chunk(events: tuple[KvEvent, ...], max_tokens: int) -> list[list[KvEvent]]:
    """``events`` cut into runs of at most ``max_tokens`` token ids (a stored event longer
    than the room left is split between pages, its pieces chained by their parents)."""
    chunks: list[list[KvEvent]] = [[]]
    room = max_tokens
    for event in events:
        while isinstance(event, BlockStored) and len(event.token_ids) > room:
            pages = room // event.block_size
            if pages == 0 and chunks[-1]:  # no room for a page here: the next chunk
                chunks.append([])
                room = max_tokens
                continue
            cut = max(1, pages) * event.block_size  # a page larger than a chunk goes alone
            if cut >= len(event.token_ids):
                break
            n = cut // event.block_size
            chunks[-1].append(
                replace(event, block_hashes=event.block_hashes[:n], token_ids=event.token_ids[:cut])
            )
            event = replace(
                event,
                block_hashes=event.block_hashes[n:],
                parent_block_hash=event.block_hashes[n - 1],
                token_ids=event.token_ids[cut:],
            )
            chunks.append([])
            room = max_tokens
        chunks[-1].append(event)
        if isinstance(event, BlockStored):
            room -= len(event.token_ids)
    return [c for c in chunks if c]
