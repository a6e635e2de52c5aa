"""A match whose L1 part ends above an L1-resident node (its snapshot only in L2) and
whose L2 part goes deeper: admit gives the whole L1 path plus the loaded host-only
pages, never the loaded pages alone (found by the 512-prompt soak: the request's
pages and the tree's disagreed, and a page was freed twice)."""

from __future__ import annotations

from hicache.cache import HiCache
from hicache.cache.components import SnapshotStore
from hicache.cache.components.snapshots import SNAPSHOT
from hicache.cache.report import check_integrity
from hicache.tree.components import Tier
from tests.cache.test_snapshots import SPEC, cache, resume_state, run, snapshot
from tests.helpers.kvdata import page_kv, read_device

__all__ = ["cache"]  # the fixture, imported for pytest

SHORT = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # 4 whole pages before the last token
LONG = [*SHORT[:-1], 20, 21, 22]  # the same 4 pages, then 1 more before the last token


def test_l1_prefix_without_l1_snapshot_then_host_only_tail(cache: HiCache) -> None:
    run(cache, SHORT, snapshot(1))  # node X = pages 0..3, snapshot at 8 tokens
    s2 = snapshot(2)
    run(cache, LONG, s2)  # node Y = page 4 under X, snapshot at 10 tokens
    cache.sync(wait=True)  # both backed up to L2 with their snapshots
    assert cache.full.pages.evict_device(1) == 1  # Y (the leaf) is L2-only now
    (x,) = [n for n in cache.full.pages.tree.iter_nodes() if n.parent is cache.full.pages.tree.root]
    (y,) = x.children.values()
    assert x.device is not None and y.device is None and y.host is not None
    snaps = cache.stores.of_type(SnapshotStore)
    assert snaps is not None
    snaps.free(Tier.DEVICE, cache.full.pages.tree.evict_component(SNAPSHOT, x, Tier.DEVICE))
    check_integrity(cache)  # X: in L1 without its L1 snapshot (L2 has it)

    req = cache.open(LONG)
    assert cache.admit(req, LONG)
    assert req.prefix_tokens == 10 and req.prefix_pages == 5
    assert req.pages[:4] == x.device  # X's L1 pages, then Y's loaded page
    assert req.cached.device == 8 and req.cached.host == 2
    for layer in range(SPEC.num_layers):
        assert req.wait_layer(layer, 10)
    assert read_device(cache, req.pages[:5]).equal(page_kv(cache, LONG, 0, 5))
    got = resume_state(req)
    assert got is not None and all(a.equal(b) for a, b in zip(got, s2, strict=True))
    cache.release(req, LONG)
    cache.sync(wait=True)
    check_integrity(cache)
    assert all(n.lock_ref == 0 and n.host_ref == 0 for n in cache.full.pages.tree.iter_nodes())
