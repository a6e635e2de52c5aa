"""Random walks over a tree's tiers: after every operation, the pages the hub reports
resident are exactly the tree's resident pages (L1 or L2), each with its path's hash."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

from hicache.kv_events import BlockRemoved, BlockStored, KvEventHub, Medium, ResidencyRecorder
from hicache.tree import HiRadixTree
from hicache.tree.node import decode_tokens, page_ids

P = 2


def _resident(tree: HiRadixTree) -> dict[int, tuple[int, ...]]:
    """Every resident page of ``tree``: its hash (computed from the whole path) -> tokens."""
    out: dict[int, tuple[int, ...]] = {}
    for node in tree.iter_nodes():
        if node.device is None and node.host is None:
            continue
        tokens = decode_tokens(tree.path_key(node))
        seed = b"sglang-cache-salt-v1\0" + node.tenant.encode()
        prior = hashlib.sha256(seed).digest() if node.tenant else b""
        first = len(tokens) // P - len(node.key) // (4 * P)
        for i in range(0, len(tokens), P):
            page = tokens[i : i + P]
            prior = hashlib.sha256(prior + struct.pack(f"<{P}I", *page)).digest()
            if i // P >= first:
                out[int.from_bytes(prior[:8], "big", signed=True)] = tuple(page)
    return out


def _reported(hub: KvEventHub) -> dict[int, tuple[int, ...]]:
    out: dict[int, tuple[int, ...]] = {}
    for e in hub.snapshot().events:
        if isinstance(e, BlockStored):
            for i, h in enumerate(e.block_hashes):
                out[h] = e.token_ids[i * P : (i + 1) * P]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_reported_pages_are_the_resident_pages(seed: int) -> None:
    rng = random.Random(seed)
    tree = HiRadixTree(P)
    rec = ResidencyRecorder(P)
    tree.observe_residency(rec)
    hub = KvEventHub()
    ids = iter(range(10**6))
    kinds: set[object] = set()
    for _ in range(150):
        op = rng.choice(["insert"] * 4 + ["backup", "evict_l1", "evict_l2", "drop_l2", "fetch"])
        tenant = rng.choice(["", "", "acme"])
        if op == "insert":
            tokens = [rng.randrange(4) for _ in range(P * rng.randint(1, 5))]
            tree.insert(tokens, [next(ids) for _ in range(len(tokens) // P)], tenant=tenant)
        elif op == "backup":  # back up the first node whose parent is backed up
            for node in tree.iter_nodes():
                up = node.parent
                if node.host is None and up is not None and up.host is not None:
                    tree.assign_host(
                        node, page_ids([next(ids) for _ in range(len(node.key) // (4 * P))])
                    )
                    break
        elif op == "evict_l1":
            node = next(iter(tree.device_eviction_order()), None)
            if node is not None:
                tree.evict_device(node)
        elif op == "evict_l2":
            node = next(iter(tree.host_eviction_order()), None)
            if node is not None:
                tree.evict_host(node)
        elif op == "drop_l2":
            node = next(iter(tree.host_copy_eviction_order()), None)
            if node is not None:
                tree.drop_node_host(node)
        elif op == "fetch":  # an L3 hit lands in L2 below a backed-up node
            backed = [n for n in tree.iter_nodes() if n.host is not None]
            if backed:
                node = rng.choice(backed)
                tokens = decode_tokens(tree.path_key(node)) + [rng.randrange(4) for _ in range(P)]
                start = len(tokens) // P - 1
                tree.insert_host(tokens, page_ids([next(ids)]), start, node.tenant)
        if rng.random() < 0.03:
            tree.reset()
        events = rec.drain()
        kinds.update(
            type(e) if isinstance(e, BlockRemoved) else getattr(e, "medium", e) for e in events
        )
        hub.publish(events)
        tree.check_integrity()
        assert _reported(hub) == _resident(tree)
    assert {BlockRemoved, Medium.DEVICE, Medium.HOST} <= kinds  # every kind of change seen
