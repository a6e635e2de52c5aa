"""KV events as pure frozen records: what a router learns of the pages this instance holds.

A page (a *block*; the block size is the cache's page size) is named by its block hash
(:mod:`hicache.kv_events.hashing`). :class:`BlockStored` says pages became resident on the
instance, :class:`BlockRemoved` that they left it, :class:`AllBlocksCleared` that every
page left at once; each carries the medium it concerns. A :class:`KvEventBatch` is what
the hub publishes: a sequence number (1, 2, ... per hub; 0 is a snapshot taken before the
first batch), a wall-clock timestamp and the events in order.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KvEvent",
    "KvEventBatch",
    "Medium",
]


class Medium(enum.Enum):
    """Where pages live; the value is the medium string vLLM and SGLang publish."""

    DEVICE = "GPU"
    """L1: accelerator memory (on a CPU-only host, the RAM pool standing in for it)."""
    HOST = "CPU"
    """L2: host RAM."""
    STORAGE = "STORAGE"
    """L3: a storage backend."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Pages that became resident, in path order.

    Attributes:
        block_hashes: one signed 64-bit hash per page; ``block_hashes[i]`` names the
            prefix up to and including page ``i``.
        parent_block_hash: the hash of the page before the first (``None``: the first
            page starts the sequence).
        token_ids: ``len(block_hashes) * block_size`` token ids, page after page.
        block_size: tokens per page (the cache's page size).
        medium: the tier the pages arrived in.
        cache_salt: the tenant salt the hashes were seeded with (``None``: shared pages).
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: Medium
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or len(self.token_ids) != len(self.block_hashes) * self.block_size:
            raise ValueError(
                f"token_ids has {len(self.token_ids)} ids; need block_size={self.block_size}"
                f" per each of the {len(self.block_hashes)} block_hashes"
            )


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Pages that left the instance; ``medium`` is the one they were stored with."""

    block_hashes: tuple[int, ...]
    medium: Medium


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every page left the instance (a flush, or the start of a resync)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
"""One KV event."""


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """Events published together.

    Attributes:
        sequence_number: the hub's counter: 1 for its first batch, one more per batch; a
            snapshot carries the number of the last batch it includes (0: none yet).
        timestamp: seconds since the epoch when the batch was published.
        events: in the order they happened.
        snapshot: the batch is a resync (``AllBlocksCleared`` then every resident page),
            not a batch of live events.
    """

    sequence_number: int
    timestamp: float
    events: tuple[KvEvent, ...]
    snapshot: bool = False
