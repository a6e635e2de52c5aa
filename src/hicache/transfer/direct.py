"""DirectCopier: one ``copy_`` per page (per page and layer for loads).

The simple baseline: no coalescing, no staging. On CUDA each copy is split per kind (and
per layer for ``layer_first`` backups) so that the host side is one contiguous range and
the copy is an asynchronous DMA from/to pinned memory; torch makes any non-contiguous side
contiguous with a temporary. ``page_first`` loads read a strided host range per page and
layer, which torch stages through a pageable temporary (correct, not fast).
"""

from __future__ import annotations

from hicache.config import MemLayout
from hicache.memory.base import PageList, row_words
from hicache.memory.device_pool import DevicePool
from hicache.memory.host_pool import HostPool
from hicache.transfer.base import PageCopier, check_layer

__all__ = ["DirectCopier"]


class DirectCopier(PageCopier):
    """Page-by-page copies; byte-exact for every layout and dtype (copies integer words)."""

    name = "direct"

    def backup(
        self,
        device: DevicePool,
        host: HostPool,
        device_pages: PageList,
        host_pages: PageList,
    ) -> None:
        plan = self.plan(device, host, device_pages, host_pages, "backup")
        dv = row_words(device.buffer)  # (K, L, S, E)
        hv = row_words(host.buffer)
        ps = plan.page_size
        layout = host.layout
        cuda = device.device.type == "cuda"
        for d, h in plan.pairs:
            src = dv[:, :, d * ps : (d + 1) * ps]  # (K, L, ps, E)
            if layout is MemLayout.LAYER_FIRST:
                dst = hv[:, :, h * ps : (h + 1) * ps]
            elif layout is MemLayout.PAGE_FIRST:
                dst = hv[:, h * ps : (h + 1) * ps]  # (K, ps, L, E)
                src = src.transpose(1, 2)
            else:
                dst = hv[:, h]  # (K, L, ps, E)
            if not cuda:
                dst.copy_(src)
            elif layout is MemLayout.LAYER_FIRST:
                for k in range(dst.shape[0]):
                    for layer in range(dst.shape[1]):
                        dst[k, layer].copy_(src[k, layer], non_blocking=True)
            else:
                for k in range(dst.shape[0]):
                    dst[k].copy_(src[k], non_blocking=True)

    def load_layer(
        self,
        device: DevicePool,
        host: HostPool,
        host_pages: PageList,
        device_pages: PageList,
        layer: int,
    ) -> None:
        check_layer(device, layer)
        plan = self.plan(device, host, device_pages, host_pages, "load")
        dv = row_words(device.buffer)[:, layer]  # (K, S, E)
        hv = row_words(host.buffer)
        layout = host.layout
        if layout is MemLayout.LAYER_FIRST:
            hl = hv[:, layer]  # (K, S, E)
        elif layout is MemLayout.PAGE_FIRST:
            hl = hv[:, :, layer]  # (K, S, E), token stride L * E
        else:
            hl = hv[:, :, layer]  # (K, P, ps, E)
        ps = plan.page_size
        cuda = device.device.type == "cuda"
        for d, h in plan.pairs:
            dst = dv[:, d * ps : (d + 1) * ps]
            src = (
                hl[:, h] if layout is MemLayout.PAGE_FIRST_DIRECT else hl[:, h * ps : (h + 1) * ps]
            )
            if cuda:
                for k in range(dst.shape[0]):
                    dst[k].copy_(src[k], non_blocking=True)
            else:
                dst.copy_(src)
