"""hicache's KV events over ZMQ, decoded by the pinned vLLM's own event classes."""

from __future__ import annotations

import time

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared as VAllBlocksCleared,
)
from vllm.distributed.kv_events import (
    BlockRemoved as VBlockRemoved,
)
from vllm.distributed.kv_events import (
    BlockStored as VBlockStored,
)
from vllm.distributed.kv_events import (
    KVEventBatch,
)

from hicache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventHub,
    Medium,
)
from hicache.kv_events.config import KvEventsConfig
from hicache.kv_events.zmq_publisher import ZmqKvEventPublisher

STORED = BlockStored((-7, 8), None, (1, 2, 3, 4), 2, Medium.HOST, "acme")
CHILD = BlockStored((9,), 8, (5, 6), 2, Medium.DEVICE, "acme")


def _decode(payload: bytes) -> KVEventBatch:
    return msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)


def test_vllm_decodes_published_batches_live_and_by_replay() -> None:
    hub = KvEventHub(clock=lambda: 42.0)
    cfg = KvEventsConfig(
        publisher="zmq",
        endpoint="tcp://127.0.0.1:0",
        replay_endpoint="tcp://127.0.0.1:0",
        topic="kv",
    )
    ctx = zmq.Context()
    with ZmqKvEventPublisher(hub, cfg) as pub:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.endpoint)
        # ZMQ's slow joiner: publish until the subscription has taken.
        deadline = time.monotonic() + 10
        while not sub.poll(50):
            assert time.monotonic() < deadline, "no message reached the subscriber"
            hub.publish([AllBlocksCleared()])
        while sub.poll(200):
            sub.recv_multipart()
        hub.publish([STORED, CHILD])
        hub.publish([BlockRemoved((9,), Medium.DEVICE), AllBlocksCleared()])
        got = [sub.recv_multipart() for _ in range(2)]
        topics = [m[0] for m in got]
        seqs = [int.from_bytes(m[1], "big") for m in got]
        assert topics == [b"kv", b"kv"] and seqs[1] == seqs[0] + 1
        first, second = (_decode(m[2]) for m in got)
        assert first.ts == 42.0 and first.data_parallel_rank == 0
        stored, child = first.events
        assert isinstance(stored, VBlockStored) and isinstance(child, VBlockStored)
        assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids) == (
            [-7, 8],
            None,
            [1, 2, 3, 4],
        )
        assert (stored.block_size, stored.medium, stored.lora_id, stored.lora_name) == (
            2,
            "CPU",
            None,
            None,
        )
        assert stored.extra_keys == [("acme",), None]  # vLLM's form of a salt: block 0
        assert (child.parent_block_hash, child.medium, child.extra_keys) == (8, "GPU", None)
        removed, cleared = second.events
        assert isinstance(removed, VBlockRemoved) and isinstance(cleared, VAllBlocksCleared)
        assert (removed.block_hashes, removed.medium) == ([9], "GPU")

        # The replay endpoint answers from a sequence on, then the end marker.
        req = ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        assert pub.replay_address is not None
        req.connect(pub.replay_address)
        req.send_multipart((b"", seqs[0].to_bytes(8, "big")))
        replayed = []
        while True:
            assert req.poll(5000)
            empty, *msg = req.recv_multipart()
            assert empty == b""
            if int.from_bytes(msg[1], "big", signed=True) == -1:
                break
            replayed.append(msg)
        assert [int.from_bytes(m[1], "big") for m in replayed] == seqs
        assert [m[2] for m in replayed] == [m[2] for m in got]
        sub.close()
        req.close()
    assert pub.stats().sent >= 3 and pub.stats().replays == 1
    ctx.term()
    hub.close()
