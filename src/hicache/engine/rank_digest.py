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
from hicache.engine.request import Request


def _ids(ids: Iterable[int] | None) -> str:
    return "-" if ids is None else ",".join(str(int(i)) for i in ids)


def rank_state_digest(
    cache: HiCache, waiting: Iterable[Request], running: Iterable[Request]
) -> str:
    """SHA-256 (hex) of the tree of ``cache`` and the requests ``waiting`` and ``running``
    (each in order): equal on two ranks exactly when they hold the same state."""
    h = hashlib.sha256()
    paths: dict[int, bytes] = {}
    lines: list[bytes] = []
    for node in cache.tree.iter_nodes():  # parents before children
        parent = node.parent
        above = paths.get(parent.id, b"") if parent is not None else b""
        path = hashlib.sha256(above + node.key).digest()
        paths[node.id] = path
        lines.append(
            path
            + (
                f"|{_ids(node.device)}|{_ids(node.host)}|{node.lock_ref}|{node.host_ref}"
                f"|{node.hit_count}|{node.last_access}|{node.priority}|{node.tenant}"
            ).encode()
        )
    for line in sorted(lines):  # the order children are stored in is not state
        h.update(line)
    for kind, reqs in (("W", waiting), ("R", running)):
        for req in reqs:
            h.update(
                f"{kind}|{req.rid}|{req.kv_len}|{_ids(req.output_ids)}|{req.finish_reason}"
                f"|{req.aborted}".encode()
            )
    return h.hexdigest()


__all__ = ["rank_state_digest"]
