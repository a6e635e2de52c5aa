"""The component-store contract: a store registered through the list is built from the
model's spec, shapes the tree's matches, plans forwards, takes the runner's extras and
hands the next request what it resumes from, with the facade and the scheduler unchanged.

The store here is tiny but real: a *tag* per boundary (one int64 in its own L1 slot pool,
like a state snapshot), taken every ``every`` tokens. A match may end only at a tagged
node (its tree component's validator).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from hicache.cache import CacheRequest, HiCache
from hicache.cache.components import STORE_TYPES, SnapshotStore, SwaStore
from hicache.cache.components.base import (
    ChunkPlan,
    ComponentStore,
    NominalSize,
    ServingLimits,
    StoreAdmission,
    StoreContext,
)
from hicache.cache.components.records import ComponentRecords
from hicache.cache.report import cache_stats, check_integrity
from hicache.config import CacheConfig
from hicache.engine.request import Request
from hicache.engine.sampling import SamplingParams
from hicache.extras import KeptState, SequenceExtras
from hicache.memory.allocator import PageAllocator
from hicache.metrics import ComponentUsage
from hicache.runner.model_runner import ForwardBatch
from hicache.spec import (
    CacheSpec,
    ComponentSpec,
    KVSpec,
    SlidingWindowSpec,
    SnapshotSpec,
    StateTensor,
)
from hicache.tree import TreeNode
from hicache.tree.components import (
    ComponentValues,
    Granularity,
    MatchValidator,
    Tier,
    TreeComponent,
)
from hicache.tree.node import page_ids
from tests.helpers.fake_runner import NextTokenRunner
from tests.helpers.fake_runner import make_scheduler as make
from tests.helpers.fake_runner import run_until_idle as run

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32")
PAGE = 2


@dataclass(frozen=True, kw_only=True)
class TagSpec(ComponentSpec):
    """A tag after every ``every`` tokens (a page multiple), in ``slots`` L1 slots."""

    name: ClassVar[str] = "tag"
    every: int
    slots: int = 4


class TagComponent(TreeComponent):
    """One tag per boundary; a match ends only where one is."""

    name: ClassVar[str] = "tag"
    granularity: ClassVar[Granularity] = Granularity.BOUNDARY

    def validator(self, *, device_only: bool) -> MatchValidator:
        return lambda node: self.present(node, device_only=device_only)

    def hit_span(self, depth_pages: int, page_size: int) -> int:
        return 0


class TagStore(ComponentStore):
    """L1 slots of tags (no L2: built over a cache without the hierarchical cache)."""

    spec_type = TagSpec
    label = "tag"
    resumes = True

    def __init__(self, spec: ComponentSpec, ctx: StoreContext) -> None:
        super().__init__(spec, ctx)
        assert isinstance(spec, TagSpec) and not ctx.hierarchical
        self.every = spec.every
        self.page_size = ctx.config.page_size
        self.alloc = PageAllocator(spec.slots)
        self.tags = torch.zeros(spec.slots, dtype=torch.int64)

    @classmethod
    def tree_component(cls, spec: ComponentSpec) -> TreeComponent:
        return TagComponent()

    @property
    def device_pool(self) -> PageAllocator:
        return self.alloc

    @property
    def host_pool(self) -> None:
        return None

    def allocator(self, tier: Tier) -> PageAllocator:
        if tier is not Tier.DEVICE:
            raise RuntimeError("tags live in L1 only")
        return self.alloc

    def plan(self, req: CacheRequest, start: int, tokens: int) -> ChunkPlan:
        nxt = (start // self.every + 1) * self.every
        if nxt < start + tokens:
            tokens = nxt - start
        return ChunkPlan(tokens, (tokens,) if (start + tokens) % self.every == 0 else ())

    def admit(self, req: CacheRequest, node: TreeNode, prefix_pages: int) -> StoreAdmission:
        req.set_part(self.name, [])
        if node.parent is None:
            req.set_resume(None)
        else:
            slot = int(self.tree.hit_ids(self.name, node)[0])
            tag = KeptState(prefix_pages * self.page_size, (self.tags[slot : slot + 1].clone(),))
            req.set_resume(SequenceExtras((tag,)))
        return StoreAdmission(ok=True)

    def keep(self, req: CacheRequest, extras: SequenceExtras) -> None:
        kept = req.part(self.name)
        assert isinstance(kept, list)
        kept.extend(extras.states)

    def values(self, req: CacheRequest, full: int, final: bool) -> ComponentValues | None:
        kept = req.part(self.name)
        assert isinstance(kept, list)
        slots: dict[int, int] = {}
        for state in [s for s in kept if s.tokens <= full * self.page_size]:
            kept.remove(state)
            pages = state.tokens // self.page_size
            if pages > req.prefix_pages:
                got = self.alloc.alloc(1)
                assert got is not None
                self.tags[got[0]] = state.tensors[0][0]
                slots[pages] = int(got[0])
        return ComponentValues.snapshots(slots) if slots else None

    def release(self, req: CacheRequest) -> None:
        req.set_part(self.name, None)
        req.set_resume(None)

    def back_up(self, last: TreeNode) -> list[TreeNode]:
        return []

    def records(self) -> ComponentRecords:
        raise ValueError("tags are not written to L3")

    def nominal(self) -> NominalSize:
        return NominalSize(0, 8 / self.every, "slots", f"one tag per {self.every} tokens")

    def usage(self, cached_tokens: int) -> ComponentUsage:
        return self._usage(8, cached_tokens)


def tagged(tokens: int, tag: int) -> SequenceExtras:
    return SequenceExtras((KeptState(tokens, (torch.tensor([tag]),)),))


CONFIG = CacheConfig(page_size=PAGE, device_tokens=32, enable_hierarchical_cache=False)


@pytest.fixture
def cache() -> Iterator[HiCache]:
    spec = CacheSpec(kv=SPEC, components=(TagSpec(every=4),))
    with HiCache(CONFIG, spec, store_types=(*STORE_TYPES, TagStore)) as c:
        yield c


def test_a_store_in_the_list_is_built_from_its_spec(cache: HiCache) -> None:
    store = cache.stores.of_type(TagStore)
    assert store is not None and cache.stores.names == ["tag"] and list(cache.stores) == [store]
    assert cache.stores.of_type(SwaStore) is None and cache.stores.of_type(SnapshotStore) is None
    assert isinstance(cache.full.pages.tree.component("tag"), TagComponent)
    assert cache.stores.resumes  # the store hands requests a state to resume from
    assert [u.name for u in cache_stats(cache).components] == ["full", "tag"]
    with pytest.raises(ValueError, match="no component store takes a TagSpec"):
        HiCache(CONFIG, CacheSpec(kv=SPEC, components=(TagSpec(every=4),)))


def test_the_tree_matches_only_where_the_store_tagged(cache: HiCache) -> None:
    prompt = list(range(1, 10))  # 9 tokens
    req = cache.open(prompt)
    assert cache.admit(req, prompt) and req.take_resume() is None
    assert cache.plan_chunk(req, 0, 9) == ChunkPlan(4, (4,))  # ends at the first tag
    assert cache.plan_chunk(req, 4, 3) == ChunkPlan(3, ())
    assert cache.grow(req, 4, computed=0)
    cache.commit(req, prompt[:4], extras=tagged(4, 111))
    assert cache.grow(req, 8, computed=4)
    cache.commit(req, prompt[:6])  # 3 pages: no tag after them
    cache.commit(req, extras=tagged(8, 222))  # a forward that commits nothing
    cache.release(req, prompt[:8])
    check_integrity(cache)
    store = cache.stores.of_type(TagStore)
    assert store is not None and store.alloc.used_pages == 2

    again = cache.open(prompt)
    assert cache.admit(again, prompt)
    got = again.take_resume()
    assert again.prefix_tokens == 8 and got is not None
    assert [(s.tokens, int(s.tensors[0][0])) for s in got.states] == [(8, 222)]
    cache.release(again)
    # 6 shared tokens: the untagged boundary after 3 pages is no match end; 4 is
    other = [*prompt[:6], 50, 51, 52]
    third = cache.open(other)
    assert cache.admit(third, other)
    got = third.take_resume()
    assert third.prefix_tokens == 4 and got is not None and int(got.states[0].tensors[0][0]) == 111
    cache.release(third)
    check_integrity(cache)
    assert {u.name: u.device_used for u in cache_stats(cache).components}["tag"] == 2
    cache.reset()
    assert store.alloc.used_pages == 0
    check_integrity(cache)


def test_the_ownership_check_covers_the_store(cache: HiCache) -> None:
    store = cache.stores.of_type(TagStore)
    assert store is not None
    leaked = store.alloc.alloc(1)
    assert leaked is not None
    with pytest.raises(AssertionError, match="L1 tag"):
        check_integrity(cache)
    store.free(Tier.DEVICE, page_ids(leaked))
    check_integrity(cache)


class TaggingRunner(NextTokenRunner):
    """A runner that keeps, at the cache's planned offsets, the position as a tag, and
    records what it was asked to resume from."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: dict[str, SequenceExtras] = {}
        self.resumed: list[tuple[str, int, int]] = []
        self.keeps: list[list[tuple[int, ...]]] = []

    def forward(self, batch: ForwardBatch, *, logit_rows: list[int] | None = None) -> torch.Tensor:
        assert batch.seq_ids is not None
        keep = list(batch.keep or [()] * batch.num_seqs)
        self.keeps.append(keep)
        for key, k, prefix in zip(batch.seq_ids, keep, batch.prefix_lens, strict=True):
            if k:
                states = tuple(KeptState(prefix + x, (torch.tensor([prefix + x]),)) for x in k)
                self.kept[key] = SequenceExtras(states)
        return super().forward(batch, logit_rows=logit_rows)

    def take_extras(self, seq_id: str) -> SequenceExtras | None:
        return self.kept.pop(seq_id, None)

    def resume(self, seq_id: str, extras: SequenceExtras) -> None:
        (state,) = extras.states
        self.resumed.append((seq_id, state.tokens, int(state.tensors[0][0])))


def test_the_scheduler_carries_a_new_stores_plan_and_extras_untouched(cache: HiCache) -> None:
    sched, _ = make(cache, chunked_prefill_size=64)
    runner = TaggingRunner()
    sched.runner = runner  # type: ignore[assignment]
    prompt = list(range(1, 12))  # 11 tokens: tags at 4 and 8
    sched.add(Request(prompt, SamplingParams(temperature=0.0, max_tokens=1)))
    run(sched)
    assert [sum(1 for k in keep if k) for keep in runner.keeps] == [1, 1, 0]
    assert runner.keeps[:2] == [[(4,)], [(4,)]]  # chunks end at each tag: 4, 8, then 3
    store = cache.stores.of_type(TagStore)
    assert store is not None and sorted(int(store.tags[s]) for s in store.owned(Tier.DEVICE)) == [
        4,
        8,
    ]
    follow = Request(prompt, SamplingParams(temperature=0.0, max_tokens=1))
    sched.add(follow)
    run(sched)
    assert runner.resumed == [(follow.rid, 8, 8)]  # the cache's record reached the runner
    check_integrity(cache)


def test_a_full_kv_cache_has_no_store_and_plans_whole_chunks() -> None:
    with HiCache(CONFIG, SPEC) as c:
        assert c.stores.names == [] and not c.stores.resumes and c.stores.runner_pools() == {}
        req = c.open([1, 2, 3, 4, 5])
        assert c.admit(req, [1, 2, 3, 4, 5])
        assert c.plan_chunk(req, 0, 5) == ChunkPlan(5)
        with pytest.raises(ValueError, match="at least 1"):
            c.plan_chunk(req, 0, 0)
        c.release(req)


def test_specs_plans_and_extras_refuse_bad_input() -> None:
    state = SnapshotSpec(num_layers=1, tensors=(StateTensor(name="s", shape=(1,)),))
    swa = SlidingWindowSpec(kv=SPEC, window=4)
    both = CacheSpec(kv=SPEC, components=(swa, state))
    assert both.component("mamba") is state and both.component("indexer") is None
    assert CacheSpec.of(SPEC) == CacheSpec(kv=SPEC)
    cfg = CacheConfig(page_size=PAGE, device_tokens=32, swa_full_tokens_ratio=0.5)
    assert both.device_token_bytes(cfg) == SPEC.token_bytes * 1.5
    with pytest.raises(ValueError, match="names must be unique"):
        CacheSpec(kv=SPEC, components=(state, state))
    with pytest.raises(ValueError, match="keep=\\(3,\\) must be distinct ascending"):
        ChunkPlan(2, (3,))
    with pytest.raises(ValueError, match="max_running"):
        ServingLimits(chunk_tokens=8, max_running=0)
    with pytest.raises(ValueError, match="distinct ascending positions"):
        SequenceExtras((KeptState(4, ()), KeptState(4, ())))
