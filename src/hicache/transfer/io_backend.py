"""Choosing a copy strategy by :class:`~hicache.config.IOBackend`."""

from __future__ import annotations

from hicache.config import IOBackend
from hicache.transfer.base import PageCopier
from hicache.transfer.direct import DirectCopier
from hicache.transfer.kernel import KernelCopier

__all__ = ["DirectCopier", "KernelCopier", "PageCopier", "make_copier"]


def make_copier(io_backend: IOBackend | str) -> PageCopier:
    """A new copier for ``io_backend`` (``"direct"`` or ``"kernel"``)."""
    backend = IOBackend(io_backend)
    if backend is IOBackend.DIRECT:
        return DirectCopier()
    return KernelCopier()
