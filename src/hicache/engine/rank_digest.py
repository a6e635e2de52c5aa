"""A digest of one rank's scheduling and cache state, to show the ranks stay identical.

Under tensor parallelism every rank runs the same scheduler over the same cache, so at
the same step every rank's digest must be the same (:meth:`hicache.engine.engine.Engine.rank_digests`
gathers them). The digest covers what decides future steps: every tree node (its path's
tokens, L1 and L2 page ids, pins, hit count, logical access clock, tenant, priority) and
every request the scheduler holds (id, computed length, tokens generated, finish state),
in the scheduler's order. Not covered: the bytes in the pools (each rank holds its own
shard of them) and anything timed in seconds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from hicache.cache import HiCache
from hicache.cache.inspect import tree_digest
from hicache.engine.request import Request


def rank_state_digest(
    cache: HiCache, waiting: Iterable[Request], running: Iterable[Request]
) -> str:
    """SHA-256 (hex) of the tree of ``cache`` (:func:`~hicache.cache.inspect.tree_digest`,
    exact: page ids and clocks included) and the requests ``waiting`` and ``running``
    (each in order): equal on two ranks exactly when they hold the same state."""
    h = hashlib.sha256(tree_digest(cache.full.tree, exact=True).encode())
    for kind, reqs in (("W", waiting), ("R", running)):
        for req in reqs:
            out = ",".join(str(int(i)) for i in req.output_ids)
            h.update(
                f"{kind}|{req.rid}|{req.kv_len}|{out}|{req.finish_reason}|{req.aborted}".encode()
            )
    return h.hexdigest()


__all__ = ["rank_state_digest"]
