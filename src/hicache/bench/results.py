"""Results of the HTTP serving benchmarks: statistics, the JSON document, the report.

* :func:`percentile`, :func:`summarize`: TTFT, throughput and hit-rate figures of a set of
  :class:`hicache.bench.httpclient.RequestRecord`;
* :func:`config_json` (one config: :data:`CONFIG_KEYS` plus one summary per round /
  phase) and :func:`meta_doc` (workload flags, tier sizes, per-config server figures);
* :func:`report_runs`: the shared end of ``multiturn`` and ``long-context``: build the
  document, print the tables, write ``--json`` / ``--plot``, return the exit status.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from typing import Any

from hicache.bench.httpclient import TIERS, RequestRecord
from hicache.bench.plot import print_results, write_outputs
from hicache.bench.runner import ConfigRun

__all__ = [
    "CONFIG_KEYS",
    "config_json",
    "meta_doc",
    "percentile",
    "report_runs",
    "summarize",
]

CONFIG_KEYS = ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "input_tok_s",
               "output_tok_s", "hit_rate", "hit_tokens")  # fmt: skip


# ---------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between ranks (numpy's)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(records: Sequence[RequestRecord], wall_s: float | None = None) -> dict[str, Any]:
    """TTFT stats (s), throughput (tokens/s over ``wall_s``, default first start to last
    end) and hit tokens per tier of ``records``; ``hit_rate`` = cached / prompt tokens."""
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
        "output_tokens": output,
        "wall_s": wall_s,
    }


# ---------------------------------------------------------------------------- documents


def config_json(run: ConfigRun, group_key: str) -> dict[str, Any]:
    """The per-config JSON entry: :data:`CONFIG_KEYS` over all requests plus one summary
    per group (``group_key`` = ``"rounds"`` or ``"phases"``) with its index (from 1)."""
    every = [r for g in run.groups for r in g]
    whole = summarize(every, run.wall_s)
    entry: dict[str, Any] = {k: whole[k] for k in CONFIG_KEYS}
    index = group_key[:-1]  # "round" / "phase"
    entry[group_key] = [{index: i + 1, **summarize(g)} for i, g in enumerate(run.groups) if g]
    return entry


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
    server-side TTFT mean (s), the wall time (s), the server flags and any problem."""
    keys = [*workload_keys, "model_path", "max_parallel", "page_size", "seed"]
    rate = None if math.isinf(args.request_rate) else args.request_rate
    return {
        "workload": {k: getattr(args, k) for k in keys} | {"request_rate": rate},
        "l1_tokens": l1,
        "l2_ratio": ratio,
        "working_set_tokens": working_set,
        "server_ttft_mean_s": {r.name: r.server_ttft_mean_s for r in runs},
        "wall_s": {r.name: r.wall_s for r in runs},
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
) -> int:
    """Build the JSON document (``configs`` and ``meta``), print it as tables under
    ``title`` (when any config ran), write ``--json`` / ``--plot``; 1 when a config
    failed, else 0 (skipped configs do not count)."""
    doc: dict[str, Any] = {"configs": {r.name: config_json(r, group_key) for r in runs}}
    doc["meta"] = meta_doc(args, workload_keys, l1, ratio, working_set, runs, problems)
    if runs:
        print_results(title, doc, group_key)
    write_outputs(doc, group_key, title, args.json, args.plot)
    return 1 if problems and any(v.startswith("failed") for v in problems.values()) else 0
