"""The measured rates (:mod:`hicache.rates`): exact estimates from tiny observations."""

from __future__ import annotations

import math

import pytest

from hicache.rates import (
    BreakEven,
    RateFit,
    RestoreMeter,
    RestoreRates,
    Throughput,
    break_even,
)


def test_no_estimate_before_the_first_observation() -> None:
    assert Throughput().estimate() is None


def test_one_size_gives_the_line_through_the_origin() -> None:
    t = Throughput(half_life=1)
    assert t.observe(8, 2.0)
    assert t.observe(8, 4.0)
    # weights 0.5 and 1: amounts 4 + 8 = 12, seconds 1 + 4 = 5
    assert t.estimate() == RateFit(
        observations=2,
        per_second=12 / 5,
        mean_amount=8.0,
        overhead_s=0.0,
        seconds_per_unit=5 / 12,
    )


def test_two_sizes_fit_overhead_and_slope() -> None:
    t = Throughput(half_life=1)
    t.observe(2, 3.0)  # seconds = 1 + amount
    t.observe(4, 5.0)
    t.observe(4, 5.0)
    fit = t.estimate()
    assert fit is not None
    assert fit.overhead_s == pytest.approx(1.0, abs=1e-12)
    assert fit.seconds_per_unit == pytest.approx(1.0, rel=1e-12)
    # weights 0.25, 0.5, 1: amounts 0.5 + 2 + 4 = 6.5, seconds 0.75 + 2.5 + 5 = 8.25
    assert fit.per_second == 6.5 / 8.25
    assert fit.per_second_at(fit.mean_amount) == pytest.approx(fit.per_second, rel=1e-12)
    assert fit.seconds(10) == pytest.approx(11.0, rel=1e-12)
    assert fit.marginal_per_second == pytest.approx(1.0, rel=1e-12)


def test_a_fit_that_needs_a_negative_overhead_goes_through_the_origin() -> None:
    t = Throughput(half_life=1)
    t.observe(2, 1.0)  # seconds = 2 * amount - 3: negative overhead
    t.observe(4, 5.0)
    fit = t.estimate()
    assert fit is not None
    # weights 0.5, 1: amounts 1 + 4 = 5, seconds 0.5 + 5 = 5.5
    assert (fit.overhead_s, fit.seconds_per_unit, fit.per_second) == (0.0, 5.5 / 5, 5 / 5.5)


def test_the_newest_observations_weigh_most() -> None:
    t = Throughput(half_life=1)
    t.observe(100, 100.0)  # 1/s, long ago
    for _ in range(30):
        t.observe(100, 1.0)  # 100/s now
    fit = t.estimate()
    assert fit is not None and fit.observations == 31
    assert fit.per_second == pytest.approx(100.0, rel=1e-6)


@pytest.mark.parametrize(
    ("amount", "seconds"),
    [(0, 1.0), (-1, 1.0), (1, 0.0), (1, -1.0), (math.nan, 1.0), (1, math.inf), (11, 1.0)],
)
def test_empty_instant_and_absurd_observations_are_ignored(amount: float, seconds: float) -> None:
    t = Throughput(max_per_second=10)
    assert not t.observe(amount, seconds)
    assert (t.estimate(), t.observations, t.ignored) == (None, 0, 1)
    assert t.observe(10, 1.0)  # at the bound: taken


@pytest.mark.parametrize("kwargs", [{"half_life": 0}, {"max_per_second": 0}])
def test_a_bad_meter_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Throughput(**kwargs)


def test_restore_rates_per_tier_and_the_break_even() -> None:
    with pytest.raises(ValueError, match="token_bytes"):
        RestoreMeter(0)
    meter = RestoreMeter(token_bytes=4, half_life=1)
    assert meter.rates() == RestoreRates(token_bytes=4)
    meter.host.observe(400, 1.0)  # 100 tokens/s
    rates = meter.rates()
    assert rates.storage is None and [t for t, _ in rates.tiers()] == ["host"]
    assert rates.tokens_per_second("host") == 100.0
    assert rates.tokens_per_second("storage") is None
    prefill = Throughput(half_life=1)
    assert break_even(rates, prefill.estimate()) == ()
    prefill.observe(50, 1.0)
    meter.storage.observe(80, 1.0)  # 20 tokens/s
    got = break_even(meter.rates(), prefill.estimate())
    assert got == (BreakEven("host", 100.0, 50.0), BreakEven("storage", 20.0, 50.0))
    assert [(b.ratio, b.load_wins) for b in got] == [(2.0, True), (0.4, False)]


def test_forget_storage_starts_the_l3_meters_afresh_and_keeps_the_host_one() -> None:
    meter = RestoreMeter(10)
    assert meter.host.observe(100, 1.0) and meter.storage.observe(100, 1.0)
    assert meter.lookup.observe(1, 0.5, at=3.0)
    meter.forget_storage()
    rates = meter.rates()
    assert rates.storage is None and meter.lookup.estimate() is None
    assert meter.lookup.last_at is None
    assert rates.host is not None and rates.host.per_second == 100.0
