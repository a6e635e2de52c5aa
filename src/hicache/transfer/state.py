"""State-slot copies between an L1 and an L2 :class:`~hicache.memory.state_pool.StatePool`.

``backup`` copies every layer and tensor of ``device_slots[i]`` into ``host_slots[i]``;
``load_layer`` copies one layer of ``host_slots[i]`` into ``device_slots[i]`` (so a load
can overlap the forward layer by layer like KV pages). Copies move bytes, never values:
each buffer is viewed as ``(dim0, dim1, bytes)`` ``uint8`` rows, so every dtype and every
layout round-trips exactly. An op is validated before any byte moves (ids in range, equal
lengths, destination ids unique).

``direct``: one ``copy_`` per slot (per slot and layer for a load). ``kernel``: one
``index_select`` + ``index_copy_`` per tensor over all slots of the op (gathered on the
source device, moved once, scattered on the destination). On CUDA both may leave copies
in flight on the current stream (pinned host pool); the caller synchronizes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from hicache.config import IOBackend, MemLayout
from hicache.memory.base import PageList
from hicache.memory.state_pool import StatePool

__all__ = [
    "DirectStateCopier",
    "KernelStateCopier",
    "StateCopier",
    "check_state_pools",
    "make_state_copier",
]


def check_state_pools(device: StatePool, host: StatePool) -> None:
    """Raise ValueError unless both pools hold the same state spec and L1 is layer_first."""
    if device.spec != host.spec:
        raise ValueError(f"state pools differ in spec: {device.spec} vs {host.spec}")
    if device.layout is not MemLayout.LAYER_FIRST:
        raise ValueError(f"the device state pool must be layer_first, not {device.layout.value}")


def _bytes(buf: torch.Tensor) -> torch.Tensor:
    """``buf`` ``(a, b, *shape)`` as a ``(a, b, nbytes)`` uint8 view."""
    return buf.view(buf.shape[0], buf.shape[1], -1).view(torch.uint8)


def _host_layer(host: StatePool, buf: torch.Tensor, layer: int | slice) -> torch.Tensor:
    """Host bytes ``(S, [L,] E)`` of ``layer`` with slots first, whatever the layout."""
    b = _bytes(buf)
    return b[layer] if host.layout is MemLayout.LAYER_FIRST else b[:, layer]


class StateCopier(ABC):
    """A strategy for slot copies between an L1 and an L2 state pool (no threads)."""

    name = "abstract"

    def _plan(
        self, device: StatePool, host: StatePool, src: PageList, dst: PageList, load: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(device slot ids, host slot ids), validated, as CPU int64 tensors."""
        check_state_pools(device, host)
        dpool, hpool = (device, host)
        if load:
            h = hpool.check_slots(src, "host slots")
            d = dpool.check_slots(dst, "device slots", unique=True)
        else:
            d = dpool.check_slots(src, "device slots")
            h = hpool.check_slots(dst, "host slots", unique=True)
        if d.numel() != h.numel():
            raise ValueError(f"{d.numel()} device slots vs {h.numel()} host slots")
        return d, h

    @abstractmethod
    def backup(
        self, device: StatePool, host: StatePool, device_slots: PageList, host_slots: PageList
    ) -> None:
        """Copy all layers and tensors of ``device_slots[i]`` into ``host_slots[i]``."""

    @abstractmethod
    def load_layer(
        self,
        device: StatePool,
        host: StatePool,
        host_slots: PageList,
        device_slots: PageList,
        layer: int,
    ) -> None:
        """Copy ``layer`` (all tensors) of ``host_slots[i]`` into ``device_slots[i]``."""

    def load(
        self, device: StatePool, host: StatePool, host_slots: PageList, device_slots: PageList
    ) -> None:
        """Copy every layer of ``host_slots[i]`` into ``device_slots[i]`` (layer by layer)."""
        for layer in range(device.spec.num_layers):
            self.load_layer(device, host, host_slots, device_slots, layer)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _check_layer(pool: StatePool, layer: int) -> None:
    if not 0 <= layer < pool.spec.num_layers:
        raise IndexError(f"layer {layer} out of range [0, {pool.spec.num_layers})")


class DirectStateCopier(StateCopier):
    """One copy per slot (and per layer for a load)."""

    name = "direct"

    def backup(
        self, device: StatePool, host: StatePool, device_slots: PageList, host_slots: PageList
    ) -> None:
        d, h = self._plan(device, host, device_slots, host_slots, load=False)
        cuda = device.torch_device.type == "cuda"
        for db, hb in zip(device.buffers, host.buffers, strict=True):
            dv, hv = _bytes(db), _bytes(hb)
            for ds, hs in zip(d.tolist(), h.tolist(), strict=True):
                src = dv[:, ds]  # (L, E)
                dst = hv[:, hs] if host.layout is MemLayout.LAYER_FIRST else hv[hs]
                dst.copy_(src, non_blocking=cuda)

    def load_layer(
        self,
        device: StatePool,
        host: StatePool,
        host_slots: PageList,
        device_slots: PageList,
        layer: int,
    ) -> None:
        _check_layer(device, layer)
        d, h = self._plan(device, host, host_slots, device_slots, load=True)
        cuda = device.torch_device.type == "cuda"
        for db, hb in zip(device.buffers, host.buffers, strict=True):
            dl, hl = _bytes(db)[layer], _host_layer(host, hb, layer)  # (S, E) each
            for ds, hs in zip(d.tolist(), h.tolist(), strict=True):
                dl[ds].copy_(hl[hs], non_blocking=cuda)


class KernelStateCopier(StateCopier):
    """One gather and one scatter per tensor over all slots of an op."""

    name = "kernel"

    def backup(
        self, device: StatePool, host: StatePool, device_slots: PageList, host_slots: PageList
    ) -> None:
        d, h = self._plan(device, host, device_slots, host_slots, load=False)
        if d.numel() == 0:
            return
        dd = d.to(device.torch_device)
        for db, hb in zip(device.buffers, host.buffers, strict=True):
            g = _bytes(db).index_select(1, dd).cpu()  # (L, n, E)
            hv = _bytes(hb)
            if host.layout is MemLayout.LAYER_FIRST:
                hv.index_copy_(1, h, g)
            else:
                hv.index_copy_(0, h, g.transpose(0, 1))

    def load_layer(
        self,
        device: StatePool,
        host: StatePool,
        host_slots: PageList,
        device_slots: PageList,
        layer: int,
    ) -> None:
        _check_layer(device, layer)
        d, h = self._plan(device, host, host_slots, device_slots, load=True)
        if d.numel() == 0:
            return
        on = device.torch_device
        dd = d.to(on)
        for db, hb in zip(device.buffers, host.buffers, strict=True):
            g = _host_layer(host, hb, layer).index_select(0, h)  # (n, E), CPU
            _bytes(db)[layer].index_copy_(0, dd, g.to(on))


def make_state_copier(io_backend: IOBackend | str) -> StateCopier:
    """A new state copier for ``io_backend`` (``"direct"`` or ``"kernel"``)."""
    if IOBackend(io_backend) is IOBackend.DIRECT:
        return DirectStateCopier()
    return KernelStateCopier()
