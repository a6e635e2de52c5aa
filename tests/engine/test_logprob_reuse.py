"""Prompt-logprob requests reuse the cache (issue 27, part 6).

A log-likelihood evaluation (lm-eval's multiple-choice tasks) sends one context once per
choice, asking the prompt logprobs of the choice only (``logprob_start_len`` =
``len(context)``). Such a request is matched against the cache, its match capped at
``logprob_start_len - 1`` tokens (floored to a page) so that the logits before every scored
position are computed, and its pages are cached for the next choice.

* The four choices of one context, each scored on an engine with the cache and on one
  without (``disable_radix_cache``, the cold run): the second to fourth hit the cache
  (their context's whole pages up to the cap), and every chosen-token logprob, top-5 and
  log-likelihood equals the cold run's and transformers' (the oracle).
* The cap for every kind of ``logprob_start_len`` (0, 1, unaligned, aligned, the prompt's
  length): the cached tokens are exactly the page floor of ``start - 1``; positions
  before ``start`` stay None, every one from it equals transformers'.
* Every hybrid family matches the next choice up to the cap (a recurrent one resumes
  from the state snapshot the first choice took there), with transformers' values.
* Bad ``logprob_start_len`` values are refused naming the field.

Tolerance (:data:`TOL`): the cold and the cached run do the same arithmetic on the same
inputs except where a forward's shape changes the order of the sums (a choice's rows are
computed in a forward of their own instead of one that began with the context's last
chunk, and attention sums over the cached K/V in other blocks). A logprob is ``z_i -
logsumexp(z)``, so it moves by at most twice the logits' difference; both runs are within
test_sampling_features' bound of transformers (``TOL`` = 1e-4: twice the logits' order
bound, measured at most 2e-5 there), so each side is held to it against the oracle and to
it against the other (measured: at most 2e-6 apart, 1 ulp of values near 16). A
log-likelihood sums ``k`` of them: ``k * TOL``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import cache

import pytest
import torch

from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.logits import TokenLogprob
from hicache.engine.request import RequestOutput
from hicache.engine.sampling import InvalidRequest, SamplingParams
from hicache.engine.step.scheduler import SchedulerConfig
from tests.helpers.engine_fixtures import engine_model, hf_logits
from tests.helpers.tier_walk import assert_idle
from tests.runner.models.hybrid_fixtures import HYBRID, hf_twin, hybrid_model
from tests.runner.models.hybrid_fixtures import prompt as hybrid_prompt

MODEL = "tiny-random-llama"
PAGE = 4
CONTEXT = 301
"""Context tokens: its cap (300) is a page boundary, 75 whole pages reused per choice."""
TOP = 5
TOL = 1e-4
"""See the module docstring."""


@cache
def context_ids(n: int = CONTEXT) -> tuple[int, ...]:
    """``n`` real token ids of an English multiple-choice context."""
    text = " ".join(
        f"Question {i}: which tier keeps page {i * 7} of the shared prefix, the device,"
        " the host or the store?"
        for i in range(40)
    )
    ids = engine_model(MODEL).tokenizer(text)["input_ids"][:n]
    assert len(ids) == n
    return tuple(ids)


CHOICES = ([11, 12, 13], [2020, 2121, 2222, 2323, 2424], [305, 306], [40, 41, 42, 43, 44, 45, 46])


def make_engine(*, cold: bool, page_size: int = PAGE) -> Engine:
    config = EngineConfig(
        model_path=MODEL,
        dtype="float32",
        device="cpu",
        cache=CacheConfig(page_size=page_size, device_tokens=2048, hicache_ratio=2.0),
        scheduler=SchedulerConfig(
            max_running_requests=8, chunked_prefill_size=64, disable_radix_cache=cold
        ),
        context_length=512,
    )
    return Engine(config, loaded=engine_model(MODEL)).start()


@pytest.fixture(scope="module")
def warm() -> Iterator[Engine]:
    with make_engine(cold=False) as e:
        yield e


@pytest.fixture(scope="module")
def cold() -> Iterator[Engine]:
    with make_engine(cold=True) as e:
        yield e


def scoring(start: int, k: int = TOP) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k, logprob_start_len=start)


def scored(out: RequestOutput, start: int) -> list[TokenLogprob]:
    """The prompt logprobs from ``start`` on; those before it must be None."""
    plp = out.prompt_logprobs
    assert out.error is None and plp is not None
    assert all(g is None for g in plp[:start]), "a position before start was scored"
    got = plp[max(start, 1) :]
    assert all(g is not None for g in got), "a position from start on was not scored"
    return [g for g in got if g is not None]


def assert_close(got: TokenLogprob, want: TokenLogprob) -> None:
    assert got.token_id == want.token_id
    assert got.logprob == pytest.approx(want.logprob, abs=TOL)
    assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=TOL)
    ids = [t for t, _ in got.top]
    if ids != [t for t, _ in want.top]:  # only a tie within TOL may swap two ids
        for (a, va), (b, vb) in zip(got.top, want.top, strict=True):
            assert a == b or abs(va - vb) <= TOL


def assert_oracle(got: TokenLogprob, ref: torch.Tensor) -> None:
    """``got`` against ``ref (vocab,)``: transformers' log_softmax before its position."""
    assert got.logprob == pytest.approx(float(ref[got.token_id]), abs=TOL)
    values = ref.topk(len(got.top)).values.tolist()
    assert [v for _, v in got.top] == pytest.approx(values, abs=TOL)
    for tid, v in got.top:
        assert float(ref[tid]) == pytest.approx(v, abs=TOL)


def test_multiple_choice_loglikelihoods_equal_a_cold_run_and_transformers(
    warm: Engine, cold: Engine
) -> None:
    ctx = list(context_ids())
    start = len(ctx)
    cap = (start - 1) // PAGE * PAGE
    assert warm.flush_cache()
    hot = [warm.generate(ctx + c, scoring(start), timeout=60) for c in CHOICES]
    base = [cold.generate(ctx + c, scoring(start), timeout=60) for c in CHOICES]
    assert [o.cached.total for o in base] == [0, 0, 0, 0]
    assert [o.cached.total for o in hot] == [0, cap, cap, cap]
    for choice, h, b in zip(CHOICES, hot, base, strict=True):
        ids = ctx + choice
        ref = torch.log_softmax(hf_logits(MODEL, torch.tensor(ids)), dim=-1)
        got, want = scored(h, start), scored(b, start)
        assert [g.token_id for g in got] == choice == [g.token_id for g in want]
        for p, (g, w) in enumerate(zip(got, want, strict=True), start=start):
            assert_close(g, w)
            assert_oracle(g, ref[p - 1])
            assert_oracle(w, ref[p - 1])
        ll = math.fsum(g.logprob for g in got)
        assert ll == pytest.approx(math.fsum(w.logprob for w in want), abs=len(choice) * TOL)
        oracle = math.fsum(float(ref[p - 1, ids[p]]) for p in range(start, len(ids)))
        assert ll == pytest.approx(oracle, abs=len(choice) * TOL)
        assert h.output_ids == b.output_ids
    # the choices' pages were cached too: the whole of the last one is a hit now
    plain = SamplingParams(temperature=0, max_tokens=1)
    last = ctx + CHOICES[-1]
    assert warm.generate(last, plain, timeout=60).cached.total == (len(last) - 1) // PAGE * PAGE
    assert_idle(warm)


@pytest.mark.parametrize("start", [0, 1, 2, 5, 8, 9, 30, 44, 45])
def test_the_match_is_capped_below_the_first_scored_position(warm: Engine, start: int) -> None:
    """The prompt (45 tokens) is cached whole first; a request scoring from ``start``
    reuses exactly the page floor of ``start - 1`` tokens and scores every position from
    ``start`` (45: none; the prompt's own cap, 44, bounds the match)."""
    ids = list(context_ids(45))
    assert warm.flush_cache()
    warm.generate(ids, SamplingParams(temperature=0, max_tokens=1), timeout=60)
    out = warm.generate(ids, scoring(start), timeout=60)
    assert out.cached.total == min(max(0, start - 1), len(ids) - 1) // PAGE * PAGE
    ref = torch.log_softmax(hf_logits(MODEL, torch.tensor(ids)), dim=-1)
    got = scored(out, start)
    assert [g.token_id for g in got] == ids[max(start, 1) :]
    for p, g in enumerate(got, start=max(start, 1)):
        assert_oracle(g, ref[p - 1])


def test_a_page_of_64_floors_the_match() -> None:
    """Page 64 (the default): a context of 301 tokens reuses 256 (four whole pages), and
    the 44 positions between the page floor and the first scored one are computed but
    not reported."""
    ctx = list(context_ids())
    with make_engine(cold=False, page_size=64) as engine:
        outs = [engine.generate(ctx + c, scoring(len(ctx)), timeout=60) for c in CHOICES[:2]]
        assert [o.cached.total for o in outs] == [0, 256]
        ref = torch.log_softmax(hf_logits(MODEL, torch.tensor(ctx + CHOICES[1])), dim=-1)
        for p, g in enumerate(scored(outs[1], len(ctx)), start=len(ctx)):
            assert_oracle(g, ref[p - 1])
        assert_idle(engine)


@pytest.mark.parametrize("name", HYBRID)
def test_hybrids_resume_the_next_choice_at_the_cap(name: str) -> None:
    """Recurrent hybrids (Qwen3-Next, Nemotron-H: their layers carry state): the first
    choice's prefill takes a snapshot at its cap (no track interval falls there), so the
    next choice resumes at the cap, the state coming from the cache. Sliding-window
    hybrids (Gemma 3, GPT-OSS) match up to the cap too (the window before it is still
    held). Every scored token equals transformers'."""
    ctx = hybrid_prompt(name, 30).tolist()
    choices = [hybrid_prompt(name, 3, offset=40 + 5 * i).tolist() for i in range(3)]
    start = len(ctx)
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
    with Engine(config, loaded=hybrid_model(name)).start() as engine:
        assert engine.core.scheduler.resumable_prefix
        outs = [engine.generate(ctx + c, scoring(start), timeout=60) for c in choices]
        assert [o.cached.total for o in outs] == [0] + [(start - 1) // PAGE * PAGE] * 2
        for c, out in zip(choices, outs, strict=True):
            ids = ctx + c
            with torch.no_grad():
                logits = hf_twin(name)(torch.tensor([ids])).logits[0].float()
            ref = torch.log_softmax(logits, dim=-1)
            got = scored(out, start)
            assert [g.token_id for g in got] == c
            for p, g in enumerate(got, start=start):
                assert_oracle(g, ref[p - 1])
        assert_idle(engine)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"prompt_logprobs": 1, "logprob_start_len": -1}, "an int >= 0"),
        ({"prompt_logprobs": 1, "logprob_start_len": True}, "an int >= 0"),
        ({"prompt_logprobs": 1, "logprob_start_len": 2.0}, "an int >= 0"),
        ({"logprob_start_len": 3}, "prompt_logprobs, which are not asked"),
    ],
)
def test_bad_logprob_start_len_is_refused(fields: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidRequest, match=match) as err:
        SamplingParams(**fields)  # type: ignore[arg-type]
    assert err.value.param == "logprob_start_len"
    assert "logprob_start_len=" in str(err.value)


def test_a_start_past_the_prompt_is_refused(warm: Engine) -> None:
    with pytest.raises(InvalidRequest, match=r"0 to 3 \(the prompt has 3 tokens\)") as err:
        warm.submit([5, 6, 7], scoring(4))
    assert err.value.param == "logprob_start_len"
    out = warm.generate([5, 6, 7], scoring(3), timeout=60)  # its length: nothing scored
    assert out.prompt_logprobs == [None, None, None]


def test_max_prefix_is_checked_by_the_cache(warm: Engine) -> None:
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="max_prefix="):
            warm.core.cache.open([1, 2, 3], max_prefix=bad)  # type: ignore[arg-type]
