"""Per-component node data (full attention now; sliding window, Mamba state, indexer later)."""

from hicache.tree.components.base import FullAttention, TreeComponent

__all__ = ["FullAttention", "TreeComponent"]
