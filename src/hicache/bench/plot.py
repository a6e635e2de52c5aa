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

from hicache.bench.pairs import quantile
from hicache.bench.report import print_table as _rich_table

__all__ = [
    "plot_bars",
    "plot_configs",
    "plot_setups",
    "print_repeats",
    "print_results",
    "print_table",
    "require_matplotlib",
    "write_outputs",
]


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """:func:`hicache.bench.report.print_table`, but 160 columns wide when the output is
    not a terminal (rich would squeeze the tables into 80 columns in logs and files).
    Square brackets are shown as they are (not read as rich markup)."""
    from rich.markup import escape

    title, columns = escape(title), [escape(c) for c in columns]
    rows = [[escape(c) for c in row] for row in rows]
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
        agree = c.get("agreement_us_per_step")
        rows.append([name, str(c.get("tp", 1)), "-" if agree is None else f"{agree:.0f}",
                     f"{c['ttft_mean_s'] * 1e3:.1f}", f"{c['ttft_p50_s'] * 1e3:.1f}",
                     f"{c['ttft_p90_s'] * 1e3:.1f}", f"{c['ttft_p99_s'] * 1e3:.1f}",
                     f"{c['input_tok_s']:.0f}", f"{c['output_tok_s']:.1f}",
                     f"{c['hit_rate']:.1%}", str(h["device"]), str(h["host"]),
                     str(h["storage"])])  # fmt: skip
    print_table(
        title,
        ["config", "tp", "agree µs/step", "TTFT mean ms", "p50 ms", "p90 ms", "p99 ms", "input tok/s",
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


def _ratio_cell(s: Mapping[str, Any] | None, pct: bool) -> str:
    """``median [q25..q75] (min..max)`` of a ratio spread: as % changes when ``pct``
    (``-47% [-50..-36] (-59..-32)``), else as factors (``1.39x [1.38..1.60] (...)``)."""
    if s is None:
        return "-"

    def f(x: float) -> str:
        return f"{(x - 1) * 100:+.0f}" if pct else f"{x:.2f}"

    unit = "%" if pct else "x"
    q, r = f"{f(s['q25'])}..{f(s['q75'])}", f"{f(s['min'])}..{f(s['max'])}"
    return f"{f(s['median'])}{unit} [{q}] ({r})"


def _value_cell(s: Mapping[str, Any] | None, scale: float, fmt: str) -> str:
    """``median (min..max)`` of a spread, times ``scale``."""
    if s is None:
        return "-"
    m, lo, hi = (s[k] * scale for k in ("median", "min", "max"))
    return f"{m:{fmt}} ({lo:{fmt}}..{hi:{fmt}})"


def _pair_cell(f: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> str:
    """One repetition's TTFT change, throughput and server CPU ratios to the baseline's."""
    if f is None or b is None or b["ttft_mean_s"] <= 0 or b["input_tok_s"] <= 0:
        return "-"
    ttft = f["ttft_mean_s"] / b["ttft_mean_s"] - 1
    cell = f"{ttft:+.0%} / {f['input_tok_s'] / b['input_tok_s']:.2f}x"
    fc, bc = f.get("server_cpu_s"), b.get("server_cpu_s")
    return cell + (f" / {fc / bc:.2f}x" if fc is not None and bc else "")


def print_repeats(doc: Mapping[str, Any]) -> None:
    """Per repetition (in run order) each config's TTFT mean (ms), input tokens/s and the
    load average, and the ratios to the baseline; then per config the median and range
    over the repetitions and the pairwise ratios: median [IQR] (min..max)."""
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
        loads = [f["load_1m"] for f in figs.values() if f.get("load_1m") is not None]
        row.append(f"{max(loads):.1f}" if loads else "-")
        rows.append(row)
    print_table(
        "per repetition, in run order: TTFT mean ms / input tok/s (vs baseline: TTFT /"
        " tok/s / server CPU)",
        ["rep", "order", *names, *(f"{n} vs {base}" for n in pairs), "load 1m"],
        rows,
    )
    rows = [[n, _value_cell(pc.get("ttft_mean_s"), 1e3, ".1f"),
             _value_cell(pc.get("input_tok_s"), 1.0, ".0f"),
             _value_cell(pc.get("server_cpu_s"), 1.0, ".1f")]
            for n, pc in rep["per_config"].items()]  # fmt: skip
    print_table(
        f"median (min..max) over {rep['count']} repetitions",
        ["config", "TTFT mean ms", "input tok/s", "server CPU s"],
        rows,
    )
    if not pairs:
        return
    rows = [[n, _ratio_cell(p.get("ttft_mean_ratio"), True),
             _ratio_cell(p.get("input_tok_s_ratio"), False),
             _ratio_cell(p.get("server_cpu_ratio"), False),
             _ratio_cell(p.get("work_saved_bound"), False),
             _ratio_cell(p.get("bound_fraction"), False),
             _ratio_cell(p.get("cpu_bound_fraction"), False)]
            for n, p in pairs.items()]  # fmt: skip
    n_pairs = max(p["ttft_mean_ratio"]["n"] for p in pairs.values())
    print_table(
        f"pairwise against {base}, {n_pairs} pairs: median [q25..q75] (min..max); bound ="
        f" {base}'s computed prompt tokens / the config's, gain / bound = input tok/s ratio"
        " / bound (CPU: the server CPU saving / bound)",
        [
            "config",
            "TTFT mean",
            "input tok/s",
            "server CPU s",
            "bound",
            "gain / bound",
            "CPU / bound",
        ],
        rows,
    )


def write_outputs(
    doc: dict[str, Any], group_key: str, title: str, json_path: str | None, plot_path: str | None
) -> None:
    """Write ``--json`` and ``--plot`` (TTFT per group as lines, input tok/s as bars, and
    with ``pairs`` in ``doc`` the TTFT ratio of every pair)."""
    if json_path:
        Path(json_path).write_text(json.dumps(doc, indent=2) + "\n")
    if plot_path and doc["configs"]:
        configs = doc["configs"]
        pairs = doc.get("pairs") or {}
        plot_configs(
            plot_path,
            title=title,
            x_label=group_key[:-1],
            ttft_s={n: [g["ttft_mean_s"] for g in c[group_key]] for n, c in configs.items()},
            input_tok_s={n: c["input_tok_s"] for n, c in configs.items()},
            ttft_ratios={n: p["ttft_mean_ratio"]["values"] for n, p in pairs.items()} or None,
            baseline=(doc.get("repeats") or {}).get("baseline"),
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
    ttft_ratios: Mapping[str, Sequence[float]] | None = None,
    baseline: str | None = None,
) -> None:
    """Left: mean TTFT (ms) per round/phase, one line per config. Middle: input tokens/s
    per config as bars. ``ttft_s`` in seconds, ``input_tok_s`` in tokens per second.
    Right, with ``ttft_ratios`` (config -> its TTFT ratio to ``baseline`` per pair): one
    dot per pair and a bar at the median."""
    plt = require_matplotlib()
    panels = 3 if ttft_ratios else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), dpi=80)
    ax1, ax2 = axes[0], axes[1]
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
    if ttft_ratios:
        ax3 = axes[2]
        for i, (name, rs) in enumerate(ttft_ratios.items()):
            ax3.plot([i] * len(rs), rs, "o", color=f"C{names.index(name) if name in names else i}",
                     alpha=0.7)  # fmt: skip
            ax3.hlines(quantile(rs, 0.5), i - 0.3, i + 0.3, color="black")
        ax3.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax3.set_xticks(range(len(ttft_ratios)), list(ttft_ratios))
        ax3.set_xlim(-0.6, len(ttft_ratios) - 0.4)
        ax3.set_ylabel(f"TTFT mean / {baseline or 'baseline'}'s, per pair")
        ax3.tick_params(axis="x", labelrotation=20, labelsize=8)
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


def plot_setups(path: str, *, title: str, panels: Mapping[str, Mapping[str, float | None]]) -> None:
    """One bar chart per panel side by side: ``panels[y_label][bar_label]`` is a bar's
    height (None: no bar, shown as "n/a"), bars in the same order in every panel."""
    plt = require_matplotlib()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), dpi=80)
    for ax, (y_label, bars) in zip(
        list(axes) if len(panels) > 1 else [axes], panels.items(), strict=True
    ):
        names = list(bars)
        heights = [bars[n] or 0.0 for n in names]
        drawn = ax.bar(range(len(names)), heights, color=[f"C{i}" for i in range(len(names))])
        ax.bar_label(
            drawn,
            labels=["n/a" if bars[n] is None else f"{bars[n]:.3g}" for n in names],
            fontsize=7,
        )
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel(y_label)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
