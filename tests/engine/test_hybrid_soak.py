"""Soak: 512 prompts submitted at once to a tiny hybrid model whose every tier and
component is too small for them (CPU, fp32).

L1 and L2 hold a fraction of the prompts, the recurrent-state snapshot pools a few slots
and the sliding-window pools (Gemma 3) one page more than the engine accepts (one
request's window and prefill chunk), so full KV pages are demoted and evicted in L1,
evicted in L2, and snapshots and SWA pages are evicted in both tiers on their own
(counted at the tree, :func:`count_component_evictions`). Prompts mix shared prefixes
(8 "system prompts"), distinct prompts and exact duplicates.

Checked: every request finishes without error before a deadline (no hang, no OOM);
duplicates give identical tokens; a sample equals transformers' greedy; and afterwards
the engine is idle with every pin at 0, integrity clean, every pool's free count plus
what the tree owns equal to its size, and every pool wholly free after ``flush_cache``.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from hicache.cache.components import SnapshotStore, SwaStore
from hicache.cache.components.snapshots import SNAPSHOT
from hicache.cache.components.swa import SWA, request_pages
from hicache.cache.report import cache_stats
from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.request import RequestOutput
from hicache.engine.sampling import SamplingParams
from hicache.engine.step.scheduler import SchedulerConfig
from hicache.memory.allocator import PageAllocator
from hicache.tree.components import Tier
from tests.engine.test_hybrid_serving import hf_greedy
from tests.helpers.tier_walk import assert_idle
from tests.runner.models.hybrid_fixtures import hybrid_model

PAGE = 4
PROMPTS = 512
NEW_TOKENS = 3
DEADLINE_S = 180.0
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
L1_PAGES = 48
CHUNK = 64
WINDOW = 6
"""Tiny Gemma 3's sliding window (tokens)."""
SWA_L1_PAGES = request_pages(WINDOW, CHUNK, PAGE) + 1
"""L1 SWA pages: one more than the engine accepts (20 of 4 tokens; L2: twice that)."""
MODELS = ("tiny-random-qwen3-next", "tiny-random-gemma3")


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """512 prompts of 9..26 tokens: 8 shared 16-token prefixes + 3..10 distinct tokens
    (half of them), distinct 9..20-token prompts (a quarter), and repeats of earlier
    prompts (the rest), shuffled."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    systems = [ids(16) for _ in range(8)]
    shared = [rng.choice(systems) + ids(rng.randint(3, 10)) for _ in range(PROMPTS // 2)]
    distinct = [ids(rng.randint(9, 20)) for _ in range(PROMPTS // 4)]
    base = shared + distinct
    repeats = [list(rng.choice(base)) for _ in range(PROMPTS - len(base))]
    out = base + repeats
    rng.shuffle(out)
    return out


def make_engine(name: str) -> Engine:
    cache = CacheConfig(
        page_size=PAGE,
        device_tokens=L1_PAGES * PAGE,  # about 7 requests' worth; 16 may run at once
        hicache_ratio=2.0,
        load_back_threshold=0,
        max_mamba_cache_size=6,  # L1 snapshot slots (L2: 12)
        mamba_track_interval=4 * PAGE,  # a snapshot at the end of each shared prefix
        swa_full_tokens_ratio=(SWA_L1_PAGES + 0.5) / L1_PAGES,  # Gemma 3 only
    )
    config = EngineConfig(
        model_path=name,
        dtype="float32",
        device="cpu",
        cache=cache,
        scheduler=SchedulerConfig(max_running_requests=16, chunked_prefill_size=CHUNK),
        context_length=64,
    )
    return Engine(config, loaded=hybrid_model(name)).start()


@dataclass
class Evictions:
    """Snapshots (slots) and SWA pages evicted on their own (the node and its full KV
    stay), per tier, counted at the tree."""

    snapshot: Counter[Tier]
    swa: Counter[Tier]


def count_component_evictions(engine: Engine) -> Evictions:
    """Wrap the tree's ``evict_component`` to count evictions per component and tier (L1, L2)."""
    tree = engine.core.cache.full.pages.tree
    seen = Evictions(Counter(), Counter())
    inner = tree.evict_component

    def counting(name, node, tier):  # type: ignore[no-untyped-def]
        got = inner(name, node, tier)
        if name == SNAPSHOT:
            seen.snapshot[Tier(tier)] += len(got)
        elif name == SWA:
            seen.swa[Tier(tier)] += len(got)
        return got

    tree.evict_component = counting  # type: ignore[method-assign]
    return seen


def submit_all(engine: Engine, prompts: list[list[int]]) -> list[RequestOutput]:
    """Submit every prompt at once; their final outputs in prompt order (fails the test
    if any is missing at the deadline)."""
    finals: dict[int, RequestOutput] = {}
    lock = threading.Lock()
    done = threading.Event()

    def on(i: int) -> Callable[[RequestOutput], None]:
        def cb(out: RequestOutput) -> None:
            if out.finished:
                with lock:
                    finals[i] = out
                    if len(finals) == len(prompts):
                        done.set()

        return cb

    for i, p in enumerate(prompts):
        engine.submit(p, GREEDY, on(i))
    assert done.wait(DEADLINE_S), f"{len(prompts) - len(finals)} requests hang"
    return [finals[i] for i in range(len(prompts))]


def pools(engine: Engine) -> list[tuple[str, PageAllocator, list[int]]]:
    """(name, allocator, ids the tree owns) of every pool of the cache."""
    cache = engine.core.cache
    tree = cache.full.pages.tree
    out = [("L1 KV", cache.full.pages.device_pool.allocator, tree.device_page_ids())]
    if cache.full.pages.host_pool is not None:
        out.append(("L2 KV", cache.full.pages.host_pool.allocator, tree.host_page_ids()))
    sn = cache.stores.of_type(SnapshotStore)
    if sn is not None:
        out.append(("L1 snapshots", sn.device_pool.allocator, sn.owned(Tier.DEVICE)))
        if sn.host_pool is not None:
            out.append(("L2 snapshots", sn.host_pool.allocator, sn.owned(Tier.HOST)))
    swa = cache.stores.of_type(SwaStore)
    if swa is not None:
        out.append(("L1 SWA", swa.device_pool.allocator, swa.owned(Tier.DEVICE)))
        if swa.host_pool is not None:
            out.append(("L2 SWA", swa.host_pool.allocator, swa.owned(Tier.HOST)))
    return out


@pytest.mark.parametrize("name", MODELS)
def test_512_concurrent_prompts_evict_every_tier_and_leave_every_pool_idle(name: str) -> None:
    prompts = make_prompts(int(hybrid_model(name).hf_config.vocab_size))
    with make_engine(name) as engine:
        swa = engine.core.cache.stores.of_type(SwaStore)
        snaps = engine.core.cache.stores.of_type(SnapshotStore)
        if swa is not None:  # the pool sizes the test means
            assert swa.window == WINDOW
            assert swa.device_pool.num_pages == SWA_L1_PAGES
        evicted = count_component_evictions(engine)
        t0 = time.perf_counter()
        outs = submit_all(engine, prompts)
        elapsed = time.perf_counter() - t0
        assert [o.error for o in outs if o.error] == []
        assert all(len(o.output_ids) == NEW_TOKENS for o in outs)
        by_prompt: dict[tuple[int, ...], list[int]] = {}
        for p, o in zip(prompts, outs, strict=True):
            assert by_prompt.setdefault(tuple(p), o.output_ids) == o.output_ids
        assert len(by_prompt) < len(prompts)  # duplicates were there
        for p in prompts[:: len(prompts) // 6][:6]:  # a sample against transformers
            assert by_prompt[tuple(p)] == hf_greedy(name, p, NEW_TOKENS)

        c = engine.call(lambda: cache_stats(engine.core.cache)).result(timeout=30).counters
        assert c["device_demoted_tokens_total"] > 0  # L1 full KV: backed up, then dropped
        assert c["host_evicted_tokens_total"] > 0  # L2 full KV
        assert c["device_hit_tokens_total"] + c["host_hit_tokens_total"] > 0
        if snaps is not None:  # recurrent: snapshots in both tiers
            assert evicted.snapshot[Tier.DEVICE] > 0
            assert evicted.snapshot[Tier.HOST] > 0
        if swa is not None:  # sliding window: SWA pages in both tiers
            assert evicted.swa[Tier.DEVICE] > 0
            assert evicted.swa[Tier.HOST] > 0
        expected = (
            {"L1 KV", "L2 KV"}
            | ({"L1 snapshots", "L2 snapshots"} if snaps is not None else set())
            | ({"L1 SWA", "L2 SWA"} if swa is not None else set())
        )
        assert {n for n, _, _ in engine.call(lambda: pools(engine)).result(timeout=30)} == expected

        assert_idle(engine)  # idle, no request, no state, pins 0, integrity clean

        def owned_plus_free() -> list[tuple[str, int, int, int]]:
            return [(n, a.free_pages, len(ids), a.num_pages) for n, a, ids in pools(engine)]

        for pool, free, owned, total in engine.call(owned_plus_free).result(timeout=30):
            assert free + owned == total, pool
        assert engine.flush_cache()
        for pool, free, owned, total in engine.call(owned_plus_free).result(timeout=30):
            assert (free, owned) == (total, 0), pool
    assert elapsed < DEADLINE_S
