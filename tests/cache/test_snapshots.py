"""Recurrent-state snapshots through the request verbs: a match ends only where a snapshot
is, the snapshot comes back byte for byte from L1 and, after demotion, from L2."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from hicache.cache import CacheRequest, HiCache
from hicache.cache.components import SnapshotStore
from hicache.cache.components.base import ChunkPlan
from hicache.cache.report import check_integrity
from hicache.config import CacheConfig
from hicache.extras import KeptState, SequenceExtras
from hicache.spec import CacheSpec, KVSpec, SnapshotSpec, StateTensor
from hicache.tree.components import Tier
from tests.helpers.kvdata import page_kv, read_device, write_tokens

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
STATE = SnapshotSpec(
    num_layers=2,
    tensors=(StateTensor(name="conv", shape=(3, 2)), StateTensor(name="ssm", shape=(2, 2, 2))),
)
PAGE = 2
PROMPT = [5, 6, 7, 8, 9, 10, 11]  # 3 whole pages before the last token


def snapshot(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, STATE.num_layers, *t.shape, generator=gen) for t in STATE.tensors]


def kept(tokens: int, state: list[torch.Tensor] | None) -> SequenceExtras | None:
    """The runner's extras of a forward that kept ``state`` after ``tokens`` positions."""
    return None if state is None else SequenceExtras((KeptState(tokens, tuple(state)),))


def resume_state(req: CacheRequest) -> list[torch.Tensor] | None:
    """The snapshot ``req`` resumes from (taken from the handle; it covers exactly its
    prefix), or None."""
    got = req.take_resume()
    if got is None:
        return None
    (state,) = got.states
    assert state.tokens == req.prefix_tokens
    return list(state.tensors)


@pytest.fixture
def cache() -> Iterator[HiCache]:
    cfg = CacheConfig(
        page_size=PAGE, device_tokens=16, hicache_ratio=2.0, load_back_threshold=0,
        max_mamba_cache_size=4,
    )  # fmt: skip
    with HiCache(cfg, CacheSpec(kv=SPEC, components=(STATE,))) as c:
        yield c


def run(cache: HiCache, prompt: list[int], state: list[torch.Tensor] | None) -> CacheRequest:
    """Admit ``prompt``, compute it, commit its last whole page before the last token with
    ``state`` as the snapshot there, release; returns the handle."""
    req = cache.open(prompt)
    assert cache.admit(req, prompt)
    for layer in range(SPEC.num_layers):
        assert req.wait_layer(layer, 10)
    full = (len(prompt) - 1) // PAGE
    assert read_device(cache, req.pages[: req.prefix_pages]).equal(
        page_kv(cache, prompt, 0, req.prefix_pages)
    )
    write_tokens(cache, prompt, req.pages[req.prefix_pages : full], req.prefix_pages)
    cache.commit(req, prompt[: full * PAGE], extras=kept(full * PAGE, state))
    cache.release(req)
    check_integrity(cache)
    return req


def test_a_match_resumes_only_where_a_snapshot_is(cache: HiCache) -> None:
    s = snapshot(1)
    first = run(cache, PROMPT, s)
    assert first.prefix_tokens == 0 and first.take_resume() is None
    again = cache.open(PROMPT)
    assert cache.admit(again, PROMPT)
    assert again.prefix_tokens == 6
    got = resume_state(again)
    assert got is not None and all(a.equal(b) for a, b in zip(got, s, strict=True))
    cache.release(again)
    # a prompt committed without a snapshot is no boundary: nothing to resume from
    other = [1, 2, 3, 4, 5]
    run(cache, other, None)
    third = cache.open(other)
    assert cache.admit(third, other)
    assert third.prefix_tokens == 0 and third.take_resume() is None
    cache.release(third)
    check_integrity(cache)


def test_a_demoted_boundary_brings_its_snapshot_back_from_l2(cache: HiCache) -> None:
    s = snapshot(2)
    run(cache, PROMPT, s)
    cache.sync(wait=True)
    cache.full.pages.evict_device(8)  # full KV and snapshot: L2 only now
    (node,) = [n for n in cache.full.pages.tree.iter_nodes() if n.parent is not None]
    assert node.device is None and node.host is not None
    req = cache.open(PROMPT)
    assert cache.admit(req, PROMPT)
    assert req.prefix_tokens == 6 and req.cached.host == 6
    for layer in range(SPEC.num_layers):
        assert req.wait_layer(layer, 10)
    got = resume_state(req)
    assert got is not None and all(a.equal(b) for a, b in zip(got, s, strict=True))
    cache.release(req)
    cache.sync(wait=True)
    check_integrity(cache)
    cache.reset()
    check_integrity(cache)
    snaps = cache.stores.of_type(SnapshotStore)
    assert snaps is not None and snaps.device_pool.allocator.used_pages == 0


def test_the_store_plans_marks_forward_ends_and_end_states() -> None:
    """Boundaries every 4 tokens and at the prompt's last page boundary (10 of 11 tokens):
    the first inside a forward is a mark, a second ends it; past the prompt, a forward
    ending on a page boundary keeps the state for the request's end."""
    cfg = CacheConfig(
        page_size=PAGE, device_tokens=32, hicache_ratio=2.0, max_mamba_cache_size=6,
        mamba_track_interval=4,
    )  # fmt: skip
    prompt = list(range(20, 31))  # 11 tokens
    with HiCache(cfg, CacheSpec(kv=SPEC, components=(STATE,))) as cache:
        req = cache.open(prompt)
        assert cache.admit(req, prompt)
        plan = cache.plan_chunk
        assert plan(req, 0, 11) == ChunkPlan(8, (4, 8))  # mark at 4, ends at 8
        assert plan(req, 0, 4) == ChunkPlan(4, (4,))
        assert plan(req, 8, 3) == ChunkPlan(3, (2,))  # the prompt's last boundary: 10
        assert plan(req, 11, 1) == ChunkPlan(1, (1,))  # 12: a page boundary past it
        assert plan(req, 12, 1) == ChunkPlan(1)
        blind = cache.open(prompt, cacheable=False)
        assert cache.admit(blind, prompt)
        assert plan(blind, 0, 11) == ChunkPlan(11)  # nothing kept for an uncacheable one
        cache.release(blind)

        s4, s8, s10, s12 = snapshot(4), snapshot(8), snapshot(10), snapshot(12)
        both = SequenceExtras((KeptState(4, tuple(s4)), KeptState(8, tuple(s8))))
        cache.commit(req, prompt[:8], extras=both)  # one forward: its mark and its end
        cache.commit(req, prompt[:11], extras=kept(10, s10))
        assert len(cache.full.pages.tree.component_ids("mamba", Tier.DEVICE)) == 3
        assert cache.grow(req, 12, computed=11)
        cache.commit(req, extras=kept(12, s12))  # a decode step: kept for the request's end
        cache.release(req, [*prompt, 99])  # its last commit takes it
        assert len(cache.full.pages.tree.component_ids("mamba", Tier.DEVICE)) == 4
        check_integrity(cache)

        for tokens, want in (([*prompt, 99, 5, 6], s12), (prompt, s10), (prompt[:9], s8)):
            again = cache.open(tokens)
            assert cache.admit(again, tokens)
            got = resume_state(again)
            assert got is not None and all(a.equal(b) for a, b in zip(got, want, strict=True))
            cache.release(again)

        other = list(range(60, 71))  # a commit that is not the last leaves the end state
        req = cache.open(other)
        assert cache.admit(req, other)
        assert cache.grow(req, 12, computed=0)
        cache.commit(req, extras=kept(12, snapshot(99)))
        cache.commit(req, [*other, 98])
        assert len(cache.full.pages.tree.component_ids("mamba", Tier.DEVICE)) == 4
        cache.release(req, None)
        check_integrity(cache)


def test_every_snapshot_of_one_commit_comes_back_from_l2() -> None:
    """One forward kept the state at a mark (4 tokens: the end of a shared system prompt)
    and at its end (8): one commit inserts both. After the span is demoted to L2, a prompt
    that shares only the first 4 tokens still resumes there: the backup copied the mark's
    snapshot to L2 too, not only the one at the run's end."""
    cfg = CacheConfig(
        page_size=PAGE, device_tokens=32, hicache_ratio=2.0, load_back_threshold=0,
        max_mamba_cache_size=6, mamba_track_interval=4,
    )  # fmt: skip
    prompt = list(range(20, 31))  # 11 tokens: boundaries at 4, 8 and 10
    with HiCache(cfg, CacheSpec(kv=SPEC, components=(STATE,))) as cache:
        req = cache.open(prompt)
        assert cache.admit(req, prompt)
        s4, s8 = snapshot(4), snapshot(8)
        write_tokens(cache, prompt, req.pages[:4], 0)
        both = SequenceExtras((KeptState(4, tuple(s4)), KeptState(8, tuple(s8))))
        cache.commit(req, prompt[:8], extras=both)
        cache.release(req)
        cache.sync(wait=True)
        snaps = cache.stores.of_type(SnapshotStore)
        assert snaps is not None
        assert len(cache.full.pages.tree.component_ids("mamba", Tier.HOST)) == 2  # both boundaries
        cache.full.pages.evict_device(16)  # full KV and snapshots: L2 only now
        assert not cache.full.pages.tree.component_ids("mamba", Tier.DEVICE)

        other = [*prompt[:4], 90, 91, 92, 93, 94]  # shares the first 4 tokens only
        again = cache.open(other)
        assert cache.admit(again, other)
        assert again.prefix_tokens == 4 and again.cached.host == 4
        for layer in range(SPEC.num_layers):
            assert again.wait_layer(layer, 10)
        got = resume_state(again)
        assert got is not None and all(a.equal(b) for a, b in zip(got, s4, strict=True))
        assert read_device(cache, again.pages[:2]).equal(page_kv(cache, other, 0, 2))
        cache.release(again)
        cache.sync(wait=True)
        check_integrity(cache)
