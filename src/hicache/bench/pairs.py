"""Repeated A/B comparisons of cache configs on a machine whose speed drifts.

The serving benchmarks' configs run one after another; on a shared machine the speed can
change by 2x between two configs' runs minutes apart, so one run per config compares the
machine's moods as much as the configs. Instead every config runs the same workload in
``R`` short repetitions, in an order that alternates (:func:`alternating_order`), and a
config is compared with the baseline **pair by pair**: the ratio of its figure to the
baseline's figure in the same repetition, run back to back (:func:`pair_ratios`). Drift
slower than a repetition cancels inside each ratio; what is left shows as the spread of
the ``R`` ratios (:class:`Spread`: median, quartiles, min and max).

Pure functions on plain numbers; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Spread",
    "alternating_order",
    "compare_to_baseline",
    "pair_ratios",
    "quantile",
]


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) by linear interpolation between ranks (numpy's default).

    ValueError on an empty sequence or ``q`` outside [0, 1].
    """
    if not values:
        raise ValueError("quantile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q={q!r} must be in [0, 1]")
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Spread:
    """Median and spread of a few measurements (ratios, seconds, tokens/s: the caller's unit).

    Invariant: ``min <= q25 <= median <= q75 <= max``; ``values`` in measurement order.
    """

    values: tuple[float, ...]
    median: float
    q25: float
    q75: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """The spread of ``values`` (at least one; ValueError otherwise)."""
        if not values:
            raise ValueError("Spread.of needs at least one value")
        xs = tuple(float(v) for v in values)
        return cls(xs, quantile(xs, 0.5), quantile(xs, 0.25), quantile(xs, 0.75), min(xs), max(xs))

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def iqr(self) -> float:
        """Interquartile range, ``q75 - q25``."""
        return self.q75 - self.q25

    def to_json(self) -> dict[str, Any]:
        return {"n": self.n, "median": self.median, "q25": self.q25, "q75": self.q75,
                "min": self.min, "max": self.max, "values": list(self.values)}  # fmt: skip


def alternating_order(configs: Sequence[str], repeats: int) -> list[tuple[str, ...]]:
    """The order configs run in, per repetition: as given in even repetitions (0, 2, ...),
    reversed in odd ones. Two configs give A B, B A, A B, ...: each is first as often as
    the other (for an even ``repeats``), so a steady drift favours neither.

    ValueError when ``repeats < 1``, ``configs`` is empty or names a config twice.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    if not configs or len(set(configs)) != len(configs):
        raise ValueError(f"configs={list(configs)} must be non-empty and distinct")
    fwd = tuple(configs)
    return [fwd if r % 2 == 0 else fwd[::-1] for r in range(repeats)]


def pair_ratios(values: Sequence[float | None], baseline: Sequence[float | None]) -> Spread | None:
    """The spread of ``values[r] / baseline[r]`` over the repetitions ``r`` where both
    were measured (not None) and the baseline is > 0; None when there is no such pair.

    ValueError when the two sequences differ in length (they are indexed by repetition).
    """
    if len(values) != len(baseline):
        raise ValueError(f"{len(values)} values against {len(baseline)} baseline values")
    ratios = [v / b for v, b in zip(values, baseline, strict=True)
              if v is not None and b is not None and b > 0]  # fmt: skip
    return Spread.of(ratios) if ratios else None


def compare_to_baseline(
    per_repeat: Sequence[Mapping[str, Mapping[str, float]]],
    configs: Sequence[str],
    baseline: str,
    metrics: Sequence[str],
) -> dict[str, dict[str, Spread]]:
    """Per config other than ``baseline``, per metric: :func:`pair_ratios` of the config's
    figure to the baseline's over the repetitions.

    ``per_repeat[r][config][metric]`` is one repetition's figure; a config missing from a
    repetition (it failed) leaves that pair out. A config without any pair is left out.
    """
    out: dict[str, dict[str, Spread]] = {}

    def column(name: str, metric: str) -> list[float | None]:
        return [rep[name][metric] if name in rep else None for rep in per_repeat]

    for name in configs:
        if name == baseline:
            continue
        entry = {}
        for m in metrics:
            s = pair_ratios(column(name, m), column(baseline, m))
            if s is not None:
                entry[m] = s
        if entry:
            out[name] = entry
    return out
