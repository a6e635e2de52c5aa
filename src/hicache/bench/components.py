"""Per-component memory and hit figures of a running engine's cache, for the benchmarks.

A hybrid model's cache keeps one *component* per kind of layer state, named as the cache
names them (:class:`~hicache.metrics.ComponentUsage`):

* ``full``: K/V of every cached token in the full-attention (global) layers;
* ``swa``: K/V of the sliding-window layers, in their own L1/L2 pools; only the window
  before each cached boundary and each live sequence's last ``window`` tokens are held;
* ``mamba``: one recurrent-state snapshot per cached boundary (Mamba2, Gated DeltaNet).

:func:`component_figures` is the one place that reads memory figures: it takes them from
``HiCache.stats().components`` and adds each component's nominal size, so a component
the cache starts exposing appears in every bench that reports components.
:class:`ComponentHitProbe` counts, per admission that reused a prefix, whether the
hit's SWA window / snapshot was in L1 already or had to be copied from L2.

Units: bytes per cached token (B/token, over the tokens whose full KV is in L1); pool
usage in the pool's own unit (``pages`` of ``page_size`` tokens for KV pools, ``slots`` of
one snapshot for state pools); hits in admissions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hicache.cache.snapshot_tier import SNAPSHOT
from hicache.cache.swa_tier import SWA
from hicache.metrics import ComponentUsage

if TYPE_CHECKING:
    from hicache.cache.facade import HiCache
    from hicache.cache.request import CacheRequest
    from hicache.engine.engine import Engine
    from hicache.tokens import TokenIds
    from hicache.tree import TreeNode

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
    cache = engine.cache
    return [_figures(cache, u) for u in cache.stats().components]


def _figures(cache: HiCache, u: ComponentUsage) -> ComponentFigures:
    """:class:`ComponentFigures` of one :class:`ComponentUsage` of ``cache``."""
    cached = cache.device_pool.allocator.used_pages > 0  # the denominator is not 0
    held = u.bytes_per_cached_token if cached else None
    if u.name == FULL:
        spec = cache.device_pool.spec
        layers, nominal, unit = spec.num_layers, float(spec.token_bytes), "pages"
        note = "global layers" if cache.swa is not None else ""
    elif u.name == SWA and cache.swa is not None:
        spec = cache.swa.spec.kv
        layers, nominal, unit = spec.num_layers, float(spec.token_bytes), "pages"
        note = f"window {cache.swa.window} tokens"
    elif u.name == SNAPSHOT and cache.snapshots is not None:
        sn = cache.snapshots.spec
        interval = cache.config.mamba_track_interval
        layers, nominal, unit = sn.num_layers, sn.slot_bytes / interval, "slots"
        note = f"{sn.slot_bytes} B per snapshot, interval {interval} tokens"
    else:  # pragma: no cover - a component this module does not know yet
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
    """Counts :class:`ComponentHits` of one cache, per admission that reused a prefix.

    The cache keeps no such counter, so this wraps two of its public methods on the
    instance (the cache's code is unchanged): ``HiCache.admit`` and the tree's
    ``component_load_nodes``, which a hit's SWA window / snapshot load asks for the
    nodes it must copy from L2. An admission is counted when it succeeds with a hit
    (``prefix_pages > 0``); a copy made by an attempt that then failed (no L1 room yet)
    is carried to the request's successful attempt. Attach and read on the engine thread.
    """

    def __init__(self, cache: HiCache) -> None:
        self.components: tuple[str, ...] = tuple(
            name
            for name, tier in ((SWA, cache.swa), (SNAPSHOT, cache.snapshots))
            if tier is not None
        )
        self._l1 = dict.fromkeys(self.components, 0)
        self._l2 = dict.fromkeys(self.components, 0)
        self._current: set[str] | None = None
        self._pending: dict[int, set[str]] = {}
        if not self.components:
            return
        admit = cache.admit
        load_nodes = cache.tree.component_load_nodes

        def counting_admit(req: CacheRequest, tokens: TokenIds) -> bool:
            self._current = self._pending.pop(id(req), set())
            try:
                ok = admit(req, tokens)
            finally:
                loaded, self._current = self._current, None
            if not ok:
                if loaded:
                    self._pending[id(req)] = loaded
            elif req.prefix_pages > 0:
                for name in self.components:
                    counts = self._l2 if name in loaded else self._l1
                    counts[name] += 1
            return ok

        def noting_load_nodes(name: str, node: TreeNode) -> list[TreeNode]:
            nodes = load_nodes(name, node)
            if nodes and self._current is not None:
                self._current.add(name)
            return nodes

        cache.admit = counting_admit  # type: ignore[method-assign]
        cache.tree.component_load_nodes = noting_load_nodes  # type: ignore[method-assign]

    def take(self) -> list[ComponentHits]:
        """The counts since the last :meth:`take` (or since attaching), one per component
        the cache has besides full KV; resets them."""
        out = [ComponentHits(n, self._l1[n], self._l2[n]) for n in self.components]
        self._l1 = dict.fromkeys(self.components, 0)
        self._l2 = dict.fromkeys(self.components, 0)
        return out
