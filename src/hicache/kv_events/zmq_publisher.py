"""The ZMQ publisher: one hub subscriber that sends every batch in vLLM's wire format.

Its thread (``start()`` / ``close()``) reads the hub, numbers the messages with its own
counter (0, 1, ...; as vLLM's publisher does), sends ``(topic, seq, payload)`` on a PUB
socket, which never blocks (past a subscriber's high-water mark ZMQ drops), keeps the
last ``buffer_steps`` payloads and, with a replay endpoint, answers a ROUTER request
(an 8-byte big-endian start sequence) with the kept messages from there and an end
marker (sequence ``-1``). When it falls behind the hub it resubscribes: the next
message is a snapshot (``AllBlocksCleared`` then every resident page).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

import zmq

from hicache.kv_events.config import KvEventsConfig
from hicache.kv_events.hub import (
    KvEventHub,
    KvEventSubscription,
    SubscriberLagged,
    SubscriptionClosed,
)
from hicache.kv_events.wire import encode_batch, frames

__all__ = ["ZmqKvEventPublisher", "ZmqPublisherStats"]

log = logging.getLogger(__name__)

_POLL_S = 0.05
_END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True, slots=True)
class ZmqPublisherStats:
    """Messages ``sent`` (handed to ZMQ: past a subscriber's high-water mark ZMQ drops
    them for that subscriber, uncounted), hub ``resyncs`` (this publisher fell behind the
    hub), ``replays`` answered; the bound ``endpoint``."""

    sent: int
    resyncs: int
    replays: int
    endpoint: str


def _binds(endpoint: str) -> bool:
    """vLLM's rule (a wildcard host, ``ipc://``, ``inproc://``), and any port 0."""
    wildcard = "*" in endpoint or "::" in endpoint or endpoint.endswith(":0")
    return wildcard or endpoint.startswith(("ipc://", "inproc://"))


class ZmqKvEventPublisher:
    """Publishes ``hub``'s batches over ZMQ as ``config`` says (see the module docstring)."""

    def __init__(self, hub: KvEventHub, config: KvEventsConfig) -> None:
        self.hub = hub
        self.config = config
        self._topic = config.topic.encode("utf-8")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self._sub: KvEventSubscription | None = None
        self._seq = 0
        self._sent = self._resyncs = self._replays = 0
        self.endpoint = config.endpoint
        """The PUB address (once bound: the address it bound, the port of ``:0`` too)."""
        self.replay_address: str | None = None
        """The ROUTER address it bound (None: no replay endpoint)."""

    def start(self) -> ZmqKvEventPublisher:
        """Open the sockets, subscribe to the hub and start the thread (idempotent)."""
        if self._thread is not None:
            return self
        ctx = self._ctx = zmq.Context()
        try:
            pub = self._pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            pub.setsockopt(zmq.LINGER, 0)
            bind = self.config.bind
            if bind if bind is not None else _binds(self.config.endpoint):
                pub.bind(self.config.endpoint)
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(self.config.endpoint)
            if self.config.replay_endpoint is not None:
                replay = self._replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.setsockopt(zmq.SNDHWM, 2 * (self.config.buffer_steps + 1))
                replay.bind(self.config.replay_endpoint)
                self.replay_address = replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._sub = self.hub.subscribe()
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (after the message in hand) and close the sockets."""
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        if self._sub is not None:
            self._sub.close()
        thread.join(timeout)
        if thread.is_alive():
            log.error("the KV event ZMQ publisher did not stop within %.1f s", timeout)
            return
        self._thread = None
        self._close_sockets()

    def __enter__(self) -> ZmqKvEventPublisher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> ZmqPublisherStats:
        """The counters now."""
        return ZmqPublisherStats(self._sent, self._resyncs, self._replays, self.endpoint)

    # ------------------------------------------------------------------ thread

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            sub = self._sub
            if sub is None:
                return
            try:
                batch = sub.get(_POLL_S)
            except SubscriberLagged:
                sub.close()
                self._resyncs += 1
                try:
                    self._sub = self.hub.subscribe()
                except SubscriptionClosed:
                    return
                continue
            except SubscriptionClosed:
                return
            if batch is not None:
                self._send(encode_batch(batch))

    def _send(self, payload: bytes) -> None:
        assert self._pub is not None
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart(frames(self._topic, seq, payload))  # PUB never blocks
        self._sent += 1
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        msg = self._replay.recv_multipart()
        if len(msg) != 3 or len(msg[2]) != 8:
            log.warning("ignoring a malformed KV event replay request (%d frames)", len(msg))
            return
        client, _, start = msg
        first = int.from_bytes(start, "big")
        self._replays += 1
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", *frames(self._topic, seq, payload)))
        self._replay.send_multipart((client, b"", b"", _END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
