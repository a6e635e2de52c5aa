"""A ZMQ subscriber process that freezes (SIGSTOP) or dies never holds the engine up:
publishing goes on at full speed and the publisher keeps up with the hub."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from hicache.kv_events import AllBlocksCleared, BlockStored, KvEventHub, Medium
from hicache.kv_events.config import KvEventsConfig
from hicache.kv_events.zmq_publisher import ZmqKvEventPublisher

SUBSCRIBER = """
import sys, zmq
sock = zmq.Context().socket(zmq.SUB)
sock.setsockopt(zmq.RCVHWM, 4)
sock.setsockopt(zmq.SUBSCRIBE, b"")
sock.connect(sys.argv[1])
while True:
    sock.recv_multipart()
    print("got", flush=True)
"""

PAGES = 16
BIG = BlockStored(tuple(range(PAGES)), None, tuple(range(PAGES * 64)), 64, Medium.DEVICE)


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_frozen_or_dead_zmq_subscriber_does_not_slow_publishing(how: str) -> None:
    hub = KvEventHub(clock=lambda: 1.0)
    cfg = KvEventsConfig(publisher="zmq", endpoint="tcp://127.0.0.1:0", hwm=8)
    with ZmqKvEventPublisher(hub, cfg) as pub:
        child = subprocess.Popen(
            [sys.executable, "-c", SUBSCRIBER, pub.endpoint], stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout is not None
            os.set_blocking(child.stdout.fileno(), False)
            deadline = time.monotonic() + 20
            while not (child.stdout.readline() or "").startswith("got"):
                assert time.monotonic() < deadline, "the subscriber heard nothing"
                hub.publish([AllBlocksCleared()])
                time.sleep(0.05)
            if how == "stop":
                os.kill(child.pid, signal.SIGSTOP)
            else:
                child.kill()
                child.wait(10)
            before = hub.stats().published_batches
            start = time.monotonic()
            for _ in range(2000):  # about 8 MB of messages
                hub.publish([BIG])
            assert time.monotonic() - start < 5.0
            deadline = time.monotonic() + 20
            while pub.stats().sent < before + 2000:
                assert time.monotonic() < deadline, pub.stats()
                time.sleep(0.05)
            assert pub.stats().resyncs == 0 and hub.stats().dropped_batches == 0
        finally:
            if child.poll() is None:
                os.kill(child.pid, signal.SIGCONT)
                child.kill()
            child.wait(10)
    hub.close()
