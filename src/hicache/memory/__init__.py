"""Page allocators, the device (L1) pool and the host (L2) pool with its layouts, state pools."""

from hicache.memory.allocator import AllocatorError, PageAllocator
from hicache.memory.base import KVPool, PageList, check_pages, row_words
from hicache.memory.budget import (
    MEMORY_FRACTION,
    MemoryAvailable,
    PoolSizeError,
    PoolSizes,
    check_fits,
    check_pool_sizes,
    memory_available,
)
from hicache.memory.device_pool import DevicePool
from hicache.memory.host_pool import HOST_RAM_FRACTION, HostPool, check_host_memory
from hicache.memory.layout import buffer_shape, token_indices, torch_dtype
from hicache.memory.state_pool import StatePool, state_buffer_shape

__all__ = [
    "HOST_RAM_FRACTION",
    "MEMORY_FRACTION",
    "AllocatorError",
    "DevicePool",
    "HostPool",
    "KVPool",
    "MemoryAvailable",
    "PageAllocator",
    "PageList",
    "PoolSizeError",
    "PoolSizes",
    "StatePool",
    "buffer_shape",
    "check_fits",
    "check_host_memory",
    "check_pages",
    "check_pool_sizes",
    "memory_available",
    "row_words",
    "state_buffer_shape",
    "token_indices",
    "torch_dtype",
]
