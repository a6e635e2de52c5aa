"""KV events: where this instance's pages live, for routers (smg over gRPC, ZMQ subscribers).

The tree reports residency changes to a :class:`ResidencyRecorder` in the owner's
thread; the owner drains it once per step into :meth:`KvEventHub.publish`; subscribers
(the gRPC ``SubscribeKvEvents`` stream via :func:`to_proto`, the ZMQ publisher) read
batches from the hub. Flows: ``docs/architecture.md``; routing: ``docs/router.md``.
"""

from hicache.kv_events.hashing import chain_digests, event_hash, salt_seed
from hicache.kv_events.hub import (
    KvEventHub,
    KvEventHubConfig,
    KvEventHubStats,
    KvEventSubscription,
    ReplayUnavailable,
    SubscriberLagged,
    SubscriptionClosed,
)
from hicache.kv_events.recorder import ResidencyRecorder
from hicache.kv_events.records import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    Medium,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KvEvent",
    "KvEventBatch",
    "KvEventHub",
    "KvEventHubConfig",
    "KvEventHubStats",
    "KvEventSubscription",
    "Medium",
    "ReplayUnavailable",
    "ResidencyRecorder",
    "SubscriberLagged",
    "SubscriptionClosed",
    "chain_digests",
    "event_hash",
    "salt_seed",
]
