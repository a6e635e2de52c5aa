"""Settings of the ``aibrix`` L3 backend and the AIBrix environment they become.

AIBrix KVCache reads ``AIBRIX_KV_CACHE_OL_*`` variables when its ``BaseKVCacheManager`` is
built; hicache takes its own extra-config keys and turns them into those variables
(:meth:`AibrixConfig.environment`) for that one construction. Keys: ``connector``
(``"SHFS"``, default, or ``"ROCKSDB"``; case-insensitive), ``root``, ``aibrix_namespace``
(default ``"hicache"``), ``rocksdb_ttl_s`` (seconds; default 600; 0 never expires; SHFS
ignores it), ``op_batch`` (blocks per batch, default 32), ``async_workers`` (threads,
default 8). Fixed by hicache: AIBrix's L1 host cache off, synchronous puts, no block
resizing, no meta service, metrics timing off, device ``cpu``, and AIBrix's per-token L2
timeout set from ``timeout_s`` so it never fires before hicache's own deadline. Each key's
variable and default: ``docs/configuration.md``; why: ``docs/integrations.md``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["CONNECTORS", "AibrixConfig"]

CONNECTORS: tuple[str, ...] = ("SHFS", "ROCKSDB")
"""The AIBrix L2 connectors this backend drives (those that need no server)."""

_ROOT_ENV = {"SHFS": "AIBRIX_KV_CACHE_OL_SHFS_ROOT", "ROCKSDB": "AIBRIX_KV_CACHE_OL_ROCKSDB_ROOT"}
_DEFAULT_ROOT = {"SHFS": "~/.kv_cache_ol/shfs", "ROCKSDB": "~/.kv_cache_ol/rocksdb"}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True, kw_only=True)
class AibrixConfig:
    """AIBrix KVCache settings; see the module docstring for keys and defaults.

    ``root`` is stored expanded and absolute (the same directory whatever the caller's
    working directory is later)."""

    connector: str = "SHFS"
    root: str = ""
    aibrix_namespace: str = "hicache"
    rocksdb_ttl_s: int = 600
    op_batch: int = 32
    async_workers: int = 8

    EXTRA_KEYS: ClassVar[tuple[str, ...]] = (
        "connector",
        "root",
        "aibrix_namespace",
        "rocksdb_ttl_s",
        "op_batch",
        "async_workers",
    )

    def __post_init__(self) -> None:
        c = self.connector
        if not isinstance(c, str) or c.upper() not in CONNECTORS:
            raise ValueError(
                f"connector={c!r} is invalid; choose one of {list(CONNECTORS)} "
                "(the AIBrix L2 connectors that need no server)"
            )
        object.__setattr__(self, "connector", c.upper())
        if not isinstance(self.root, str):
            raise ValueError(f"root={self.root!r} is invalid; must be a directory path (str)")
        root = self.root or os.environ.get(_ROOT_ENV[self.connector]) or _DEFAULT_ROOT[c.upper()]
        object.__setattr__(self, "root", os.path.abspath(os.path.expanduser(root)))
        ns = self.aibrix_namespace
        if not isinstance(ns, str) or not ns or not all(ch.isalnum() or ch in "-." for ch in ns):
            raise ValueError(
                f"aibrix_namespace={ns!r} is invalid; must be a non-empty str of letters, "
                "digits, '-' and '.' (it names a folder)"
            )
        if not _is_int(self.rocksdb_ttl_s) or self.rocksdb_ttl_s < 0:
            raise ValueError(
                f"rocksdb_ttl_s={self.rocksdb_ttl_s!r} is invalid; must be an int >= 0 "
                "(seconds; 0 = never expires)"
            )
        for name in ("op_batch", "async_workers"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name}={v!r} is invalid; must be an int >= 1")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> AibrixConfig:
        unknown = sorted(set(extra) - set(cls.EXTRA_KEYS))
        if unknown:
            raise ValueError(
                f"aibrix backend: unknown extra config keys {unknown}; allowed {cls.EXTRA_KEYS}"
            )
        return cls(**{k: extra[k] for k in cls.EXTRA_KEYS if k in extra})

    def environment(self, *, block_bytes: int, timeout_s: float) -> dict[str, str]:
        """The ``AIBRIX_KV_CACHE_OL_*`` variables of one manager whose blocks are
        ``block_bytes`` long (one hicache record each, padded), with hicache's deadline
        ``timeout_s`` (seconds) as the floor of AIBrix's own L2 timeouts."""
        p = "AIBRIX_KV_CACHE_OL_"
        return {
            f"{p}L1_CACHE_ENABLED": "0",
            f"{p}L2_CACHE_BACKEND": self.connector,
            f"{p}L2_CACHE_NAMESPACE": f"{self.aibrix_namespace}-r{block_bytes}",
            f"{p}L2_CACHE_OP_BATCH": str(self.op_batch),
            f"{p}L2_CACHE_NUM_ASYNC_WORKERS": str(self.async_workers),
            f"{p}L2_CACHE_INGESTION_MAX_INFLIGHT_TOKENS": "0",
            f"{p}L2_CACHE_PER_TOKEN_TIMEOUT_MS": str(max(1, math.ceil(timeout_s * 1000))),
            f"{p}META_SERVICE_BACKEND": "",
            f"{p}BLOCK_SIZE": "-1",
            f"{p}MAX_SEQ_LEN": "-1",
            f"{p}DEVICE": "cpu",
            f"{p}TIME_MEASUREMENT_ENABLED": "0",
            f"{p}BREAKDOWN_MEASUREMENT_ENABLED": "0",
            _ROOT_ENV[self.connector]: self.root,
            f"{p}ROCKSDB_TTL_S": str(self.rocksdb_ttl_s),
        }
