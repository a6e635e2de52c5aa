"""Where a recurrent model's state crosses a prefill/decode pair: :class:`StateSlots`.

A model with recurrent layers (Qwen3-Next, Nemotron-H) decodes from its state after the
whole prompt, which no KV page holds. Each rank of either side keeps one slot per request
in flight here: a :class:`~hicache.memory.state_pool.StatePool` in ``page_first`` layout
(one buffer ``(S, L, *shape)`` per state tensor: a slot of one tensor is one contiguous
run), registered with the transport like the L1 pools, one store per tensor
(``state.<tensor>``, :attr:`~hicache.disagg.layout.StoreLayout.state`). The prefill side
copies the runner's live state into its request's slot when it hands the request off; the
decode side registers its request's slot and the runner resumes from it once the pages
arrive. A rank's slot holds its own shard (the model's heads of that rank), so a pair moves
it rank to rank (equal TP sizes). Slots: ``max_running_requests`` (a parked request holds
a running slot), so a request always finds one. Engine thread only.
"""

from __future__ import annotations

import math

import torch

from hicache.config import MemLayout
from hicache.disagg.pages import PoolGeometry
from hicache.extras import KeptState
from hicache.memory.state_pool import StatePool
from hicache.spec import CacheSpec, SnapshotSpec

__all__ = ["STATE_PREFIX", "StateSlots"]

STATE_PREFIX = "state."
"""The prefix of a state store's name (``state.conv``, ``state.ssm``, ...)."""


class StateSlots:
    """``slots`` slots of one rank's state of the shape ``spec`` describes, on ``device``,
    each held by one request (by its id) until :meth:`free`."""

    def __init__(self, spec: SnapshotSpec, slots: int, device: torch.device | str) -> None:
        self.spec = spec
        self.pool = StatePool(
            spec,
            slots,
            layout=MemLayout.PAGE_FIRST,
            device=device,
            what="the prefill/decode state slots",
            flags="--max-running-requests",
        )
        self._held: dict[str, int] = {}

    @classmethod
    def of(cls, spec: CacheSpec, slots: int, device: torch.device | str) -> StateSlots | None:
        """The slots of a model whose cache ``spec`` has state snapshots (None without)."""
        state = next((c for c in spec.components if isinstance(c, SnapshotSpec)), None)
        return None if state is None else cls(state, slots, device)

    @property
    def names(self) -> tuple[str, ...]:
        """The stores of the slots, one per state tensor, in the spec's order."""
        return tuple(STATE_PREFIX + t.name for t in self.spec.tensors)

    def geometry(self) -> dict[str, PoolGeometry]:
        """Each tensor's buffer as a store of one-token pages: a slot is page ``slot`` of
        one layer whose row is the slot's every layer."""
        out: dict[str, PoolGeometry] = {}
        for name, t, buf in zip(self.names, self.spec.tensors, self.pool.buffers, strict=True):
            out[name] = PoolGeometry(
                addr=int(buf.data_ptr()),
                num_kv=1,
                layers=1,
                slots=self.pool.num_slots,
                row_bytes=self.spec.num_layers * math.prod(t.shape) * buf.element_size(),
                page_size=1,
                dtype=t.dtype,
                cuda=buf.device.type == "cuda",
                device=buf.device.index or 0,
            )
        return out

    def slot(self, rid: str) -> int | None:
        """The slot ``rid`` holds, or None."""
        return self._held.get(rid)

    def claim(self, rid: str) -> int | None:
        """The slot ``rid`` holds, taken now if it holds none; None when every slot is
        held."""
        slot = self._held.get(rid)
        if slot is None:
            got = self.pool.allocator.alloc(1)
            if got is None:
                return None
            slot = self._held[rid] = int(got[0])
        return slot

    def free(self, rid: str) -> None:
        """``rid`` no longer holds a slot (a no-op when it held none)."""
        slot = self._held.pop(rid, None)
        if slot is not None:
            self.pool.allocator.free([slot])

    def write(self, slot: int, state: KeptState) -> None:
        """Put ``state`` (canonical ``(1, L, *shape)`` tensors) into ``slot``."""
        for t, buf, x in zip(self.spec.tensors, self.pool.buffers, state.tensors, strict=True):
            if tuple(x.shape) != (1, *buf.shape[1:]):
                raise ValueError(
                    f"state {t.name!r}: {tuple(x.shape)} does not fit a slot of"
                    f" {tuple(buf.shape[1:])}"
                )
            buf[slot].copy_(x[0])

    def read(self, slot: int, tokens: int) -> KeptState:
        """A copy of ``slot`` as the state after the first ``tokens`` positions."""
        return KeptState(tokens, tuple(buf[slot : slot + 1].clone() for buf in self.pool.buffers))
