"""A started tiny :class:`HiCache` with an L3 backend attached, for the tests that freeze,
slow or kill the store under a cache; the in-memory backend attached to a cache the test
made (:func:`attach_memory`, or :func:`attach_recording` to count what reads ask)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hicache.cache import HiCache
from hicache.config import CacheConfig, PrefetchConfig
from hicache.keys import Namespace
from hicache.spec import KVSpec
from hicache.storage.backends.memory import MemoryFaults, MemoryStorage, MemoryStore
from hicache.storage.base import StorageOptions
from hicache.storage.registry import create_storage
from tests.helpers.recording_storage import RecordingStorage

WAIT_ALL = PrefetchConfig(policy="wait_complete", prefetch_threshold=0)
"""Every hit is read and waited for: a test's prefetch brings all L3 has."""


def attach_memory(
    cache: HiCache,
    store: MemoryStore,
    *,
    faults: MemoryFaults | None = None,
    prefetch: PrefetchConfig = WAIT_ALL,
) -> None:
    """Attach the in-memory backend over ``store`` to ``cache`` (keyed under model ``"m"``,
    weights ``"w"``; ``faults`` injected), with ``prefetch``."""
    ns = namespace_of(cache)
    cache.l3.attach(MemoryStorage(ns, store=store, faults=faults), ns, prefetch)


def attach_recording(cache: HiCache, store: MemoryStore, component: str) -> RecordingStorage:
    """Attach a :class:`RecordingStorage` over ``store`` (counting full pages and
    ``component`` records read) to ``cache``, every hit read and waited for."""
    ns = namespace_of(cache)
    storage = RecordingStorage(store, ns, component)
    cache.l3.attach(storage, ns, WAIT_ALL)
    return storage


def namespace_of(cache: HiCache) -> Namespace:
    """The namespace the attach helpers key ``cache``'s pages under: model ``"m"``,
    weights ``"w"``, the cache's spec, layout and page size."""
    config = cache.context.config
    return Namespace.for_spec(
        cache.context.spec,
        model="m",
        weights_fingerprint="w",
        layout=config.mem_layout,
        page_size=config.page_size,
    )


def cache_over_l3(
    spec: KVSpec,
    backend: str,
    extra_config: Mapping[str, Any],
    options: StorageOptions,
    prefetch: PrefetchConfig,
    *,
    page_size: int = 4,
    device_pages: int = 16,
    **cache_fields: Any,
) -> HiCache:
    """A started cache of ``device_pages`` device pages of ``page_size`` tokens (page-first
    layout, host pool twice the device, every L2 hit loaded back) over registry backend
    ``backend`` (``extra_config``, ``options``), keyed under model ``"m"``, weights ``"w"``;
    other :class:`CacheConfig` ``cache_fields`` as given. The caller closes it."""
    config = CacheConfig(
        page_size=page_size,
        device_tokens=device_pages * page_size,
        hicache_ratio=2.0,
        load_back_threshold=0,
        mem_layout="page_first",
        **cache_fields,
    )
    cache = HiCache(config, spec).start()
    try:
        ns = Namespace.for_spec(
            spec, model="m", weights_fingerprint="w", layout=config.mem_layout, page_size=page_size
        )
        storage = create_storage(backend, namespace=ns, extra_config=extra_config, options=options)
        cache.l3.attach(storage, ns, prefetch)
    except BaseException:
        cache.close()
        raise
    return cache
