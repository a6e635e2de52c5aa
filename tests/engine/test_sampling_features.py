"""Log probabilities, penalties, logit_bias, min_tokens, ignore_eos and stop_token_ids.

Unit tests drive :mod:`hicache.engine.logits` with crafted logits and check every value;
engine tests run the tiny random Llama and compare log probabilities with transformers'
log_softmax of its logits for the same tokens (transformers is the oracle).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from hicache.cache import HiCache
from hicache.cache.report import check_integrity
from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.logits import TokenLogprob, adjust_logits, token_logprobs
from hicache.engine.request import FinishReason, Request, RequestOutput
from hicache.engine.sampling import InvalidRequest, SamplingParams, sample_rows
from hicache.engine.step.output import OutputProcessor
from hicache.engine.step.scheduler import Scheduler, SchedulerConfig
from hicache.spec import KVSpec
from tests.helpers.engine_fixtures import engine_model, hf_logits, prompt_ids
from tests.helpers.fake_runner import MISS, VOCAB, NextTokenRunner, SpaceTokenizer, client, step

V = 8
TOL = 1e-4
"""Log-probabilities against transformers' log_softmax: ``z_i - logsumexp(z)`` moves by at
most twice the logits' error, itself within test_engine_model's order bound (1.3e-4) and
measured at most 1e-5 on every x86 dispatch (so these at most 2e-5)."""
MODEL = "tiny-random-llama"


def forced(params: SamplingParams, **fields: object) -> SamplingParams:
    """``params`` with fields set past validation (what a buggy caller could hand over)."""
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", True),
        ("logprobs", 1.0),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", -1),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("presence_penalty", float("nan")),
        ("frequency_penalty", "1"),
        ("frequency_penalty", float("inf")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("inf")),
        ("logit_bias", {1: 101.0}),
        ("logit_bias", {1: float("nan")}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"x": 1.0}),
        ("logit_bias", {True: 1.0}),
        ("logit_bias", [(1, 1.0)]),
        ("min_tokens", -1),
        ("min_tokens", 129),  # > max_tokens (128)
        ("min_tokens", 1.0),
        ("ignore_eos", 1),
        ("stop_token_ids", "12"),
        ("stop_token_ids", [1, -2]),
        ("stop_token_ids", [1, True]),
        ("stop_token_ids", 5),
    ],
)
def test_bad_values_name_their_field(field: str, value: object) -> None:
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**{field: value})  # type: ignore[arg-type,unused-ignore]
    assert err.value.param == field
    assert field in str(err.value)


def test_good_values_are_normalized() -> None:
    p = SamplingParams(
        logprobs=0,
        prompt_logprobs=20,
        presence_penalty=-2,
        frequency_penalty=2.0,
        repetition_penalty=1.3,
        logit_bias={"7": 5, 3: -100.0},  # type: ignore[dict-item,unused-ignore]
        min_tokens=128,
        ignore_eos=True,
        stop_token_ids=[4, 9],
    )
    assert dict(p.logit_bias) == {7: 5.0, 3: -100.0}
    assert p.stop_token_ids == (4, 9)
    assert p.adjusts_logits
    with pytest.raises(TypeError):
        p.logit_bias[1] = 2.0  # type: ignore[index,unused-ignore]
    assert not SamplingParams().adjusts_logits
    json_keys: dict[Any, float] = {"7": 5}
    assert SamplingParams(logit_bias=json_keys) == SamplingParams(logit_bias={7: 5.0})
    hash(p)  # still hashable (logit_bias is left out of the hash)


def test_check_vocab_names_the_field() -> None:
    SamplingParams(logit_bias={7: 1.0}, stop_token_ids=(7,)).check_vocab(8)
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(logit_bias={8: 1.0}).check_vocab(8)
    assert err.value.param == "logit_bias" and "[0, 8)" in str(err.value)
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(stop_token_ids=(1, 99)).check_vocab(8)
    assert err.value.param == "stop_token_ids" and "99" in str(err.value)


# ---------------------------------------------------------------- logit processing


def row(*values: float) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


BASE = (2.0, -1.0, 0.5, -3.0, 4.0, 0.0, 1.0, -0.5)


def adjust(
    params: SamplingParams, prompt: list[int], output: list[int], eos: tuple[int, ...] = (7,)
) -> list[float]:
    result = adjust_logits(row(*BASE), [params], [prompt], [output], eos)
    assert not result.errors
    return [float(x) for x in result.logits[0]]


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    got = adjust(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[3, 5, 0])
    want = list(BASE)
    want[0] = 2.0 / 2  # positive: divided (seen twice, applied once)
    want[1] = -1.0 * 2  # negative: multiplied
    want[3] = -3.0 * 2
    want[5] = 0.0  # zero stays zero
    assert got == want
    # below 1 it favours the seen tokens
    got = adjust(SamplingParams(repetition_penalty=0.5), prompt=[0], output=[1])
    assert got[:2] == [4.0, -0.5] and got[2:] == list(BASE[2:])


def test_frequency_and_presence_penalties_count_only_the_output() -> None:
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.5)
    got = adjust(params, prompt=[2, 2, 6], output=[4, 4, 4, 1])
    want = list(BASE)
    want[4] = 4.0 - 3 * 0.5 - 1.5
    want[1] = -1.0 - 0.5 - 1.5
    assert got == pytest.approx(want, abs=1e-6)
    assert got[2] == 0.5 and got[6] == 1.0  # prompt tokens untouched
    # negative values reward repetition
    got = adjust(SamplingParams(presence_penalty=-2.0), prompt=[], output=[3])
    assert got[3] == -1.0


def test_logit_bias_adds_and_forces_a_greedy_token() -> None:
    params = SamplingParams(temperature=0, logit_bias={3: 100.0, 4: -100.0})
    got = adjust(params, prompt=[1], output=[])
    want = list(BASE)
    want[3] += 100.0
    want[4] -= 100.0
    assert got == want
    adjusted = adjust_logits(row(*BASE), [params], [[1]], [[]], ())
    assert sample_rows(adjusted.logits, [params], [None]).tokens.tolist() == [3]
    # a sampled row draws it too: the rest has negligible mass
    sampled = SamplingParams(temperature=1.0, seed=0, logit_bias={3: 100.0})
    adjusted = adjust_logits(row(*BASE), [sampled], [[1]], [[]], ())
    gen = torch.Generator().manual_seed(0)
    assert sample_rows(adjusted.logits, [sampled], [gen]).tokens.tolist() == [3]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    params = SamplingParams(min_tokens=2, stop_token_ids=(4,))
    inf = float("-inf")
    got = adjust(params, prompt=[0], output=[5], eos=(7, 6))
    assert got == [2.0, -1.0, 0.5, -3.0, inf, 0.0, inf, inf]
    assert adjust(params, prompt=[0], output=[5, 5], eos=(7, 6)) == list(BASE)
    # ignore_eos: EOS is not a stop, so it is not masked
    ignoring = SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=(4,))
    assert adjust(ignoring, prompt=[0], output=[], eos=(7,)) == [*BASE[:4], inf, *BASE[5:]]


def test_order_penalties_then_bias_then_mask() -> None:
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, logit_bias={4: 1.0})
    got = adjust(params, prompt=[4], output=[4])
    assert got[4] == 4.0 / 2 - 1.0 + 1.0


def test_adjust_leaves_its_input_and_plain_rows_alone() -> None:
    logits = torch.stack([torch.tensor(BASE), torch.tensor(BASE)])
    before = logits.clone()
    plain = adjust_logits(logits, [SamplingParams(), SamplingParams()], [[], []], [[], []], (7,))
    assert plain.logits is logits and not plain.errors
    mixed = adjust_logits(
        logits, [SamplingParams(), SamplingParams(logit_bias={0: 1.0})], [[], []], [[], []], ()
    )
    assert torch.equal(logits, before)
    assert torch.equal(mixed.logits[0], before[0])
    assert float(mixed.logits[1, 0]) == 3.0


def test_a_bad_row_fails_alone() -> None:
    good = SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={1: 3.0})
    bad = forced(SamplingParams(temperature=0, logit_bias={2: 1.0}), logit_bias={V + 5: 1.0})
    bad_history = SamplingParams(temperature=0, frequency_penalty=1.0)
    logits = torch.stack([torch.tensor(BASE)] * 3)
    result = adjust_logits(
        logits, [good, bad, bad_history], [[0], [0], [0]], [[0], [0], [V + 1]], ()
    )
    assert set(result.errors) == {1, 2}
    assert "outside" in result.errors[1] and "outside" in result.errors[2]
    alone = adjust_logits(logits[:1], [good], [[0]], [[0]], ())
    assert torch.equal(result.logits[0], alone.logits[0])
    assert torch.equal(result.logits[1:], logits[1:])  # failed rows come back untouched


# ---------------------------------------------------------------- token_logprobs


def test_token_logprobs_are_log_softmax_with_top_k() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    lp = torch.log_softmax(logits, dim=-1)
    got = token_logprobs(logits, [5, 7, 0], [0, 3, 60])
    assert [g.token_id for g in got] == [5, 7, 0]
    assert [g.logprob for g in got] == pytest.approx(
        [float(lp[0, 5]), float(lp[1, 7]), float(lp[2, 0])], abs=1e-6
    )
    assert got[0].top == ()
    values, ids = lp[1].topk(3)
    assert [t for t, _ in got[1].top] == ids.tolist()
    assert [v for _, v in got[1].top] == pytest.approx(values.tolist(), abs=1e-6)
    assert len(got[2].top) == 50  # k beyond the vocabulary: all of it, sorted
    assert [v for _, v in got[2].top] == sorted((v for _, v in got[2].top), reverse=True)
    assert math.fsum(math.exp(v) for _, v in got[2].top) == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match="outside"):
        token_logprobs(logits, [5, 7, 50], [0, 0, 0])


# ---------------------------------------------------------------- engine, against HF


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    config = EngineConfig(
        model_path=MODEL,
        dtype="float32",
        device="cpu",
        cache=CacheConfig(page_size=4, device_tokens=256, hicache_ratio=2.0),
        scheduler=SchedulerConfig(max_running_requests=8, chunked_prefill_size=16),
        context_length=128,
    )
    with Engine(config, loaded=engine_model(MODEL)).start() as e:
        yield e


def eos_of(engine: Engine) -> int:
    return min(engine.core.scheduler.output.eos_token_ids)


def hf_logprobs(ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every position of ``ids``: ``(n, vocab)``."""
    return torch.log_softmax(hf_logits(MODEL, torch.tensor(ids)), dim=-1)


def assert_matches(got: TokenLogprob, ref: torch.Tensor, k: int) -> None:
    """``got`` against ``ref (vocab,)``, HF's log_softmax at the position before it."""
    assert got.logprob == pytest.approx(float(ref[got.token_id]), abs=TOL)
    values = ref.topk(k).values
    assert [v for _, v in got.top] == pytest.approx(values.tolist(), abs=TOL)
    for (tid, _), v in zip(got.top, values.tolist(), strict=True):
        assert float(ref[tid]) == pytest.approx(v, abs=TOL)  # same ids, ties aside


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_equal_transformers_raw_log_softmax(engine: Engine, temperature: float) -> None:
    """Greedy and sampled alike, the logprobs are of the raw distribution (no
    temperature), for every generated token."""
    prompt = prompt_ids(MODEL, 21).tolist()
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=6, logprobs=4)
    out = engine.generate(prompt, params, timeout=60)
    assert out.logprobs is not None and out.prompt_logprobs is None
    assert [g.token_id for g in out.logprobs] == out.output_ids
    ref = hf_logprobs(prompt + out.output_ids[:-1])
    for j, got in enumerate(out.logprobs):
        assert_matches(got, ref[len(prompt) - 1 + j], 4)
    if temperature == 0:  # greedy takes the top token
        assert all(g.top[0][0] == g.token_id for g in out.logprobs)


def test_no_logprobs_unless_asked(engine: Engine) -> None:
    out = engine.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=2), timeout=60)
    assert out.logprobs is None and out.prompt_logprobs is None
    out = engine.generate([5, 6, 7], SamplingParams(max_tokens=2, logprobs=0), timeout=60)
    assert out.logprobs is not None and [g.top for g in out.logprobs] == [(), ()]


def test_logprobs_are_before_logit_bias(engine: Engine) -> None:
    prompt = prompt_ids(MODEL, 9).tolist()
    forced_tok = 1234
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2, logit_bias={forced_tok: 100})
    out = engine.generate(prompt, params, timeout=60)
    assert out.output_ids == [forced_tok] * 3
    assert out.logprobs is not None
    ref = hf_logprobs(prompt + out.output_ids[:-1])
    for j, got in enumerate(out.logprobs):
        assert_matches(got, ref[len(prompt) - 1 + j], 2)
        assert got.logprob < got.top[0][1]  # the model alone would not pick it


def test_prompt_logprobs_equal_transformers_even_with_the_prefix_cached(engine: Engine) -> None:
    """Every prompt position is scored (45 tokens: three chunks of prefill), also when an
    earlier request left the prompt's prefix in the cache; such a request (no
    ``logprob_start_len``) computes its whole prompt, and caches its pages for the others."""
    prompt = prompt_ids(MODEL, 45).tolist()
    ref = hf_logprobs(prompt)
    want = [float(ref[p - 1, prompt[p]]) for p in range(1, len(prompt))]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3, logprobs=1)
    plain = SamplingParams(temperature=0, max_tokens=1)
    assert engine.flush_cache()
    outs: list[RequestOutput] = []
    outs.append(engine.generate(prompt, params, timeout=60))  # cold; caches the prefix
    hit = engine.generate(prompt, plain, timeout=60)
    assert hit.cached.device == 44
    outs.append(engine.generate(prompt, params, timeout=60))  # prefix cached
    for out in outs:
        assert out.cached.total == 0
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(prompt) and plp[0] is None
        scored = [g for g in plp[1:] if g is not None]
        assert [g.token_id for g in scored] == prompt[1:]
        assert [g.logprob for g in scored] == pytest.approx(want, abs=TOL)
        for p, got in enumerate(scored, start=1):
            assert_matches(got, ref[p - 1], 3)
        # the log-likelihood of the prompt: a sum of 44 of them, 44 * 2e-5 = 8.8e-4 at worst
        # (measured 2.9e-6)
        assert math.fsum(g.logprob for g in scored) == pytest.approx(math.fsum(want), abs=1e-3)
        assert out.output_ids == hit.output_ids
        assert out.logprobs is not None
        assert_matches(out.logprobs[0], ref[-1], 1)
    assert engine.generate(prompt, plain, timeout=60).cached.device == 44


def test_prompt_logprobs_batched_with_other_requests(engine: Engine) -> None:
    """A prompt-logprobs request sharing its prefill and decode batches with plain ones
    gets the values it gets alone, and the plain ones the tokens they get alone."""
    prompts = [prompt_ids(MODEL, n).tolist() for n in (7, 13, 30)]
    plain = SamplingParams(temperature=0, max_tokens=4)
    scoring = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, logprobs=2)
    params = [plain, scoring, plain]
    solo = [engine.generate(p, q, timeout=60) for p, q in zip(prompts, params, strict=True)]
    assert engine.flush_cache()
    results: dict[int, RequestOutput] = {}
    done = threading.Event()

    def on(i: int) -> Callable[[RequestOutput], None]:
        def cb(out: RequestOutput) -> None:
            if out.finished:
                results[i] = out
                if len(results) == len(prompts):
                    done.set()

        return cb

    for i, (p, q) in enumerate(zip(prompts, params, strict=True)):
        engine.submit(p, q, on(i))
    assert done.wait(60)
    for i, alone in enumerate(solo):
        assert results[i].output_ids == alone.output_ids
    ref = hf_logprobs(prompts[1])
    plp = results[1].prompt_logprobs
    assert plp is not None and plp[0] is None
    got = [g.logprob for g in plp[1:] if g is not None]
    assert got == pytest.approx([float(ref[p - 1, prompts[1][p]]) for p in range(1, 13)], abs=TOL)
    assert results[1].logprobs is not None and solo[1].logprobs is not None
    assert [g.logprob for g in results[1].logprobs] == pytest.approx(
        [g.logprob for g in solo[1].logprobs], abs=TOL
    )


# ---------------------------------------------------------------- stopping


def test_min_tokens_suppresses_eos(engine: Engine) -> None:
    eos = eos_of(engine)
    prompt = prompt_ids(MODEL, 9).tolist()
    pushed = SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100})
    out = engine.generate(prompt, pushed, timeout=60)
    assert out.output_ids == [eos] and out.finish_reason is FinishReason.STOP
    held = SamplingParams(temperature=0, max_tokens=8, min_tokens=4, logit_bias={eos: 100})
    out = engine.generate(prompt, held, timeout=60)
    assert len(out.output_ids) == 5 and eos not in out.output_ids[:4]
    assert out.output_ids[4] == eos and out.finish_reason is FinishReason.STOP


def test_ignore_eos_runs_to_max_tokens(engine: Engine) -> None:
    eos = eos_of(engine)
    prompt = prompt_ids(MODEL, 9).tolist()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={eos: 100})
    out = engine.generate(prompt, params, timeout=60)
    assert out.output_ids == [eos] * 6 and out.finish_reason is FinishReason.LENGTH


def test_stop_token_ids_stop_and_stay_out_of_the_text(engine: Engine) -> None:
    prompt = prompt_ids(MODEL, 11).tolist()
    base = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=10), timeout=60)
    ids = base.output_ids
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[ids[k]])
    out = engine.generate(prompt, params, timeout=60)
    assert out.output_ids == ids[: k + 1] and out.finish_reason is FinishReason.STOP
    assert out.text == engine.model.tokenizer.decode(ids[:k], skip_special_tokens=True)
    # min_tokens defers it: masked until then, so a different token is picked there
    if k < 9:
        late = SamplingParams(
            temperature=0, max_tokens=10, stop_token_ids=[ids[k]], min_tokens=k + 1
        )
        out = engine.generate(prompt, late, timeout=60)
        assert out.output_ids[:k] == ids[:k] and out.output_ids[k] != ids[k]


def test_engine_refuses_ids_outside_the_vocabulary(engine: Engine) -> None:
    vocab = int(engine_model(MODEL).hf_config.vocab_size)
    with pytest.raises(InvalidRequest) as err:
        engine.submit([1, 2], SamplingParams(logit_bias={vocab: 1.0}))
    assert err.value.param == "logit_bias"
    with pytest.raises(InvalidRequest) as err:
        engine.submit([1, 2], SamplingParams(stop_token_ids=[vocab + 3]))
    assert err.value.param == "stop_token_ids"


# ---------------------------------------------------------------- scheduler, retraction

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")


def test_prompt_logprobs_survive_retraction_and_chunking() -> None:
    """A prompt-logprobs request chunked and retracted (L1 holds 8 pages; two requests of
    13 prompt tokens overflow it while decoding) scores each prompt position once and
    exactly; the other request keeps using the cache."""
    cfg = CacheConfig(page_size=4, device_tokens=32, hicache_ratio=2.0)
    with HiCache(cfg, SPEC) as cache:
        runner = NextTokenRunner()
        output = OutputProcessor(SpaceTokenizer(), eos_token_ids=[], context_length=64)
        sched = Scheduler(
            cache,
            runner,  # type: ignore[arg-type,unused-ignore]
            output,
            SchedulerConfig(chunked_prefill_size=5),
        )
        long = SamplingParams(temperature=0.0, max_tokens=8)
        scoring = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=1, logprobs=0)
        prompt = [1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23, 24]
        b_outs: list[RequestOutput] = []
        a_outs: list[RequestOutput] = []
        b = client(Request(list(range(30, 43)), long), b_outs.append)
        a = client(Request(prompt, scoring), a_outs.append)
        sched.add(b)
        sched.add(a)
        for _ in range(200):
            if sched.idle:
                break
            step(sched)
        assert sched.idle and a.retracted >= 1
        assert a.output_ids == list(range(25, 33)) and b.output_ids == list(range(43, 51))
        plp = a_outs[-1].prompt_logprobs
        assert plp is not None and plp[0] is None
        assert [g.token_id for g in plp[1:] if g is not None] == prompt[1:]
        want = [MISS if p == 8 else 0.0 for p in range(1, len(prompt))]
        assert [g.logprob for g in plp[1:] if g is not None] == want
        assert all(
            g is not None and g.top == ((prompt[p - 1] + 1, 0.0),) for p, g in enumerate(plp) if p
        )
        lps = a_outs[-1].logprobs
        assert lps is not None and [(g.token_id, g.logprob, g.top) for g in lps] == [
            (t, 0.0, ()) for t in range(25, 33)
        ]
        # prompt positions scored once, in the chunks that computed them (b's last token,
        # then a's first two positions; then b decodes beside four, four and three of a's,
        # in mixed batches); never again after retraction
        assert [r for r in runner.logit_rows if r is not None] == [
            [2, 3, 4],
            [0, 1, 2, 3, 4],
            [0, 1, 2, 3, 4],
            [0, 1, 2, 3],
        ]
        assert a.retracted and runner.logit_rows[-1] is None
        assert a.cached.total == 0
        cache.sync(wait=True)
        check_integrity(cache)


def test_a_failing_row_ends_only_its_request() -> None:
    """Prompt scoring, token logprobs or logit processing that fails for one request
    (parameters forced past validation) aborts that request alone, with a reason; the
    request batched with it gets exactly its solo output."""
    cfg = CacheConfig(page_size=4, device_tokens=64, hicache_ratio=2.0)
    with HiCache(cfg, SPEC) as cache:
        output = OutputProcessor(SpaceTokenizer(), eos_token_ids=[], context_length=64)
        sched = Scheduler(
            cache,
            NextTokenRunner(),  # type: ignore[arg-type,unused-ignore]
            output,
            SchedulerConfig(),
        )
        good_params = SamplingParams(
            temperature=0.0, max_tokens=3, prompt_logprobs=1, logprobs=1, logit_bias={9: 1.0}
        )
        bad = [
            forced(
                SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1),
                prompt_logprobs="x",
            ),
            forced(SamplingParams(temperature=0.0, max_tokens=3, logprobs=1), logprobs="x"),
            forced(
                SamplingParams(temperature=0.0, max_tokens=3, logit_bias={1: 1.0}),
                logit_bias={VOCAB: 1.0},
            ),
        ]
        outs: list[list[RequestOutput]] = [[] for _ in range(4)]
        reqs = [client(Request([1, 2, 3, 4, 5], good_params), outs[0].append)]
        reqs += [client(Request([1, 2, 3, 4, 5], p), outs[i + 1].append) for i, p in enumerate(bad)]
        for r in reqs:
            sched.add(r)
        for _ in range(50):
            if sched.idle:
                break
            step(sched)
        assert sched.idle
        good = outs[0][-1]
        assert good.output_ids == [6, 7, 8] and good.finish_reason is FinishReason.LENGTH
        assert good.error is None and good.logprobs is not None and len(good.logprobs) == 3
        errors = [o[-1].error or "" for o in outs[1:]]
        assert [o[-1].finish_reason for o in outs[1:]] == [FinishReason.ABORT] * 3
        assert errors[0].startswith("prompt logprobs failed")
        assert errors[1].startswith("logprobs failed")
        assert errors[2].startswith("logit processing failed") and "outside" in errors[2]
        assert len(cache.admitted) == 0
        cache.sync(wait=True)
        check_integrity(cache)
