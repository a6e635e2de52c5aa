"""What an admitted request holds in L1, store by store: the seam a transfer of its KV to
another instance (prefill/decode disaggregation) iterates.

Each store says which pages of its L1 pool the request's positions occupy
(:meth:`~hicache.cache.components.base.ComponentStore.held`, :class:`HeldPages`): the full
KV first, then every component store that keeps values per position (sliding-window K/V,
the DSA indexer's keys). A sender reads each store's pages, a receiver writes them into
the pages its own admission gave the request; neither names a component. Stores that keep
state instead (recurrent snapshots) hold none per position: the live state is the
runner's and travels with its extras.
"""

from __future__ import annotations

from hicache.cache.components.base import HeldPages
from hicache.cache.facade import HiCache
from hicache.cache.request import CacheRequest, RequestState

__all__ = ["HeldPages", "held_pages"]


def held_pages(cache: HiCache, req: CacheRequest) -> tuple[HeldPages, ...]:
    """The L1 pages admitted ``req`` holds in each of ``cache``'s stores, the full KV
    first, in the stores' order; RuntimeError when ``req`` is not admitted."""
    if req.state is not RequestState.ADMITTED:
        raise RuntimeError(f"held pages of a request that is {req.state.value}, not admitted")
    out = [cache.full.held(req), *(s.held(req) for s in cache.stores)]
    return tuple(h for h in out if h is not None)
