"""The HiRadixTree: which tier holds each page of each cached prefix (pure Python)."""

from hicache.tokens import decode_tokens, encode_tokens
from hicache.tree.components import (
    ComponentValues,
    FullComponent,
    MambaState,
    SlidingWindow,
    Tier,
    TreeComponent,
)
from hicache.tree.node import TreeNode
from hicache.tree.radix import HiRadixTree
from hicache.tree.results import (
    ComponentStats,
    InsertResult,
    MatchResult,
    MatchStop,
    NodeEviction,
    TreeStats,
)

__all__ = [
    "ComponentStats",
    "ComponentValues",
    "FullComponent",
    "HiRadixTree",
    "InsertResult",
    "MambaState",
    "MatchResult",
    "MatchStop",
    "NodeEviction",
    "SlidingWindow",
    "Tier",
    "TreeComponent",
    "TreeNode",
    "TreeStats",
    "decode_tokens",
    "encode_tokens",
]
