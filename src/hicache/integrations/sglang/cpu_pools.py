"""SGLang's own KV pools on CPU, built the way SGLang builds them: the device (L1) pool
``MHATokenToKVPool`` / ``MLATokenToKVPool`` on ``"cpu"``, then its host (L2) pool from the
device pool's buffer info, unpinned. For ``hicache bench storage --sglang`` and the
integration's tests; imports sglang (make it importable first:
:func:`hicache.integrations.pinned.enable`).
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

__all__ = ["device_pool", "host_of"]


def device_pool(
    kind: str,
    *,
    tokens: int,
    page_size: int,
    layers: int,
    dtype: torch.dtype = torch.bfloat16,
    heads: int = 2,
    head_dim: int = 8,
    kv_lora_rank: int = 16,
    rope_dim: int = 8,
) -> Any:
    """SGLang's device pool of ``tokens`` tokens on ``"cpu"``: ``MHATokenToKVPool`` (``heads``
    x ``head_dim`` per layer for K and for V) or, for ``kind`` ``"mla"``,
    ``MLATokenToKVPool`` (one latent of ``kv_lora_rank + rope_dim`` per token and layer)."""
    if kind not in ("mha", "mla"):
        raise ValueError(f"kind={kind!r} is invalid; choose 'mha' or 'mla'")
    if kind == "mla":
        return MLATokenToKVPool(
            tokens, page_size, dtype, kv_lora_rank, rope_dim, layers, "cpu", False,
            start_layer=0, end_layer=layers,
        )  # fmt: skip
    return MHATokenToKVPool(
        tokens, page_size, dtype, heads, head_dim, layers, "cpu", False,
        start_layer=0, end_layer=layers,
    )  # fmt: skip


def host_of(dev: Any, layout: str, ratio: float = 2.0) -> Any:
    """The unpinned host pool of device pool ``dev`` in SGLang's ``layout``, ``ratio``
    times its size (SGLang adds one padding page)."""
    kwargs: dict[str, Any] = {}
    cls: Any = MHATokenToKVPoolHost
    if isinstance(dev, MLATokenToKVPool):
        cls = MLATokenToKVPoolHost
        kwargs = {"target_layer_num": dev.layer_num, "override_kv_cache_dim": dev.kv_cache_dim}
    return cls(
        dev.get_device_pool_infos()[0].buffer_info,
        ratio,
        0,
        dev.page_size,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=dev.size,
        start_layer=dev.start_layer,
        end_layer=dev.end_layer,
        **kwargs,
    )
