"""Sampling parameters at their bounds, and per-row isolation of sampling failures.

One request's sampling must never touch another's: a row that cannot be sampled is
reported on its own, and every other row gets exactly the token it would have got alone.
"""

from __future__ import annotations

import pytest
import torch

from hicache.engine.sampling import (
    GREEDY_TEMPERATURE,
    SEED_MAX,
    SEED_MIN,
    InvalidRequest,
    SamplingParams,
    make_generator,
    sample,
    sample_rows,
)

V = 64


def logits_rows(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))


def forced(params: SamplingParams, **fields: object) -> SamplingParams:
    """``params`` with fields set past validation (what a buggy caller could hand over)."""
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 2**64),
        ("seed", SEED_MIN - 1),
        ("seed", 10**40),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("top_p", float("nan")),
        ("top_k", -2),
    ],
)
def test_out_of_range_values_name_their_field(field: str, value: object) -> None:
    with pytest.raises(InvalidRequest, match=field) as err:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert err.value.param == field
    assert isinstance(err.value, ValueError)  # callers catching ValueError keep working


def test_seed_bounds_are_what_torch_accepts() -> None:
    for seed in (SEED_MIN, -1, 0, SEED_MAX):
        gen = make_generator(SamplingParams(seed=seed), "cpu")
        assert gen is not None
    with pytest.raises((ValueError, RuntimeError)):  # the bound is torch's, not ours
        torch.Generator().manual_seed(SEED_MAX + 1)


def test_tiny_temperature_is_greedy() -> None:
    logits = logits_rows(3)
    for t in (1e-40, 5e-324, GREEDY_TEMPERATURE / 2):
        p = SamplingParams(temperature=t, seed=1)
        assert p.greedy and make_generator(p, "cpu") is None
        result = sample_rows(logits, [p] * 3, [None] * 3)
        assert result.ok and torch.equal(result.tokens, logits.argmax(-1))
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy


def test_top_k_beyond_vocab_or_int64_keeps_everything() -> None:
    logits = logits_rows(2, seed=3)

    def draw(top_k: int) -> list[int]:
        params = [SamplingParams(temperature=3.0, top_k=top_k, seed=11)] * 2
        gens = [make_generator(p, "cpu") for p in params]
        return [int(t) for _ in range(20) for t in sample(logits, params, gens)]

    off = draw(0)
    assert draw(V) == off and draw(2**63) == off and draw(10**30) == off
    assert len(set(off)) > 3


def seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.5, top_k=20, top_p=0.9, seed=100 + i)


def alone(logits: torch.Tensor, i: int) -> int:
    """Row ``i`` sampled on its own with a fresh generator."""
    p = seeded(i)
    return int(sample(logits[[i]], [p], [make_generator(p, "cpu")])[0])


@pytest.mark.parametrize("bad_kind", ["nan_logits", "inf_logits", "overflow", "raises", "greedy"])
def test_one_bad_row_fails_alone(bad_kind: str) -> None:
    logits = logits_rows(4, seed=5)
    params = [seeded(i) for i in range(4)]
    bad = 2
    if bad_kind == "nan_logits":
        logits[bad, 7] = float("nan")
    elif bad_kind == "inf_logits":
        logits[bad, 3] = float("inf")
    elif bad_kind == "overflow":  # finite logits whose scaled values overflow to inf
        logits[bad] = 3e38
        logits[bad, 0] = -3e38
        params[bad] = forced(seeded(bad), temperature=1e-3)
    elif bad_kind == "raises":  # a value torch cannot even make a tensor of
        params[bad] = forced(seeded(bad), temperature="hot")
    else:  # greedy rows with broken logits fail too, instead of emitting a NaN's index
        logits[bad, :] = float("nan")
        params[bad] = forced(seeded(bad), temperature=0)
    gens = [make_generator(seeded(i), "cpu") for i in range(4)]
    result = sample_rows(logits, params, gens)
    assert set(result.errors) == {bad} and not result.ok
    assert result.errors[bad]
    good = [i for i in range(4) if i != bad]
    assert [int(result.tokens[i]) for i in good] == [alone(logits, i) for i in good]
    with pytest.raises(RuntimeError, match=f"row {bad}"):
        sample(logits, params, [make_generator(seeded(i), "cpu") for i in range(4)])


def test_every_row_failing_and_empty_batch() -> None:
    logits = torch.full((2, V), float("nan"))
    params = [seeded(0), SamplingParams(temperature=0)]
    result = sample_rows(logits, params, [make_generator(p, "cpu") for p in params])
    assert set(result.errors) == {0, 1}
    empty = sample_rows(torch.empty(0, V), [], [])
    assert empty.ok and empty.tokens.shape == (0,)
    with pytest.raises(ValueError, match="one params"):
        sample_rows(logits, params[:1], [None])


def test_sample_rows_reads_the_device_once_for_greedy_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """One device -> host read gives the greedy ids and every row's checks (a sync on
    CUDA); drawn rows add one read of their ids. A NaN row still fails alone."""
    reads = 0
    tolist = torch.Tensor.tolist

    def counting(t: torch.Tensor) -> object:
        nonlocal reads
        reads += 1
        return tolist(t)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    logits = torch.randn(4, 16)
    logits[2, 3] = float("nan")
    greedy = SamplingParams(temperature=0)
    got = sample_rows(logits, [greedy] * 4, [None] * 4)
    assert reads == 1 and set(got.errors) == {2}
    assert list(got.token_ids) == tolist(logits.argmax(-1))
    reads = 0
    hot = SamplingParams(temperature=1.0, seed=1)
    got = sample_rows(logits, [greedy, hot, hot, greedy], [None, torch.Generator(), None, None])
    assert reads == 2 and set(got.errors) == {2}  # the checks, then the drawn ids
    assert list(got.token_ids) == tolist(got.tokens)
