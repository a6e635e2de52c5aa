"""The cache facade, its tiers and its component stores: ``HiCache`` speaks in requests
(``CacheRequest``).

* :mod:`~hicache.cache.facade`: :class:`HiCache`, the request verbs and ``sync``;
* :mod:`~hicache.cache.request`: the opaque per-request handle and ``CachedTokens``;
* :mod:`~hicache.cache.sync`: :class:`~hicache.cache.sync.CacheSync`, the one owner of
  asynchronous results (completions, rank agreement, waits, failing holders) and the
  one re-entrancy rule; the tiers and stores report to it, never to the facade;
* :mod:`~hicache.cache.full_kv`: :class:`~hicache.cache.full_kv.FullKVStore`, the full KV,
  the first store (the tree's spine): its L1 tier (:mod:`~hicache.cache.device_tier`:
  allocation with eviction, reserved pages), its L2 tier (:mod:`~hicache.cache.host_tier`:
  L1<->L2 copies, L2 eviction), the layer-wise load back and the page-level API;
* :mod:`~hicache.cache.l3`: the L3 slot (attach/detach, retired backends) and the
  attached tier's two parties of the sync: the prefetches and the writes;
* :mod:`~hicache.cache.quarantine`: the one hold-until-final primitive (pages a worker
  may still write stay out of use);
* :mod:`~hicache.cache.components`: the component stores (sliding window, state
  snapshots, the DSA indexer) behind one contract, and the list a cache holds;
* :mod:`~hicache.cache.report`: stats, integrity check and digest of a whole cache
  (:mod:`~hicache.cache.pool_audit`: one pool's use and ownership check);
* :mod:`~hicache.cache.held`: the L1 pages a request holds in each store (a transfer's
  seam).

"Tier" means L1 / L2 / L3 only; a component's pools and hooks are its *store*.
"""

from hicache.cache.facade import HiCache
from hicache.cache.request import CachedTokens, CacheRequest, RequestState

__all__ = ["CacheRequest", "CachedTokens", "HiCache", "RequestState"]
