"""L3 under tensor parallelism, through the engine's real rank processes (gloo, CPU).

* MLA models (DeepSeek-V2, and V3.2 with its indexer component) at TP 2: greedy output
  equals transformers' cold, from L1, from L2 (the prompt's pages pushed out of a small L1
  by other prompts) and from a file L3 after ``flush_cache``; rank 0 alone writes the latent
  records, every rank reads them (equal rank digests), and a TP 1 server on the same L3
  hits all of them (latent KV does not depend on TP).
* MHA (Llama) at TP 2: each rank writes its own shard's records; a second TP 2 server
  reuses them; a TP 1 server on the same L3 misses cleanly (its namespace differs) and
  still answers exactly.
* MHA (Llama, 2 K/V heads) at TP 4, each K/V head replicated on two ranks: equal to
  transformers and TP 1 through every tier, every rank writing its records under its own
  namespace (replicas the same bytes, each its own copy) and reading them back.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hicache.config import CacheConfig
from hicache.engine.engine import Engine, EngineConfig
from hicache.engine.sampling import SamplingParams
from hicache.engine.scheduler import SchedulerConfig
from hicache.keys import Namespace, page_keys
from hicache.storage.record import HEADER_SIZE
from tests.helpers.engine_fixtures import engine_model, hf_greedy_ids
from tests.runner.models import deepseek_fixtures as v2
from tests.runner.models import deepseek_v32_fixtures as v32

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP 2 needs 2 CPU cores")

PAGE = 4
PROMPT_LEN = 33  # prompt[:-1] is matched: 8 whole pages
MATCHED = 32
NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def config(model_path: str, tp: int, l3: Path) -> EngineConfig:
    return EngineConfig(
        model_path=model_path,
        dtype="float32",
        device="cpu",
        # 16 L1 pages: two other prompts of 10 pages each push the first one out to L2
        cache=CacheConfig(
            page_size=PAGE,
            device_tokens=16 * PAGE,
            hicache_ratio=4.0,
            load_back_threshold=0,
            write_policy="write_through",
        ),
        scheduler=SchedulerConfig(max_running_requests=2, chunked_prefill_size=16),
        context_length=128,
        tp_size=tp,
        dist_init_timeout_s=120.0,
        storage_backend="file",
        storage_extra_config={"file_path": str(l3), "prefetch_threshold": 8},
        storage_prefetch_policy="wait_complete",
    )


def llama_prompt(n: int, seed: int) -> list[int]:
    vocab = int(engine_model("tiny-random-llama").hf_config.vocab_size)
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def llama_greedy(ids: list[int]) -> list[int]:
    return hf_greedy_ids("tiny-random-llama", ids, NEW)


MODELS: dict[
    str, tuple[Callable[[], str], Callable[[int], list[int]], Callable[[list[int]], list[int]]]
] = {
    "deepseek-v2": (
        lambda: str(v2.checkpoint("v2-lite")),
        lambda k: v2.prompt("v2-lite", PROMPT_LEN, offset=k * 40),
        lambda ids: v2.hf_greedy("v2-lite", ids, NEW),
    ),
    "deepseek-v32": (
        lambda: str(v32.checkpoint()),
        lambda k: v32.prompt(PROMPT_LEN, offset=k * 40),
        lambda ids: v32.hf_greedy(ids, NEW),
    ),
    "llama": (
        lambda: "tiny-random-llama",
        lambda k: llama_prompt(PROMPT_LEN, seed=k),
        llama_greedy,
    ),
}


def serve_through_every_tier(engine: Engine, model: str) -> None:
    """Cold, from L1, from L2 and from L3 (after ``flush_cache``), each equal to transformers."""
    _, prompt, want = MODELS[model]
    a, b, c = prompt(0), prompt(1), prompt(2)
    expect = want(a)
    cold = engine.generate(a, GREEDY, timeout=120)
    assert cold.error is None and cold.cached.total == 0 and cold.output_ids == expect
    from_l1 = engine.generate(a, GREEDY, timeout=120)
    assert from_l1.cached.device == MATCHED and from_l1.output_ids == expect
    for other in (b, c):  # push a's pages out of L1 (write-through: they are in L2)
        assert engine.generate(other, GREEDY, timeout=120).output_ids == want(other)
    from_l2 = engine.generate(a, GREEDY, timeout=120)
    assert from_l2.cached.host > 0 and from_l2.cached.total == MATCHED
    assert from_l2.output_ids == expect
    assert engine.flush_cache()  # every backup reaches L3 first, then L1 and L2 are emptied
    from_l3 = engine.generate(a, GREEDY, timeout=120)
    assert from_l3.cached.storage == MATCHED and from_l3.output_ids == expect
    digests = engine.rank_digests()
    assert len(digests) == engine.config.tp_size and len(set(digests)) == 1


def l3_files(root: Path) -> int:
    return sum(1 for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("model", ["deepseek-v2", "deepseek-v32"])
def test_mla_at_tp2_one_writer_and_tp1_reuses_the_records(model: str, tmp_path: Path) -> None:
    path, prompt, want = MODELS[model]
    with Engine(config(path(), 2, tmp_path)) as engine:
        serve_through_every_tier(engine, model)
    written = l3_files(tmp_path)
    assert written > 0
    a = prompt(0)
    with Engine(config(path(), 1, tmp_path)) as tp1:  # latent KV does not depend on TP
        again = tp1.generate(a, GREEDY, timeout=120)
        assert again.cached.storage == MATCHED and again.output_ids == want(a)
        assert tp1.flush_cache()
    assert l3_files(tmp_path) == written  # the TP 1 server found every record present


def test_mha_l3_is_per_rank_and_per_tp_size(tmp_path: Path) -> None:
    path, prompt, want = MODELS["llama"]
    with Engine(config(path(), 2, tmp_path)) as engine:
        serve_through_every_tier(engine, "llama")
    a = prompt(0)
    with Engine(config(path(), 2, tmp_path)) as second:  # same TP size: its records
        again = second.generate(a, GREEDY, timeout=120)
        assert again.cached.storage == MATCHED and again.output_ids == want(a)
    with Engine(config(path(), 1, tmp_path)) as tp1:  # another TP size: a clean miss
        miss = tp1.generate(a, GREEDY, timeout=120)
        assert miss.error is None and miss.cached.total == 0 and miss.output_ids == want(a)


def test_mha_replicated_kv_heads_at_tp4(tmp_path: Path) -> None:
    """Ranks 0 and 1 hold K/V head 0, ranks 2 and 3 head 1. One engine (4 ranks on a
    CPU of 2 cores: few tokens): cold, L1, L2 after eviction and L3 after a flush equal
    transformers, the rank digests are equal, and TP 1 answers the same. Each rank wrote
    the prompt's pages under its own namespace, replicas the same payload bytes."""
    path, prompt, want = MODELS["llama"]
    l3 = tmp_path / "l3"
    with Engine(config(path(), 4, l3)) as engine:
        model = engine.model.model
        assert model.tp.size == 4 and model.num_kv_heads == 1
        serve_through_every_tier(engine, "llama")
        cache, loaded = engine.cache, engine.model
        spaces = [
            Namespace.for_spec(
                cache.spec,
                model=loaded.name,
                weights_fingerprint=loaded.fingerprint,
                layout=cache.config.mem_layout,
                page_size=PAGE,
                tp_size=4,
                tp_rank=rank,
            )
            for rank in range(4)
        ]
    a = prompt(0)
    for page in range(MATCHED // PAGE):
        payloads = []
        for ns in spaces:
            key = page_keys(ns, a[:MATCHED])[page].key
            record = (l3 / key.rsplit("-", 1)[-1][:2] / key).read_bytes()
            payloads.append(record[HEADER_SIZE:])
        assert payloads[0] == payloads[1] and payloads[2] == payloads[3], page
        assert payloads[0] != payloads[2], page  # two different heads
    with Engine(config(path(), 1, tmp_path / "tp1"), loaded=engine_model(path())) as tp1:
        assert tp1.generate(a, GREEDY, timeout=120).output_ids == want(a)
