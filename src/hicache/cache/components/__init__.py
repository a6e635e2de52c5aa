"""Component stores: the cached state of a model besides its full KV, one store per kind.

:mod:`.base` holds the contract (:class:`ComponentStore`), :mod:`.paged` the base of the
stores over their own page pools, one module per implementation:
:mod:`.swa` (sliding-window KV), :mod:`.snapshots` (recurrent-state snapshots),
:mod:`.indexer` (the DSA indexer's keys, on the full KV's page ids), :mod:`.logprob`
(scoring entries: prompt logprobs, on the full KV's page ids, added by the engine);
:mod:`.records` the L3 codec contract; :mod:`.stores` the list a cache holds.

:data:`STORE_TYPES` is the list the cache builds its stores from: one store per
:class:`~hicache.spec.ComponentSpec` of the model's
:class:`~hicache.spec.CacheSpec`, of the type whose ``spec_type`` the spec is. A new
component is a spec, a store module, and an entry here.
"""

from hicache.cache.components.base import ComponentStore
from hicache.cache.components.indexer import IndexerStore
from hicache.cache.components.logprob import LogprobStore
from hicache.cache.components.snapshots import SnapshotStore
from hicache.cache.components.swa import SwaStore

STORE_TYPES: tuple[type[ComponentStore], ...] = (
    SwaStore,
    SnapshotStore,
    IndexerStore,
    LogprobStore,
)
"""Every component store the cache can build, by the spec type each takes."""

__all__ = [
    "STORE_TYPES",
    "ComponentStore",
    "IndexerStore",
    "LogprobStore",
    "SnapshotStore",
    "SwaStore",
]
