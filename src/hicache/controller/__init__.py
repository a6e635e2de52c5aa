"""Worker-side of the cache: L1<->L2 copies, L3 threads, write rules, rank agreement.

Nothing here walks the tree: the cache's tiers decide what to copy and apply the records
the workers post to the one :class:`CompletionQueue`.
"""

from hicache.controller.cache_controller import CacheController, page_tensor
from hicache.controller.completions import (
    CompletionQueue,
    ComponentFound,
    L3Lookup,
    L3Read,
    L3Write,
    Record,
)
from hicache.controller.policy import WriteRule, write_rule

__all__ = [
    "CacheController",
    "CompletionQueue",
    "ComponentFound",
    "L3Lookup",
    "L3Read",
    "L3Write",
    "Record",
    "WriteRule",
    "page_tensor",
    "write_rule",
]
