"""Tensor-parallel ranks as the cache sees them: rank, size and all-reduce(min).

Ranks must agree on everything that changes their trees (the L3 hit length, how much a
prefetch fetched, whether an L2 allocation succeeded, when a copy landed), or they would
load different prefixes. :class:`~hicache.controller.agreement.Agreement` builds the
per-step agreement on :meth:`RankGroup.all_reduce_min`; the scalar helpers serve the few
agreed calls made while an agreed record is applied. With one rank (or no process group)
every call is a no-op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class LocalOnlyError(RuntimeError):
    """A collective was asked for where one rank runs alone (say a function the engine
    runs on rank 0 only): the other ranks would never join it, so it is refused at once
    instead of blocking until the collective's timeout."""


class RankGroup:
    """A torch.distributed (gloo) group, or nothing for a single rank.

    ``group``: the process group to reduce over (None: the default group, when one is
    initialized). Built before ``init_process_group`` it stays a single rank.
    """

    def __init__(self, group: object | None = None) -> None:
        import torch.distributed as dist

        self._dist: Any = dist if dist.is_available() and dist.is_initialized() else None
        self._group = group
        self.size: int = self._dist.get_world_size(group) if self._dist is not None else 1
        """Ranks in the group (1: no group)."""
        self.rank: int = self._dist.get_rank(group) if self._dist is not None else 0
        """This process's rank in the group, ``0 <= rank < size``."""
        self._local: str | None = None  # why collectives are refused now (local_only)

    @classmethod
    def single(cls) -> RankGroup:
        """One rank, whatever process group is initialized (every call a no-op)."""
        g = cls.__new__(cls)
        g._dist, g._group, g.size, g.rank, g._local = None, None, 1, 0, None
        return g

    @contextlib.contextmanager
    def local_only(self, why: str) -> Iterator[None]:
        """While inside, every collective raises :class:`LocalOnlyError` naming ``why``
        (this rank runs code the others do not). Not reentrant."""
        self._local = why
        try:
            yield
        finally:
            self._local = None

    @property
    def multi(self) -> bool:
        """Whether there is more than one rank (collectives are real)."""
        return self._dist is not None and self.size > 1

    def all_reduce_min(self, t: torch.Tensor) -> torch.Tensor:
        """Replace CPU int64 tensor ``t`` (any shape) in place by its elementwise minimum
        over all ranks; returns it. Every rank must call it with the same shape."""
        if t.dtype != torch.int64 or t.device.type != "cpu":
            raise ValueError(f"all_reduce_min needs a CPU int64 tensor, got {t.dtype} {t.device}")
        if self.multi:
            if self._local is not None:
                raise LocalOnlyError(
                    f"rank {self.rank} of {self.size} asked the ranks to agree {self._local},"
                    " where the others never would: do it in a step every rank runs"
                )
            self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self._group)
        return t

    def min(self, value: int) -> int:
        """The minimum of ``value`` over all ranks (``value`` itself for one rank)."""
        if not self.multi:
            return int(value)
        t = torch.tensor([int(value)], dtype=torch.int64)
        return int(self.all_reduce_min(t).item())

    def max(self, value: int) -> int:
        """The maximum of ``value`` over all ranks (one all-reduce(min) of its negation)."""
        return -self.min(-int(value))
