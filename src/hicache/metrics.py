"""Counters of the cache, kept by the facade and read as one frozen snapshot.

Names follow Prometheus conventions (``*_total`` counters); the serving engine exports
every :class:`CacheCounters` field ``x_total`` as ``hicache_x_total``
(:mod:`hicache.server.metrics`), so a field added here is exported with no other change.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from hicache.rates import RestoreRates


@dataclass(slots=True)
class CacheCounters:
    """Monotonic counters (tokens and bytes), updated on the owner's thread only."""

    prefix_queries_total: int = 0
    query_tokens_total: int = 0
    device_hit_tokens_total: int = 0
    host_hit_tokens_total: int = 0
    backup_ops_total: int = 0
    backup_tokens_total: int = 0
    backup_bytes_total: int = 0
    backup_failures_total: int = 0
    load_ops_total: int = 0
    load_tokens_total: int = 0
    load_bytes_total: int = 0
    load_failures_total: int = 0
    load_skipped_tokens_total: int = 0
    load_fallbacks_total: int = 0
    """Requests requeued after a load their prefix depended on failed: re-admitted with
    no load from L2, they recompute what it could not bring (the request does not fail)."""
    device_evicted_tokens_total: int = 0
    device_demoted_tokens_total: int = 0
    host_evicted_tokens_total: int = 0
    session_demotions_total: int = 0
    """Idle sessions whose L2 pin was dropped because the sessions' pins passed their
    share of L2 (the least recently active first)."""
    session_yields_total: int = 0
    """Idle sessions whose L2 pin was dropped because an L2 allocation found nothing else
    to evict (retention never refuses pages)."""
    session_expired_total: int = 0
    """Sessions ended by their TTL."""
    storage_hit_tokens_total: int = 0
    prefetch_tokens_total: int = 0
    l3_backup_tokens_total: int = 0
    """Tokens written to L3 (records already there are counted apart)."""
    l3_backup_present_tokens_total: int = 0
    l3_backup_failed_tokens_total: int = 0
    l3_unstored_evicted_tokens_total: int = 0
    """L2-only tokens evicted from L2 while an L3 tier was attached and not in L3 (not
    marked ``stored``): lost to every tier (``watermark``: not written ahead in time)."""
    l3_ahead_writes_total: int = 0
    """L3 writes issued ahead of eviction (``watermark``) or by ``write_path`` (one per
    run of spans)."""
    l3_backup_snapshots_total: int = 0
    """Recurrent-state snapshots written to L3 (``"mamba"`` records)."""
    l3_backup_snapshots_failed_total: int = 0
    l3_backup_swa_pages_total: int = 0
    """Sliding-window KV pages written to L3 (``"swa"`` records)."""
    l3_backup_swa_pages_failed_total: int = 0
    l3_backup_indexer_pages_total: int = 0
    """DSA indexer key pages written to L3 (``"indexer"`` records)."""
    l3_backup_indexer_pages_failed_total: int = 0
    l3_backup_logprob_pages_total: int = 0
    """Scoring-entry pages written to L3 (``"logprob"`` records)."""
    l3_backup_logprob_pages_failed_total: int = 0
    prefetch_timeouts_total: int = 0
    """L3 prefetches whose request the policy let in at the prefetch's deadline with the
    lookup or the read not over (``timeout``: its computed wait; ``wait_complete``:
    ``prefetch_timeout_max``): each is a request that waited that long on L3 (a frozen
    or slow backend), whatever the backend's own deadline did meanwhile."""
    l3_negative_lookups_saved_total: int = 0
    """L3 lookups whose run the negative cache answered whole (its first key a miss
    remembered within ``negative_ttl_s``): no store call (:mod:`hicache.storage.negative`)."""
    l3_negative_keys_skipped_total: int = 0
    """Page keys of lookup runs not asked of the store because the negative cache
    remembered one of them (or one before them) missing."""
    l3_announced_pages_total: int = 0
    """Pages this instance announced as on their way to L3 at a request's end
    (:mod:`hicache.storage.announce`)."""
    l3_announced_waits_total: int = 0
    """L3 lookups whose run stopped at a page another writer announced, and that waited
    for it (:mod:`hicache.controller.announced`)."""
    l3_announced_waits_expired_total: int = 0
    """Of those, the waits that ran out (``announced_wait_s``, the announcement expired,
    or a read of the run would no longer pay) with the page still absent."""
    l3_announced_unwaited_total: int = 0
    """L3 lookups whose run stopped at an announced page and that did not wait for it: by
    the rule that reads a hit (the measured rates, or the threshold), no run it could
    reach, the pages announced in a row included, was worth a wait."""
    l3_decided_read_tokens_total: int = 0
    """L3 hit tokens read because this rank's measured rates said reading them beats
    recomputing them (:mod:`hicache.cache.l3.worth`; hits read to measure an unmeasured
    L3, or by a configured ``prefetch_threshold``, are not counted)."""
    l3_decided_recompute_tokens_total: int = 0
    """L3 hit tokens not read because recomputing them was measured to be faster."""
    l3_unwaited_prefetches_total: int = 0
    """Prefetches their request did not wait for: by the measured rates even a whole hit,
    looked up and read, would have come later than recomputing it."""
    prefetch_component_records_total: int = 0
    """Component records (snapshots, SWA pages) read from L3 into L2 by prefetches whose
    hit was taken."""
    restores_total: int = 0
    """Restores started (``POST /hicache/prefetch``; :mod:`hicache.cache.restores`)."""
    restore_failures_total: int = 0
    """Restores that ended without a hold (no L3, or its lookup failed)."""
    restore_tokens_total: int = 0
    """Tokens restores read from L3 into L2 (also in ``prefetch_tokens_total``)."""
    restore_l1_tokens_total: int = 0
    """Tokens of held restores copied on from L2 into L1 ahead of their request."""

    def snapshot(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class ComponentUsage:
    """One component's pools at a point in time (hybrid models).

    ``name``: ``"full"`` (full-attention KV pages), ``"swa"`` (sliding-window KV pages),
    ``"mamba"`` (recurrent-state slots) or ``"indexer"`` (DSA indexer key pages, on the full
    KV's page ids: its L1 use is the full KV's). ``*_used`` / ``*_total``: pages (slots) in use
    and in the pool, per tier (host 0/0 without L2). ``unit_bytes``: bytes of one page
    (slot). ``bytes_per_cached_token``: the component's used L1 bytes over the tokens
    whose full KV is in L1 (tree and requests), 0.0 when there are none: for full KV its
    per-token bytes; for sliding-window layers far less once sequences are longer than
    the window (only the last ``window`` tokens of each are held).

    Holders (pages / slots): ``device_requests``: L1 ones admitted requests own (not yet
    the tree's; for full KV also the pages the cache reserved); ``device_cached``: L1
    ones the tree owns; ``host_cached``: L2 ones the tree owns. The rest of the used
    ones are held by copies or L3 operations in flight: ``device_used - device_requests
    - device_cached >= 0`` and ``host_used - host_cached >= 0``; 0 once idle.
    """

    name: str
    device_used: int
    device_total: int
    host_used: int
    host_total: int
    unit_bytes: int
    bytes_per_cached_token: float
    device_requests: int = 0
    device_cached: int = 0
    host_cached: int = 0


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A point-in-time view: occupancy (tokens) and the counters."""

    page_size: int
    device_total_tokens: int
    device_cached_tokens: int
    device_free_tokens: int
    device_request_tokens: int
    """L1 token slots held by admitted requests (pages not handed to the tree yet) and by
    reserved pages (:meth:`~hicache.cache.full_pages.FullPages.reserve`)."""
    device_evictable_tokens: int
    host_total_tokens: int
    host_cached_tokens: int
    host_free_tokens: int
    host_only_tokens: int
    nodes: int
    counters: dict[str, int]
    storage: Any = None
    """The L3 backend's ``StorageStats`` snapshot, when one is attached."""
    components: tuple[ComponentUsage, ...] = ()
    """Per component (full first, then swa / mamba where present): pool use and bytes
    per cached token."""
    tree_tokens: int = 0
    """Distinct tokens L1 and L2 hold together: those of every tree node (each is in L1,
    L2 or both; a page in both counts once)."""
    l3_stored_tokens: int = 0
    """Tokens of tree nodes marked in L3 (``stored``: a write of them landed on every rank
    or a prefetch read them; the backend may have evicted some since)."""
    restores: RestoreRates | None = None
    """What restoring costs per tier, measured on this rank (:mod:`hicache.rates`)."""

    @property
    def device_held_tokens(self) -> int:
        """L1 token slots neither free nor reclaimable: held by requests, or in the tree
        and pinned (a running request's prefix, an in-flight copy). SGLang's
        ``num_used_tokens`` (total less available less evictable): cache pages an
        allocation would evict are not load, so a router's KV-pressure check does not
        see an instance whose L1 is full of cache as full."""
        return max(
            0,
            self.device_total_tokens - self.device_free_tokens - self.device_evictable_tokens,
        )

    @property
    def distinct_tokens(self) -> int:
        """Distinct tokens L1, L2 and L3 hold together, each page once: :attr:`tree_tokens`
        plus the L3 pages out of the tree, estimated as the new L3 records this instance
        wrote (``l3_backup_tokens_total``) less :attr:`l3_stored_tokens` (at least 0).
        Exact for an L3 this instance alone writes and that evicts nothing; a shared or
        capped backend's own record count is the true L3 figure."""
        written = self.counters.get("l3_backup_tokens_total", 0)
        return self.tree_tokens + max(0, written - self.l3_stored_tokens)

    @property
    def hit_rate(self) -> float:
        """Tokens served from L1, L2 or L3 over queried tokens, 0 when nothing was queried."""
        queried = self.counters["query_tokens_total"]
        c = self.counters
        hits = (
            c["device_hit_tokens_total"]
            + c["host_hit_tokens_total"]
            + c["storage_hit_tokens_total"]
        )
        return hits / queried if queried else 0.0
