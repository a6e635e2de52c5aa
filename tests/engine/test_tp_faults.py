"""One faulty rank under tensor parallelism, through the engine's real rank processes.

An engine at TP 2 (gloo, CPU) serves prompts with write-through to a ``memory`` L3 (each
rank process its own store), flushes L1 and L2, and attaches the same stores again with
rank 1's backend faulty (``fault_rank``): slow, its lookups failing, or its reads timing
out. For each prefetch policy the prompts are served again from L3: every answer equals
transformers', the ranks' digests stay equal (one agreed hit length: what rank 1 cannot
serve, no rank reads), and nothing hangs. On the tiny Llama and on Qwen3-Next, a hybrid
whose recurrent-state snapshots (sharded by heads) are L3 records beside its full KV: a
hit resumes only where every rank can read both.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.sampling import SamplingParams
from hicache.engine.step.scheduler import SchedulerConfig
from tests.helpers.engine_fixtures import engine_model, hf_greedy_ids

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP 2 needs 2 CPU cores")

PAGE = 4
PROMPT_LEN = 21  # prompt[:-1] is matched: 5 whole pages
MATCHED = 20
NEW = 4
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
POLICIES = ("best_effort", "wait_complete", "timeout")
FAULTS: dict[str, dict[str, Any]] = {
    "slow": {"delay_s": 0.15},
    "lookup_fail": {"fail_after": 0},
    "read_timeout": {"get_delay_s": 0.5, "timeout_s": 0.25},
}
MODELS = ("tiny-random-llama", "tiny-random-qwen3-next")


def config(name: str) -> EngineConfig:
    return EngineConfig(
        model_path=name,
        dtype="float32",
        device="cpu",
        cache=CacheConfig(
            page_size=PAGE,
            device_tokens=24 * PAGE,
            hicache_ratio=4.0,
            load_back_threshold=0,
            write_policy="write_through",
            max_mamba_cache_size=8,  # Qwen3-Next's snapshots (unused by the others)
        ),
        scheduler=SchedulerConfig(max_running_requests=2, chunked_prefill_size=16),
        context_length=64,
        tp_size=2,
        dist_init_timeout_s=120.0,
    )


def prompts(name: str) -> list[list[int]]:
    """Two prompts sharing their first 8 tokens."""
    ids = engine_model(name).tokenizer(
        "Hierarchical caches keep the key and value tensors of shared prefixes in GPU memory,"
        " host memory and remote storage, so that a long conversation does not pay twice"
        " for the prompt it has already sent, nor for the answers it has already read."
    )["input_ids"]
    batch = [ids[:PROMPT_LEN], ids[:8] + ids[PROMPT_LEN : 2 * PROMPT_LEN - 8]]
    assert all(len(p) == PROMPT_LEN for p in batch)
    return batch


@pytest.fixture(scope="module", params=MODELS)
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, Engine]]:
    with Engine(config(request.param)) as engine:
        yield request.param, engine


@pytest.mark.parametrize("policy", POLICIES)
def test_one_faulty_rank_neither_blocks_nor_splits_the_ranks(
    served: tuple[str, Engine], policy: str
) -> None:
    name, engine = served
    batch = prompts(name)
    want = [hf_greedy_ids(name, p, NEW) for p in batch]
    for fault, faults in FAULTS.items():
        store = {"store": f"{name}-{policy}-{fault}", "prefetch_threshold": 0}
        bound = {"prefetch_timeout_base": 5.0, "prefetch_timeout_max": 5.0}
        engine.attach_storage("memory", {**store, **bound}, policy)
        for p, w in zip(batch, want, strict=True):
            assert engine.generate(p, GREEDY, timeout=120).output_ids == w
        assert engine.flush_cache()  # every backup in L3, then L1 and L2 emptied
        assert engine.detach_storage()
        engine.attach_storage("memory", {**store, **bound, **faults, "fault_rank": 1}, policy)
        t0 = time.monotonic()
        outs = [engine.generate(p, GREEDY, timeout=120) for p in batch]
        elapsed = time.monotonic() - t0
        assert [o.output_ids for o in outs] == want, fault
        assert all(o.error is None for o in outs), fault
        storage = [o.cached.storage for o in outs]
        if fault != "slow":  # rank 1 cannot serve: no rank reads
            assert storage == [0, 0], (fault, storage)
        elif policy != "best_effort":  # the policy waits for the slow rank's reads
            # the second prompt's first 8 tokens are the first's, in L1 by then
            assert storage == [MATCHED, MATCHED - 8], (fault, storage)
            assert [o.cached.total for o in outs] == [MATCHED, MATCHED], fault
        assert elapsed < 60, (fault, elapsed)
        digests = engine.rank_digests()
        assert len(digests) == 2 and digests[0] == digests[1], fault
        assert engine.flush_cache()
        assert engine.detach_storage()
