"""The cache facade and its tiers: ``HiCache`` speaks in requests (``CacheRequest``).

* :mod:`~hicache.cache.facade`: :class:`HiCache`, the request verbs, L1 pages;
* :mod:`~hicache.cache.request`: the opaque per-request handle and ``CachedTokens``;
* :mod:`~hicache.cache.host_tier`: L2 pool, L1<->L2 copies, L2 eviction;
* :mod:`~hicache.cache.storage_tier`: L3 prefetch, writes and quarantine;
* :mod:`~hicache.cache.inspect`: stats snapshot and integrity check.
"""

from hicache.cache.facade import HiCache
from hicache.cache.request import CachedTokens, CacheRequest, RequestState

__all__ = ["CacheRequest", "CachedTokens", "HiCache", "RequestState"]
