"""What ``hicache bench shared-prefix`` shows and writes: tables, JSON and the PNG.

The document (:func:`hicache.bench.shared_prefix.main` builds it) is
``{"workload", "l1_tokens", "hicache_ratio", "working_set_tokens", "mamba_track_interval",
"models": {MODEL: {CONFIG: [ROUND, ...]}}}``, each ROUND being
:meth:`~hicache.bench.shared_prefix.RoundResult.summary` (times in s, token counts).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hicache.bench.components import fmt_optional
from hicache.bench.plot import print_table, require_matplotlib

__all__ = ["plot_rounds", "print_report", "round_ratios", "write_outputs"]

JSON_NAME = "shared_prefix.json"
PNG_NAME = "shared_prefix.png"


def round_ratios(rounds: Sequence[Mapping[str, Any]]) -> list[float]:
    """Mean TTFT of each round over round 1's (1.0 for round 1; nan when undefined)."""
    first = rounds[0]["ttft_mean_s"] if rounds else math.nan
    return [r["ttft_mean_s"] / first if first and first > 0 else math.nan for r in rounds]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:.1f}"


def _pool(p: Mapping[str, Any] | None) -> str:
    return "n/a" if p is None else f"{p['used']}/{p['total']}"


POOL_LABELS: dict[str, str] = {"full": "KV pages", "swa": "SWA pages", "mamba": "snapshots"}
"""Column label of each component's pool (the cache's component names)."""
HIT_LABELS: dict[str, str] = {"swa": "SWA window", "mamba": "snapshot"}
"""Column label of each component's hits (where its part of a reused prefix was)."""


def _component(rnd: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    return next((c for c in rnd["components"] if c["component"] == name), None)


def _hits(rnd: Mapping[str, Any], name: str) -> str:
    h = next((h for h in rnd.get("component_hits", ()) if h["component"] == name), None)
    return "n/a" if h is None else f"{h['l1']}/{h['l2']}"


def _names(per: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """Component names of a model's runs, in the cache's order (full first)."""
    names: list[str] = []
    for rounds in per.values():
        for c in rounds[0]["components"] if rounds else []:
            if c["component"] not in names:
                names.append(c["component"])
    return names


def print_report(doc: Mapping[str, Any]) -> None:
    """Per model: one row per config and round (TTFT, ratio to round 1, hit rates per
    tier, resumed admissions, where each component's part of the hits was (L1/L2
    admissions), pools at the round's end); then the components' bytes per cached token
    at the end of each config's last round, against their nominal per-token size."""
    ms = 1e3
    for model, per in doc["models"].items():
        names = _names(per)
        extra = [n for n in names if n != "full"]
        rows = []
        for config, rounds in per.items():
            for r, ratio in zip(rounds, round_ratios(rounds), strict=True):
                t = r["hit_rate_per_tier"]
                pools = []
                for n in names:
                    c = _component(r, n)
                    pools += [_pool(c and c["l1"]), _pool(c and c["l2"])]
                agree = r.get("agreement_us_per_step")
                rows.append([
                    config, str(r.get("tp", 1)), "-" if agree is None else f"{agree:.0f}",
                    str(r["round"]), f"{r['ttft_mean_s'] * ms:.1f}",
                    f"{r['ttft_p50_s'] * ms:.1f}", _ms(r["ttft_hit_mean_s"]),
                    _ms(r["ttft_miss_mean_s"]), f"{ratio:.2f}", f"{r['hit_rate']:.1%}",
                    f"{t['device']:.1%}", f"{t['host']:.1%}", f"{t['storage']:.1%}",
                    f"{r['resumed_requests']}/{r['requests'] - r['errors']}",
                    *[_hits(r, n) for n in extra], *pools,
                    str(r["counters"]["device_evicted_tokens_total"]
                        + r["counters"]["device_demoted_tokens_total"]),
                ])  # fmt: skip
        print_table(
            f"shared prefix: {model}; L1 {doc['l1_tokens']} tokens, L2 {doc['hicache_ratio']:g}"
            f" x L1, system prompts {doc['working_set_tokens']} tokens",
            ["config", "tp", "agree µs/step", "round", "TTFT mean ms", "p50 ms", "hit ms", "miss ms", "vs round 1",
             "hit rate", "L1 hit", "L2 hit", "L3 hit", "resumed",
             *[f"{HIT_LABELS.get(n, n)} L1/L2" for n in extra],
             *[f"{tier} {POOL_LABELS.get(n, n)}" for n in names for tier in ("L1", "L2")],
             "L1 evicted tok"],
            rows,
        )  # fmt: skip
        comp_rows = []
        for config, rounds in per.items():
            for c in rounds[-1]["components"] if rounds else []:
                comp_rows.append([
                    config, c["component"], str(c["layers"]),
                    fmt_optional(c["bytes_per_token"]), fmt_optional(c["nominal_bytes_per_token"]),
                    fmt_optional(c["held_ratio"], ".4f"), _pool(c["l1"]), _pool(c["l2"]),
                    c["note"],
                ])  # fmt: skip
        print_table(
            f"{model}: L1 bytes per cached token per component (end of the last round)",
            ["config", "component", "layers", "held B/token", "nominal B/token",
             "held/nominal", "L1 pool", "L2 pool", "note"],
            comp_rows,
        )  # fmt: skip


def write_outputs(doc: Mapping[str, Any], out: Path) -> None:
    """``out/shared_prefix.json`` and ``out/shared_prefix.png`` (directory created)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / JSON_NAME).write_text(json.dumps(_no_nan(doc), indent=2) + "\n")
    plot_rounds(doc, out / PNG_NAME)


def _no_nan(x: Any) -> Any:
    """``x`` with every NaN float replaced by None (JSON has no NaN)."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, Mapping):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_no_nan(v) for v in x]
    return x


def plot_rounds(doc: Mapping[str, Any], path: Path) -> None:
    """One panel per model: mean TTFT (ms) per round, one bar per config, each bar
    labelled with its ratio to the config's round 1."""
    plt = require_matplotlib()
    models = list(doc["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), dpi=80, squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        per = doc["models"][model]
        n_rounds = max((len(r) for r in per.values()), default=0)
        width = 0.8 / max(1, len(per))
        for i, (config, rounds) in enumerate(per.items()):
            xs = [j + 1 + (i - (len(per) - 1) / 2) * width for j in range(len(rounds))]
            bars = ax.bar(xs, [r["ttft_mean_s"] * 1e3 for r in rounds], width, label=config)
            ax.bar_label(bars, labels=[f"{x:.2f}x" for x in round_ratios(rounds)], fontsize=7)
        ax.set_xticks(range(1, n_rounds + 1))
        ax.set_xlabel("round")
        ax.set_ylabel("mean TTFT (ms)")
        ax.set_title(model, fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(
        f"shared prefix: {doc['workload']['groups']} groups x"
        f" {doc['workload']['requests_per_group']} requests, system prompt"
        f" {doc['workload']['system_tokens']} tokens; L1 {doc['l1_tokens']} tokens"
        " (labels: TTFT / round 1)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
