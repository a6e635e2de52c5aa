"""A digest of one rank's scheduling and cache state, to show the ranks stay identical.

Under tensor parallelism every rank runs the same scheduler over the same cache, so at
the same step every rank's digest must be the same (:meth:`hicache.engine.front.engine.Engine.rank_digests`
gathers them). The digest covers what decides future steps: every tree node (its path's
tokens, L1 and L2 page ids, pins, hit count, logical access clock, tenant, priority) and
every request the scheduler holds (id, computed length, tokens generated, finish state),
in the scheduler's order. Not covered: the bytes in the pools (each rank holds its own
shard of them) and anything timed in seconds.

:func:`page_digests` covers those bytes for one prompt instead: each page a rank's cache
holds of it, per component and tier (a recurrent model's state snapshots too, by the page
they end), so a test can show that a copy between tiers kept every byte on every rank.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence

import torch

from hicache.cache import HiCache
from hicache.cache.report import tree_digest
from hicache.engine.request import Request
from hicache.memory import DevicePool, HostPool, StatePool
from hicache.tree.components import Tier
from hicache.tree.node import common_prefix_bytes


def rank_state_digest(
    cache: HiCache, waiting: Iterable[Request], running: Iterable[Request]
) -> str:
    """SHA-256 (hex) of the tree of ``cache`` (:func:`~hicache.cache.report.tree_digest`,
    exact: page ids and clocks included), its kept sessions and the requests ``waiting`` and ``running``
    (each in order): equal on two ranks exactly when they hold the same state."""
    h = hashlib.sha256(tree_digest(cache, exact=True).encode())
    for v in cache.sessions.views():  # not the deadline: each rank's own clock
        h.update(f"S|{v.session_id}|{v.state.value}|{v.tokens}|{v.pinned_tokens}".encode())
    for kind, reqs in (("W", waiting), ("R", running)):
        for req in reqs:
            out = ",".join(str(int(i)) for i in req.output_ids)
            h.update(
                f"{kind}|{req.rid}|{req.kv_len}|{out}|{req.finish_reason}|{req.aborted}".encode()
            )
    return h.hexdigest()


def page_digests(cache: HiCache, tokens: Sequence[int]) -> dict[str, dict[int, str]]:
    """SHA-256 (hex) of the bytes of every page ``cache`` holds of the cached prefix of
    ``tokens`` (whole pages, the shared tenant), by ``"<component>/<tier>"`` (``"full/device"``,
    ``"full/host"``, and the same for each paged component, e.g. ``"swa/device"``) and
    page index in ``tokens``. The in-flight copies are applied first
    (:meth:`HiCache.sync` with ``wait``, agreed: call it on every rank at the same step); the tree is
    walked without touching it. A page's digest is the same in every tier it is copied
    to; each tensor-parallel rank holds its own K/V heads, so the ranks' digests differ."""
    cache.sync(wait=True)
    tree = cache.full.pages.tree
    width = tree.page_size * 4  # a page of uint32 token ids
    key = array("I", tokens[: len(tokens) // tree.page_size * tree.page_size]).tobytes()
    pools: dict[str, tuple[str | None, DevicePool | HostPool | StatePool | None]] = {
        "full/device": (None, cache.full.pages.device_pool),
        "full/host": (None, cache.full.pages.host_pool),
    }
    for store in cache.stores:
        for tier, pool in (("device", store.device_pool), ("host", store.host_pool)):
            if isinstance(pool, DevicePool | HostPool | StatePool):
                pools[f"{store.name}/{tier}"] = (store.name, pool)
    out: dict[str, dict[int, str]] = {name: {} for name, (_, pool) in pools.items() if pool}
    node, at = tree.root_of(""), 0
    while at < len(key):
        child = node.children.get(key[at : at + width])
        if child is None:
            break
        pages = common_prefix_bytes(child.key, key[at:], width) // width
        first = at // width
        whole = pages == tree.num_pages(child)
        for name, (component, pool) in pools.items():
            tier = Tier.DEVICE if name.endswith("/device") else Tier.HOST
            if component is None:
                ids = child.device if tier is Tier.DEVICE else child.host
            else:
                ids = tree.component(component).get(child, tier)
            if isinstance(pool, StatePool):  # a snapshot of the state where the node ends
                if whole and ids is not None:
                    out[name][first + pages - 1] = _sha256(*pool.read_slots(list(ids)))
                continue
            for i, page in enumerate(list(ids or ())[:pages]):
                if pool is not None:
                    out[name][first + i] = _sha256(pool.read_pages(torch.tensor([page])))
        if not whole:
            break
        node, at = child, at + pages * width
    return out


def _sha256(*tensors: torch.Tensor) -> str:
    """SHA-256 (hex) of the tensors' bytes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


__all__ = ["page_digests", "rank_state_digest"]
