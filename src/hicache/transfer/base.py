"""The copy-strategy contract between the device (L1) and host (L2) pools.

A :class:`PageCopier` moves whole pages: ``backup`` copies every layer and kind of
``device_pages[i]`` into ``host_pages[i]``; ``load_layer`` copies one layer of
``host_pages[i]`` into ``device_pages[i]``. Page lists are 1-D integer tensors (CPU); the
copier moves them to the device itself. Every op is validated before any byte moves (pages
in range, same length, destination pages unique): a bad op raises and copies nothing.

On CUDA the copies are enqueued on the *current* stream and may still be in flight when a
method returns (the host pool is pinned); the caller synchronizes (the
:class:`~hicache.transfer.engine.TransferEngine` does). On CPU they are done on return.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from hicache.memory.base import PageList
from hicache.memory.device_pool import DevicePool
from hicache.memory.host_pool import HostPool
from hicache.transfer.plan import Direction, OpPlan

__all__ = ["PageCopier"]


class PageCopier(ABC):
    """A strategy for page copies between a :class:`DevicePool` and a :class:`HostPool`.

    Copiers hold no per-pool state except a one-entry cache of the last validated op (so
    the ``num_layers`` calls of one load validate once); they start no threads.
    """

    name: str = "abstract"

    def __init__(self) -> None:
        self._last: tuple[object, ...] | None = None

    def plan(
        self,
        device: DevicePool,
        host: HostPool,
        device_pages: PageList,
        host_pages: PageList,
        direction: Direction,
    ) -> OpPlan:
        """The validated :class:`OpPlan` of an op, reused while its inputs are unchanged.

        Reuse needs the very same page tensors (identity, kept alive by the cache) at the
        same in-place version, the same pools and direction; anything else re-validates.
        """
        last = self._last
        if (
            last is not None
            and last[0] is device
            and last[1] is host
            and last[2] is device_pages
            and last[3] is host_pages
            and last[4] == direction
            and last[5] == _version(device_pages)
            and last[6] == _version(host_pages)
        ):
            plan = last[7]
            assert isinstance(plan, OpPlan)
            return plan
        plan = OpPlan(device, host, device_pages, host_pages, direction)
        cacheable = _version(device_pages) is not None and _version(host_pages) is not None
        self._last = (
            (
                device,
                host,
                device_pages,
                host_pages,
                direction,
                _version(device_pages),
                _version(host_pages),
                plan,
            )
            if cacheable
            else None
        )
        return plan

    @abstractmethod
    def backup(
        self,
        device: DevicePool,
        host: HostPool,
        device_pages: PageList,
        host_pages: PageList,
    ) -> None:
        """Copy all layers and kinds of ``device_pages[i]`` into ``host_pages[i]`` (D -> H)."""

    @abstractmethod
    def load_layer(
        self,
        device: DevicePool,
        host: HostPool,
        host_pages: PageList,
        device_pages: PageList,
        layer: int,
    ) -> None:
        """Copy ``layer`` (all kinds) of ``host_pages[i]`` into ``device_pages[i]`` (H -> D)."""

    def load(
        self,
        device: DevicePool,
        host: HostPool,
        host_pages: PageList,
        device_pages: PageList,
    ) -> None:
        """Copy all layers of ``host_pages[i]`` into ``device_pages[i]`` (layer by layer)."""
        self.load_layers(device, host, host_pages, device_pages, lambda layer: None)

    def load_layers(
        self,
        device: DevicePool,
        host: HostPool,
        host_pages: PageList,
        device_pages: PageList,
        done: Callable[[int], None],
    ) -> None:
        """Copy every layer of ``host_pages[i]`` into ``device_pages[i]``, calling
        ``done(layer)`` for ``0, 1, ...`` in order, each once its layer has landed (on CUDA:
        has been enqueued on the current stream). A copier may copy several layers at once;
        this default copies one at a time. On an error, raises after every copy it started
        has ended; the layers reported done stay valid."""
        for layer in range(device.spec.num_layers):
            self.load_layer(device, host, host_pages, device_pages, layer)
            done(layer)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _version(pages: PageList) -> int | None:
    """In-place version counter of a page tensor; None for non-tensors (never cached)."""
    v = getattr(pages, "_version", None)
    return v if isinstance(v, int) else None


def check_layer(device: DevicePool, layer: int) -> None:
    """Raise IndexError unless ``0 <= layer < num_layers``."""
    if not 0 <= layer < device.spec.num_layers:
        raise IndexError(f"layer {layer} out of range [0, {device.spec.num_layers})")
