"""Write policies as small strategy objects: when an L1 node gets its L2 copy."""

from __future__ import annotations

from dataclasses import dataclass

from hicache.config import CacheConfig, WritePolicy


@dataclass(frozen=True, slots=True)
class WriteRule:
    """What a write policy asks of the cache.

    ``backup_min_hits``: after an insert, back up the not-yet-backed-up run of the path
    whose nodes have at least this many hits (``None``: never on insert).
    ``backup_on_evict``: back a node up (synchronously) just before evicting it from L1.
    """

    backup_min_hits: int | None
    backup_on_evict: bool


def write_rule(config: CacheConfig) -> WriteRule:
    """The rule of ``config.write_policy``.

    * ``write_through``: every inserted node, at once;
    * ``write_through_selective``: once it has ``write_through_threshold`` hits (a new node
      has one hit; each later insert through it adds one);
    * ``write_back``: only when it is evicted from L1;
    * ``watermark``: as ``write_through`` (it differs from it in L2 -> L3 writes).
    """
    policy = config.write_policy
    if policy in (WritePolicy.WRITE_THROUGH, WritePolicy.WATERMARK):
        return WriteRule(backup_min_hits=0, backup_on_evict=False)
    if policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
        return WriteRule(backup_min_hits=config.write_through_threshold, backup_on_evict=False)
    return WriteRule(backup_min_hits=None, backup_on_evict=True)
