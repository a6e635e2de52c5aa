"""What the serving benchmarks show and write: tables, ``--json`` and ``--plot`` PNGs.

Plots use matplotlib on the Agg backend (no display needed), imported only when a plot is
asked for; without it, :func:`require_matplotlib` raises a RuntimeError that says how to
install it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hicache.bench.report import print_table as _rich_table

__all__ = [
    "plot_bars",
    "plot_configs",
    "print_repeats",
    "print_results",
    "print_table",
    "require_matplotlib",
    "write_outputs",
]


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """:func:`hicache.bench.report.print_table`, but 160 columns wide when the output is
    not a terminal (rich would squeeze the tables into 80 columns in logs and files)."""
    if sys.stdout.isatty():
        _rich_table(title, columns, rows)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*row)
    Console(width=160).print(table)


def print_results(title: str, doc: Mapping[str, Any], group_key: str) -> None:
    """The summary table (one row per config) and TTFT per group x config (ms, hit %)."""
    configs: Mapping[str, Any] = doc["configs"]
    rows = []
    for name, c in configs.items():
        h = c["hit_tokens"]
        rows.append([name, f"{c['ttft_mean_s'] * 1e3:.1f}", f"{c['ttft_p50_s'] * 1e3:.1f}",
                     f"{c['ttft_p90_s'] * 1e3:.1f}", f"{c['ttft_p99_s'] * 1e3:.1f}",
                     f"{c['input_tok_s']:.0f}", f"{c['output_tok_s']:.1f}",
                     f"{c['hit_rate']:.1%}", str(h["device"]), str(h["host"]),
                     str(h["storage"])])  # fmt: skip
    print_table(
        title,
        ["config", "TTFT mean ms", "p50 ms", "p90 ms", "p99 ms", "input tok/s",
         "output tok/s", "hit rate", "L1 hit tok", "L2 hit tok", "L3 hit tok"],
        rows,
    )  # fmt: skip
    n = max((len(c[group_key]) for c in configs.values()), default=0)
    index = group_key[:-1]
    per = []
    for i in range(n):
        row = [str(i + 1)]
        for c in configs.values():
            g = c[group_key][i] if i < len(c[group_key]) else None
            row.append("-" if g is None else f"{g['ttft_mean_s'] * 1e3:.1f} ({g['hit_rate']:.0%})")
        per.append(row)
    print_table(
        f"TTFT mean ms (hit rate) per {index}", [index, *configs.keys()], per
    )  # fmt: skip


def _ratio_cells(s: Mapping[str, Any] | None, pct: bool) -> list[str]:
    """Median, IQR (q25..q75) and min..max of a ratio spread; as a % change when ``pct``."""
    if s is None:
        return ["-", "-", "-"]

    def f(x: float) -> str:
        return f"{x - 1:+.0%}" if pct else f"{x:.2f}"

    unit = "" if pct else "x"
    return [f(s["median"]) + unit, f"{f(s['q25'])}..{f(s['q75'])}{unit}",
            f"{f(s['min'])}..{f(s['max'])}{unit}"]  # fmt: skip


def _pair_cell(f: Mapping[str, float] | None, b: Mapping[str, float] | None) -> str:
    """One repetition's TTFT change and throughput ratio against the baseline's."""
    if f is None or b is None or b["ttft_mean_s"] <= 0 or b["input_tok_s"] <= 0:
        return "-"
    ttft = f["ttft_mean_s"] / b["ttft_mean_s"] - 1
    return f"{ttft:+.0%} / {f['input_tok_s'] / b['input_tok_s']:.2f}x"


def print_repeats(doc: Mapping[str, Any]) -> None:
    """Per repetition (in run order) each config's TTFT mean (ms) and input tokens/s, and
    the pairwise ratios to the baseline: median, interquartile range and min..max."""
    rep = doc["repeats"]
    names = list(rep["per_config"])
    base = rep["baseline"]
    pairs: Mapping[str, Any] = doc["pairs"]
    rows = []
    for r, (order, figs) in enumerate(zip(rep["order"], rep["runs"], strict=True)):
        row = [str(r + 1), " ".join(order)]
        for n in names:
            f = figs.get(n)
            row.append(
                "-" if f is None else f"{f['ttft_mean_s'] * 1e3:.1f} / {f['input_tok_s']:.0f}"
            )
        row += [_pair_cell(figs.get(n), figs.get(base)) for n in pairs]
        rows.append(row)
    print_table(
        f"per repetition, in run order: TTFT mean ms / input tok/s; vs {base}: TTFT / tok/s",
        ["rep", "order", *names, *(f"{n} vs {base}" for n in pairs)],
        rows,
    )
    rows = []
    for n in names:
        pc = rep["per_config"][n]
        t, i = pc["ttft_mean_s"], pc["input_tok_s"]
        p = pairs.get(n, {})
        rows.append([
            n, f"{t['median'] * 1e3:.1f} ({t['min'] * 1e3:.1f}..{t['max'] * 1e3:.1f})",
            f"{i['median']:.0f} ({i['min']:.0f}..{i['max']:.0f})",
            *_ratio_cells(p.get("ttft_mean_ratio"), True),
            *_ratio_cells(p.get("input_tok_s_ratio"), False),
        ])  # fmt: skip
    n_pairs = max((p["ttft_mean_ratio"]["n"] for p in pairs.values()), default=0)
    print_table(
        f"over {rep['count']} repetitions; pairwise against {base} ({n_pairs} pairs)",
        ["config", "TTFT ms median (min..max)", "input tok/s median (min..max)",
         "TTFT vs base median", "IQR", "min..max", "tok/s vs base median", "IQR", "min..max"],
        rows,
    )  # fmt: skip


def write_outputs(
    doc: dict[str, Any], group_key: str, title: str, json_path: str | None, plot_path: str | None
) -> None:
    """Write ``--json`` and ``--plot`` (TTFT per group as lines, input tok/s as bars)."""
    if json_path:
        Path(json_path).write_text(json.dumps(doc, indent=2) + "\n")
    if plot_path and doc["configs"]:
        configs = doc["configs"]
        plot_configs(
            plot_path,
            title=title,
            x_label=group_key[:-1],
            ttft_s={n: [g["ttft_mean_s"] for g in c[group_key]] for n, c in configs.items()},
            input_tok_s={n: c["input_tok_s"] for n, c in configs.items()},
        )


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the Agg backend; RuntimeError when matplotlib is absent."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_configs(
    path: str,
    *,
    title: str,
    x_label: str,
    ttft_s: Mapping[str, Sequence[float]],
    input_tok_s: Mapping[str, float],
) -> None:
    """Left: mean TTFT (ms) per round/phase, one line per config. Right: input tokens/s
    per config as bars. ``ttft_s`` in seconds, ``input_tok_s`` in tokens per second."""
    plt = require_matplotlib()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), dpi=80)
    for name, ys in ttft_s.items():
        ax1.plot(range(1, len(ys) + 1), [y * 1e3 for y in ys], marker="o", label=name)
    ax1.set_xlabel(x_label)
    ax1.set_ylabel("mean TTFT (ms)")
    ax1.set_yscale("log")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    n = max((len(v) for v in ttft_s.values()), default=0)
    ax1.set_xticks(range(1, n + 1))
    names = list(input_tok_s)
    bars = ax2.bar(names, [input_tok_s[k] for k in names], color=f"C{0}")
    for i, b in enumerate(bars):
        b.set_color(f"C{i}")
    ax2.bar_label(bars, fmt="%.0f", fontsize=8)
    ax2.set_ylabel("input throughput (tokens/s)")
    ax2.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_bars(
    path: str,
    *,
    title: str,
    labels: Sequence[str],
    series: Mapping[str, Sequence[float | None]],
    y_label: str,
) -> None:
    """Grouped bars: one group per label, one bar per series (None = no bar)."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(8, 4), dpi=80)
    width = 0.8 / max(1, len(series))
    for i, (name, ys) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        vals = [float("nan") if y is None else y for y in ys]
        bars = ax.bar(xs, vals, width, label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel(y_label)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
