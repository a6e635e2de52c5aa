"""Validated page pairs of one copy operation, with the runs copiers coalesce.

A copy op pairs ``device_pages[i]`` with ``host_pages[i]``. Copiers validate an op once
into an :class:`OpPlan` (range checks, destination pages unique) before touching any
memory, so a bad op copies nothing.
"""

from __future__ import annotations

from functools import cached_property
from typing import Literal, NamedTuple

import torch

from hicache.memory.base import PageList
from hicache.memory.device_pool import DevicePool
from hicache.memory.host_pool import HostPool
from hicache.memory.layout import token_indices

__all__ = ["Direction", "OpPlan", "Run", "RunTensors", "check_compatible"]

_SMALL = 256
"""Ops up to this many pages compute their runs in Python rather than with torch ops."""

Direction = Literal["backup", "load"]
"""``backup``: device -> host (host pages are written); ``load``: host -> device."""


class Run(NamedTuple):
    """``length`` op positions from ``pos`` whose pages are consecutive.

    For :attr:`OpPlan.runs` both ``dev`` and ``host`` pages are consecutive
    (``dev + j``, ``host + j`` for ``j < length``); for :attr:`OpPlan.host_runs` only the
    host pages are (``dev`` is the first device page and means nothing more).
    """

    pos: int
    dev: int
    host: int
    length: int


def check_compatible(device: DevicePool, host: HostPool) -> None:
    """Raise ValueError unless both pools hold the same KV shape, dtype and page size."""
    if device.spec != host.spec:
        raise ValueError(f"device and host pools differ in spec: {device.spec} vs {host.spec}")
    if device.page_size != host.page_size:
        raise ValueError(
            f"device and host pools differ in page_size: {device.page_size} vs {host.page_size}"
        )


class RunTensors(NamedTuple):
    """Runs as 1-D int64 CPU tensors (same fields as :class:`Run`)."""

    pos: torch.Tensor
    dev: torch.Tensor
    host: torch.Tensor
    length: torch.Tensor


def _run_tensors(dev: torch.Tensor, host: torch.Tensor, *, both: bool) -> RunTensors:
    n = dev.numel()
    if n <= _SMALL:  # Python is faster than a handful of tiny torch ops
        d, h = dev.tolist(), host.tolist()
        starts = [
            i for i in range(n) if i == 0 or h[i] - h[i - 1] != 1 or (both and d[i] - d[i - 1] != 1)
        ]
        lengths = [b - a for a, b in zip(starts, [*starts[1:], n], strict=True)]
        pos = torch.tensor(starts, dtype=torch.int64)
        return RunTensors(pos, dev[pos], host[pos], torch.tensor(lengths, dtype=torch.int64))
    brk = host[1:] - host[:-1] != 1
    if both:
        brk |= dev[1:] - dev[:-1] != 1
    starts_t = torch.cat([torch.zeros(1, dtype=torch.int64), torch.nonzero(brk).flatten() + 1])
    ends = torch.cat([starts_t[1:], torch.tensor([n], dtype=torch.int64)])
    return RunTensors(starts_t, dev[starts_t], host[starts_t], ends - starts_t)


def _run_list(rt: RunTensors) -> list[Run]:
    return [
        Run(*r)
        for r in zip(
            rt.pos.tolist(), rt.dev.tolist(), rt.host.tolist(), rt.length.tolist(), strict=True
        )
    ]


class OpPlan:
    """One op's validated pages (CPU int64, same length) and what copiers derive from them.

    Derived data is computed lazily and cached on the plan: coalesced runs, Python lists of
    the pages and index tensors on a given device.
    """

    def __init__(
        self,
        device: DevicePool,
        host: HostPool,
        device_pages: PageList,
        host_pages: PageList,
        direction: Direction,
    ) -> None:
        check_compatible(device, host)
        self.direction: Direction = direction
        self.device_pages = device.check_pages(
            device_pages, "device_pages", unique=direction == "load"
        )
        self.host_pages = host.check_pages(host_pages, "host_pages", unique=direction == "backup")
        if self.device_pages.numel() != self.host_pages.numel():
            raise ValueError(
                f"device_pages ({self.device_pages.numel()}) and host_pages "
                f"({self.host_pages.numel()}) differ in length"
            )
        self.n = self.device_pages.numel()
        self.page_size = device.page_size
        self._on: dict[tuple[str, torch.device], torch.Tensor] = {}
        self.memo: dict[str, object] = {}
        """Copier-specific data derived from the op (e.g. block offsets), kept with the plan
        so that the ``num_layers`` calls of one load compute it once."""

    @cached_property
    def run_tensors(self) -> RunTensors:
        """:attr:`runs` as tensors."""
        return _run_tensors(self.device_pages, self.host_pages, both=True)

    @cached_property
    def runs(self) -> list[Run]:
        """Maximal runs where device and host pages are both consecutive, in op order."""
        return _run_list(self.run_tensors)

    @cached_property
    def host_runs(self) -> list[Run]:
        """Maximal runs where the host pages are consecutive, in op order."""
        return _run_list(_run_tensors(self.device_pages, self.host_pages, both=False))

    @cached_property
    def pairs(self) -> list[tuple[int, int]]:
        """``(device_page, host_page)`` per position, as Python ints."""
        return list(zip(self.device_pages.tolist(), self.host_pages.tolist(), strict=True))

    def index(self, what: str, device: torch.device) -> torch.Tensor:
        """An int64 index tensor on ``device``.

        ``what`` is ``"dev_pages"``, ``"host_pages"``, ``"dev_tokens"`` or ``"host_tokens"``
        (token slots of the pages, page by page).
        """
        key = (what, device)
        t = self._on.get(key)
        if t is None:
            pages = self.device_pages if what.startswith("dev") else self.host_pages
            if what.endswith("tokens"):
                pages = token_indices(pages, self.page_size)
            t = pages.to(device)
            self._on[key] = t
        return t
