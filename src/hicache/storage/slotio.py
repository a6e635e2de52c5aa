"""Byte-level access to recurrent-state slots of a host (L2) state pool, as L3 payloads.

A ``mamba`` component record (see ``docs/l3-keys.md``) holds one state slot: per state
tensor in spec order, the slot's ``(L, *shape)`` values in the tensor's dtype, C order,
concatenated (``SnapshotSpec.slot_bytes`` bytes). The order is canonical, the same for every
host layout:

- ``page_first`` / ``page_first_direct`` pools (buffers ``(S, L, *shape)``): a slot of one
  tensor is one contiguous block, read and written in place (no copy);
- ``layer_first`` pools (buffers ``(L, S, *shape)``): a set gathers the slots into a
  canonical copy first; a get fills a staging copy that :meth:`StateSlots.commit`
  scatters into the pool, for the good slots only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache.memory.state_pool import StatePool
from hicache.storage.pageio import Payloads, byte_view

__all__ = ["StateSlots"]


class StateSlots(Payloads):
    """Payload access to ``slots`` of the host state pool ``pool``; item ``i`` belongs to
    ``slots[i]``. Validates the slots (in range; unique for a get). ``pool`` must live in
    CPU memory (an L2 pool)."""

    def __init__(
        self, pool: StatePool, slots: Sequence[int] | torch.Tensor, *, for_get: bool
    ) -> None:
        if pool.torch_device.type != "cpu":
            raise ValueError(f"L3 state records need a host (CPU) state pool, got {pool!r}")
        idx = pool.check_slots(slots if isinstance(slots, torch.Tensor) else list(slots),
                               unique=for_get)  # fmt: skip
        self.pool = pool
        self.slots: list[int] = idx.tolist()
        self.payload_len = pool.slot_bytes
        self.zero_copy = False  # no registered-buffer views (a backend stages or copies)
        self.in_place = pool.slot_dim() == 0
        self._for_get = for_get
        self._stage: list[torch.Tensor] | None = None
        if not self.in_place and self.slots:
            if for_get:
                n, layers = len(self.slots), pool.spec.num_layers
                self._stage = [
                    torch.empty((n, layers, *t.shape), dtype=b.dtype)
                    for t, b in zip(pool.spec.tensors, pool.buffers, strict=True)
                ]
            else:
                self._stage = pool.read_slots(idx)  # canonical (n, L, *shape) copies

    def __len__(self) -> int:
        return len(self.slots)

    def parts(self, i: int) -> list[memoryview]:
        """Byte views of slot ``i``'s payload, one per state tensor (writable for a get)."""
        if self.in_place:
            s = self.slots[i]
            return [byte_view(b[s]) for b in self.pool.buffers]
        assert self._stage is not None
        return [byte_view(t[i]) for t in self._stage]

    def commit(self, ok: Sequence[bool]) -> None:
        """After a get: write staged slots whose ``ok`` is True into the pool."""
        if self.in_place or not self._for_get or self._stage is None:
            return
        good = [i for i, flag in enumerate(ok) if flag]
        if not good:
            return
        rows = torch.tensor(good, dtype=torch.int64)
        self.pool.write_slots([self.slots[i] for i in good], [t[rows] for t in self._stage])
