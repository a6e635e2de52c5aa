"""Per-component memory and hit figures of a running engine's cache, for the benchmarks.

Components as the cache names them (:class:`~hicache.metrics.ComponentUsage`): ``full``
(K/V of the full-attention layers), ``swa`` (sliding-window K/V in its own pools: the
window before each cached boundary and each live sequence's last ``window`` tokens),
``mamba`` (one recurrent-state snapshot per cached boundary). :func:`component_figures` is
the one place that reads memory figures (``cache_stats(cache).components`` plus each
store's ``nominal()``), so a new component appears in every bench that reports them;
:class:`ComponentHitProbe` reads ``ComponentStores.component_hits`` (per admission, whether
each component's hit values were in L1 or copied from L2). Units: bytes per cached token
(over the tokens whose full KV is in L1); pool usage in ``pages`` (KV pools) or ``slots``
(state pools); hits in admissions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hicache.cache.report import cache_stats
from hicache.metrics import ComponentUsage

if TYPE_CHECKING:
    from hicache.cache.facade import HiCache
    from hicache.engine.front.engine import Engine

__all__ = [
    "FULL",
    "ComponentFigures",
    "ComponentHitProbe",
    "ComponentHits",
    "PoolUsage",
    "component_figures",
    "fmt_optional",
]

FULL = "full"
"""The cache's name of the full-attention KV component."""


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

    ``bytes_per_token``: L1 bytes the cache holds for this component per token whose full
    KV is in L1 (the cache's ``bytes_per_cached_token``; None when no token is cached).
    ``nominal_bytes_per_token``: what the component costs per cached token by its design
    rule without any window: ``full`` and ``swa``: its layers' K/V of one token (what
    keeping every token costs); ``mamba``: one snapshot per ``mamba_track_interval``
    tokens. ``held_ratio``: ``bytes_per_token / nominal_bytes_per_token`` (for ``swa``
    well below 1 once sequences are longer than the window). ``l1`` / ``l2``: pool usage
    per tier (``l2`` None without L2).
    """

    component: str
    layers: int
    bytes_per_token: float | None
    nominal_bytes_per_token: float
    held_ratio: float | None
    l1: PoolUsage
    l2: PoolUsage | None
    note: str = ""


@dataclass(frozen=True, slots=True)
class ComponentHits:
    """Admissions that reused a cached prefix, by where one component's part of the hit
    was (``swa``: the window before the boundary; ``mamba``: the snapshot there).

    ``l1``: already in L1. ``l2``: at least one page (slot) copied L2 -> L1 at admission
    (what an L3 prefetch brought lands in L2 first, so it counts here). Admissions, not
    requests: a request admitted again after preemption counts again.
    """

    component: str
    l1: int
    l2: int


def fmt_optional(value: float | int | None, spec: str = ".1f") -> str:
    """``value`` formatted with ``spec``, or ``n/a`` when it is None."""
    return "n/a" if value is None else format(value, spec)


def _pool(used: int, total: int, unit: str) -> PoolUsage | None:
    return None if total == 0 else PoolUsage(used, total, unit)


def component_figures(engine: Engine) -> list[ComponentFigures]:
    """Every component of ``engine``'s cache, now (``stats().components`` plus nominal
    sizes). Call on the engine thread (``engine.call(lambda: component_figures(engine))``):
    it reads the tree and pools."""
    cache = engine.core.cache
    return [_figures(cache, u) for u in cache_stats(cache).components]


def _figures(cache: HiCache, u: ComponentUsage) -> ComponentFigures:
    """:class:`ComponentFigures` of one :class:`ComponentUsage` of ``cache``."""
    cached = cache.full.pages.device_pool.allocator.used_pages > 0  # the denominator is not 0
    held = u.bytes_per_cached_token if cached else None
    store = cache.stores.get(u.name)
    if u.name == FULL:
        spec = cache.full.pages.device_pool.spec
        layers, nominal, unit = spec.num_layers, float(spec.token_bytes), "pages"
        # other pools taking some attention layers leave the full pool the global ones
        note = "global layers" if cache.stores.runner_pools() else ""
    elif store is not None:
        size = store.nominal()
        layers, nominal, unit, note = size.layers, size.bytes_per_token, size.unit, size.note
    else:  # pragma: no cover - the stats name only the cache's own components
        raise ValueError(f"unknown cache component {u.name!r}")
    return ComponentFigures(
        component=u.name,
        layers=layers,
        bytes_per_token=held,
        nominal_bytes_per_token=nominal,
        held_ratio=None if held is None else held / nominal,
        l1=PoolUsage(u.device_used, u.device_total, unit),
        l2=_pool(u.host_used, u.host_total, unit),
        note=note,
    )


class ComponentHitProbe:
    """Counts :class:`ComponentHits` of one cache from when it is attached, per admission
    that reused a prefix (the cache's own counts, ``ComponentStores.component_hits``: an admission
    is counted when it succeeds with a hit; a copy made by an attempt that then failed (no
    L1 room yet) is carried to the request's successful attempt). Attach and read on the
    engine thread.
    """

    def __init__(self, cache: HiCache) -> None:
        self._cache = cache
        self._base = {h.name: (h.l1, h.l2) for h in cache.stores.component_hits()}
        self.components: tuple[str, ...] = tuple(self._base)

    def take(self) -> list[ComponentHits]:
        """The counts since the last :meth:`take` (or since attaching), one per component
        the cache has besides full KV; resets them."""
        now = {h.name: (h.l1, h.l2) for h in self._cache.stores.component_hits()}
        out = [
            ComponentHits(n, now[n][0] - self._base[n][0], now[n][1] - self._base[n][1])
            for n in self.components
        ]
        self._base = now
        return out
