"""Agreement across tensor-parallel ranks: all-reduce(min) of small integers.

Ranks must agree on the L3 hit length and on how much a prefetch fetched, or they would
load different prefixes. With one rank (or no process group) every call is a no-op.
"""

from __future__ import annotations

import torch


class RankGroup:
    """A torch.distributed (gloo) group, or nothing for a single rank."""

    def __init__(self, group: object | None = None) -> None:
        import torch.distributed as dist

        self._dist = dist if dist.is_available() and dist.is_initialized() else None
        self._group = group
        self.size = self._dist.get_world_size(group) if self._dist is not None else 1
        self.rank = self._dist.get_rank(group) if self._dist is not None else 0

    def min(self, value: int) -> int:
        """The minimum of ``value`` over all ranks (``value`` itself for one rank)."""
        if self._dist is None or self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self._group)
        return int(t.item())
