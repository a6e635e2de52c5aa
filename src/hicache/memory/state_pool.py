"""State pools: fixed-size slots of recurrent-layer state (Mamba2, Gated DeltaNet), L1 and L2.

A slot holds one snapshot: every tensor of a :class:`~hicache.spec.SnapshotSpec` in every
recurrent layer. A pool has one preallocated buffer per state tensor and a
:class:`~hicache.memory.allocator.PageAllocator` over its slots. Layouts (L layers, S slots,
``*shape`` the per-layer shape): ``layer_first`` ``(L, S, *shape)``, what a model reads,
always the device (L1) pool's; ``page_first`` and ``page_first_direct`` (the same for state)
``(S, L, *shape)``, one slot over all layers contiguous, the unit an L3 record stores.
Invariant: :meth:`StatePool.read_slots` / :meth:`StatePool.write_slots` use the canonical
``(n, L, *shape)`` per tensor, whatever the layout.
"""

from __future__ import annotations

import torch

from hicache.config import MemLayout
from hicache.memory.allocator import PageAllocator
from hicache.memory.base import PageList, check_pages
from hicache.memory.budget import DEVICE_FLAGS, HOST_FLAGS, check_fits, pool_bytes
from hicache.memory.layout import torch_dtype
from hicache.spec import SnapshotSpec
from hicache.validate import int_at_least

__all__ = ["StatePool", "state_buffer_shape"]

STATE_DEVICE_FLAGS = f"max_mamba_cache_size or mamba_full_memory_ratio ({DEVICE_FLAGS})"
STATE_HOST_FLAGS = f"max_mamba_cache_size or mamba_full_memory_ratio, and {HOST_FLAGS}"


def state_buffer_shape(
    num_layers: int, num_slots: int, shape: tuple[int, ...], layout: MemLayout
) -> tuple[int, ...]:
    """Buffer shape of one state tensor in ``layout`` (see the module docstring)."""
    if MemLayout(layout) is MemLayout.LAYER_FIRST:
        return (num_layers, num_slots, *shape)
    return (num_slots, num_layers, *shape)


class StatePool:
    """Slots of recurrent state on one device in one layout.

    ``buffers[i]`` holds ``spec.tensors[i]`` (dtype from the spec), zero-filled at
    construction (every OS page touched once). ``allocator`` hands out slot ids
    ``0 .. num_slots-1``. A pool larger than its memory may take raises
    :class:`~hicache.memory.budget.PoolSizeError` before anything is allocated. Use
    :meth:`device` (L1: ``layer_first``) or :meth:`host` (L2: any layout, pinned for CUDA).
    """

    def __init__(
        self,
        spec: SnapshotSpec,
        num_slots: int,
        *,
        layout: MemLayout | str = MemLayout.LAYER_FIRST,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
        what: str = "the state pool",
        flags: str = "",
    ) -> None:
        int_at_least("num_slots", num_slots, 1)
        self._spec = spec
        self._num_slots = num_slots
        self._layout = MemLayout(layout)
        dev = torch.device(device)
        check_fits(pool_bytes(spec.slot_bytes * num_slots, num_slots), dev, what=what, flags=flags)
        self._pinned = bool(pin_memory)
        self.buffers: tuple[torch.Tensor, ...] = tuple(
            torch.zeros(
                state_buffer_shape(spec.num_layers, num_slots, t.shape, self._layout),
                dtype=torch_dtype(t.dtype),
                device=dev,
                pin_memory=self._pinned,
            )
            for t in spec.tensors
        )
        self.allocator = PageAllocator(num_slots)

    @classmethod
    def device(cls, spec: SnapshotSpec, num_slots: int, device: torch.device | str) -> StatePool:
        """The L1 state pool on ``device`` (``layer_first``)."""
        return cls(
            spec,
            num_slots,
            device=device,
            what="the device (L1) state pool",
            flags=STATE_DEVICE_FLAGS,
        )

    @classmethod
    def host(
        cls,
        spec: SnapshotSpec,
        num_slots: int,
        layout: MemLayout | str,
        device: torch.device | str,
    ) -> StatePool:
        """The L2 state pool in RAM backing an L1 pool on ``device`` (pinned iff CUDA)."""
        return cls(
            spec,
            num_slots,
            layout=layout,
            device="cpu",
            pin_memory=torch.device(device).type == "cuda",
            what="the host (L2) state pool",
            flags=STATE_HOST_FLAGS,
        )

    # -- sizes ---------------------------------------------------------------------------
    @property
    def spec(self) -> SnapshotSpec:
        return self._spec

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def layout(self) -> MemLayout:
        return self._layout

    @property
    def pinned(self) -> bool:
        return self._pinned

    @property
    def torch_device(self) -> torch.device:
        return self.buffers[0].device

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot over all layers and tensors."""
        return self._spec.slot_bytes

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    # -- access --------------------------------------------------------------------------
    def check_slots(
        self, slots: PageList, what: str = "slots", *, unique: bool = False
    ) -> torch.Tensor:
        """Validated slot ids as a 1-D int64 CPU tensor (see :func:`check_pages`)."""
        return check_pages(slots, self._num_slots, what, unique=unique)

    def layer(self, tensor: int | str, layer: int) -> torch.Tensor:
        """View ``(num_slots, *shape)`` of one tensor in one layer (``layer_first`` only):
        what a recurrent layer reads and writes by slot id."""
        if self._layout is not MemLayout.LAYER_FIRST:
            raise ValueError(f"a {self._layout.value} state pool has no per-layer view")
        i = self._index(tensor)
        if not 0 <= layer < self._spec.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self._spec.num_layers})")
        return self.buffers[i][layer]

    def slot_dim(self) -> int:
        """The buffers' slot dimension: 1 for ``layer_first``, 0 otherwise."""
        return 1 if self._layout is MemLayout.LAYER_FIRST else 0

    def read_slots(self, slots: PageList) -> list[torch.Tensor]:
        """CPU copies of ``slots``, one per tensor, canonical ``(n, L, *shape)``."""
        idx = self.check_slots(slots).to(self.torch_device)
        out = []
        for b in self.buffers:
            x = b.index_select(self.slot_dim(), idx)
            if self.slot_dim() == 1:
                x = x.transpose(0, 1)
            out.append(x.contiguous().cpu())
        return out

    def write_slots(self, slots: PageList, data: list[torch.Tensor]) -> None:
        """Write canonical ``data`` (one ``(n, L, *shape)`` tensor per state tensor, the
        pool's dtypes: no conversion) into ``slots`` (no repeats)."""
        idx = self.check_slots(slots, unique=True)
        if len(data) != len(self.buffers):
            raise ValueError(f"data has {len(data)} tensors; expected {len(self.buffers)}")
        for t, b, x in zip(self._spec.tensors, self.buffers, data, strict=True):
            want = (idx.numel(), self._spec.num_layers, *t.shape)
            if tuple(x.shape) != want or x.dtype != b.dtype:
                raise ValueError(
                    f"{t.name}: data {tuple(x.shape)} {x.dtype}; expected {want} {b.dtype}"
                )
        if idx.numel() == 0:
            return
        on = idx.to(self.torch_device)
        for b, x in zip(self.buffers, data, strict=True):
            x = x.to(self.torch_device)
            b.index_copy_(self.slot_dim(), on, x.transpose(0, 1) if self.slot_dim() == 1 else x)

    def copy_slots(self, src: PageList, dst: PageList) -> None:
        """Copy slot ``src[i]`` to ``dst[i]`` within this pool (a fork: a request starts
        from a cached snapshot, or a snapshot is taken of a request's running state)."""
        s = self.check_slots(src, "src")
        d = self.check_slots(dst, "dst", unique=True)
        if s.numel() != d.numel():
            raise ValueError(f"src has {s.numel()} slots, dst {d.numel()}")
        if set(s.tolist()) & set(d.tolist()):
            raise ValueError("src and dst slots overlap")
        dim = self.slot_dim()
        s, d = s.to(self.torch_device), d.to(self.torch_device)
        for b in self.buffers:
            b.index_copy_(dim, d, b.index_select(dim, s))

    def _index(self, tensor: int | str) -> int:
        if isinstance(tensor, str):
            for i, t in enumerate(self._spec.tensors):
                if t.name == tensor:
                    return i
            raise KeyError(f"no state tensor {tensor!r}")
        if not 0 <= tensor < len(self.buffers):
            raise IndexError(f"tensor {tensor} out of range [0, {len(self.buffers)})")
        return tensor

    def __repr__(self) -> str:
        return (
            f"StatePool(layout={self._layout.value}, slots={self._num_slots}, "
            f"slot_bytes={self.slot_bytes}, device={self.torch_device}, pinned={self._pinned})"
        )
