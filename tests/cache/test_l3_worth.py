"""Whether an L3 hit is worth waiting for and reading, on exact cost lines: restore
(read + load back) against recompute (tokens times the prefill's seconds per token),
unknown while a rate is unmeasured or stale."""

from __future__ import annotations

import pytest

from hicache.cache.l3.worth import DEFAULT_RATE_MAX_AGE_S, RestoreCosts
from hicache.rates import RateFit, RestoreMeter


def fit(overhead_s: float, seconds_per_unit: float) -> RateFit:
    """A cost line ``seconds = overhead_s + amount * seconds_per_unit``."""
    return RateFit(
        observations=1,
        per_second=1.0 / seconds_per_unit,
        mean_amount=1.0,
        overhead_s=overhead_s,
        seconds_per_unit=seconds_per_unit,
    )


TOKEN = 1000  # bytes of one token's KV
READ = fit(0.001, 1e-9)  # 1 ms a call, 1 GB/s
LOAD = fit(0.0, 1e-10)  # 10 GB/s
PREFILL = fit(0.02, 1e-4)  # 10k tokens/s past a forward's 20 ms


def test_a_fast_tier_is_read_and_waited_for() -> None:
    costs = RestoreCosts(TOKEN, read=READ, load=LOAD, lookup=fit(0.0, 0.002), prefill=PREFILL)
    # 1000 tokens: read 1 ms + 1 ms, load 0.1 ms; recompute 1000 x 0.1 ms (not the 20 ms)
    assert costs.restore_s(1000) == pytest.approx(0.0021)
    assert costs.recompute_s(1000) == pytest.approx(0.1)
    assert costs.worth_reading(1000) is True
    assert costs.worth_waiting(1000) is True  # lookup 2 ms + restore 2.1 ms < 100 ms
    # 10 tokens: the read (1.011 ms with its 1 ms call) costs more than recomputing (1 ms)
    assert costs.worth_reading(10) is False


def test_a_slow_tier_is_neither_read_nor_waited_for() -> None:
    slow_read = RestoreCosts(TOKEN, read=fit(0.5, 1e-9), prefill=PREFILL)
    assert slow_read.worth_reading(1000) is False
    assert slow_read.worth_waiting(1000) is False
    slow_lookup = RestoreCosts(TOKEN, read=READ, lookup=fit(0.0, 0.2), prefill=PREFILL)
    assert slow_lookup.worth_reading(1000) is True  # once looked up, the read pays
    assert slow_lookup.worth_waiting(1000) is False  # but waiting for the lookup does not


def test_without_a_read_or_prefill_rate_nothing_is_decided() -> None:
    for costs in (
        RestoreCosts(TOKEN, read=None, prefill=PREFILL),
        RestoreCosts(TOKEN, read=READ, prefill=None),
    ):
        assert costs.worth_reading(1000) is None
        assert costs.worth_waiting(1000) is None
    assert RestoreCosts(TOKEN, read=READ, load=None, prefill=PREFILL).restore_s(1000) == (
        pytest.approx(0.002)
    )  # an unmeasured load back counts 0 (it overlaps the forward)


def test_measured_drops_rates_older_than_max_age() -> None:
    meter = RestoreMeter(TOKEN)
    assert meter.storage.observe(1_000_000, 0.001, at=100.0)
    assert meter.lookup.observe(1, 0.002, at=100.0)
    assert meter.host.observe(1_000_000, 0.0001)  # no time given: never fresh
    fresh = RestoreCosts.measured(meter, PREFILL, now=100.0 + DEFAULT_RATE_MAX_AGE_S)
    assert fresh.read is not None and fresh.lookup is not None and fresh.load is None
    assert fresh.read.per_second == pytest.approx(1e9)
    assert fresh.prefill is PREFILL
    stale = RestoreCosts.measured(meter, PREFILL, now=100.0 + DEFAULT_RATE_MAX_AGE_S + 0.001)
    assert stale.read is None and stale.lookup is None
    assert stale.worth_reading(1000) is None


def test_the_read_gain_is_recompute_minus_restore_and_positive_where_reading_pays() -> None:
    costs = RestoreCosts(TOKEN, read=READ, load=LOAD, prefill=PREFILL)
    fixed, per_token = costs.read_gain() or (0.0, 0.0)
    assert fixed == pytest.approx(0.001)  # the read's 1 ms call
    assert per_token == pytest.approx(1e-4 - 1e-6 - 1e-7)  # prefill less read and load
    for n in (1, 10, 11, 1000):
        gain = n * per_token - fixed
        assert gain == pytest.approx(costs.recompute_s(n) - costs.restore_s(n))  # type: ignore[operator]
        assert (gain > 0) == costs.worth_reading(n)
    assert RestoreCosts(TOKEN, read=None, prefill=PREFILL).read_gain() is None
    assert RestoreCosts(TOKEN, read=READ, prefill=None).read_gain() is None
