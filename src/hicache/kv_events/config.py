"""``--kv-events-config``: SGLang's and vLLM's flag and JSON keys, as a frozen config."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from hicache.validate import int_at_least, require

__all__ = ["PUBLISHERS", "KvEventsConfig"]

PUBLISHERS = ("null", "zmq")
"""``null``: the hub only (smg's gRPC ``SubscribeKvEvents`` reads it); ``zmq``: also a ZMQ
publisher in vLLM's and SGLang's wire format."""

_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True, kw_only=True)
class KvEventsConfig:
    """KV events on (a config present) and how they go out.

    Attributes:
        publisher: one of :data:`PUBLISHERS`.
        endpoint: the ZMQ PUB address; one with ``*`` / ``::``, port 0, or an ``ipc://``
            / ``inproc://`` one is bound, any other is connected to (as vLLM does).
        bind: bind (True) or connect (False) the PUB socket whatever the address says
            (SGLang's key; None: the rule above).
        replay_endpoint: a ZMQ ROUTER address (bound) answering replay requests (an 8-byte
            big-endian start sequence) with the kept batches, or None.
        buffer_steps: batches the ZMQ publisher keeps for replay.
        hwm: the PUB socket's send high-water mark (messages).
        max_queue_size: batches a hub subscriber (the ZMQ publisher, a gRPC stream) may
            have unread before it is lagged (dropped, counted, then resynced).
        topic: the ZMQ topic frame of every message.
        history_batches: batches the hub keeps for gRPC subscribers that resume.
    """

    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    bind: bool | None = None
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    history_batches: int = 1024

    def __post_init__(self) -> None:
        require(self.publisher in PUBLISHERS, "publisher", self.publisher, f"one of {PUBLISHERS}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            require(
                isinstance(value, str) and value.startswith(_ENDPOINT_SCHEMES),
                name,
                value,
                f"must be a ZMQ address starting with one of {_ENDPOINT_SCHEMES}",
            )
        require(
            self.bind is None or isinstance(self.bind, bool),
            "bind",
            self.bind,
            "must be a bool or null",
        )
        int_at_least("buffer_steps", self.buffer_steps, 1)
        int_at_least("hwm", self.hwm, 1)
        int_at_least("max_queue_size", self.max_queue_size, 1)
        int_at_least("history_batches", self.history_batches, 0)
        require(isinstance(self.topic, str), "topic", self.topic, "must be a str")

    @classmethod
    def parse(cls, text: str) -> KvEventsConfig | None:
        """The config of a ``--kv-events-config`` JSON object (vLLM's and SGLang's keys,
        SGLang's ``format`` only as ``"default"``). Returns None when
        ``enable_kv_cache_events`` is false (vLLM's switch). Raises ValueError naming a bad
        or unknown key."""
        try:
            raw: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"kv_events_config={text!r} is invalid; must be a JSON object ({exc})"
            ) from exc
        require(isinstance(raw, dict), "kv_events_config", text, "must be a JSON object")
        raw = dict(raw)
        enabled = raw.pop("enable_kv_cache_events", True)
        require(isinstance(enabled, bool), "enable_kv_cache_events", enabled, "must be a bool")
        fmt = raw.pop("format", "default")
        require(
            fmt == "default",
            "format",
            fmt,
            "only SGLang's 'default' event format is published ('dynamo' hashes are not)",
        )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        require(not unknown, "kv_events_config", unknown, f"unknown keys; known: {sorted(known)}")
        if raw.get("publisher") is None:
            raw.pop("publisher", None)
        return cls(**raw) if enabled else None
