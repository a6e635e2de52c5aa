"""How a cache is configured: frozen, validated configs and the policy enums.

:class:`CacheConfig` shapes the tiers and picks the policies; :class:`PrefetchConfig` says
when an L3 prefetch starts and stops. What the model caches is its spec
(:mod:`hicache.spec`); the config sizes pools for a KV of any shape (:class:`KVBytes`).

Every config is a keyword-only frozen dataclass validated in ``__post_init__``; a bad value
raises :class:`ValueError` naming the field, the value and what is allowed. Derived sizes are
properties. Names and defaults follow SGLang's ``--hicache-*`` flags where they exist.

This module is pure: no torch, no threads, no IO.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol

from hicache.validate import (
    enum_value,
    int_at_least,
    is_finite_number,
    is_int,
    is_number,
    number_at_least,
    require,
)


class WritePolicy(str, enum.Enum):
    """When a device (L1) node is copied to host (L2)."""

    WRITE_THROUGH = "write_through"
    """Back up on first insert."""
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    """Back up once a node has been hit ``write_through_threshold`` times."""
    WRITE_BACK = "write_back"
    """Back up only when the node is evicted from the device."""
    WATERMARK = "watermark"
    """L1 -> L2 as ``write_through``; L2 -> L3 not when a run lands in L2 but ahead of L2
    eviction: once the L2 pages in use pass ``write_back_threshold`` of the pool, the
    coldest ones not yet in L3 are written (:mod:`hicache.cache.l3.ahead`)."""


class IOBackend(str, enum.Enum):
    """How pages move between L1 and L2."""

    DIRECT = "direct"
    """One copy per page (and per layer when loading layer by layer)."""
    KERNEL = "kernel"
    """Vectorized gather/scatter over all pages of an operation at once."""


class MemLayout(str, enum.Enum):
    """Host (L2) tensor layout; see DESIGN.md."""

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"


class EvictionPolicy(str, enum.Enum):
    """Order in which evictable leaves go first."""

    LRU = "lru"
    LFU = "lfu"
    FIFO = "fifo"
    PRIORITY = "priority"


class PrefetchPolicy(str, enum.Enum):
    """When a prefetch from L3 stops (whatever was fetched by then is used)."""

    BEST_EFFORT = "best_effort"
    """Never wait: stop as soon as the request could run."""
    WAIT_COMPLETE = "wait_complete"
    """Wait until every hit page has arrived (or failed)."""
    TIMEOUT = "timeout"
    """Wait until done or ``min(max, base + per_ki_token * tokens / 1024)`` seconds."""


class KVBytes(Protocol):
    """What sizing a pool reads of a KV's shape (a :class:`hicache.spec.KVSpec`)."""

    @property
    def token_bytes(self) -> int:
        """Bytes one token occupies across all layers."""
        ...


MAX_SESSION_TTL_MS = 86_400_000
"""The longest a session's KV may be kept idle (24 h, in ms): anything longer is a
mistake, not a retention."""


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """How the hierarchical cache is shaped and how it behaves.

    Sizes: the device (L1) pool holds ``device_tokens`` tokens. The host (L2) pool holds
    ``hicache_size`` GB (10**9 bytes) per rank when that is set (> 0), else
    ``hicache_ratio x device_tokens`` tokens. Both are rounded down to whole pages.
    """

    page_size: int = 64
    device_tokens: int = 65536
    enable_hierarchical_cache: bool = True
    hicache_ratio: float = 2.0
    hicache_size: float = 0.0
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    write_through_threshold: int = 2
    write_back_threshold: float = 0.8
    """``watermark``: the high mark, as the fraction of the L2 pool's pages the tree holds
    past which L2 pages are written to L3 ahead of eviction (in (0, 1]; SGLang's
    ``--hicache-write-back-threshold``)."""
    io_backend: IOBackend = IOBackend.KERNEL
    mem_layout: MemLayout = MemLayout.PAGE_FIRST
    eviction_policy: EvictionPolicy = EvictionPolicy.LRU
    load_back_threshold: int = 10
    swa_full_tokens_ratio: float = 0.8
    """Hybrid models with sliding-window layers: the SWA layers' L1 pool holds this ratio
    of ``device_tokens`` (SGLang's ``--swa-full-tokens-ratio``;
    :meth:`hicache.spec.SlidingWindowSpec.device_pages`)."""
    max_mamba_cache_size: int = 0
    """Hybrid models with recurrent layers: state slots in the L1 state pool (SGLang's
    ``--max-mamba-cache-size``); 0 derives it from ``mamba_full_memory_ratio``
    (:meth:`hicache.spec.SnapshotSpec.device_slots`)."""
    mamba_full_memory_ratio: float = 0.9
    """L1 state-pool bytes per byte of the L1 full KV pool, when ``max_mamba_cache_size``
    is 0 (SGLang's ``--mamba-full-memory-ratio``)."""
    mamba_track_interval: int = 256
    """Tokens between state snapshots taken during a prefill (SGLang's
    ``--mamba-track-interval``); snapshots sit on page boundaries, every
    :meth:`hicache.spec.SnapshotSpec.track_pages` pages."""
    session_ratio: float = 0.5
    """Share of the L2 pool that idle agent sessions' KV may stay pinned in until their
    next turn (:mod:`hicache.cache.sessions`); past it the least recently active are
    demoted to L3. 0: no session's KV is kept."""
    session_ttl_ms: int = 300_000
    """How long an idle session's KV is kept after its last request ended (ms), unless a
    request names its own ``session_ttl_ms``; at most :data:`MAX_SESSION_TTL_MS`."""

    def __post_init__(self) -> None:
        for field, cls in (
            ("write_policy", WritePolicy),
            ("io_backend", IOBackend),
            ("mem_layout", MemLayout),
            ("eviction_policy", EvictionPolicy),
        ):
            object.__setattr__(self, field, enum_value(cls, field, getattr(self, field)))
        int_at_least("page_size", self.page_size, 1, "(64 is the default, 1 is allowed)")
        require(
            is_int(self.device_tokens) and self.device_tokens >= self.page_size,
            "device_tokens",
            self.device_tokens,
            f"must be an int >= page_size ({self.page_size})",
        )
        require(
            isinstance(self.enable_hierarchical_cache, bool),
            "enable_hierarchical_cache",
            self.enable_hierarchical_cache,
            "must be a bool",
        )
        require(
            is_finite_number(self.hicache_ratio) and self.hicache_ratio > 1.0,
            "hicache_ratio",
            self.hicache_ratio,
            "must be a finite number > 1 (the host pool must be larger than the device pool)",
        )
        number_at_least("hicache_size", self.hicache_size, 0, "of GB (0: size by hicache_ratio)")
        int_at_least("write_through_threshold", self.write_through_threshold, 1)
        require(
            is_finite_number(self.write_back_threshold) and 0 < self.write_back_threshold <= 1,
            "write_back_threshold",
            self.write_back_threshold,
            "must be a number in (0, 1] (the share of L2 pages in use past which L2 is"
            " written to L3 ahead of eviction)",
        )
        int_at_least("load_back_threshold", self.load_back_threshold, 0, "(tokens)")
        require(
            is_finite_number(self.swa_full_tokens_ratio) and self.swa_full_tokens_ratio > 0,
            "swa_full_tokens_ratio",
            self.swa_full_tokens_ratio,
            "must be a finite number > 0",
        )
        int_at_least("max_mamba_cache_size", self.max_mamba_cache_size, 0, "(0: derive it)")
        require(
            is_finite_number(self.mamba_full_memory_ratio) and self.mamba_full_memory_ratio > 0,
            "mamba_full_memory_ratio",
            self.mamba_full_memory_ratio,
            "must be a finite number > 0",
        )
        int_at_least("mamba_track_interval", self.mamba_track_interval, 1, "(tokens)")
        require(
            is_finite_number(self.session_ratio) and 0 <= self.session_ratio <= 1,
            "session_ratio",
            self.session_ratio,
            "must be a finite number in [0, 1] (a share of L2)",
        )
        require(
            is_int(self.session_ttl_ms) and 0 <= self.session_ttl_ms <= MAX_SESSION_TTL_MS,
            "session_ttl_ms",
            self.session_ttl_ms,
            f"must be an int of ms in [0, {MAX_SESSION_TTL_MS}] (24 h)",
        )

    @property
    def device_pages(self) -> int:
        """Whole pages in the device pool."""
        return self.device_tokens // self.page_size

    def page_bytes(self, spec: KVBytes) -> int:
        """Bytes of one page over all layers for a KV of shape ``spec``."""
        return spec.token_bytes * self.page_size

    def device_bytes(self, spec: KVBytes) -> int:
        """Bytes of the device (L1) pool's buffer: ``device_pages`` whole pages."""
        return self.device_pages * self.page_bytes(spec)

    def host_pages(self, spec: KVBytes) -> int:
        """Whole pages in the host pool for a KV of shape ``spec``."""
        if self.hicache_size > 0:
            return int(self.hicache_size * 1e9) // self.page_bytes(spec)
        return int(self.device_pages * self.hicache_ratio)

    def write_back_mark(self, spec: KVBytes) -> int | None:
        """``watermark``: the L2 pages in use past which L2 is written to L3 ahead of
        eviction (``write_back_threshold`` of :meth:`host_pages`, rounded down); None
        under the other policies."""
        if self.write_policy is not WritePolicy.WATERMARK:
            return None
        return int(self.write_back_threshold * self.host_pages(spec))

    def host_tokens(self, spec: KVBytes) -> int:
        """Token slots of the host pool: ``host_pages(spec) * page_size``."""
        return self.host_pages(spec) * self.page_size

    def host_bytes(self, spec: KVBytes) -> int:
        """Bytes of the host (L2) pool's buffer (0 without the hierarchical cache)."""
        if not self.enable_hierarchical_cache:
            return 0
        return self.host_pages(spec) * self.page_bytes(spec)

    def host_scale(self, spec: KVBytes) -> float:
        """L2 size over L1 size of the full KV pools; the component pools' L2 sizes follow
        it (so ``hicache_size`` and ``hicache_ratio`` size every component's L2)."""
        return self.host_pages(spec) / self.device_pages


DEFAULT_NEGATIVE_TTL_S = 2.0
"""Seconds an L3 miss is trusted by default (:mod:`hicache.storage.negative`): a page
another instance wrote is found at most this late (the ``timeout`` prefetch's base wait is
2 s too, so a request loses at most about one prefetch window of sharing), while a stream
of requests over the same absent run asks the store about once per 2 s, not per request."""

DEFAULT_NEGATIVE_ENTRIES = 65536
"""L3 misses remembered by default (a few MiB of Python objects at most)."""


DEFAULT_ANNOUNCED_WAIT_S = 0.5
"""Longest wait of an L3 lookup for a page another instance announced it is writing
(:mod:`hicache.controller.announced`): a decode instance's write of an answer lands some
milliseconds after the answer ends, tens under load; half a second covers a loaded
backend and costs a request that long only when a writer announced and then failed."""

DEFAULT_PREFETCH_THRESHOLD = 256
"""Tokens an L3 hit needs to be read when ``prefetch_threshold`` is unset and no rate
decides (another policy, or a cache with no engine timing its prefill): SGLang's default."""

PREFETCH_KEYS: tuple[str, ...] = (
    "prefetch_threshold",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "prefetch_timeout_max",
    "announced_wait_s",
    "announce_writes",
)
"""Keys of ``--hicache-storage-backend-extra-config`` that tune prefetch, not the backend."""


@dataclass(frozen=True, kw_only=True)
class PrefetchConfig:
    """How prefetch from L3 starts and stops.

    A prefetch reads an L3 hit beyond the local match when it is at least
    ``prefetch_threshold`` tokens. Left unset (None, the default), the ``timeout`` policy
    decides by this instance's measured rates instead (whether to wait for a prefetch and
    whether to read a hit; :mod:`hicache.cache.l3.worth`), and :data:`DEFAULT_PREFETCH_THRESHOLD`
    applies where nothing is measured; set, it decides alone, as it always did. Under the ``timeout`` policy it stops after
    ``min(prefetch_timeout_max, prefetch_timeout_base + prefetch_timeout_per_ki_token *
    tokens / 1024)`` seconds (defaults 30, 2, 0.1).

    ``negative_ttl_s``: seconds a page key the store did not have is remembered, so that
    lookups through it do not ask again (:mod:`hicache.storage.negative`; 0: off, every
    lookup asks); ``negative_max_entries``: keys remembered at most (LRU).

    ``announced_wait_s``: a lookup whose run stops at a page a writer announced
    (:mod:`hicache.storage.announce`) waits for it at most this long, seconds
    (:mod:`hicache.controller.announced`; 0: announcements are not read, no wait), and
    only while the rule that reads a hit (the rates, or the threshold) says a read of the
    run it could reach would still pay.
    ``announce_writes``: at a request's end this instance announces the pages of its path
    on their way to L3 (a PD decode instance with offload does, whatever this says: its
    answers' writes land after the answers ended).
    """

    policy: PrefetchPolicy = PrefetchPolicy.TIMEOUT
    prefetch_threshold: int | None = None
    prefetch_timeout_base: float = 2.0
    prefetch_timeout_per_ki_token: float = 0.1
    prefetch_timeout_max: float = 30.0
    negative_ttl_s: float = DEFAULT_NEGATIVE_TTL_S
    negative_max_entries: int = DEFAULT_NEGATIVE_ENTRIES
    announced_wait_s: float = DEFAULT_ANNOUNCED_WAIT_S
    announce_writes: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", enum_value(PrefetchPolicy, "policy", self.policy))
        if self.prefetch_threshold is not None:
            int_at_least("prefetch_threshold", self.prefetch_threshold, 0, "(tokens)")
        for name in (
            "prefetch_timeout_base",
            "prefetch_timeout_per_ki_token",
            "prefetch_timeout_max",
        ):
            v = getattr(self, name)
            require(is_number(v) and v >= 0, name, v, "must be a number of seconds >= 0")
        ttl = self.negative_ttl_s
        require(
            is_finite_number(ttl) and ttl >= 0,
            "negative_ttl_s",
            ttl,
            "must be a finite number of seconds >= 0 (0: off)",
        )
        int_at_least("negative_max_entries", self.negative_max_entries, 1)
        wait = self.announced_wait_s
        require(
            is_finite_number(wait) and wait >= 0,
            "announced_wait_s",
            wait,
            "must be a finite number of seconds >= 0 (0: no wait)",
        )
        require(
            isinstance(self.announce_writes, bool),
            "announce_writes",
            self.announce_writes,
            "must be true or false",
        )

    @classmethod
    def from_extra(cls, policy: PrefetchPolicy | str, extra: dict[str, Any]) -> PrefetchConfig:
        """The prefetch keys of an extra-config dict (other keys are the backend's)."""
        return cls(
            policy=PrefetchPolicy(policy), **{k: extra[k] for k in PREFETCH_KEYS if k in extra}
        )

    def timeout_s(self, tokens: int) -> float:
        """Seconds a ``timeout`` prefetch of ``tokens`` tokens may take."""
        linear = self.prefetch_timeout_base + self.prefetch_timeout_per_ki_token * tokens / 1024
        return min(self.prefetch_timeout_max, linear)
