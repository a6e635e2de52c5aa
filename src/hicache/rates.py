"""Measured rates of one instance: restore bytes/s per tier, prefill tokens/s, break-even.

A :class:`Throughput` meter takes observations ``(amount, seconds)`` (bytes a load moved,
tokens a prefill step computed) on its owner's thread and keeps exponentially decayed
sums; its :class:`RateFit` is the recent rate and a cost line ``seconds = overhead +
amount * seconds_per_unit`` through them. :class:`RestoreMeter` holds one meter per
restore tier (:data:`RESTORE_TIERS`); :func:`break_even` compares a tier's restore tokens/s
with the prefill's. Pure: no torch, no threads, no IO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "DEFAULT_HALF_LIFE",
    "MAX_BYTES_PER_SECOND",
    "MAX_TOKENS_PER_SECOND",
    "RESTORE_TIERS",
    "BreakEven",
    "RateFit",
    "RestoreMeter",
    "RestoreRates",
    "Throughput",
    "break_even",
]

RESTORE_TIERS = ("host", "storage")
"""The tiers a hit is restored from: ``host`` (an L2 -> L1 load back) and ``storage``
(an L3 -> L2 read). An L1 hit costs nothing to restore and has no meter."""

DEFAULT_HALF_LIFE = 32.0
"""Observations after which an observation weighs half as much as the newest."""

MAX_BYTES_PER_SECOND = 1e13
"""An observation above this (10 TB/s, beyond any memory bus) is a timer artefact,
ignored."""

MAX_TOKENS_PER_SECOND = 1e9
"""A prefill observation above this many tokens/s is a timer artefact, ignored."""

_FLAT = 1e-9
"""Relative spread of the amounts below which the cost line is not fitted (every
observation the same size: no slope to see)."""


@dataclass(frozen=True, slots=True)
class RateFit:
    """A :class:`Throughput`'s estimate. ``observations``: taken so far (all time, >= 1).
    ``per_second``: the decayed amount over the decayed seconds (> 0): the rate of recent
    observations, weighted by their size. ``mean_amount``: the decayed mean amount of one
    observation (> 0). The cost line ``seconds(amount) = overhead_s + amount *
    seconds_per_unit`` (``overhead_s >= 0``, ``seconds_per_unit > 0``) is the decayed
    least-squares fit; it passes through the decayed means, so ``per_second_at(mean_amount)
    == per_second``; with one size only (or a fit that would need a negative overhead or
    slope) it is the line through the origin, ``overhead_s == 0``."""

    observations: int
    per_second: float
    mean_amount: float
    overhead_s: float
    seconds_per_unit: float

    def seconds(self, amount: float) -> float:
        """Predicted seconds of an observation of ``amount`` units."""
        return self.overhead_s + amount * self.seconds_per_unit

    def per_second_at(self, amount: float) -> float:
        """Predicted units per second of an observation of ``amount`` (> 0) units."""
        return amount / self.seconds(amount)

    @property
    def marginal_per_second(self) -> float:
        """Units per second of one more unit in an observation (``1 / seconds_per_unit``)."""
        return 1.0 / self.seconds_per_unit


class Throughput:
    """A meter of one rate (owner's thread only; not thread-safe).

    ``half_life``: observations after which an observation weighs half (> 0);
    ``max_per_second``: observations faster than this are ignored (> 0). Observations
    with a non-finite or non-positive amount or seconds are ignored too (an empty load, a
    clock that did not move)."""

    def __init__(
        self, *, half_life: float = DEFAULT_HALF_LIFE, max_per_second: float = math.inf
    ) -> None:
        if not half_life > 0:
            raise ValueError(f"half_life={half_life!r}: must be > 0")
        if not max_per_second > 0:
            raise ValueError(f"max_per_second={max_per_second!r}: must be > 0")
        self.half_life = half_life
        self.max_per_second = max_per_second
        self._keep = 0.5 ** (1.0 / half_life)
        self.observations = 0
        """Observations taken so far."""
        self.ignored = 0
        """Observations ignored so far (empty, instant or absurdly fast)."""
        self.last_at: float | None = None
        """When the last observation taken was made (the caller's clock, seconds; None:
        none taken, or none given a time)."""
        self._w = self._a = self._t = self._aa = self._at = 0.0

    def observe(self, amount: float, seconds: float, at: float | None = None) -> bool:
        """Take one observation: ``amount`` units moved or computed in ``seconds``, made at
        ``at`` (the caller's clock; kept as :attr:`last_at`); whether it was taken (see the
        class docstring)."""
        finite = math.isfinite(amount) and math.isfinite(seconds)
        if not finite or amount <= 0 or seconds <= 0 or amount > self.max_per_second * seconds:
            self.ignored += 1
            return False
        k = self._keep
        self._w = self._w * k + 1.0
        self._a = self._a * k + amount
        self._t = self._t * k + seconds
        self._aa = self._aa * k + amount * amount
        self._at = self._at * k + amount * seconds
        self.observations += 1
        if at is not None:
            self.last_at = at
        return True

    def estimate(self) -> RateFit | None:
        """The estimate from the observations so far; None before the first."""
        if not self.observations:
            return None
        w, a, t = self._w, self._a, self._t
        mean_a, mean_t = a / w, t / w
        var = self._aa / w - mean_a * mean_a
        cov = self._at / w - mean_a * mean_t
        overhead, slope = 0.0, t / a
        if var > (_FLAT * mean_a) ** 2 and cov > 0:
            fitted = cov / var
            if mean_t - fitted * mean_a >= 0:
                overhead, slope = mean_t - fitted * mean_a, fitted
        return RateFit(
            observations=self.observations,
            per_second=a / t,
            mean_amount=mean_a,
            overhead_s=overhead,
            seconds_per_unit=slope,
        )


@dataclass(frozen=True, slots=True)
class RestoreRates:
    """The restore meters' estimates at one point: per tier of :data:`RESTORE_TIERS`, in
    bytes per second per rank (None: no observation yet); ``token_bytes``: the bytes one
    token's KV takes on this rank, all layers (> 0), which turns bytes into tokens."""

    token_bytes: int
    host: RateFit | None = None
    storage: RateFit | None = None

    def tiers(self) -> tuple[tuple[str, RateFit], ...]:
        """``(tier, estimate)`` of each tier with an estimate, in :data:`RESTORE_TIERS` order."""
        both = (("host", self.host), ("storage", self.storage))
        return tuple((name, fit) for name, fit in both if fit is not None)

    def tokens_per_second(self, tier: str) -> float | None:
        """Tokens per second ``tier`` restores (its bytes/s over :attr:`token_bytes`)."""
        fit = dict(self.tiers()).get(tier)
        return None if fit is None else fit.per_second / self.token_bytes


class RestoreMeter:
    """One :class:`Throughput` per restore tier, in bytes per second per rank (the cache's
    thread only). ``token_bytes``: bytes of one token's KV on this rank (> 0)."""

    def __init__(self, token_bytes: int, *, half_life: float = DEFAULT_HALF_LIFE) -> None:
        if token_bytes <= 0:
            raise ValueError(f"token_bytes={token_bytes!r}: must be > 0")
        self.token_bytes = token_bytes
        self.host = Throughput(half_life=half_life, max_per_second=MAX_BYTES_PER_SECOND)
        """L2 -> L1 loads: bytes a load moved, seconds its copy took."""
        self.storage = Throughput(half_life=half_life, max_per_second=MAX_BYTES_PER_SECOND)
        """L3 -> L2 reads: bytes of pages read intact, seconds of the backend calls."""
        self.lookup = Throughput(half_life=half_life)
        """L3 lookups (not a restore tier): one unit per lookup, the seconds of its
        backend call, so ``seconds(1)`` is what a lookup costs."""

    def forget_storage(self) -> None:
        """Start the ``storage`` and ``lookup`` meters afresh: a newly attached L3 is not
        the one they measured."""
        self.storage = Throughput(
            half_life=self.storage.half_life, max_per_second=MAX_BYTES_PER_SECOND
        )
        self.lookup = Throughput(half_life=self.lookup.half_life)

    def rates(self) -> RestoreRates:
        """The estimates now."""
        return RestoreRates(
            token_bytes=self.token_bytes,
            host=self.host.estimate(),
            storage=self.storage.estimate(),
        )


@dataclass(frozen=True, slots=True)
class BreakEven:
    """A tier's restore speed against recomputing: ``restore_tokens_per_second`` (its
    bytes/s over the bytes of one token) and ``prefill_tokens_per_second`` (both > 0)."""

    tier: str
    restore_tokens_per_second: float
    prefill_tokens_per_second: float

    @property
    def ratio(self) -> float:
        """Restore tokens/s over prefill tokens/s: above 1, loading a hit beats recomputing it."""
        return self.restore_tokens_per_second / self.prefill_tokens_per_second

    @property
    def load_wins(self) -> bool:
        """Whether loading a token is faster than recomputing it (:attr:`ratio` > 1)."""
        return self.ratio > 1.0


def break_even(restores: RestoreRates, prefill: RateFit | None) -> tuple[BreakEven, ...]:
    """The break-even of each restore tier with an estimate against ``prefill`` (tokens/s
    of recent prefill steps, :attr:`RateFit.per_second`); empty without a prefill estimate."""
    if prefill is None:
        return ()
    return tuple(
        BreakEven(tier, fit.per_second / restores.token_bytes, prefill.per_second)
        for tier, fit in restores.tiers()
    )
