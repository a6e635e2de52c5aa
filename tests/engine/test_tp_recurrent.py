"""The recurrent hybrids (Qwen3-Next, Nemotron-H) served at tp_size 2 through the engine's
real rank processes (gloo, CPU), with a file L3; also their one-group twins (one DeltaNet
key head / Mamba2 group, replicated on both ranks, each rank half its heads).

Each rank holds its shard of the model and of every pool: its K/V heads, and its heads'
recurrent state snapshots (``"mamba"``). One prompt walks the tiers: cold, from L1, from L2
(its pages pushed out of a small L1 by two other prompts; the snapshot at its last page
boundary comes back with them) and from L3 after ``flush_cache`` (each rank reads the
records it wrote under its own namespace). Every time the greedy output equals
transformers', the ranks' scheduling digests are equal, and each rank's SHA-256 of the
bytes its L1 holds for the prefix (full KV pages and the snapshot at its end;
:func:`~hicache.engine.step.rank_digest.page_digests`) is the same after L2 and after
L3 as after the cold prefill: D->H->D and D->H->L3->H->D copy every shard exactly. The
ranks' bytes differ (each its own shard). A TP 1 server on the same L3 misses cleanly
(its namespace differs: a rank's snapshot shard is no whole state) and still answers
exactly.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hicache.config import CacheConfig, WritePolicy
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.sampling import SamplingParams
from hicache.engine.step.scheduler import SchedulerConfig
from hicache.runner.checkpoints import TINY_REPLICATED_MODELS
from tests.engine.test_hybrid_serving import hf_greedy
from tests.runner.models.hybrid_fixtures import prompt

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP 2 needs 2 CPU cores")

PAGE = 4
PROMPT_LEN = 33  # prompt[:-1] is matched: 8 whole pages, the snapshot at its end
MATCHED = 32
NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def config(name: str, l3: Path, tp: int = 2) -> EngineConfig:
    return EngineConfig(
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
            max_mamba_cache_size=8,
        ),
        scheduler=SchedulerConfig(max_running_requests=2, chunked_prefill_size=16),
        context_length=128,
        tp_size=tp,
        dist_init_timeout_s=120.0,
        storage_backend="file",
        storage_extra_config={"file_path": str(l3), "prefetch_threshold": 8},
        storage_prefetch_policy="wait_complete",
    )


def l1_bytes(engine: Engine, ids: list[int]) -> list[tuple[list[str], str]]:
    """Per rank: the SHA-256 of each full-KV page its L1 holds of ``ids`` (whole pages),
    and of the L1 snapshot taken where they end."""
    last = len(ids) // PAGE - 1
    got = []
    for rank in engine.rank_digests(pages_of=ids):
        full = rank["full/device"]
        assert sorted(full) == list(range(last + 1)), sorted(full)
        got.append(([full[i] for i in range(last + 1)], rank["mamba/device"][last]))
    return got


@pytest.mark.parametrize(
    "name", ["tiny-random-qwen3-next", "tiny-random-nemotron-h", *TINY_REPLICATED_MODELS]
)
def test_tp2_walks_every_tier_with_exact_bytes_on_every_rank(name: str, tmp_path: Path) -> None:
    a, b, c = (prompt(name, PROMPT_LEN, offset=k * 40).tolist() for k in range(3))
    expect = hf_greedy(name, a, NEW)
    with Engine(config(name, tmp_path)) as engine:
        cold = engine.generate(a, GREEDY, timeout=120)
        assert cold.error is None and cold.cached.total == 0 and cold.output_ids == expect
        held = l1_bytes(engine, a[:MATCHED])
        assert len(held) == 2 and held[0][0][0] != held[1][0][0]  # each rank its own shard
        assert held[0][1] != held[1][1]
        from_l1 = engine.generate(a, GREEDY, timeout=120)
        assert from_l1.cached.device == MATCHED and from_l1.output_ids == expect
        for other in (b, c):  # push a's pages out of L1 (write-through: they are in L2)
            assert engine.generate(other, GREEDY, timeout=120).output_ids == hf_greedy(
                name, other, NEW
            )
        from_l2 = engine.generate(a, GREEDY, timeout=120)
        assert from_l2.cached.host > 0 and from_l2.cached.total == MATCHED
        assert from_l2.output_ids == expect
        assert l1_bytes(engine, a[:MATCHED]) == held  # D -> H -> D
        assert engine.flush_cache()  # every backup reaches L3 first, then L1 and L2 emptied
        from_l3 = engine.generate(a, GREEDY, timeout=120)
        assert from_l3.cached.storage == MATCHED and from_l3.output_ids == expect
        assert l1_bytes(engine, a[:MATCHED]) == held  # H -> L3 -> H, to D
        digests = engine.rank_digests()
        assert len(digests) == 2 and len(set(digests)) == 1
    files = {p.parent for p in tmp_path.rglob("*") if p.is_file()}
    assert len(files) >= 2  # each rank its own namespace
    with Engine(config(name, tmp_path, tp=1)) as tp1:  # the shards are no TP 1 state
        miss = tp1.generate(a, GREEDY, timeout=120)
        assert miss.error is None and miss.cached.total == 0 and miss.output_ids == expect
