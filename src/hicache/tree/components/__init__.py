"""Per-component node data and rules: full KV, sliding-window KV, Mamba / linear state,
the DSA indexer's keys, scoring entries (prompt logprobs)."""

from hicache.tree.components.base import (
    ComponentData,
    ComponentValues,
    Granularity,
    MatchValidator,
    PathAccess,
    Span,
    Tier,
    TreeComponent,
)
from hicache.tree.components.full import FullComponent
from hicache.tree.components.indexer import IndexerKeys
from hicache.tree.components.logprob import LogprobEntries
from hicache.tree.components.mamba import MambaState
from hicache.tree.components.swa import SlidingWindow

__all__ = [
    "ComponentData",
    "ComponentValues",
    "FullComponent",
    "Granularity",
    "IndexerKeys",
    "LogprobEntries",
    "MambaState",
    "MatchValidator",
    "PathAccess",
    "SlidingWindow",
    "Span",
    "Tier",
    "TreeComponent",
]
