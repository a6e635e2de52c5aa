"""Per-component memory figures of a running engine's cache, for the benchmarks.

A hybrid model's cache keeps one *component* per kind of layer state:

* ``full_kv``: K/V of every cached token in the full-attention layers;
* ``swa_kv``: K/V of the sliding-window layers; ideally only the last ``window`` tokens
  of each live sequence (older pages tombstoned);
* ``mamba``: one recurrent-state snapshot per cached boundary (Mamba2, Gated DeltaNet).

:func:`component_figures` is the one place that reads them, so that a component or a
pool the cache starts exposing (the separate SWA pool) is added here and every bench
that reports components picks it up. A figure the cache does not expose yet is None
(printed ``n/a``), never a guess.

Units: bytes per cached token (B/token); pool usage in the pool's own unit (``pages`` of
``page_size`` tokens for KV pools, ``slots`` of one snapshot for state pools).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hicache.cache.snapshot_tier import SnapshotTier
from hicache.config import KVSpec
from hicache.engine.models.hybrid import HybridConfig, HybridLM

if TYPE_CHECKING:
    from hicache.engine.engine import Engine

__all__ = ["ComponentFigures", "PoolUsage", "component_figures", "fmt_optional"]


@dataclass(frozen=True, slots=True)
class PoolUsage:
    """One tier's pool of one component: ``used`` of ``total`` units (``unit``)."""

    used: int
    total: int
    unit: str

    def __str__(self) -> str:
        return f"{self.used}/{self.total} {self.unit}"


@dataclass(frozen=True, slots=True)
class ComponentFigures:
    """Memory figures of one component of the cache at one moment.

    ``bytes_per_token``: bytes the cache holds for this component per token cached in L1
    (None when not measurable: nothing cached, or the component's pool is not exposed).
    ``ideal_bytes_per_token``: what the component needs per cached token by design
    (``full_kv``: its layers' K/V; ``swa_kv``: its layers' K/V x ``window / cached
    tokens``; ``mamba``: one snapshot per ``mamba_track_interval`` tokens).
    ``l1`` / ``l2``: pool usage per tier (None: no such pool, or not exposed).
    ``shared_pool``: the component lives in another component's pool (its pages are
    that pool's pages; its own usage is then not separable).
    """

    component: str
    layers: int
    bytes_per_token: float | None
    ideal_bytes_per_token: float | None
    l1: PoolUsage | None
    l2: PoolUsage | None
    shared_pool: str | None = None
    note: str = ""


def fmt_optional(value: float | int | None, spec: str = ".1f") -> str:
    """``value`` formatted with ``spec``, or ``n/a`` when it is None."""
    return "n/a" if value is None else format(value, spec)


def _layer_kinds(engine: Engine) -> tuple[tuple[str, ...], int | None]:
    """The pool layers' kinds (``full_attention`` / ``sliding_attention``, in pool order)
    and the sliding window (tokens; None when the model has none)."""
    model = engine.model.model
    if not isinstance(model, HybridLM):
        return ("full_attention",) * engine.cache.spec.num_layers, None
    cfg: HybridConfig = model.config
    kinds = tuple(cfg.layer_kinds[i] for i in cfg.kv_layers)
    window = getattr(cfg, "sliding_window", None)
    return kinds, None if window is None else int(window)


def _swa_pool_usage(engine: Engine) -> tuple[PoolUsage | None, PoolUsage | None] | None:
    """L1 and L2 usage of a separate sliding-window pool, or None while the cache keeps
    SWA layers in the full pool (as it does today). Extend here when the SWA pool lands."""
    return None


def component_figures(engine: Engine) -> list[ComponentFigures]:
    """Every component of ``engine``'s cache, now. Call on the engine thread
    (``engine.call(lambda: component_figures(engine))``): it reads the tree and pools."""
    cache = engine.cache
    spec: KVSpec = cache.spec
    ps = cache.page_size
    kinds, window = _layer_kinds(engine)
    full_layers = sum(k == "full_attention" for k in kinds)
    swa_layers = len(kinds) - full_layers
    tree = cache.tree.stats()
    cached = tree.device_pages * ps  # tokens cached in L1
    l1_full = PoolUsage(
        cache.device_pool.allocator.used_pages, cache.device_pool.num_pages, "pages"
    )
    host = cache.host_pool
    l2_full = (
        None if host is None else PoolUsage(host.allocator.used_pages, host.num_pages, "pages")
    )
    out: list[ComponentFigures] = []
    layer_bytes = spec.token_bytes_per_layer
    if full_layers:
        out.append(
            ComponentFigures(
                component="full_kv",
                layers=full_layers,
                bytes_per_token=float(layer_bytes * full_layers) if cached else None,
                ideal_bytes_per_token=float(layer_bytes * full_layers),
                l1=l1_full,
                l2=l2_full,
            )
        )
    if swa_layers:
        per_token = layer_bytes * swa_layers
        ideal = None if not cached or window is None else per_token * min(1.0, window / cached)
        swa = _swa_pool_usage(engine)
        if swa is None:  # in the full pool: every cached token keeps its SWA K/V
            out.append(
                ComponentFigures(
                    component="swa_kv",
                    layers=swa_layers,
                    bytes_per_token=float(per_token) if cached else None,
                    ideal_bytes_per_token=ideal,
                    l1=None,
                    l2=None,
                    shared_pool="full_kv" if full_layers else None,
                    note=f"window {window}; no separate SWA pool yet: all tokens kept",
                )
            )
        else:
            l1, l2 = swa
            held = None if l1 is None or not cached else l1.used * ps * per_token / cached
            out.append(
                ComponentFigures(
                    component="swa_kv",
                    layers=swa_layers,
                    bytes_per_token=held,
                    ideal_bytes_per_token=ideal,
                    l1=l1,
                    l2=l2,
                    note=f"window {window}",
                )
            )
    if cache.snapshots is not None:
        out.append(_mamba_figures(cache.snapshots, cached, cache.config.mamba_track_interval))
    return out


def _mamba_figures(sn: SnapshotTier, cached: int, interval: int) -> ComponentFigures:
    slot = sn.spec.slot_bytes
    used = sn.device_pool.allocator.used_pages
    l2 = None
    if sn.host_pool is not None:
        l2 = PoolUsage(sn.host_pool.allocator.used_pages, sn.host_pool.num_slots, "slots")
    return ComponentFigures(
        component="mamba",
        layers=sn.spec.num_layers,
        bytes_per_token=used * slot / cached if cached else None,
        ideal_bytes_per_token=slot / interval,
        l1=PoolUsage(used, sn.device_pool.num_slots, "slots"),
        l2=l2,
        note=f"{slot} B per snapshot, interval {interval} tokens",
    )
