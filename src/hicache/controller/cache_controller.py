"""The cache controller: issues L1<->L2 copies; their completions go to the owner's queue.

It knows pools and page ids, never the tree: the owner (the cache's host tier) decides what
to copy and records what each op id stands for; the transfer worker posts one
:class:`~hicache.transfer.Completion` per op to the :class:`CompletionQueue` the owner
drains in its ``poll()``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from hicache.config import IOBackend
from hicache.controller.completions import CompletionQueue
from hicache.lifecycle import Lifecycle
from hicache.memory import DevicePool, HostPool
from hicache.transfer import LayerProgress, TransferEngine, make_copier
from hicache.tree.node import PageIds


def page_tensor(pages: PageIds) -> torch.Tensor:
    """Page ids as a CPU int64 tensor; shares memory with ``pages`` when non-empty."""
    if len(pages) == 0:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(pages, dtype=torch.int64)


class CacheController(Lifecycle):
    """Owns the transfer engine between one device pool and one host pool.

    Lifecycle: ``start()`` starts the worker, ``close()`` drains and stops it (also as a
    context manager). Op ids are unique and increasing.
    """

    def __init__(
        self,
        device_pool: DevicePool,
        host_pool: HostPool,
        io_backend: IOBackend,
        completions: CompletionQueue,
        *,
        layer_hook: Callable[[int, int], None] | None = None,
    ) -> None:
        self.device_pool = device_pool
        self.host_pool = host_pool
        self._engine = TransferEngine(
            device_pool,
            host_pool,
            make_copier(io_backend),
            layer_hook=layer_hook,
            sink=completions.post,
        )
        self._op_ids = itertools.count(1)

    def start(self) -> None:
        self._engine.start()

    def close(self) -> None:
        self._engine.close()

    def backup(self, device_pages: PageIds, host_pages: PageIds) -> int:
        """Copy L1 pages to L2 pages (all layers); returns the op id."""
        op_id = next(self._op_ids)
        self._engine.submit_backup(op_id, page_tensor(device_pages), page_tensor(host_pages))
        return op_id

    def load(self, host_pages: PageIds, device_pages: PageIds) -> tuple[int, LayerProgress]:
        """Copy L2 pages to L1 pages layer by layer; returns the op id and its progress."""
        op_id = next(self._op_ids)
        progress = self._engine.submit_load(
            op_id, page_tensor(host_pages), page_tensor(device_pages)
        )
        return op_id, progress

    def wait_idle(self, timeout_s: float) -> None:
        """Wait until every submitted op has posted its completion; TimeoutError after
        ``timeout_s`` seconds."""
        self._engine.wait_idle(timeout_s)

    def wait_backups(self, timeout_s: float) -> None:
        """Wait until every backup submitted so far has posted its completion (loads of
        other pages may still run); TimeoutError after ``timeout_s`` seconds."""
        self._engine.wait_backups(timeout_s)

    @property
    def pending_backups(self) -> int:
        """Backups submitted whose completion has not been posted yet."""
        return self._engine.pending_backups

    @property
    def pending(self) -> int:
        """Ops submitted whose completion has not been posted yet."""
        return self._engine.pending
