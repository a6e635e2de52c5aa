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
    "work_saved_bound",
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


def work_saved_bound(
    per_repeat: Sequence[Mapping[str, Mapping[str, float]]],
    configs: Sequence[str],
    baseline: str,
) -> dict[str, dict[str, Spread]]:
    """Per config other than ``baseline``: how much faster a cache could make it, and how
    much of that it achieved, repetition by repetition.

    ``per_repeat[r][config]`` needs ``"prompt_computed"`` (prompt tokens the server had to
    compute: prompt tokens - cached tokens, summed over the run's requests) and
    ``"input_tok_s"``. The **bound** of repetition ``r`` is the baseline's computed tokens
    over the config's (the throughput gain if the time of a request were all prefill of
    its uncached tokens; > 1 when the config computes less); the **fraction** is the
    achieved gain (the config's input tokens/s over the baseline's) over that bound (1.0:
    every computed token saved turned into throughput). Returns ``{config: {"bound":
    Spread, "fraction": Spread}}`` over the repetitions where both ran, the config
    computed at least one token and the baseline's throughput is > 0; a config with no
    such repetition is left out. When both runs of a repetition also have
    ``"server_cpu_s"`` (not None, > 0), ``"cpu_fraction"`` is the same fraction of the
    server's CPU seconds (the baseline's over the config's, over the bound: the work
    saved, far less moved by other jobs than throughput), over those repetitions.
    """
    out: dict[str, dict[str, Spread]] = {}
    for name in configs:
        if name == baseline:
            continue
        bounds: list[float] = []
        fractions: list[float] = []
        cpu: list[float] = []
        for rep in per_repeat:
            if name not in rep or baseline not in rep:
                continue
            mine, base = rep[name], rep[baseline]
            if mine["prompt_computed"] <= 0 or base["input_tok_s"] <= 0:
                continue
            bound = base["prompt_computed"] / mine["prompt_computed"]
            bounds.append(bound)
            fractions.append(mine["input_tok_s"] / base["input_tok_s"] / bound)
            mine_cpu, base_cpu = mine.get("server_cpu_s"), base.get("server_cpu_s")
            if mine_cpu and base_cpu:
                cpu.append(base_cpu / mine_cpu / bound)
        if bounds:
            out[name] = {"bound": Spread.of(bounds), "fraction": Spread.of(fractions)}
            if cpu:
                out[name]["cpu_fraction"] = Spread.of(cpu)
    return out
