"""Command-line flags of the engine, with SGLang's names where they exist."""

from __future__ import annotations

import argparse

import torch

from hicache.config import (
    CacheConfig,
    EvictionPolicy,
    IOBackend,
    MemLayout,
    PrefetchPolicy,
    WritePolicy,
)
from hicache.engine.engine import EngineConfig
from hicache.engine.scheduler import SchedulerConfig
from hicache.memory import PoolSizeError, check_fits
from hicache.storage.registry import parse_extra_config


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags that shape the model, the cache tiers and batching."""
    m = p.add_argument_group("model")
    m.add_argument("--model-path", default=None, help="HF dir, .gguf, tiny-random-*, or default")
    m.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    m.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    m.add_argument("--context-length", type=int, default=None)
    c = p.add_argument_group("cache")
    c.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    c.add_argument("--max-total-tokens", type=int, default=16384, help="L1 size in tokens")
    c.add_argument("--device-cache-size", type=float, default=None, help="L1 size in GB")
    c.add_argument("--disable-radix-cache", action="store_true", help="no prefix reuse at all")
    c.add_argument("--enable-hierarchical-cache", action="store_true", help="add the L2 tier")
    c.add_argument("--hicache-ratio", type=float, default=2.0, help="L2 size = ratio x L1")
    c.add_argument("--hicache-size", type=float, default=0.0, help="L2 GB per rank (overrides)")
    c.add_argument(
        "--hicache-write-policy", choices=[e.value for e in WritePolicy], default="write_through"
    )
    c.add_argument("--hicache-write-through-threshold", type=int, default=2)
    c.add_argument("--hicache-io-backend", choices=[e.value for e in IOBackend], default="kernel")
    c.add_argument(
        "--hicache-mem-layout", choices=[e.value for e in MemLayout], default="page_first"
    )
    c.add_argument(
        "--radix-eviction-policy", choices=[e.value for e in EvictionPolicy], default="lru"
    )
    c.add_argument("--hicache-load-back-threshold", type=int, default=10, help="tokens")
    c.add_argument(
        "--hicache-storage-backend", default=None, help="file | mooncake | redis | module:Class"
    )
    c.add_argument(
        "--hicache-storage-prefetch-policy",
        choices=[e.value for e in PrefetchPolicy],
        default="timeout",
    )
    c.add_argument(
        "--hicache-storage-backend-extra-config",
        default=None,
        help="JSON object or @file.json: backend keys plus prefetch_threshold, prefetch_timeout_*",
    )
    s = p.add_argument_group("scheduler")
    s.add_argument("--max-running-requests", type=int, default=32)
    s.add_argument("--chunked-prefill-size", type=int, default=512)


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    """Build a validated config; a bad value raises ValueError naming the field."""
    cache = CacheConfig(
        page_size=a.page_size,
        device_tokens=a.max_total_tokens,
        enable_hierarchical_cache=bool(a.enable_hierarchical_cache),
        hicache_ratio=a.hicache_ratio,
        hicache_size=a.hicache_size,
        write_policy=a.hicache_write_policy,
        write_through_threshold=a.hicache_write_through_threshold,
        io_backend=a.hicache_io_backend,
        mem_layout=a.hicache_mem_layout,
        eviction_policy=a.radix_eviction_policy,
        load_back_threshold=a.hicache_load_back_threshold,
    )
    kwargs = {} if a.device is None else {"device": a.device}
    config = EngineConfig(
        model_path=a.model_path,
        dtype=a.dtype,
        cache=cache,
        scheduler=SchedulerConfig(
            max_running_requests=a.max_running_requests,
            chunked_prefill_size=a.chunked_prefill_size,
            disable_radix_cache=bool(a.disable_radix_cache),
        ),
        context_length=a.context_length,
        device_cache_gb=a.device_cache_size,
        storage_backend=a.hicache_storage_backend,
        storage_prefetch_policy=a.hicache_storage_prefetch_policy,
        storage_extra_config=parse_extra_config(a.hicache_storage_backend_extra_config),
        **kwargs,
    )
    check_sizes_in_gb(config)
    return config


def check_sizes_in_gb(config: EngineConfig) -> None:
    """Refuse ``--hicache-size`` / ``--device-cache-size`` beyond the memory available, with
    the numbers (:class:`~hicache.memory.PoolSizeError`), before the model is loaded.

    Sizes given in tokens (``--max-total-tokens``, ``--hicache-ratio``) need the model's
    bytes per token; the pools check them when they are built, before allocating.
    """
    host_bytes = 0
    if config.cache.enable_hierarchical_cache and config.cache.hicache_size > 0:
        host_bytes = int(config.cache.hicache_size * 1e9)
        check_fits(host_bytes, "cpu", what="the host (L2) KV pool", flags="--hicache-size")
    if config.device_cache_gb is None:
        return
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return  # loading the model fails first, with its own message
    device_bytes = int(config.device_cache_gb * 1e9)
    memory = check_fits(
        device_bytes, device, what="the device (L1) KV pool", flags="--device-cache-size"
    )
    if device.type != "cuda" and device_bytes + host_bytes > memory.allowed:
        raise PoolSizeError(
            "the device (L1) and host (L2) KV pools, both in RAM on a CPU-only host,",
            device_bytes + host_bytes,
            memory,
            "--device-cache-size or --hicache-size",
        )
