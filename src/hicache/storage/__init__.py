"""L3 storage: the :class:`HiCacheStorage` contract, page records, backends and registry.

Backends (in :mod:`.backends`, one module each): ``file``, ``memory`` (a fake for tests),
``redis`` (Redis or Valkey), ``mooncake``, ``aibrix``, ``nixl``, or ``package.module:Class``.
Build one with :func:`create_storage`. The store processes they talk to are launched by
:mod:`hicache.services`.
"""

from hicache.storage.backends.memory import MemoryFaults, MemoryStorage, MemoryStore
from hicache.storage.base import Deadline, HiCacheStorage, StorageError, StorageOptions
from hicache.storage.record import HEADER_SIZE, RecordCheck, check_record, encode_header
from hicache.storage.registry import (
    StorageConfig,
    backend_names,
    create_storage,
    parse_extra_config,
    register_backend,
    storage_config_from_args,
)
from hicache.storage.stats import MissReason, SetOutcome, SetResult, StorageStats

__all__ = [
    "HEADER_SIZE",
    "Deadline",
    "HiCacheStorage",
    "MemoryFaults",
    "MemoryStorage",
    "MemoryStore",
    "MissReason",
    "RecordCheck",
    "SetOutcome",
    "SetResult",
    "StorageConfig",
    "StorageError",
    "StorageOptions",
    "StorageStats",
    "backend_names",
    "check_record",
    "create_storage",
    "encode_header",
    "parse_extra_config",
    "register_backend",
    "storage_config_from_args",
]
