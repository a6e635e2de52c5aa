"""The cache facade, its tiers and its component stores: ``HiCache`` speaks in requests
(``CacheRequest``).

:mod:`~hicache.cache.facade` (:class:`HiCache`, the verbs, ``sync``),
:mod:`~hicache.cache.request` (the opaque handle, ``CachedTokens``),
:mod:`~hicache.cache.sync` (the one owner of asynchronous results and of the re-entrancy
rule; tiers and stores report to it, never to the facade), :mod:`~hicache.cache.full_kv`
(the first store, the tree's spine) over its page level :mod:`~hicache.cache.full_pages`
(L1 :mod:`~hicache.cache.device_tier`, L2 :mod:`~hicache.cache.host_tier` or, without
one, :mod:`~hicache.cache.no_host_tier`), :mod:`~hicache.cache.l3` (the L3 slot, its
parties), :mod:`~hicache.cache.quarantine` (hold until final),
:mod:`~hicache.cache.components` (the component stores), :mod:`~hicache.cache.report`
(stats, integrity, digest; :mod:`~hicache.cache.pool_audit` per pool),
:mod:`~hicache.cache.held` (a request's L1 pages per store). "Tier" means L1 / L2 / L3
only; a component's pools and hooks are its *store*. The layout: docs/architecture.md,
"The shape of the cache".
"""

from hicache.cache.facade import HiCache
from hicache.cache.request import CachedTokens, CacheRequest, RequestState

__all__ = ["CacheRequest", "CachedTokens", "HiCache", "RequestState"]
