"""The ZMQ wire format of KV events: vLLM's and SGLang's msgpack encoding (msgspec).

A message is three frames: the topic, the sequence number (8 bytes big-endian) and the
payload, a msgpack array ``[ts, events, data_parallel_rank]`` whose events are maps
tagged by ``type`` (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``) with
vLLM's field names. A tenant's stored event carries its ``cache_salt`` (SGLang's field)
and, when it starts a sequence, the salt as the first block's extra key (vLLM's form).
"""

from __future__ import annotations

from typing import Any

import msgspec

from hicache.kv_events import records as r

__all__ = ["encode_batch", "frames"]


class _WireBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _WireEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class BlockStored(_WireEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[str] | None] | None = None
    cache_salt: str | None = None


class BlockRemoved(_WireEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(_WireEvent):
    pass


_encoder = msgspec.msgpack.Encoder()


def _wire(event: r.KvEvent) -> _WireEvent:
    if isinstance(event, r.BlockStored):
        extra: list[list[str] | None] | None = None
        if event.cache_salt and event.parent_block_hash is None:
            extra = [[event.cache_salt]] + [None] * (len(event.block_hashes) - 1)
        return BlockStored(
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=None,
            medium=event.medium.value,
            lora_name=None,
            extra_keys=extra,
            cache_salt=event.cache_salt,
        )
    if isinstance(event, r.BlockRemoved):
        return BlockRemoved(block_hashes=list(event.block_hashes), medium=event.medium.value)
    return AllBlocksCleared()


def encode_batch(batch: r.KvEventBatch, dp_rank: int = 0) -> bytes:
    """The msgpack payload of ``batch``."""
    wire = _WireBatch(batch.timestamp, [_wire(e) for e in batch.events], dp_rank)
    return _encoder.encode(wire)


def frames(topic: bytes, seq: int, payload: bytes) -> tuple[bytes, bytes, bytes]:
    """The three frames of one message (``seq``: the publisher's own counter)."""
    return topic, seq.to_bytes(8, "big"), payload
