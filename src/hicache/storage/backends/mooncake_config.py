"""Settings of the ``mooncake`` L3 backend and the Mooncake error codes it meets.

Keys (environment fallbacks in brackets; extra-config values win):
``master_server_address`` [``MOONCAKE_MASTER``] ``127.0.0.1:50051``; ``metadata_server``
[``MOONCAKE_TE_META_DATA_SERVER``] ``P2PHANDSHAKE``; ``protocol`` [``MOONCAKE_PROTOCOL``]
``tcp``; ``device_name`` [``MOONCAKE_DEVICE``] ``""``; ``local_hostname`` ``127.0.0.1``;
``global_segment_size`` [``MOONCAKE_GLOBAL_SEGMENT_SIZE``] bytes, 0 (a service holds the
objects); ``local_buffer_size`` bytes, 0 (unused by this backend; any size is registered
memory a peer can read); ``zero_copy`` true; ``zero_copy_min_bytes`` 262144 (smaller
payloads are staged). Why the floor: ``docs/configuration.md``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["MC_ERRORS", "MooncakeConfig"]

MC_ERRORS: dict[int, str] = {
    -200: "NO_AVAILABLE_HANDLE (store full)",
    -600: "INVALID_PARAMS (buffer size differs from the object's)",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL (master unreachable)",
}
"""Mooncake error codes this backend meets, for messages."""


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v else default


@dataclass(frozen=True, kw_only=True)
class MooncakeConfig:
    """Client settings; see the module docstring for keys and defaults."""

    master_server_address: str = "127.0.0.1:50051"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = 0
    local_buffer_size: int = 0
    zero_copy: bool = True
    zero_copy_min_bytes: int = 256 << 10

    EXTRA_KEYS: ClassVar[tuple[str, ...]] = (
        "master_server_address",
        "metadata_server",
        "protocol",
        "device_name",
        "local_hostname",
        "global_segment_size",
        "local_buffer_size",
        "zero_copy",
        "zero_copy_min_bytes",
    )

    def __post_init__(self) -> None:
        for name in ("master_server_address", "metadata_server", "protocol", "local_hostname"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise ValueError(f"{name}={v!r} is invalid; must be a non-empty str")
        if ":" not in self.master_server_address:
            raise ValueError(
                f"master_server_address={self.master_server_address!r} is invalid; use host:port"
            )
        if not isinstance(self.device_name, str):
            raise ValueError(f"device_name={self.device_name!r} is invalid; must be a str")
        for name in ("global_segment_size", "local_buffer_size", "zero_copy_min_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name}={v!r} is invalid; must be an int >= 0 (bytes)")
        if not isinstance(self.zero_copy, bool):
            raise ValueError(f"zero_copy={self.zero_copy!r} is invalid; must be a bool")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> MooncakeConfig:
        unknown = sorted(set(extra) - set(cls.EXTRA_KEYS))
        if unknown:
            raise ValueError(
                f"mooncake backend: unknown extra config keys {unknown}; allowed {cls.EXTRA_KEYS}"
            )
        env = {
            "master_server_address": os.environ.get("MOONCAKE_MASTER"),
            "metadata_server": os.environ.get("MOONCAKE_TE_META_DATA_SERVER"),
            "protocol": os.environ.get("MOONCAKE_PROTOCOL"),
            "device_name": os.environ.get("MOONCAKE_DEVICE"),
            "global_segment_size": _env_int("MOONCAKE_GLOBAL_SEGMENT_SIZE", 0) or None,
        }
        kw: dict[str, Any] = {k: v for k, v in env.items() if v}
        kw.update({k: extra[k] for k in cls.EXTRA_KEYS if k in extra})
        return cls(**kw)
