"""Gemma 3 and GPT-OSS served at TP 2 through the engine's real rank processes (gloo, CPU),
each rank holding half the query and K/V heads (its pools: its K/V head, full and SWA),
and Gemma 3 at TP 4 (its 2 K/V heads replicated: ranks 0 and 1 hold head 0, 2 and 3 head 1).

One engine per family (module scope) with a small L1 and a file L3 walks one prompt
through every tier: greedy output equals transformers' cold, from L1, from L2 (its pages
pushed out of L1 by two other prompts, then loaded back) and from L3 (after
``flush_cache``), and the ranks' state digests stay equal. On every rank, the SHA-256 of
each page of the prompt, in every component (full and SWA) and tier, is the same after
each copy: the L1 bytes after L1 -> L2 -> L1, the L2 bytes after L2 -> L3 -> L2 (and L1
after the L3 hit); ranks holding different K/V heads hold different bytes, replicas the
same. A TP 1 server on the same L3 then hits every page (full and SWA head records).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import pytest

from hicache.config import CacheConfig, WritePolicy
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.sampling import SamplingParams
from hicache.engine.step.scheduler import SchedulerConfig
from hicache.heads import HeadSplit
from tests.engine.test_hybrid_serving import hf_greedy
from tests.runner.models.hybrid_fixtures import hybrid_model, prompt

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP 2 needs 2 CPU cores")

PAGE = 4
PROMPT_LEN = 33  # prompt[:-1] is matched: 8 whole pages
MATCHED = 32
NEW = 6
WINDOW_PAGES = 2
"""SWA pages a hit on 8 pages brings back: the window (6 tokens Gemma 3, 5 GPT-OSS) before
the boundary, two pages of 4."""
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)

Digests = list[dict[str, dict[int, str]]]
"""Per rank: ``"<component>/<tier>"`` -> page index -> SHA-256 (``Engine.rank_digests``)."""


@pytest.fixture(
    scope="module",
    params=[("tiny-random-gemma3", 2), ("tiny-random-gpt-oss", 2), ("tiny-random-gemma3", 4)],
    ids=lambda p: f"{p[0]}-tp{p[1]}",
)
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Engine, EngineConfig]]:
    name, size = request.param
    l3 = tmp_path_factory.mktemp("l3")
    config = EngineConfig(
        model_path=name,
        dtype="float32",
        device="cpu",
        # 16 L1 pages: two other prompts of 10 pages each push the first one out to L2
        cache=CacheConfig(
            page_size=PAGE,
            device_tokens=16 * PAGE,
            hicache_ratio=4.0,
            load_back_threshold=0,
            write_policy=WritePolicy.WRITE_THROUGH,
        ),
        scheduler=SchedulerConfig(max_running_requests=2, chunked_prefill_size=16),
        context_length=128,
        tp_size=size,
        dist_init_timeout_s=120.0,
        storage_backend="file",
        storage_extra_config={"file_path": str(l3), "prefetch_threshold": 8},
        storage_prefetch_policy="wait_complete",
        storage_tp_lcm=4,  # TP 1, 2 and 4 share the L3: one record per K/V head
    )
    with Engine(config) as engine:
        yield name, engine, config


def same_pages(before: Digests, after: Digests, component: str, tier: str, want: int) -> None:
    """On every rank, ``after``'s pages of ``component`` in ``tier`` equal ``before``'s
    (same page index, same bytes), at least ``want`` of them."""
    key = f"{component}/{tier}"
    for rank, (a, b) in enumerate(zip(before, after, strict=True)):
        common = sorted(set(a[key]) & set(b[key]))
        assert len(common) >= want, (rank, key, sorted(a[key]), sorted(b[key]))
        assert [a[key][i] for i in common] == [b[key][i] for i in common], (rank, key)


def test_walks_every_tier_with_the_same_bytes(served: tuple[str, Engine, EngineConfig]) -> None:
    name, engine, config = served
    a, b, c = (prompt(name, PROMPT_LEN, offset=k * 40).tolist() for k in range(3))
    want = hf_greedy(name, a, NEW)
    cold = engine.generate(a, GREEDY, timeout=120)
    assert cold.error is None and cold.cached.total == 0 and cold.output_ids == want
    first = engine.rank_digests(pages_of=a)  # write-through: in L1 and L2 (and L3)
    size = engine.config.tp_size
    assert len(first) == size
    kv = [HeadSplit(4, 2, size, r).first_kv_head for r in range(size)]  # 4 query, 2 K/V heads
    for key in ("full/device", "full/host", "swa/device", "swa/host"):
        for r in range(1, size):
            assert first[0][key] and first[r][key], key
            common = set(first[0][key]) & set(first[r][key])
            same = [first[0][key][i] == first[r][key][i] for i in common]
            assert same == [kv[r] == kv[0]] * len(common), (key, r)  # replicas alike
    assert len(first[0]["full/device"]) == MATCHED // PAGE

    from_l1 = engine.generate(a, GREEDY, timeout=120)
    assert from_l1.cached.device == MATCHED and from_l1.output_ids == want
    for other in (b, c):  # push a's pages out of L1 (write-through: they are in L2)
        assert engine.generate(other, GREEDY, timeout=120).output_ids == hf_greedy(name, other, NEW)
    from_l2 = engine.generate(a, GREEDY, timeout=120)
    assert from_l2.cached.host > 0 and from_l2.cached.total == MATCHED
    assert from_l2.output_ids == want
    loaded = engine.rank_digests(pages_of=a)  # D -> H -> D
    same_pages(first, loaded, "full", "device", MATCHED // PAGE)
    same_pages(first, loaded, "swa", "device", WINDOW_PAGES)
    same_pages(first, loaded, "full", "host", MATCHED // PAGE)

    assert engine.flush_cache()  # every backup reaches L3 first, then L1 and L2 are emptied
    assert all(not pages for rank in engine.rank_digests(pages_of=a) for pages in rank.values())
    from_l3 = engine.generate(a, GREEDY, timeout=120)
    assert from_l3.cached.storage == MATCHED and from_l3.output_ids == want
    fetched = engine.rank_digests(pages_of=a)  # H -> L3 -> H (-> D)
    same_pages(loaded, fetched, "full", "host", MATCHED // PAGE)
    same_pages(loaded, fetched, "swa", "host", WINDOW_PAGES)
    same_pages(first, fetched, "full", "device", MATCHED // PAGE)
    same_pages(first, fetched, "swa", "device", WINDOW_PAGES)
    digests = engine.rank_digests()
    assert len(digests) == size and len(set(digests)) == 1
    # one L3 across TP sizes: a TP 1 server gathers every head's full and SWA records
    one = dataclasses.replace(config, tp_size=1)
    with Engine(one, loaded=hybrid_model(name)) as tp1:
        hit = tp1.generate(a, GREEDY, timeout=120)
        assert hit.cached.storage == MATCHED and hit.output_ids == want
