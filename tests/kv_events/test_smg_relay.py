"""smg's own SGLang servicer relays hicache's ZMQ events (SGLang's wire) into the same
``KvEventBatch`` events as :func:`~hicache.kv_events.proto.to_proto` sends directly."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import grpc
from smg.smg_rs import SglangGrpcServer
from smg_grpc_proto.generated import common_pb2, sglang_scheduler_pb2_grpc

from hicache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventHub,
    Medium,
)
from hicache.kv_events.config import KvEventsConfig
from hicache.kv_events.proto import to_proto
from hicache.kv_events.zmq_publisher import ZmqKvEventPublisher
from hicache.runner.checkpoints import resolve_checkpoint

EVENTS = (
    BlockStored((-7, 8), None, (1, 2, 3, 4), 2, Medium.DEVICE, "acme"),
    BlockStored((9,), 8, (5, 6), 2, Medium.DEVICE, "acme"),
    BlockStored((10,), None, (7, 8), 2, Medium.HOST),
    BlockRemoved((9,), Medium.DEVICE),
    BlockRemoved((10,), Medium.HOST),
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _comparable(event: common_pb2.KvCacheEvent) -> common_pb2.KvCacheEvent:
    """``event`` without what only the relay sets: its event id, and the extra keys
    (vLLM's form of the salt, which it also passes on as ``cache_salt``)."""
    out = common_pb2.KvCacheEvent()
    out.CopyFrom(event)
    out.event_id = 0
    if out.WhichOneof("data") == "stored":
        for block in out.stored.blocks:
            del block.extra_keys[:]
    return out


def test_smgs_relay_of_our_zmq_events_equals_to_proto(tmp_path: Path) -> None:
    hub = KvEventHub()
    cfg = KvEventsConfig(publisher="zmq", endpoint="tcp://127.0.0.1:0")
    model = resolve_checkpoint("tiny-random-llama").path
    with ZmqKvEventPublisher(hub, cfg) as pub:
        address = f"127.0.0.1:{_free_port()}"
        server = SglangGrpcServer(
            address,
            f"ipc://{tmp_path}/ipc",
            f"ipc://{tmp_path}/handshake",
            str(model),
            kv_events_endpoint=pub.endpoint,
        )
        stop = threading.Event()
        try:
            with grpc.insecure_channel(address) as channel:
                grpc.channel_ready_future(channel).result(timeout=20)
                stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
                stream = stub.SubscribeKvEvents(
                    common_pb2.SubscribeKvEventsRequest(start_sequence_number=0), timeout=30
                )

                def probe() -> None:  # ZMQ's slow joiner: until the relay hears one
                    while not stop.wait(0.05):
                        hub.publish([AllBlocksCleared()])

                prober = threading.Thread(target=probe)
                prober.start()
                ours = None
                for batch in stream:
                    kinds = {e.WhichOneof("data") for e in batch.events}
                    if ours is None and kinds == {"cleared"}:
                        stop.set()
                        prober.join()
                        ours = hub.publish(EVENTS)
                    elif "stored" in kinds:
                        relayed = [_comparable(e) for e in batch.events]
                        break
                stream.cancel()
        finally:
            stop.set()
            server.stop()
    assert ours is not None
    assert relayed == [_comparable(e) for e in to_proto(ours).events]
    hub.close()
