"""Settings of the ``nixl`` L3 backend (NIXL's POSIX plugin over record files).

Keys of the engine's extra config:

- ``file_path``: the record directory, as for the ``file`` backend (the two write the same
  files, so either reads the other's); else ``$HICACHE_NIXL_BACKEND_STORAGE_DIR``, else
  ``/tmp/hicache-nixl``. Created with mode 0700.
- ``max_bytes``: size cap in bytes, least recently used records evicted past it (0, the
  default: no cap); as the ``file`` backend's.
- ``fsync``: fsync each record and its folder before it is published (default false).
- ``posix_io``: the POSIX plugin's IO queue: ``"auto"`` (default: the plugin's own choice,
  Linux AIO where built), ``"aio"`` (Linux AIO, ``use_aio``), ``"uring"`` (io_uring,
  ``use_uring``) or ``"posix_aio"`` (glibc's POSIX AIO, ``use_posix_aio``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from hicache.storage.backends.file import FileConfig

__all__ = ["DEFAULT_DIR", "ENV_DIR", "POSIX_IO", "NixlConfig"]

DEFAULT_DIR = "/tmp/hicache-nixl"
ENV_DIR = "HICACHE_NIXL_BACKEND_STORAGE_DIR"

POSIX_IO: dict[str, dict[str, str]] = {
    "auto": {},
    "aio": {"use_aio": "true"},
    "uring": {"use_uring": "true"},
    "posix_aio": {"use_posix_aio": "true"},
}
"""``posix_io`` value -> the POSIX plugin's init parameters."""


@dataclass(frozen=True, kw_only=True)
class NixlConfig(FileConfig):
    """The ``file`` backend's settings (``path``, ``max_bytes``, ``fsync``) plus the POSIX
    plugin's IO queue ``posix_io`` (a key of :data:`POSIX_IO`)."""

    posix_io: str = "auto"

    EXTRA_KEYS: ClassVar[tuple[str, ...]] = ("file_path", "max_bytes", "fsync", "posix_io")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.posix_io, str) or self.posix_io not in POSIX_IO:
            raise ValueError(
                f"posix_io={self.posix_io!r} is invalid; choose one of {sorted(POSIX_IO)}"
            )

    @property
    def plugin_params(self) -> dict[str, str]:
        """The POSIX plugin's init parameters for :attr:`posix_io`."""
        return dict(POSIX_IO[self.posix_io])

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> NixlConfig:
        unknown = sorted(set(extra) - set(cls.EXTRA_KEYS))
        if unknown:
            raise ValueError(
                f"nixl backend: unknown extra config keys {unknown}; allowed {cls.EXTRA_KEYS}"
            )
        path = extra.get("file_path") or os.environ.get(ENV_DIR) or DEFAULT_DIR
        return cls(
            path=path,
            max_bytes=extra.get("max_bytes", 0),
            fsync=extra.get("fsync", False),
            posix_io=extra.get("posix_io", "auto"),
        )
