"""L3 storage: the :class:`HiCacheStorage` contract, page records, backends and registry.

Backends: ``file`` (:mod:`.file`), ``memory`` (:mod:`.memory`, a fake for tests),
``redis`` (:mod:`.redis_store`, Redis or Valkey), ``mooncake`` (:mod:`.mooncake_store`),
or ``package.module:Class``. Build one with :func:`create_storage`.
"""

from hicache.storage.base import Deadline, HiCacheStorage, StorageError, StorageOptions
from hicache.storage.memory import MemoryFaults, MemoryStorage, MemoryStore
from hicache.storage.record import HEADER_SIZE, RecordCheck, check_record, encode_header
from hicache.storage.registry import (
    backend_names,
    create_storage,
    parse_extra_config,
    register_backend,
)
from hicache.storage.stats import MissReason, SetOutcome, StorageStats

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
    "StorageError",
    "StorageOptions",
    "StorageStats",
    "backend_names",
    "check_record",
    "create_storage",
    "encode_header",
    "parse_extra_config",
    "register_backend",
]
