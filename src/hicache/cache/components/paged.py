"""The base of the component stores whose values are pages of their own K/V-shaped pools.

A :class:`PagedStore` holds an L1 :class:`~hicache.memory.DevicePool` of ``kv`` pages,
with the hierarchical cache an L2 :class:`~hicache.memory.HostPool` of the same shape
(in the cache's host layout), and the copier the cache's ``io_backend`` picks to move
pages between the two. Which page ids a node holds, and who allocates them, is the
subclass's: the SWA store allocates its own, the indexer uses the full KV's.
"""

from __future__ import annotations

import torch

from hicache.cache.components.base import ComponentStore, StoreContext
from hicache.memory import DevicePool, HostPool
from hicache.spec import KVSpec
from hicache.transfer import PageCopier, make_copier
from hicache.tree.components import Tier
from hicache.tree.node import PageIds


def ids_tensor(ids: PageIds) -> torch.Tensor:
    """Page ids as a 1-D int64 CPU tensor (the copiers' page lists)."""
    return torch.tensor(list(ids), dtype=torch.int64)


class PagedStore(ComponentStore):
    """A component store over an L1 page pool and, with the hierarchical cache, an L2 one
    (see the module doc). Subclasses call :meth:`_build_pools` in ``__init__``."""

    page_size: int
    copier: PageCopier
    _device_pool: DevicePool
    _host_pool: HostPool | None

    def _build_pools(
        self, kv: KVSpec, ctx: StoreContext, device_pages: int, host_pages: int
    ) -> None:
        """``device_pages`` L1 pages of ``kv`` on the cache's device; ``host_pages`` L2
        pages when the cache is hierarchical (none otherwise)."""
        config = ctx.config
        self.page_size = config.page_size
        self._device_pool = DevicePool(kv, device_pages, config.page_size, ctx.device)
        self.copier = make_copier(config.io_backend)
        self._host_pool = None
        if ctx.hierarchical:
            self._host_pool = HostPool.create(
                kv, host_pages, config.page_size, config.mem_layout, ctx.device
            )

    @property
    def device_pool(self) -> DevicePool:
        return self._device_pool

    @property
    def host_pool(self) -> HostPool | None:
        return self._host_pool

    def pool(self, tier: Tier) -> DevicePool | HostPool:
        """The ``tier`` pool (RuntimeError for L2 without the hierarchical cache)."""
        if tier is Tier.DEVICE:
            return self._device_pool
        if self._host_pool is None:
            raise RuntimeError(f"no L2 {self.label} pool without the hierarchical cache")
        return self._host_pool

    def host_ready(self) -> None:
        """Wait until every L1 -> L2 page copy issued so far has landed (on CUDA they are
        ordered on the current stream; on CPU they are done already). Call before another
        thread reads this store's L2 pages (an L3 write)."""
        dev = self._device_pool.device
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
