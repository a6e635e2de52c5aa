"""Scoring entries on every hybrid family: the next choice of a question reuses the
context through the entries, with transformers' logprobs.

A choice asks its prompt logprobs with one alternative (what the entries keep by default):
``echo``-style from position 1, or from the choice (``logprob_start_len``). Sliding-window
hybrids (Gemma 3, GPT-OSS) reuse the context's whole pages either way. Recurrent ones
(Qwen3-Next, Nemotron-H) resume only where a state snapshot was taken: from the choice,
the first choice takes one at ``logprob_start_len - 1`` (floored to a page) as before; an
``echo`` request names no such point, so its next choice resumes only at a track interval
(none within this short context: it recomputes, as documented). The tolerance is
``tests/engine/test_logprob_reuse.py``'s (1e-4 per token against transformers).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.request import RequestOutput
from hicache.engine.sampling import SamplingParams
from hicache.engine.step.scheduler import SchedulerConfig
from tests.helpers.tier_walk import assert_idle
from tests.runner.models.hybrid_fixtures import HYBRID, hf_twin, hybrid_model
from tests.runner.models.hybrid_fixtures import prompt as hybrid_prompt

PAGE = 4
TOL = 1e-4
RECURRENT = ("tiny-random-qwen3-next", "tiny-random-nemotron-h")


def engine(name: str) -> Engine:
    config = EngineConfig(
        model_path=name,
        dtype="float32",
        device="cpu",
        cache=CacheConfig(
            page_size=PAGE, device_tokens=256, hicache_ratio=4.0, max_mamba_cache_size=16
        ),
        scheduler=SchedulerConfig(max_running_requests=8, chunked_prefill_size=16),
        context_length=128,
    )
    return Engine(config, loaded=hybrid_model(name)).start()


def check(name: str, ids: list[int], out: RequestOutput, start: int) -> None:
    """Every scored position's logprob and top-1 against transformers'."""
    assert out.error is None and out.prompt_logprobs is not None
    with torch.no_grad():
        logits = hf_twin(name)(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    for p in range(max(1, start), len(ids)):
        g = out.prompt_logprobs[p]
        assert g is not None and g.token_id == ids[p], p
        assert abs(g.logprob - float(ref[p - 1, ids[p]])) <= TOL, p
        assert g.k == 1 and abs(g.top[0][1] - float(ref[p - 1].max())) <= TOL, p


@pytest.mark.parametrize("from_choice", [False, True], ids=["echo", "from-choice"])
@pytest.mark.parametrize("name", HYBRID)
def test_the_next_choice_reuses_the_context_through_the_entries(
    name: str, from_choice: bool
) -> None:
    ctx = hybrid_prompt(name, 30).tolist()
    choices = [hybrid_prompt(name, 3, offset=40 + 5 * i).tolist() for i in range(3)]
    start = len(ctx) if from_choice else 0
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, logprob_start_len=start)
    with engine(name) as e:
        outs = [e.generate(ctx + c, params, timeout=60) for c in choices]
        for c, out in zip(choices, outs, strict=True):
            check(name, ctx + c, out, start)
        reused = 28  # the context's whole pages (slot 27's entry names ctx[28])
        if name in RECURRENT and not from_choice:
            reused = 0  # no snapshot inside the context (module docstring)
        assert [o.cached.total for o in outs] == [0, reused, reused]
        assert_idle(e)


def test_deepseek_v32_keeps_its_indexer_keys_and_the_entries_apart() -> None:
    """DeepSeek-V3.2: the indexer's keys and the scoring entries are two stores on the
    full KV's page ids; an ``echo`` choice after the first reuses the context with
    transformers' logprobs."""
    from tests.runner.models.deepseek_v32_fixtures import hf_logits, v32_model
    from tests.runner.models.deepseek_v32_fixtures import prompt as v32_prompt

    ctx = v32_prompt(30)
    choices = [v32_prompt(3, offset=40 + 5 * i) for i in range(2)]
    config = EngineConfig(
        model_path=str(v32_model().path),
        dtype="float32",
        device="cpu",
        cache=CacheConfig(page_size=PAGE, device_tokens=256, hicache_ratio=4.0),
        scheduler=SchedulerConfig(max_running_requests=4, chunked_prefill_size=16),
        context_length=128,
    )
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    with Engine(config, loaded=v32_model()).start() as e:
        assert sorted(e.core.cache.stores.names) == ["indexer", "logprob"]
        outs = [e.generate(ctx + c, params, timeout=60) for c in choices]
        assert [o.cached.total for o in outs] == [0, 28]
        for c, out in zip(choices, outs, strict=True):
            ids = ctx + c
            ref = torch.log_softmax(hf_logits(ids).float(), dim=-1)
            assert out.prompt_logprobs is not None
            for p in range(1, len(ids)):
                g = out.prompt_logprobs[p]
                assert g is not None and abs(g.logprob - float(ref[p - 1, ids[p]])) <= TOL
        assert_idle(e)


def test_the_flag_is_validated() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs_top=-1"):
        EngineConfig(prompt_logprobs_top=-1)
    with pytest.raises(ValueError, match="prompt_logprobs_top=True"):
        EngineConfig(prompt_logprobs_top=True)
    assert EngineConfig().prompt_logprobs_top == 1


def test_a_cold_server_answers_a_scoring_request_from_l3(tmp_path: Path) -> None:
    """The entries go to L3 with the pages (whole records under the engine's per-head
    namespace); a second server over the same L3 serves the next choice's context from
    it, with the first server's values bit for bit."""
    from tests.helpers.api_fixtures import make_engine

    ctx = list(range(300, 337))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    storage = {"file_path": str(tmp_path), "prefetch_threshold": 4}
    with make_engine(storage_backend="file", storage_extra_config=storage) as e:
        first = e.generate([*ctx, 5, 6, 7], params, timeout=60)
        e.call(lambda: e.core.cache.sync(wait=True)).result(timeout=30)
        counters = e.core.cache.full.pages.counters
        assert (
            counters.l3_backup_logprob_pages_total == 9
        )  # every page but the last (no next prompt token)
        assert counters.l3_backup_logprob_pages_failed_total == 0
    with make_engine(storage_backend="file", storage_extra_config=storage) as cold:
        out = cold.generate([*ctx, 8, 9, 10], params, timeout=60)
        assert out.error is None and out.cached.storage == 36
        assert first.prompt_logprobs is not None and out.prompt_logprobs is not None
        assert out.prompt_logprobs[: 36 + 1] == first.prompt_logprobs[: 36 + 1]
        assert_idle(cold)
