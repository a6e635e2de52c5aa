"""The HiRadixTree: which tier holds each page of each cached prefix (pure Python)."""

from hicache.tokens import decode_tokens, encode_tokens
from hicache.tree.node import TreeNode
from hicache.tree.radix import HiRadixTree
from hicache.tree.results import InsertResult, MatchResult, MatchStop, TreeStats

__all__ = [
    "HiRadixTree",
    "InsertResult",
    "MatchResult",
    "MatchStop",
    "TreeNode",
    "TreeStats",
    "decode_tokens",
    "encode_tokens",
]
