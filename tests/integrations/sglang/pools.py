"""SGLang's own device and host pools on CPU of the tests' size
(:mod:`hicache.integrations.sglang.cpu_pools`), and the backend through SGLang's factory.

Import only after :func:`hicache.integrations.pinned.enable` (the conftest does).
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from hicache.integrations.sglang import cpu_pools

PAGE = 4
LAYERS = 2
HEADS = 2
DIM = 8
TOKENS = 64  # device tokens; the host pool holds twice as many
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head", "page_unified")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_unified")
DYNAMIC = {
    "backend_name": "hicache",
    "module_path": "hicache.integrations.sglang",
    "class_name": "HiCacheL3",
    "interface_v1": 1,
}


def device_pool(
    kind: str, dtype: torch.dtype = torch.bfloat16, page: int = PAGE, heads: int = HEADS
) -> Any:
    """SGLang's device (L1) pool on ``"cpu"`` of the tests' size: ``MHATokenToKVPool``
    (``heads`` K/V heads: a rank's) or, for ``"mla"``, ``MLATokenToKVPool`` (kv_lora_rank
    16, rope dim 8)."""
    return cpu_pools.device_pool(
        kind, tokens=TOKENS, page_size=page, layers=LAYERS, dtype=dtype, heads=heads,
        head_dim=DIM,
    )  # fmt: skip


def host_of(dev: Any, layout: str) -> Any:
    """The unpinned host (L2) pool of a device pool, twice its size, in a layout. Built
    against a 1 GiB budget: SGLang checks a pool against the host's free RAM less a 10
    GiB reserve, which a busy test machine may not have, and these pools are KiB."""
    with host_memory_budget_scope(1 << 30):
        return cpu_pools.host_of(dev, layout)


def mha_host(layout: str, dtype: torch.dtype = torch.bfloat16, page: int = PAGE) -> Any:
    return host_of(device_pool("mha", dtype, page), layout)


def mla_host(layout: str, dtype: torch.dtype = torch.bfloat16, page: int = PAGE) -> Any:
    return host_of(device_pool("mla", dtype, page), layout)


def host_pool(kind: str, layout: str, dtype: torch.dtype = torch.bfloat16) -> Any:
    return (mla_host if kind == "mla" else mha_host)(layout, dtype)


def storage_config(
    extra: dict[str, Any],
    *,
    mla: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
    model: str | None = "test/model",
    metrics: bool = False,
    tp_lcm_size: int | None = None,
    should_split_heads: bool = False,
) -> HiCacheStorageConfig:
    """What SGLang's cache controller passes (``_generate_storage_config``), one rank."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=False,
        model_name=model,
        tp_lcm_size=tp_lcm_size,
        should_split_heads=should_split_heads,
        extra_config={**DYNAMIC, **extra},
    )


def attach(pool: Any, extra: dict[str, Any], **cfg: Any) -> Any:
    """SGLang's attach: ``create_backend("dynamic", ...)`` then ``register_mem_pool_host``
    (the result may be SGLang's fault injector around :class:`HiCacheL3`)."""
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra, mla=cfg.pop("mla", False), **cfg), pool
    )
    backend.register_mem_pool_host(pool)
    return backend


def fill(pool: Any, seed: int) -> None:
    """Random bytes in the whole host buffer (NaN patterns included: compare bytes)."""
    g = torch.Generator().manual_seed(seed)
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))


def indices(pages: list[int], page: int = PAGE) -> torch.Tensor:
    """Host token indices of whole pages (SGLang's host_indices for those pages)."""
    return torch.cat([torch.arange(p * page, (p + 1) * page) for p in pages]).to(torch.int64)


def page_bytes(pool: Any, p: int) -> bytes:
    """Host page ``p``'s bytes, by SGLang's own accessors (the page block for
    ``page_unified``, which has no flat page)."""
    if pool.layout == "page_unified":
        return pool.kv_buffer[p].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    page = pool.get_data_page(p * pool.page_size, flat=True).contiguous()
    return page.view(torch.uint8).numpy().tobytes()
