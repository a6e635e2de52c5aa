"""A digest of one rank's scheduling and cache state, to show the ranks stay identical.

Under tensor parallelism every rank runs the same scheduler over the same cache, so at
the same step every rank's digest must be the same (:meth:`hicache.engine.engine.Engine.rank_digests`
gathers them). The digest covers what decides future steps: every tree node (its path's
tokens, L1 and L2 page ids, pins, hit count, logical access clock, tenant, priority) and
every request the scheduler holds (id, computed length, tokens generated, finish state),
in the scheduler's order. Not covered: the bytes in the pools (each rank holds its own
shard of them) and anything timed in seconds.

:func:`prefix_bytes_digest` covers those bytes, for one cached prefix on one rank: what its
L1 holds for the prefix in every component (full KV pages, a recurrent model's snapshot at
the prefix's end). Ranks differ there (their shards); one rank's digest of a prefix must
not change when the prefix leaves L1 and comes back from L2 or L3.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch

from hicache.cache import HiCache
from hicache.cache.inspect import tree_digest
from hicache.engine.request import Request
from hicache.memory import DevicePool
from hicache.memory.state_pool import StatePool
from hicache.tokens import encode_tokens
from hicache.tree.components import Tier


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


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def prefix_bytes_digest(cache: HiCache, tokens: Sequence[int]) -> str:
    """SHA-256 (hex) of what this rank's L1 holds for the cached prefix ``tokens`` (whole
    pages, the shared tenant): the full KV of every page in token order, then each extra
    component's L1 value at the node that ends where the prefix ends (a recurrent model's
    snapshot: its slot's state tensors; ``none`` when it has none there). Read only: walks
    the tree without a match (no split, no access mark). A prefix not wholly in L1 gives
    ``"absent: <why>"`` instead (never an error: every rank applies a digest request, and
    none may fail on it)."""
    tree = cache.full.tree
    want = encode_tokens(list(tokens))
    step = tree.page_size * len(encode_tokens([0]))
    if len(want) % step:
        return f"absent: {len(tokens)} tokens are not whole pages of {tree.page_size}"
    node, at = tree.root, 0
    pages: list[int] = []
    end = None  # the node ending exactly at the prefix's end, if one does
    while at < len(want):
        child = node.children.get(want[at : at + step])
        if child is None or child.device is None:
            return f"absent: page {at // step} of the prefix is not in L1"
        n = min(len(child.key), len(want) - at) // step
        if child.key[: n * step] != want[at : at + n * step]:
            return f"absent: the prefix leaves the tree inside a node at page {at // step}"
        pages.extend(int(p) for p in child.device[:n])
        at += n * step
        node = child
        end = child if n * step == len(child.key) else None
    h = hashlib.sha256(_bytes(cache.full.device_pool.read_pages(pages)))
    for store in cache.stores:
        ids = None if end is None else tree.component(store.name).get(end, Tier.DEVICE)
        h.update(f"|{store.name}:".encode())
        pool = store.device_pool
        if ids is None:
            h.update(b"none")
        elif isinstance(pool, StatePool):
            for t in pool.read_slots(list(ids)):
                h.update(_bytes(t))
        elif isinstance(pool, DevicePool):
            h.update(_bytes(pool.read_pages(list(ids))))
    return h.hexdigest()


__all__ = ["prefix_bytes_digest", "rank_state_digest"]
