"""The device (L1) KV pool: one ``layer_first`` tensor on the accelerator (or CPU)."""

from __future__ import annotations

import math

import torch

from hicache.config import MemLayout
from hicache.memory.base import KVPool, check_sizes
from hicache.memory.budget import DEVICE_FLAGS, check_fits, pool_bytes
from hicache.memory.hugepages import advise_huge_pages
from hicache.memory.layout import buffer_shape
from hicache.spec import AttentionKind, KVSpec

__all__ = ["DevicePool"]


class DevicePool(KVPool):
    """Paged KV cache on ``device``.

    ``buffer`` has shape ``(K, L, S, H, D)`` (K = ``spec.num_kv``: 0 = K or latent, 1 = V;
    L = layers; S = ``num_pages * page_size`` token slots; H = ``spec.heads``;
    D = ``spec.dim``), dtype ``spec.dtype``, zero-filled at construction (on CPU, after
    advising transparent huge pages: :mod:`hicache.memory.hugepages`). A buffer larger
    than what ``device`` has free raises :class:`~hicache.memory.budget.PoolSizeError`
    before anything is allocated.
    """

    def __init__(
        self,
        spec: KVSpec,
        num_pages: int,
        page_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        check_sizes(num_pages, page_size)
        dev = torch.device(device)
        shape = buffer_shape(spec, num_pages, page_size, MemLayout.LAYER_FIRST)
        check_fits(
            pool_bytes(math.prod(shape) * spec.dtype_bytes, num_pages),
            dev,
            what="the device (L1) KV pool",
            flags=DEVICE_FLAGS,
        )
        super().__init__(spec, num_pages, page_size, MemLayout.LAYER_FIRST)
        self.buffer = torch.empty(shape, dtype=self.dtype, device=dev)
        # on CPU, huge pages before the first touch (see hicache.memory.hugepages)
        self._huge_pages = advise_huge_pages(self.buffer)
        self.buffer.zero_()

    @property
    def huge_pages(self) -> bool:
        """Whether the kernel accepted the transparent-huge-page advice (CPU buffers only)."""
        return self._huge_pages

    def kv(self, kind: int, layer: int) -> torch.Tensor:
        """View ``(size_tokens, H, D)`` of ``kind`` (0 = K or latent, 1 = V) in ``layer``."""
        if not 0 <= kind < self.spec.num_kv:
            raise IndexError(f"kind {kind} out of range [0, {self.spec.num_kv})")
        if not 0 <= layer < self.spec.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.spec.num_layers})")
        return self.buffer[kind, layer]

    def k_buffer(self, layer: int) -> torch.Tensor:
        """K of ``layer``, ``(size_tokens, H, D)`` (for MLA this is the latent)."""
        return self.kv(0, layer)

    def v_buffer(self, layer: int) -> torch.Tensor:
        """V of ``layer``, ``(size_tokens, H, D)``; MHA only."""
        if self.spec.attention is not AttentionKind.MHA:
            raise ValueError("an MLA pool has no V buffer; use latent_buffer(layer)")
        return self.kv(1, layer)

    def latent_buffer(self, layer: int) -> torch.Tensor:
        """MLA latent of ``layer``, ``(size_tokens, 1, kv_lora_rank + qk_rope_head_dim)``."""
        if self.spec.attention is not AttentionKind.MLA:
            raise ValueError("an MHA pool has no latent buffer; use k_buffer/v_buffer")
        return self.kv(0, layer)

    def __repr__(self) -> str:
        return (
            f"DevicePool(pages={self.num_pages}, page_size={self.page_size}, "
            f"shape={tuple(self.buffer.shape)}, dtype={self.dtype}, device={self.device})"
        )
