"""The cache controller: L1<->L2 copies, write policies (L3 threads come later)."""

from hicache.controller.cache_controller import CacheController, page_tensor
from hicache.controller.policy import WriteRule, write_rule

__all__ = ["CacheController", "WriteRule", "page_tensor", "write_rule"]
