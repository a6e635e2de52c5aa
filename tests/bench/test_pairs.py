"""The repeated A/B comparison of the serving benchmarks on hand-made numbers (no server).

* :func:`hicache.bench.pairs.alternating_order`: A B, B A, ... (and reversed for more configs);
* :func:`hicache.bench.pairs.pair_ratios` / :class:`Spread`: exact medians, quartiles, ranges;
* :func:`hicache.bench.results.pool_runs` and :func:`repeats_doc`: repetitions pooled into
  per-round figures, and the per-repetition figures and pairs of the JSON.
"""

from __future__ import annotations

import pytest

from hicache.bench.httpclient import RequestRecord
from hicache.bench.pairs import (
    Spread,
    alternating_order,
    compare_to_baseline,
    pair_ratios,
    quantile,
    work_saved_bound,
)
from hicache.bench.results import config_json, pool_runs, repeats_doc
from hicache.bench.runner import ConfigRun, RepeatedRuns


def test_alternating_order_two_configs_is_a_b_b_a() -> None:
    order = alternating_order(["A", "B"], 5)
    assert order == [("A", "B"), ("B", "A"), ("A", "B"), ("B", "A"), ("A", "B")]
    assert [c for rep in order[:4] for c in rep] == list("ABBAABBA")


def test_alternating_order_three_configs_reverses_every_other() -> None:
    assert alternating_order(["a", "b", "c"], 3) == [
        ("a", "b", "c"),
        ("c", "b", "a"),
        ("a", "b", "c"),
    ]
    assert alternating_order(["a"], 2) == [("a",), ("a",)]


def test_alternating_order_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="repeats=0"):
        alternating_order(["a", "b"], 0)
    with pytest.raises(ValueError, match="distinct"):
        alternating_order(["a", "a"], 2)
    with pytest.raises(ValueError, match="non-empty"):
        alternating_order([], 2)


def test_spread_quantiles_are_exact() -> None:
    s = Spread.of([4.0, 1.0, 3.0, 2.0])
    assert (s.median, s.q25, s.q75, s.min, s.max) == (2.5, 1.75, 3.25, 1.0, 4.0)
    assert s.values == (4.0, 1.0, 3.0, 2.0) and s.n == 4 and s.iqr == 1.5
    assert s.to_json() == {"n": 4, "median": 2.5, "q25": 1.75, "q75": 3.25, "min": 1.0,
                           "max": 4.0, "values": [4.0, 1.0, 3.0, 2.0]}  # fmt: skip
    one = Spread.of([7.0])
    assert (one.median, one.q25, one.q75, one.min, one.max) == (7.0,) * 5
    with pytest.raises(ValueError, match="at least one"):
        Spread.of([])
    assert quantile([1.0, 2.0, 3.0], 0.5) == 2.0
    with pytest.raises(ValueError, match=r"q=1\.5"):
        quantile([1.0], 1.5)


def test_pair_ratios_pair_by_repetition() -> None:
    # repetition 2 lacks the config, repetition 4's baseline is 0: both pairs left out
    s = pair_ratios([2.0, 3.0, None, 8.0, 1.0], [4.0, 3.0, 5.0, 2.0, 0.0])
    assert s is not None
    assert s.values == (0.5, 1.0, 4.0)
    assert (s.median, s.q25, s.q75, s.min, s.max) == (1.0, 0.75, 2.5, 0.5, 4.0)
    assert pair_ratios([None], [1.0]) is None
    with pytest.raises(ValueError, match="2 values against 1"):
        pair_ratios([1.0, 2.0], [1.0])


def test_ratio_of_pairs_is_not_ratio_of_medians() -> None:
    """A 2x drift between repetitions moves both configs of a pair; the pairwise ratio
    stays 0.5 while the ratio of per-config medians does not."""
    base = [100.0, 200.0, 100.0]  # the machine was twice as slow in repetition 2
    fast = [50.0, 100.0, 50.0]
    s = pair_ratios(fast, base)
    assert s is not None and s.values == (0.5, 0.5, 0.5) and s.min == s.max == 0.5


def test_compare_to_baseline_skips_missing_and_the_baseline() -> None:
    per_rep = [
        {"l1": {"t": 2.0}, "l1_l2": {"t": 1.0}, "x": {"t": 4.0}},
        {"l1": {"t": 4.0}, "l1_l2": {"t": 3.0}},  # x failed in repetition 2
    ]
    out = compare_to_baseline(per_rep, ["l1", "l1_l2", "x"], "l1", ["t"])
    assert set(out) == {"l1_l2", "x"}
    assert out["l1_l2"]["t"].values == (0.5, 0.75)
    assert out["x"]["t"].values == (2.0,)


def _rec(group: int, start: float, end: float, ttft: float, prompt: int) -> RequestRecord:
    return RequestRecord(group=group, client=0, prompt_tokens=prompt, output_tokens=2,
                         ttft_s=ttft, latency_s=end - start, start_s=start, end_s=end,
                         cached={"device": 0, "host": prompt // 2, "storage": 0})  # fmt: skip


def _run(name: str, ttft: float, offset: float, cpu: float | None = None) -> ConfigRun:
    """Two rounds of one request each: round 1 takes 1 s, round 2 takes 2 s."""
    groups = [
        [_rec(0, offset, offset + 1, ttft, 100)],
        [_rec(1, offset + 1, offset + 3, ttft, 200)],
    ]
    return ConfigRun(name, groups, 3.0, ttft, flags=["--x"], server_cpu_s=cpu, load_1m=1.5)


def test_pool_runs_sums_walls_per_round() -> None:
    # the second repetition ran 1000 s later: the gap between them is not wall time
    pooled = pool_runs([_run("l1", 0.1, 0.0, 2.0), _run("l1", 0.3, 1000.0, 3.0)])
    assert pooled.name == "l1" and pooled.wall_s == 6.0 and pooled.flags == ["--x"]
    assert pooled.server_cpu_s == 5.0
    assert pool_runs([_run("l1", 0.1, 0.0, 2.0), _run("l1", 0.1, 9.0)]).server_cpu_s is None
    assert pooled.group_wall_s == [2.0, 4.0]
    assert pooled.server_ttft_mean_s == pytest.approx(0.2)
    entry = config_json(pooled, "rounds")
    assert entry["input_tok_s"] == 600 / 6.0
    assert [r["input_tok_s"] for r in entry["rounds"]] == [200 / 2.0, 400 / 4.0]
    assert [r["requests"] for r in entry["rounds"]] == [2, 2]
    assert entry["rounds"][0]["ttft_mean_s"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="at least one"):
        pool_runs([])


def test_repeats_doc_pairs_each_repetition_with_the_baseline() -> None:
    order = alternating_order(["l1", "l1_l2"], 3)
    ttft = {"l1": [0.1, 0.2, 0.1], "l1_l2": [0.05, 0.15, 0.08]}
    cpu = {"l1": [2.0, 2.0, 2.0], "l1_l2": [1.0, 1.5, 1.0]}
    runs = [{n: _run(n, ttft[n][r], 10.0 * r, cpu[n][r]) for n in order[r]} for r in range(3)]
    # the baseline ran first in repetitions 1 and 3, second in repetition 2
    assert list(runs[1]) == ["l1_l2", "l1"]
    del runs[2]["l1_l2"]  # l1_l2 failed in repetition 3
    rr = RepeatedRuns(["l1", "l1_l2"], order, runs, {"l1_l2": "failed in repetition 3: x"})
    doc = repeats_doc(rr, "l1")
    rep = doc["repeats"]
    assert rep["count"] == 3 and rep["baseline"] == "l1"
    assert rep["order"] == [["l1", "l1_l2"], ["l1_l2", "l1"], ["l1", "l1_l2"]]
    assert [sorted(r) for r in rep["runs"]] == [["l1", "l1_l2"], ["l1", "l1_l2"], ["l1"]]
    assert rep["runs"][0]["l1"]["input_tok_s"] == 300 / 3.0
    assert rep["runs"][1]["l1_l2"]["server_ttft_mean_s"] == 0.15
    assert rep["runs"][1]["l1_l2"]["server_cpu_s"] == 1.5
    assert rep["runs"][1]["l1_l2"]["load_1m"] == 1.5
    assert [r["l1"]["start_s"] for r in rep["runs"]] == [0.0, 10.0, 20.0]
    assert rep["per_config"]["l1_l2"]["server_cpu_s"]["values"] == [1.0, 1.5]
    assert rep["per_config"]["l1"]["ttft_mean_s"]["values"] == [0.1, 0.2, 0.1]
    assert rep["per_config"]["l1_l2"]["ttft_mean_s"]["n"] == 2
    pair = doc["pairs"]["l1_l2"]
    assert pair["baseline"] == "l1"
    assert pair["ttft_mean_ratio"]["values"] == pytest.approx([0.5, 0.75])
    assert pair["ttft_mean_ratio"]["median"] == pytest.approx(0.625)
    assert pair["input_tok_s_ratio"]["values"] == [1.0, 1.0]  # same tokens, same walls
    assert pair["server_cpu_ratio"]["values"] == [0.5, 0.75]
    assert set(doc["pairs"]) == {"l1_l2"}
    assert repeats_doc(rr, None)["pairs"] == {}
    # without CPU times (--url): no CPU spread, no CPU ratio
    bare = [{n: _run(n, 0.1, 0.0) for n in ("l1", "l1_l2")}]
    doc = repeats_doc(RepeatedRuns(["l1", "l1_l2"], order[:1], bare, {}), "l1")
    assert "server_cpu_s" not in doc["repeats"]["per_config"]["l1"]
    assert set(doc["pairs"]["l1_l2"]) == {"baseline", "ttft_mean_ratio", "input_tok_s_ratio",
                                          "work_saved_bound", "bound_fraction"}  # fmt: skip
    assert doc["pairs"]["l1_l2"]["work_saved_bound"]["values"] == [1.0]  # same hits


def test_work_saved_bound_is_computed_tokens_ratio_and_gain_over_it() -> None:
    per_rep = [
        # bound 1200 / 300 = 4; gain 300 / 100 = 3: 0.75 of the bound
        {"l1": {"prompt_computed": 1200, "input_tok_s": 100.0},
         "l1_l2": {"prompt_computed": 300, "input_tok_s": 300.0}},
        # bound 2, gain 2: the whole bound
        {"l1": {"prompt_computed": 1000, "input_tok_s": 50.0},
         "l1_l2": {"prompt_computed": 500, "input_tok_s": 100.0}},
        # everything hit: no finite bound, left out
        {"l1": {"prompt_computed": 1000, "input_tok_s": 50.0},
         "l1_l2": {"prompt_computed": 0, "input_tok_s": 900.0}},
        {"l1_l2": {"prompt_computed": 10, "input_tok_s": 1.0}},  # the baseline failed
    ]  # fmt: skip
    out = work_saved_bound(per_rep, ["l1", "l1_l2"], "l1")
    assert set(out) == {"l1_l2"}
    assert out["l1_l2"]["bound"].values == (4.0, 2.0)
    assert out["l1_l2"]["fraction"].values == (0.75, 1.0)
    assert "cpu_fraction" not in out["l1_l2"]  # no CPU seconds (--url)
    # CPU 12 s against 4 s: 3x less work, 0.75 of the bound of 4; repetition 2 has none
    per_rep[0]["l1"]["server_cpu_s"], per_rep[0]["l1_l2"]["server_cpu_s"] = 12.0, 4.0
    per_rep[1]["l1"]["server_cpu_s"] = None
    out = work_saved_bound(per_rep, ["l1", "l1_l2"], "l1")
    assert out["l1_l2"]["cpu_fraction"].values == (0.75,)
    assert out["l1_l2"]["fraction"].values == (0.75, 1.0)
    assert work_saved_bound(per_rep[2:], ["l1", "l1_l2"], "l1") == {}


def test_repeats_doc_reports_the_bound_from_each_requests_cached_tokens() -> None:
    """Computed tokens = prompt - cached, summed over a run's requests (usage per request)."""

    def run(name: str, cached: int, wall: float, cpu: float = 1.0) -> ConfigRun:
        recs = [RequestRecord(group=0, client=c, prompt_tokens=400, output_tokens=1,
                              ttft_s=0.1, latency_s=wall, start_s=0.0, end_s=wall,
                              cached={"device": cached // 2, "host": cached - cached // 2,
                                      "storage": 0}) for c in range(2)]  # fmt: skip
        return ConfigRun(name, [recs], wall, None, server_cpu_s=cpu)

    # l1 computes 2 x (400 - 16) = 768 tokens in 4 s, l1_l2 2 x (400 - 304) = 192 in 2 s;
    # CPU 8 s against 4 s
    runs = [{"l1": run("l1", 16, 4.0, 8.0), "l1_l2": run("l1_l2", 304, 2.0, 4.0)}]
    doc = repeats_doc(RepeatedRuns(["l1", "l1_l2"], [("l1", "l1_l2")], runs, {}), "l1")
    assert doc["repeats"]["runs"][0]["l1"]["prompt_computed"] == 768
    assert doc["repeats"]["runs"][0]["l1_l2"]["prompt_computed"] == 192
    pair = doc["pairs"]["l1_l2"]
    assert pair["input_tok_s_ratio"]["values"] == [2.0]
    assert pair["work_saved_bound"]["values"] == [4.0]
    assert pair["bound_fraction"]["values"] == [0.5]
    assert pair["cpu_bound_fraction"]["values"] == [0.5]
