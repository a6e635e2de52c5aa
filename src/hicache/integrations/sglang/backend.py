"""``HiCacheL3``: hicache's L3 as an SGLang ``HiCacheStorage`` backend.

SGLang loads it, unmodified, with ``--hicache-storage-backend dynamic`` and the extra config
``{"backend_name": "hicache", "module_path": "hicache.integrations.sglang", "class_name":
"HiCacheL3", "interface_v1": 1, "hicache_backend": "file", ...}``; its factory calls
``HiCacheL3(storage_config, kwargs)``, then ``register_mem_pool_host(pool)`` (and
``register_mem_host_pool_v2`` per side pool of a hybrid model). Construction validates the
config (:class:`~hicache.integrations.sglang.settings.SGLangL3Settings`) and does no IO;
registration checks the pool, builds the namespace and the hicache backend, and starts it.
An MHA ``page_head`` pool's pages are head-group records shared by every TP size dividing
``tp_lcm_size`` (:mod:`~hicache.integrations.sglang.head_pages`); other pools' pages are one
record per rank.
Invariants: every page is a checked hicache record, and a bad record, a timeout or a store
that is down is a miss (False / None / 0), never an exception into SGLang; a backend that
could not start is retried at most every :data:`RETRY_START_S` s; with ``is_storage_writer``
False nothing is written (sets report success); pages a get reported False for are held
by a :class:`~hicache.integrations.sglang.quarantine.HostQuarantine` until the backend is
``host_writes_settled``. Zero-copy, late writes, side pools: ``docs/integrations.md``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage as SGLangStorage,
)
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from hicache.integrations.sglang.head_pages import PageHeads, model_kv_heads
from hicache.integrations.sglang.metrics import IoWindow
from hicache.integrations.sglang.namespace import (
    ShardIdentity,
    head_namespace,
    sglang_namespace,
    sglang_page_key,
    side_namespace,
)
from hicache.integrations.sglang.pages import (
    ByteParts,
    FlatFormat,
    FlatPages,
    KVPoolGeometry,
    page_starts,
)
from hicache.integrations.sglang.quarantine import HostQuarantine
from hicache.integrations.sglang.settings import SGLangL3Settings
from hicache.keys import Namespace, PageKey
from hicache.storage.base import HiCacheStorage, StorageError
from hicache.storage.stats import SetOutcome, StorageStats

__all__ = ["RETRY_START_S", "HiCacheL3"]

log = logging.getLogger(__name__)

RETRY_START_S = 10.0
"""Seconds between attempts to start a hicache backend that failed to start."""

_T = TypeVar("_T")


class _SidePool:
    """A v2 side pool: its host pool, namespace and flat page format."""

    def __init__(self, pool: Any, namespace: Namespace, fmt: FlatFormat) -> None:
        self.pool = pool
        self.namespace = namespace
        self.fmt = fmt
        self.page_size = int(getattr(pool, "page_size", 1) or 1)

    def key(self, sglang_key: str) -> PageKey:
        return sglang_page_key(self.namespace, sglang_key)


class HiCacheL3(SGLangStorage):
    """An SGLang storage backend over any hicache L3 backend (see the module docstring)."""

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
    ) -> None:
        self.settings = SGLangL3Settings.from_extra(storage_config.extra_config)
        model = self.settings.model or storage_config.model_name
        if not model:
            raise ValueError(
                "hicache SGLang backend: SGLang gave no model_name; set hicache_model in the "
                "extra config"
            )
        if storage_config.dcp_size > 1:
            raise ValueError(
                f"hicache SGLang backend: decode context parallelism (dcp_size="
                f"{storage_config.dcp_size}) is not supported; use SGLang's file or mooncake"
            )
        self.storage_config = storage_config
        self.shard = ShardIdentity(
            model=model,
            tp_rank=storage_config.tp_rank,
            tp_size=storage_config.tp_size,
            rank_replicated=bool(storage_config.is_mla_model),
            pp_rank=storage_config.pp_rank,
            pp_size=storage_config.pp_size,
            cp_rank=storage_config.attn_cp_rank,
            cp_size=storage_config.attn_cp_size,
        )
        self.is_writer = bool(storage_config.is_storage_writer)
        self.store: HiCacheStorage | None = None
        self.geometry: KVPoolGeometry | None = None
        self.namespace: Namespace | None = None
        """The KV pages' namespace (head records for an MHA ``page_head`` pool)."""
        self.rank_namespace: Namespace | None = None
        """The rank's page namespace, which side pools' namespaces extend."""
        self.heads: PageHeads | None = None
        """The head-group records of an MHA ``page_head`` pool (None: page records)."""
        self.sides: dict[str, _SidePool] = {}
        self.io_window: IoWindow | None = (
            IoWindow() if storage_config.enable_storage_metrics else None
        )
        """Each get's and set's pages and GB/s for SGLang's metrics (:meth:`get_stats`);
        None when SGLang's storage metrics are off."""
        self.quarantine: HostQuarantine | None = None
        """Holds the KV host pages of gets that may still land late (set at registration)."""
        self._start_lock = threading.Lock()
        self._last_start = -math.inf
        self._warned: set[str] = set()

    # -- registration ----------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Check the KV host pool, build the namespace and the hicache backend, start it.

        ValueError (naming it) for a layout or dtype hicache cannot store."""
        unified = getattr(mem_pool_host, "page_unified_layout", None)
        version = ""
        if unified is not None:
            from sglang.srt.mem_cache.pool_host.page_unified import PAGE_UNIFIED_OBJECT_LAYOUT

            version = PAGE_UNIFIED_OBJECT_LAYOUT
        rank_ns = sglang_namespace(  # refuses a layout or dtype first, naming it
            self.shard,
            weights_fingerprint=self.settings.weights_fingerprint,
            dtype=mem_pool_host.dtype,
            layout=str(mem_pool_host.layout),
            page_size=int(mem_pool_host.page_size),
            unified_groups=int(getattr(unified, "head_group_num", 1)),
            unified_version=version,
        )
        geometry = KVPoolGeometry.of(mem_pool_host, mla=self.shard.rank_replicated)
        heads = self._page_heads(mem_pool_host)
        namespace = rank_ns if heads is None else head_namespace(rank_ns, heads.group)
        super().register_mem_pool_host(mem_pool_host)
        old, self.store = self.store, self.settings.storage.create(namespace)
        if old is not None:
            old.close()
        store = self.store
        if heads is not None:
            store.use_heads(heads.records.split)
        self.heads, self.rank_namespace = heads, rank_ns
        self.quarantine = HostQuarantine(mem_pool_host, lambda: store.host_writes_settled(0))
        self.quarantine.install()
        self.geometry, self.namespace = geometry, namespace
        self.sides = {name: self._side(side.pool, name) for name, side in self.sides.items()}
        self._last_start = -math.inf
        self._ready()

    def _page_heads(self, pool: Any) -> PageHeads | None:
        """The head-group records of an MHA ``page_head`` pool, for servers whose TP sizes
        divide ``tp_lcm_size`` (default: this TP size); None for other pools, and for a
        pool of one head at TP > 1 without ``hicache_kv_heads`` and without
        ``tp_lcm_size`` (per-rank page records, as the model's head count is unknown).
        ValueError naming the layout for head splitting of another layout, or naming
        ``hicache_kv_heads`` when ``tp_lcm_size`` asks to share and it is needed."""
        cfg, layout = self.storage_config, str(pool.layout)
        if self.shard.rank_replicated:
            return None
        if layout != "page_head":
            if cfg.should_split_heads:
                raise ValueError(
                    f"hicache SGLang backend: tp_lcm_size head splitting needs SGLang's"
                    f" page_head host layout, not {layout!r}"
                )
            return None
        lcm = int(cfg.tp_lcm_size or cfg.tp_size)
        kv_heads = model_kv_heads(int(pool.head_num), cfg.tp_size, self.settings.kv_heads)
        if kv_heads is None:
            if cfg.tp_lcm_size:
                raise ValueError(
                    f"hicache SGLang backend: a rank of TP size {cfg.tp_size} holds one K/V"
                    " head, so the model's count is unknown (ranks may outnumber heads);"
                    " give it as hicache_kv_heads in the extra config to share pages"
                    f" across TP sizes (tp_lcm_size={cfg.tp_lcm_size})"
                )
            self._warn_once(
                "page_head", "pages are per-rank records: set hicache_kv_heads to share them"
            )
            return None
        return PageHeads.of(
            pool, kv_heads=kv_heads, tp_size=cfg.tp_size, tp_rank=cfg.tp_rank, tp_lcm=lcm
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Register a side pool (``mamba``, ``swa``, ``indexer``, ...) for the v2 calls."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == PoolName.KV.value:
            return  # the KV pool's pages go through the v1 path
        if self.namespace is None:
            raise ValueError("register the KV host pool (register_mem_pool_host) first")
        for attr in ("get_data_page", "set_from_flat_data_page", "get_dummy_flat_data_page"):
            if not callable(getattr(host_pool, attr, None)):
                raise ValueError(
                    f"SGLang side pool {name!r} ({type(host_pool).__name__}) has no {attr}; "
                    "hicache cannot store it"
                )
        self.sides[name] = self._side(host_pool, name)

    def _side(self, pool: Any, name: str) -> _SidePool:
        assert self.rank_namespace is not None and self.store is not None
        ns = side_namespace(
            self.rank_namespace,
            self.shard,
            pool_name=name,
            pool_class=type(pool).__name__,
            pool_layout=str(getattr(pool, "layout", "")),
            dtype=getattr(pool, "dtype", ""),
        )
        self.store.allow_whole(ns)  # one record per page even beside head records
        return _SidePool(pool, ns, FlatFormat.of(pool))

    # -- plumbing --------------------------------------------------------------------------
    def _ready(self) -> HiCacheStorage | None:
        """The started hicache backend, or None (not registered, or down: a miss)."""
        store = self.store
        if store is None:
            return None
        if store.started:
            return store
        with self._start_lock:
            if store.started:
                return store
            now = time.monotonic()
            if now - self._last_start < RETRY_START_S:
                return None
            self._last_start = now
            try:
                store.start()
            except StorageError as e:
                log.warning("hicache %s backend did not start (calls miss): %s", store.name, e)
                return None
        return store

    def _guard(
        self,
        op: str,
        fallback: _T,
        call: Callable[[HiCacheStorage], _T],
        io: tuple[str, int] | None = None,
    ) -> _T:
        """``call(store)``, or ``fallback`` when the store is not ready or anything raises.
        ``io``: (``"get"`` / ``"set"``, pages) of a KV page transfer, timed into
        :attr:`io_window` when SGLang's storage metrics are on."""
        store = self._ready()
        if store is None or self.geometry is None:
            return fallback
        try:
            if io is None or self.io_window is None:
                return call(store)
            start = time.perf_counter()
            out = call(store)
            self.io_window.record(
                io[0], io[1], self.geometry.page_bytes, time.perf_counter() - start
            )
            return out
        except Exception as e:  # a miss, never an exception into SGLang
            self._warn_once(op, f"failed (a miss): {e!r}")
            return fallback

    def page_key(self, sglang_key: str) -> PageKey:
        """The hicache key of SGLang page hash ``sglang_key`` (KV pool namespace)."""
        assert self.namespace is not None
        return sglang_page_key(self.namespace, sglang_key)

    def _kv_pages(self, host_indices: torch.Tensor, n: int) -> ByteParts:
        geo = self.geometry
        assert geo is not None
        return ByteParts.over(
            geo.buffer, geo.page_parts(host_indices, n), geo.page_bytes, owner=geo.owner
        )

    @property
    def stats(self) -> StorageStats | None:
        """The hicache backend's counters (None before registration)."""
        return None if self.store is None else self.store.stats()

    # -- zero-copy (v1) --------------------------------------------------------------------
    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read page ``keys[i]`` into host pages ``host_indices[i*page_size:...]`` in
        place; True where the page now holds a record that passed every check."""
        miss = [False] * len(keys)
        if not keys:
            return []

        def get(st: HiCacheStorage) -> list[bool]:
            pages, heads = [self.page_key(k) for k in keys], self.heads
            if heads is None:
                return st.batch_get_payloads(pages, self._kv_pages(host_indices, len(keys)))
            parts = heads.in_pool(host_indices, len(keys))
            return heads.page_ok(st.batch_get_payloads(heads.keys(pages), parts))

        ok = self._guard("batch_get_v1", miss, get, ("get", len(keys)))
        if not all(ok):
            self._hold_failed(host_indices, ok)
        return ok

    def _hold_failed(self, host_indices: torch.Tensor, ok: list[bool]) -> None:
        """Quarantine the pages of this get reported False while a late write may still
        land (a zero-copy transfer that overran its deadline is still running)."""
        q, store = self.quarantine, self.store
        if q is None or store is None or all(ok) or store.host_writes_settled(0):
            return
        page = len(host_indices) // len(ok)
        bad = [host_indices[i * page : (i + 1) * page] for i, hit in enumerate(ok) if not hit]
        q.hold(torch.cat(bad))

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Write host pages as records of ``keys``; True where stored (or already
        present); all True without writing on a non-writer rank."""
        if not keys:
            return []
        if not self.is_writer:
            return [True] * len(keys)

        def put(st: HiCacheStorage) -> list[bool]:
            pages, heads = [self.page_key(k) for k in keys], self.heads
            if heads is None:
                res = st.batch_set_payloads(pages, self._kv_pages(host_indices, len(keys)))
                return [o is not SetOutcome.FAILED for o in res.outcomes]
            mine = heads.written()
            if not mine:  # a replica: a lower rank writes these heads
                return [True] * len(keys)
            parts = heads.in_pool(host_indices, len(keys), mine)
            res = st.batch_set_payloads(heads.keys(pages, mine), parts)
            return [o is not SetOutcome.FAILED for o in heads.set_outcomes(res.outcomes, len(mine))]

        return self._guard("batch_set_v1", [False] * len(keys), put, ("set", len(keys)))

    # -- copying calls (legacy) ------------------------------------------------------------
    def batch_get(
        self,
        keys: list[str],
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None]:
        """Read pages into the given flat page tensors (SGLang's
        ``get_dummy_flat_data_page()``); each tensor, or None for a miss."""
        if not keys:
            return []
        targets = list(target_locations or [])
        if len(targets) != len(keys):
            return [None] * len(keys)

        def get(st: HiCacheStorage) -> list[torch.Tensor | None]:
            assert self.geometry is not None
            pages, heads = [self.page_key(k) for k in keys], self.heads
            if heads is None:
                parts = ByteParts.of_tensors(targets, self.geometry.page_bytes)
                ok = st.batch_get_payloads(pages, parts)
            else:
                parts = heads.in_flat(targets)
                ok = heads.page_ok(st.batch_get_payloads(heads.keys(pages), parts))
            return [t if hit else None for t, hit in zip(targets, ok, strict=True)]

        return self._guard("batch_get", [None] * len(keys), get, ("get", len(keys)))

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        if target_location is None:
            return None
        return self.batch_get([key], [target_location])[0]

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Write flat pages (SGLang's ``get_data_page(i, flat=True)``); True when all are
        stored or present (always True on a non-writer rank)."""
        if not keys:
            return True
        if not self.is_writer:
            return True
        vals = list(values or [])
        if len(vals) != len(keys):
            return False

        def put(st: HiCacheStorage) -> bool:
            assert self.geometry is not None
            flat = [v.contiguous() for v in vals]
            pages, heads = [self.page_key(k) for k in keys], self.heads
            if heads is None:
                res = st.batch_set_payloads(
                    pages, ByteParts.of_tensors(flat, self.geometry.page_bytes)
                )
                return res.failed == 0
            mine = heads.written()
            if not mine:  # a replica: a lower rank writes these heads
                return True
            res = st.batch_set_payloads(heads.keys(pages, mine), heads.in_flat(flat, mine))
            return res.failed == 0

        return self._guard("batch_set", False, put, ("set", len(keys)))

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        if value is None:
            return False
        return self.batch_set([key], [value])

    # -- lookups ---------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self._guard("exists", False, lambda st: st.batch_contains([self.page_key(key)])[0])

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many of ``keys``, from the first, are present in a row (0 when down)."""
        if not keys:
            return 0
        return self._guard(
            "batch_exists", 0, lambda st: st.batch_exists([self.page_key(k) for k in keys])
        )

    # -- side pools (v2) -------------------------------------------------------------------
    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The usable KV prefix given each side pool's hit policy (``ALL_PAGES``,
        ``TRAILING_PAGES``); a pool of policy ``BLOCK_GROUPS``, or not registered, makes
        the hit 0 (a miss)."""
        kv_pages = self.batch_exists(keys, extra_info)
        hits: dict[str, int] = {PoolName.KV.value: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            name = str(transfer.name)
            side = self.sides.get(name)
            policy = transfer.hit_policy
            if side is None or policy not in (
                PoolHitPolicy.ALL_PAGES,
                PoolHitPolicy.TRAILING_PAGES,
            ):
                self._warn_once(f"v2 pool {name} policy {policy}", "unsupported: a miss")
                restorable = []
                break
            found = self._contains([side.key(k) for k in keys[:kv_pages]])
            if policy == PoolHitPolicy.ALL_PAGES:
                boundary = found.index(False) if False in found else kv_pages
                ok = set(range(1, boundary + 1))
            else:
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                ok = {
                    p
                    for p in range(1, kv_pages + 1)
                    if all(found[i] for i in range(max(0, p - trailing), p))
                }
                boundary = max(ok, default=0)
            if boundary:
                hits[name] = boundary
            restorable = [p for p in restorable if p in ok]
        final = restorable[-1] if restorable else 0
        return PoolTransferResult(final, hits, restorable)

    def _contains(self, keys: list[PageKey]) -> list[bool]:
        return self._guard(
            "batch_exists_v2", [False] * len(keys), lambda st: st.batch_contains(keys)
        )

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Read each side pool's pages; per pool name, True where the page is valid."""
        return {str(t.name): self._side_io(t, get=True) for t in transfers}

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Write each side pool's pages (all True without writing on a non-writer rank)."""
        return {str(t.name): self._side_io(t, get=False) for t in transfers}

    def _side_io(self, transfer: PoolTransfer, *, get: bool) -> list[bool]:
        keys = list(transfer.keys or [])
        if not keys:
            return []
        name = str(transfer.name)
        if name == PoolName.KV.value and transfer.host_indices is not None:
            if get:
                return self.batch_get_v1(keys, transfer.host_indices)
            return self.batch_set_v1(keys, transfer.host_indices)
        if not get and not self.is_writer:
            return [True] * len(keys)
        side = self.sides.get(name)
        if side is None or transfer.host_indices is None:
            self._warn_once(f"v2 pool {name}", "not registered or no host indices: a miss")
            return [False] * len(keys)
        indices = transfer.host_indices

        def io(st: HiCacheStorage) -> list[bool]:
            starts = page_starts(indices, side.page_size, len(keys))
            pages = FlatPages(side.pool, side.fmt, starts, for_get=get)
            pk = [side.key(k) for k in keys]
            if get:
                return st.batch_get_payloads(pk, pages)
            res = st.batch_set_payloads(pk, pages)
            return [o is not SetOutcome.FAILED for o in res.outcomes]

        return self._guard("batch_get_v2" if get else "batch_set_v2", [False] * len(keys), io)

    def _warn_once(self, what: str, why: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("hicache SGLang backend: %s %s", what, why)

    # -- lifecycle -------------------------------------------------------------------------
    def clear(self) -> None:
        """Not supported: hicache's L3 is shared; records age out by the backend's own
        eviction (a no-op here, logged once)."""
        self._warn_once("clear", "is not supported (L3 is shared); nothing deleted")

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` of the KV page gets and sets since the last call
        (:mod:`~hicache.integrations.sglang.metrics`), or None when SGLang's storage
        metrics are off. hicache's own counters (misses by reason, latency, stalls) are
        :attr:`stats`."""
        if self.io_window is None:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        got = self.io_window.drain()
        return StorageMetrics(
            prefetch_pgs=list(got.prefetch_pgs),
            backup_pgs=list(got.backup_pgs),
            prefetch_bandwidth=list(got.prefetch_bandwidth),
            backup_bandwidth=list(got.backup_bandwidth),
        )

    def close(self) -> None:
        """Close the hicache backend (idempotent)."""
        store, self.store = self.store, None
        if store is not None:
            store.close()
