"""L3 under tensor parallelism, through the engine's real rank processes (gloo, CPU).

* MLA models (DeepSeek-V2, and V3.2 with its indexer component) at TP 2: greedy output
  equals transformers' cold, from L1, from L2 (the prompt's pages pushed out of a small L1
  by other prompts) and from a file L3 after ``flush_cache``; rank 0 alone writes the latent
  records, every rank reads them (equal rank digests), and a TP 1 server on the same L3
  hits all of them (latent KV does not depend on TP).
* MHA (Llama, 2 K/V heads) with head records shared by TP 1, 2 and 4
  (``storage_tp_lcm=4``): a TP 2 server writes one record per page and K/V head; a TP 1
  and a TP 4 server hit every full page and answer exactly; a TP 1 server's records serve
  TP 2; TP 4 (each K/V head replicated on two ranks, the lower one its writer) writes each
  head's records once, and TP 1 reads them. By default (no ``storage_tp_lcm``) a rank's
  heads are one record.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.sampling import SamplingParams
from hicache.engine.step.scheduler import SchedulerConfig
from tests.helpers.engine_fixtures import engine_model, hf_greedy_ids
from tests.runner.models import deepseek_fixtures as v2
from tests.runner.models import deepseek_v32_fixtures as v32

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP 2 needs 2 CPU cores")

PAGE = 4
PROMPT_LEN = 33  # prompt[:-1] is matched: 8 whole pages
MATCHED = 32
NEW = 6
PAGES = (PROMPT_LEN + NEW - 1) // PAGE  # whole pages a request caches (its last token unfed)
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
        storage_tp_lcm=4,  # TP 1, 2 and 4 share the L3: one record per K/V head
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


def test_mha_head_records_serve_every_tp_size(tmp_path: Path) -> None:
    """TP 2 writes one record per page and K/V head (2 heads, one per rank); a TP 1 server
    (one rank gathers both heads) and a TP 4 server (each head on two ranks) hit every full
    page and answer exactly as transformers, writing nothing again."""
    path, prompt, want = MODELS["llama"]
    with Engine(config(path(), 2, tmp_path)) as engine:
        serve_through_every_tier(engine, "llama")
    written = l3_files(tmp_path)
    assert written == 2 * 3 * PAGES  # 3 requests' pages, one record per K/V head
    a = prompt(0)
    for size in (1, 4):
        with Engine(config(path(), size, tmp_path)) as other:
            hit = other.generate(a, GREEDY, timeout=120)
            assert hit.cached.storage == MATCHED and hit.output_ids == want(a), size
            assert other.flush_cache()
        assert l3_files(tmp_path) == written, size  # every record was present


def test_mha_tp1_records_serve_tp2(tmp_path: Path) -> None:
    """TP 1 writes the records; TP 2 (one head per rank) hits every full page and answers
    exactly (TP 4 reading TP 1's records: tests/storage/test_head_records.py)."""
    size = 2
    path, prompt, want = MODELS["llama"]
    a = prompt(0)
    with Engine(config(path(), 1, tmp_path)) as tp1:
        assert tp1.generate(a, GREEDY, timeout=120).output_ids == want(a)
        assert tp1.flush_cache()
    written = l3_files(tmp_path)
    assert written == 2 * PAGES
    with Engine(config(path(), size, tmp_path)) as engine:
        hit = engine.generate(a, GREEDY, timeout=120)
        assert hit.cached.storage == MATCHED and hit.output_ids == want(a)
        assert engine.flush_cache()
    assert l3_files(tmp_path) == written  # every record was present: none written again


def test_by_default_a_ranks_heads_are_one_record(tmp_path: Path) -> None:
    """Without ``storage_tp_lcm`` a TP 1 server stores a page as one record (both K/V
    heads: a page record's bytes and cost), in a namespace of its own group: a TP 2
    server at its default (a record per K/V head) is in another, so each misses the
    other's pages (tests/storage/test_head_records.py), and never reads them."""
    path, prompt, want = MODELS["llama"]
    a = prompt(0)
    with Engine(dataclasses.replace(config(path(), 1, tmp_path), storage_tp_lcm=None)) as tp1:
        l3 = tp1.core.cache.l3.attached
        assert l3 is not None and l3.keys.namespace.head_group == 2
        assert tp1.generate(a, GREEDY, timeout=120).output_ids == want(a)
        assert tp1.flush_cache()
        hit = tp1.generate(a, GREEDY, timeout=120)
        assert hit.cached.storage == MATCHED and hit.output_ids == want(a)
    assert l3_files(tmp_path) == PAGES
    per_head = dataclasses.replace(l3.keys.namespace, head_group=1)
    assert per_head.digest != l3.keys.namespace.digest


@pytest.mark.matrix
def test_mha_replicated_kv_heads_at_tp4(tmp_path: Path) -> None:
    """Ranks 0 and 1 hold K/V head 0, ranks 2 and 3 head 1. One engine (4 ranks on a
    CPU of 2 cores: few tokens): cold, L1, L2 after eviction and L3 after a flush equal
    transformers with equal rank digests; each head's records are written once (by ranks
    0 and 2), and a TP 1 server hits every full page of them."""
    path, prompt, want = MODELS["llama"]
    with Engine(config(path(), 4, tmp_path)) as engine:
        model = engine.model.model
        assert model.tp.size == 4 and model.num_kv_heads == 1
        serve_through_every_tier(engine, "llama")
    assert l3_files(tmp_path) == 2 * 3 * PAGES  # 3 requests' pages, one record per K/V head
    a = prompt(0)
    with Engine(config(path(), 1, tmp_path), loaded=engine_model(path())) as tp1:
        hit = tp1.generate(a, GREEDY, timeout=120)
        assert hit.cached.storage == MATCHED and hit.output_ids == want(a)
