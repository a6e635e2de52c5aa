"""Whether a pool fits in memory, decided before anything is allocated.

A pool larger than its memory would not fail cleanly: the buffer is zero-filled page by
page until the kernel's OOM killer ends the process with nothing in the log. So every
pool checks its size here first and refuses, with the numbers, anything over
:data:`MEMORY_FRACTION` of what is available *now*:

* host memory (an L2 pool, or an L1 pool on a CPU-only host): ``psutil``'s available RAM;
* a CUDA device (an L1 pool on a GPU): the device's free memory from
  ``torch.cuda.mem_get_info``.

:func:`check_pool_sizes` checks both pools of a :class:`~hicache.config.CacheConfig`
together (on a CPU-only host L1 and L2 share the same RAM), naming the config fields and
the command-line flags that set them.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from hicache.config import CacheConfig
from hicache.spec import KVSpec

__all__ = [
    "DEVICE_FLAGS",
    "HOST_FLAGS",
    "MEMORY_FRACTION",
    "PAGE_BOOKKEEPING_BYTES",
    "MemoryAvailable",
    "PoolSizeError",
    "PoolSizes",
    "check_fits",
    "check_pool_sizes",
    "memory_available",
    "pool_bytes",
]

MEMORY_FRACTION = 0.9
"""A pool (or both pools sharing one memory) may take at most this fraction of the memory
available when it is created; the rest is left to the process and the OS."""

PAGE_BOOKKEEPING_BYTES = 48
"""Host bytes a pool spends per page besides its buffer (the allocator's free-list entry,
int object and used flag), counted so a pool of many tiny pages is not under-estimated."""

DEVICE_FLAGS = "device_tokens (--max-total-tokens) or --device-cache-size"
"""What sets the device (L1) pool's size."""

HOST_FLAGS = "hicache_size (--hicache-size, GB) or hicache_ratio (--hicache-ratio)"
"""What sets the host (L2) pool's size."""


@dataclass(frozen=True)
class MemoryAvailable:
    """Bytes available to a pool on one memory.

    ``available``: free now (RAM ``available`` for the host, free device memory for CUDA);
    ``allowed``: the part a pool may take, ``int(available * MEMORY_FRACTION)``;
    ``where``: a readable name of the memory (``"RAM"`` or ``"cuda:0 memory"``).
    """

    available: int
    allowed: int
    where: str


class PoolSizeError(ValueError):
    """A pool asked for more bytes than its memory has available; nothing was allocated.

    ``requested`` and ``available`` are bytes; ``allowed`` is the part of ``available`` a
    pool may take; ``flags`` names what sets the size (config fields, command-line flags).
    """

    def __init__(self, what: str, requested: int, memory: MemoryAvailable, flags: str = "") -> None:
        self.what = what
        self.requested = requested
        self.available = memory.available
        self.allowed = memory.allowed
        self.where = memory.where
        self.flags = flags
        lower = f"; lower {flags}" if flags else ""
        super().__init__(
            f"{what} needs {requested:,} bytes ({requested / 1e9:.2f} GB) but only "
            f"{memory.available:,} bytes ({memory.available / 1e9:.2f} GB) of {memory.where} "
            f"are available, of which at most {MEMORY_FRACTION:.0%} "
            f"({memory.allowed / 1e9:.2f} GB) may be used{lower}"
        )


def pool_bytes(buffer_bytes: int, num_pages: int) -> int:
    """Bytes a pool takes: its buffer plus ``PAGE_BOOKKEEPING_BYTES`` per page."""
    return buffer_bytes + num_pages * PAGE_BOOKKEEPING_BYTES


def _is_host(device: torch.device) -> bool:
    return device.type != "cuda"


def memory_available(device: torch.device | str) -> MemoryAvailable:
    """What a pool on ``device`` may use: free device memory for CUDA, else available RAM."""
    dev = torch.device(device)
    if _is_host(dev):
        available = int(psutil.virtual_memory().available)
        where = "RAM"
    else:
        available = int(torch.cuda.mem_get_info(dev)[0])
        where = f"{dev} memory"
    return MemoryAvailable(available, int(available * MEMORY_FRACTION), where)


def check_fits(
    nbytes: int, device: torch.device | str, *, what: str, flags: str = ""
) -> MemoryAvailable:
    """Raise :class:`PoolSizeError` if ``nbytes`` exceed what a pool on ``device`` may use.

    Allocates nothing. Returns the memory figures it checked against.
    """
    memory = memory_available(device)
    if nbytes > memory.allowed:
        raise PoolSizeError(what, nbytes, memory, flags)
    return memory


@dataclass(frozen=True)
class PoolSizes:
    """Bytes the pools of one config would take (see :func:`pool_bytes`): ``device`` (L1),
    ``host`` (L2, 0 when the hierarchical cache is off)."""

    device: int
    host: int


def check_pool_sizes(config: CacheConfig, spec: KVSpec, device: torch.device | str) -> PoolSizes:
    """Check that both pools of ``config`` fit before either is allocated.

    L2 always lives in RAM; L1 lives on ``device``. On a CPU-only host both share the RAM,
    so their sum is checked too. Raises :class:`PoolSizeError` naming the pool, its bytes,
    the bytes available and the flags that size it.
    """
    dev = torch.device(device)
    host_pages = config.host_pages(spec) if config.enable_hierarchical_cache else 0
    sizes = PoolSizes(
        pool_bytes(config.device_bytes(spec), config.device_pages),
        pool_bytes(config.host_bytes(spec), host_pages),
    )
    check_fits(sizes.device, dev, what="the device (L1) KV pool", flags=DEVICE_FLAGS)
    if sizes.host:
        ram = check_fits(sizes.host, "cpu", what="the host (L2) KV pool", flags=HOST_FLAGS)
        if _is_host(dev) and sizes.device + sizes.host > ram.allowed:
            raise PoolSizeError(
                "the device (L1) and host (L2) KV pools, both in RAM on a CPU-only host,",
                sizes.device + sizes.host,
                ram,
                f"{DEVICE_FLAGS}, or {HOST_FLAGS}",
            )
    return sizes
