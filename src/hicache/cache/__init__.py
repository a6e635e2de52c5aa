"""The cache facade, its tiers and its component stores: ``HiCache`` speaks in requests
(``CacheRequest``).

:mod:`~.facade` (:class:`HiCache`, the verbs, ``sync``), :mod:`~.request` (the opaque
handle), :mod:`~.sync` (the one owner of asynchronous results and of the re-entrancy rule;
tiers and stores report to it, never to the facade), :mod:`~.full_kv` (the first store,
the tree's spine) over its page level :mod:`~.full_pages` (L1 :mod:`~.device_tier`, L2
:mod:`~.host_tier` or, without one, :mod:`~.no_host_tier`), :mod:`~.l3` (the L3 slot, its
parties), :mod:`~.quarantine` (hold until final), :mod:`~.components` (the component
stores), :mod:`~.report` (stats, integrity, digest; :mod:`~.pool_audit` per pool),
:mod:`~.held` (a request's L1 pages per store). "Tier" means L1 / L2 / L3 only; a
component's pools and hooks are its *store*. The layout: docs/architecture.md, "The shape
of the cache".
"""

from hicache.cache.facade import HiCache
from hicache.cache.request import CachedTokens, CacheRequest, RequestState, ScoreAsk, ScoreLog

__all__ = ["CacheRequest", "CachedTokens", "HiCache", "RequestState", "ScoreAsk", "ScoreLog"]
