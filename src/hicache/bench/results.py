"""Results of the HTTP serving benchmarks: statistics, the JSON document, the report.

* :func:`percentile`, :func:`summarize`: TTFT, throughput and hit-rate figures of a set of
  :class:`hicache.bench.httpclient.RequestRecord`;
* :func:`config_json` (one config: :data:`CONFIG_KEYS` plus one summary per round /
  phase) and :func:`meta_doc` (workload flags, tier sizes, per-config server figures);
* :func:`pool_runs` (one config's repetitions as one run) and :func:`repeats_doc` (the
  per-repetition figures and the pairwise ratios to the baseline,
  :mod:`hicache.bench.pairs`);
* :func:`report_runs`: the shared end of ``multiturn`` and ``long-context``: build the
  document, print the tables, write ``--json`` / ``--plot``, return the exit status.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from typing import Any

from hicache.bench.httpclient import TIERS, RequestRecord
from hicache.bench.pairs import Spread, compare_to_baseline, quantile, work_saved_bound
from hicache.bench.plot import print_repeats, print_results, write_outputs
from hicache.bench.runner import ConfigRun, RepeatedRuns
from hicache.bench.serverproc import split_tp

__all__ = [
    "CONFIG_KEYS",
    "PAIR_METRICS",
    "REPEAT_KEYS",
    "config_json",
    "meta_doc",
    "percentile",
    "pool_runs",
    "repeats_doc",
    "report_runs",
    "summarize",
]

CONFIG_KEYS = ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "input_tok_s",
               "output_tok_s", "hit_rate", "hit_tokens")  # fmt: skip


# ---------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between ranks (numpy's)."""
    return quantile(values, q / 100.0) if values else float("nan")


def summarize(records: Sequence[RequestRecord], wall_s: float | None = None) -> dict[str, Any]:
    """TTFT stats (s), throughput (tokens/s over ``wall_s``, default first start to last
    end) and hit tokens per tier of ``records``; ``hit_rate`` = cached / prompt tokens;
    ``prompt_computed`` = prompt - cached tokens (what the server had to compute)."""
    if wall_s is None:
        wall_s = max(r.end_s for r in records) - min(r.start_s for r in records)
    ttfts = [r.ttft_s for r in records]
    prompt = sum(r.prompt_tokens for r in records)
    output = sum(r.output_tokens for r in records)
    hits = {t: sum(r.cached[t] for r in records) for t in TIERS}
    return {
        "ttft_mean_s": sum(ttfts) / len(ttfts),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "input_tok_s": prompt / wall_s if wall_s > 0 else 0.0,
        "output_tok_s": output / wall_s if wall_s > 0 else 0.0,
        "hit_rate": sum(hits.values()) / prompt if prompt else 0.0,
        "hit_tokens": hits,
        "requests": len(records),
        "prompt_tokens": prompt,
        "prompt_computed": prompt - sum(hits.values()),
        "output_tokens": output,
        "wall_s": wall_s,
    }


# ---------------------------------------------------------------------------- documents


def config_json(run: ConfigRun, group_key: str) -> dict[str, Any]:
    """The per-config JSON entry: :data:`CONFIG_KEYS` over all requests, ``tp`` (the
    server's tensor-parallel size), ``agreement_us_per_step`` (rank 0's mean time per
    engine step in the ranks' agreement collectives, µs; None at TP 1) and
    ``agreement_steps``, plus one summary per group (``group_key`` = ``"rounds"`` or ``"phases"``) with its index (from 1)."""
    every = [r for g in run.groups for r in g]
    whole = summarize(every, run.wall_s)
    entry: dict[str, Any] = {k: whole[k] for k in CONFIG_KEYS}
    entry["tp"] = split_tp(run.name)[1]
    entry["agreement_us_per_step"] = run.agreement_us_per_step
    entry["agreement_steps"] = run.agreement_steps
    index = group_key[:-1]  # "round" / "phase"
    walls: list[float | None] = [None] * len(run.groups)
    if run.group_wall_s is not None:
        walls = list(run.group_wall_s)
    pairs = enumerate(zip(run.groups, walls, strict=True))
    entry[group_key] = [{index: i + 1, **summarize(g, w)} for i, (g, w) in pairs if g]
    return entry


def _span(records: Sequence[RequestRecord]) -> float:
    return max(r.end_s for r in records) - min(r.start_s for r in records) if records else 0.0


def pool_runs(runs: Sequence[ConfigRun]) -> ConfigRun:
    """The runs of one config (several repetitions) as one: group ``i`` holds every run's
    group ``i``, with the sum of their wall times (s) as its wall time, so its throughput
    is tokens over time under load; ``wall_s`` and ``server_cpu_s`` are the sums of the
    runs' (CPU None unless every run has it); the server's TTFT mean is the mean of the
    runs' (they send as many requests each). ValueError on none."""
    if not runs:
        raise ValueError("pool_runs needs at least one run")
    n = max(len(r.groups) for r in runs)
    groups = [[rec for r in runs if i < len(r.groups) for rec in r.groups[i]] for i in range(n)]
    walls = [sum(_span(r.groups[i]) for r in runs if i < len(r.groups)) for i in range(n)]
    server = [r.server_ttft_mean_s for r in runs if r.server_ttft_mean_s is not None]
    cpu = [r.server_cpu_s for r in runs if r.server_cpu_s is not None]
    return ConfigRun(
        runs[0].name,
        groups,
        sum(r.wall_s for r in runs),
        sum(server) / len(server) if server else None,
        flags=list(runs[0].flags),
        server_cpu_s=sum(cpu) if len(cpu) == len(runs) else None,
        group_wall_s=walls,
        agreement_s=sum(r.agreement_s for r in runs),
        agreement_steps=sum(r.agreement_steps for r in runs),
    )


REPEAT_KEYS = ("ttft_mean_s", "ttft_p50_s", "input_tok_s", "output_tok_s", "hit_rate", "wall_s",
               "prompt_computed")  # fmt: skip
"""The figures kept per config per repetition (``repeats.runs`` in the JSON)."""

PAIR_METRICS = {"ttft_mean_ratio": "ttft_mean_s", "input_tok_s_ratio": "input_tok_s",
                "server_cpu_ratio": "server_cpu_s"}  # fmt: skip
"""The pairwise ratios reported (JSON key -> the per-repetition figure it divides). The
server's CPU seconds for the same work depend far less on other jobs than wall times do
(they still move with cache and frequency effects, and with spinning threads)."""


def repeats_doc(rr: RepeatedRuns, baseline: str | None) -> dict[str, Any]:
    """The JSON ``repeats`` and ``pairs`` entries of a repeated run.

    ``repeats``: ``count``, ``baseline``, ``order`` (configs per repetition, in run
    order), ``runs`` (per repetition, per config: :data:`REPEAT_KEYS`, the server's TTFT
    mean (s), its CPU seconds and the 1-minute load average (None when unknown), and
    ``start_s``: when its first request was sent, in s after the first run's),
    ``per_config`` (per config, the :class:`hicache.bench.pairs.Spread` of its TTFT mean
    (s), input throughput (tokens/s) and server CPU seconds over the repetitions).
    ``pairs``: per config other than ``baseline``, the spread of its ratio to the
    baseline in the same repetition for each of :data:`PAIR_METRICS` (TTFT and CPU: < 1
    is faster; throughput: > 1 is faster), and ``work_saved_bound`` / ``bound_fraction``
    / ``cpu_bound_fraction``: the spreads of :func:`hicache.bench.pairs.work_saved_bound`
    (the baseline's computed prompt tokens over the config's, and the throughput gain and
    the server CPU saving as fractions of that); empty without a baseline.
    """

    def first_start(run: ConfigRun) -> float | None:
        return min((x.start_s for g in run.groups for x in g), default=None)

    starts = [t for rep in rr.runs for run in rep.values() if (t := first_start(run)) is not None]
    t0 = min(starts, default=0.0)
    per_rep: list[dict[str, dict[str, Any]]] = []
    for rep in rr.runs:
        figures: dict[str, dict[str, Any]] = {}
        for name in rr.configs:
            if name in rep:
                run = rep[name]
                whole = summarize([x for g in run.groups for x in g], run.wall_s)
                figures[name] = {k: whole[k] for k in REPEAT_KEYS}
                first = first_start(run)
                figures[name] |= {"server_ttft_mean_s": run.server_ttft_mean_s,
                                  "server_cpu_s": run.server_cpu_s, "load_1m": run.load_1m,
                                  "start_s": None if first is None else first - t0}  # fmt: skip
        per_rep.append(figures)
    ran = [n for n in rr.configs if rr.of(n)]
    per_config: dict[str, dict[str, Any]] = {}
    for n in ran:
        per_config[n] = {}
        for m in ("ttft_mean_s", "input_tok_s", "server_cpu_s"):
            xs = [f[n][m] for f in per_rep if n in f and f[n][m] is not None]
            if xs:
                per_config[n][m] = Spread.of(xs).to_json()
    pairs: dict[str, Any] = {}
    if baseline is not None:
        ratios = compare_to_baseline(per_rep, ran, baseline, list(PAIR_METRICS.values()))
        bounds = work_saved_bound(per_rep, ran, baseline)
        for name, by_metric in ratios.items():
            pairs[name] = {"baseline": baseline} | {
                key: by_metric[m].to_json() for key, m in PAIR_METRICS.items() if m in by_metric
            }
            if name in bounds:
                pairs[name]["work_saved_bound"] = bounds[name]["bound"].to_json()
                pairs[name]["bound_fraction"] = bounds[name]["fraction"].to_json()
                if "cpu_fraction" in bounds[name]:
                    pairs[name]["cpu_bound_fraction"] = bounds[name]["cpu_fraction"].to_json()
    repeats = {"count": len(rr.runs), "baseline": baseline,
               "order": [list(o) for o in rr.order], "runs": per_rep, "per_config": per_config}  # fmt: skip
    return {"repeats": repeats, "pairs": pairs}


def meta_doc(
    args: argparse.Namespace,
    workload_keys: Sequence[str],
    l1: int,
    ratio: float,
    working_set: int,
    runs: Sequence[ConfigRun],
    problems: Mapping[str, str],
) -> dict[str, Any]:
    """The JSON ``meta`` entry: workload flags, tier sizes (tokens), and per config the
    server-side TTFT mean (s), the wall time (s), the server's CPU time (s, None when
    unknown), the server flags and any problem."""
    keys = [*workload_keys, "model_path", "max_parallel", "page_size", "seed"]
    rate = None if math.isinf(args.request_rate) else args.request_rate
    return {
        "workload": {k: getattr(args, k) for k in keys} | {"request_rate": rate},
        "l1_tokens": l1,
        "l2_ratio": ratio,
        "working_set_tokens": working_set,
        "server_ttft_mean_s": {r.name: r.server_ttft_mean_s for r in runs},
        "wall_s": {r.name: r.wall_s for r in runs},
        "server_cpu_s": {r.name: r.server_cpu_s for r in runs},
        "server_flags": {r.name: r.flags for r in runs},
        "problems": dict(problems),
    }


def report_runs(
    args: argparse.Namespace,
    runs: Sequence[ConfigRun],
    problems: Mapping[str, str],
    *,
    group_key: str,
    workload_keys: Sequence[str],
    l1: int,
    ratio: float,
    working_set: int,
    title: str,
    extra: Mapping[str, Any] | None = None,
) -> int:
    """Build the JSON document (``configs``, ``meta`` and the entries of ``extra``), print
    it as tables under ``title`` (when any config ran), write ``--json`` / ``--plot``; 1
    when a config failed, else 0 (skipped configs do not count)."""
    doc: dict[str, Any] = {"configs": {r.name: config_json(r, group_key) for r in runs}}
    doc["meta"] = meta_doc(args, workload_keys, l1, ratio, working_set, runs, problems)
    doc |= dict(extra or {})
    if runs:
        print_results(title, doc, group_key)
        if doc.get("repeats"):
            print_repeats(doc)
    write_outputs(doc, group_key, title, args.json, args.plot)
    return 1 if problems and any(v.startswith("failed") for v in problems.values()) else 0
