"""Smoke tests of the serving benchmarks on the tiny random model (CPU, small sizes).

* ``multiturn``: 2 clients x 2 rounds, 2 repetitions, against self-started servers of the
  ``no_cache`` and ``l1_l2`` configs: the JSON has the documented shape (repetitions
  pooled per config and round, the run order A B / B A, a pair per repetition) and
  ``l1_l2`` hits L1 or L2;
* ``full-hit``: a 64-token prompt through cold, L1, L2 and L3: every cached stage hits
  its tier for every whole page but the last token's, and the figures are there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.bench import full_hit, multiturn
from hicache.bench.results import percentile
from hicache.bench.runner import round_to_pages
from hicache.bench.serverproc import parse_configs, parse_tp_sizes, split_tp, with_tp

CONFIG_KEYS = {"ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "input_tok_s",
               "output_tok_s", "hit_rate", "hit_tokens", "rounds", "tp",
               "agreement_us_per_step", "agreement_steps"}  # fmt: skip


def test_multiturn_json_shape_and_hits(tmp_path: Path) -> None:
    out = tmp_path / "mt.json"
    argv = ["--num-clients", "2", "--num-rounds", "2", "--request-length", "64",
            "--output-length", "4", "--configs", "no_cache,l1_l2", "--repeats", "2",
            "--json", str(out)]  # fmt: skip
    assert multiturn.main(argv) == 0
    doc = json.loads(out.read_text())
    assert set(doc["configs"]) == {"no_cache", "l1_l2"}
    rep = doc["repeats"]
    assert rep["count"] == 2 and rep["baseline"] == "no_cache"  # no l1: the first config
    assert rep["order"] == [["no_cache", "l1_l2"], ["l1_l2", "no_cache"]]
    assert all(set(r) == {"no_cache", "l1_l2"} for r in rep["runs"])
    starts = sorted((f["start_s"], n) for r in rep["runs"] for n, f in r.items())
    assert [n for _, n in starts] == ["no_cache", "l1_l2", "l1_l2", "no_cache"]  # A B B A
    pair = doc["pairs"]["l1_l2"]
    assert set(doc["pairs"]) == {"l1_l2"} and pair["baseline"] == "no_cache"
    for key in ("ttft_mean_ratio", "input_tok_s_ratio", "server_cpu_ratio"):
        s = pair[key]
        assert s["n"] == 2 and s["min"] <= s["q25"] <= s["median"] <= s["q75"] <= s["max"]
        assert s["min"] > 0
    ratios = [r["l1_l2"]["ttft_mean_s"] / r["no_cache"]["ttft_mean_s"] for r in rep["runs"]]
    assert pair["ttft_mean_ratio"]["values"] == ratios
    for name, c in doc["configs"].items():
        assert set(c) == CONFIG_KEYS, name
        assert set(c["hit_tokens"]) == {"device", "host", "storage"}
        assert all(isinstance(v, int) for v in c["hit_tokens"].values())
        assert [r["round"] for r in c["rounds"]] == [1, 2]
        assert all(r["requests"] == 2 * 2 for r in c["rounds"])  # 2 clients x 2 repetitions
        assert 0 < c["ttft_p50_s"] <= c["ttft_p99_s"]
        assert c["input_tok_s"] > 0 and c["output_tok_s"] > 0
    assert doc["configs"]["no_cache"]["hit_rate"] == 0
    hits = doc["configs"]["l1_l2"]["hit_tokens"]
    assert hits["device"] + hits["host"] > 0
    # round 2 prompt = 64 user + 4 synthetic assistant + 64 user tokens; 2 clients, 2 reps
    assert doc["configs"]["l1_l2"]["rounds"][1]["prompt_tokens"] == 2 * 2 * 132
    # each repetition starts flushed, with conversations of its own: it hits the same
    assert rep["runs"][0]["l1_l2"]["hit_rate"] == rep["runs"][1]["l1_l2"]["hit_rate"] > 0
    assert doc["meta"]["l1_tokens"] % 16 == 0


@pytest.mark.matrix  # 10 s; real outputs in the history: the pd bench (test_pd_bench.py)
def test_multiturn_real_output_goes_into_the_history(tmp_path: Path) -> None:
    """``--real-output``: round 2's prompt is round 1's prompt, the model's own output ids
    and the new user turn (by ``/generate``, whose answer carries the ids); the pairs get
    the work-saved bound."""
    out = tmp_path / "real.json"
    argv = ["--num-clients", "2", "--num-rounds", "2", "--request-length", "64",
            "--output-length", "3", "--configs", "l1,l1_l2", "--repeats", "1",
            "--real-output", "--json", str(out)]  # fmt: skip
    assert multiturn.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["workload"]["real_output"] is True
    assert doc["meta"]["workload"]["api"] == "generate"
    for name, c in doc["configs"].items():
        r1, r2 = c["rounds"]
        assert r1["prompt_tokens"] == 2 * 64, name
        assert 2 <= r1["output_tokens"] <= 2 * 3, name
        assert r2["prompt_tokens"] == r1["prompt_tokens"] + r1["output_tokens"] + 2 * 64, name
    assert doc["configs"]["l1_l2"]["rounds"][1]["hit_rate"] > 0
    run = doc["repeats"]["runs"][0]
    bound = run["l1"]["prompt_computed"] / run["l1_l2"]["prompt_computed"]
    assert doc["pairs"]["l1_l2"]["work_saved_bound"]["values"] == [bound]
    with pytest.raises(SystemExit):
        multiturn.main([*argv, "--api", "completions"])


@pytest.mark.matrix
def test_multiturn_at_tp_1_and_2(tmp_path: Path) -> None:
    """``--tp-size 1,2``: each config runs on a server of each size; the same workload hits
    the same tokens in every tier at both (the ranks run TP 1's scheduler and cache), and
    only TP 2 reports an agreement overhead per step (from the server's /metrics)."""
    out = tmp_path / "tp.json"
    argv = ["--num-clients", "2", "--num-rounds", "2", "--request-length", "32",
            "--output-length", "3", "--configs", "l1_l2", "--tp-size", "1,2", "--repeats", "1",
            "--json", str(out)]  # fmt: skip
    assert multiturn.main(argv) == 0
    doc = json.loads(out.read_text())
    one, two = doc["configs"]["l1_l2@tp1"], doc["configs"]["l1_l2@tp2"]
    assert (one["tp"], two["tp"]) == (1, 2)
    assert one["agreement_us_per_step"] is None and one["agreement_steps"] == 0
    assert two["agreement_steps"] > 0 and two["agreement_us_per_step"] > 0
    assert one["hit_tokens"] == two["hit_tokens"] and one["hit_rate"] > 0
    assert "--tp-size" in doc["meta"]["server_flags"]["l1_l2@tp2"]
    assert "--tp-size" not in doc["meta"]["server_flags"]["l1_l2@tp1"]


def test_full_hit_json_fields(tmp_path: Path) -> None:
    out = tmp_path / "fh.json"
    argv = ["--tokens", "64", "--repeat", "1", "--dir", str(tmp_path / "l3"), "--json", str(out)]
    assert full_hit.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["hit_tokens"] == {"l1": 48, "l2": 48, "l3": 48}  # 63 matchable: 3 pages
    for key in ("ttft_cold_s", "ttft_l1_s", "ttft_l2_s", "ttft_l3_s", "ideal_l2_s",
                "ideal_l3_s", "ratio_l2", "ratio_l3", "copy_gbps", "file_read_gbps"):  # fmt: skip
        assert doc[key] > 0, key
    assert doc["kv_bytes_l2"] == 48 * doc["token_bytes"]
    even = doc["break_even"]  # both tiers restored and measured, and the prefill
    assert set(even) == {"host", "storage"}
    for b in even.values():
        assert b["restore_bytes_per_s"] > 0 and b["prefill_tokens_per_s"] > 0
        assert b["restore_tokens_per_s"] == b["restore_bytes_per_s"] / doc["token_bytes"]
        assert b["ratio"] == b["restore_tokens_per_s"] / b["prefill_tokens_per_s"]


def test_plot_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from hicache.bench.plot import plot_configs

    path = tmp_path / "p.png"
    plot_configs(
        str(path),
        title="t",
        x_label="round",
        ttft_s={"l1": [0.1, 0.2], "l1_l2": [0.1, 0.05]},
        input_tok_s={"l1": 100.0, "l1_l2": 250.0},
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with_pairs = tmp_path / "pairs.png"
    plot_configs(
        str(with_pairs),
        title="t",
        x_label="round",
        ttft_s={"l1": [0.1, 0.2], "l1_l2": [0.1, 0.05]},
        input_tok_s={"l1": 100.0, "l1_l2": 250.0},
        ttft_ratios={"l1_l2": [0.5, 0.6, 0.7]},
        baseline="l1",
    )
    assert with_pairs.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_helpers() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert round_to_pages(17, 16) == 32 and round_to_pages(0, 16) == 16
    assert parse_configs("l1, l1_l2") == ["l1", "l1_l2"]
    with pytest.raises(ValueError, match="--configs"):
        parse_configs("l1,l4")
    assert parse_tp_sizes("1, 2") == [1, 2]
    for bad in ("0", "1,1", "two", ""):
        with pytest.raises(ValueError, match="--tp-size"):
            parse_tp_sizes(bad)
    assert with_tp(["l1", "l1_l2"], [1]) == ["l1", "l1_l2"]
    assert with_tp(["l1", "l1_l2"], [1, 2]) == ["l1@tp1", "l1@tp2", "l1_l2@tp1", "l1_l2@tp2"]
    assert split_tp("l1_l2@tp2") == ("l1_l2", 2) and split_tp("l1") == ("l1", 1)
    with pytest.raises(ValueError, match="l1@tpx"):
        split_tp("l1@tpx")
    conv = multiturn.Conversations.make(2, 3, 5, 2, seed=1)
    assert len(conv.prompt(1, 2)) == 2 * 7 + 5
    assert conv.prompt(1, 2)[:7] == conv.prompt(1, 1)[:7]  # the history is a prefix
    assert conv.prompt(0, 0) != conv.prompt(1, 0)  # clients share nothing
    again = multiturn.Conversations.make(2, 3, 5, 2, seed=1)
    other = multiturn.Conversations.make(2, 3, 5, 2, seed=1, repetition=1)
    assert again == conv and other.prompt(0, 0)[:5] != conv.prompt(0, 0)[:5]


def test_mooncake_config_is_skipped_without_its_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache.bench import serverproc

    monkeypatch.setattr(serverproc, "mooncake_master_path", lambda: None)
    spec = serverproc.ServerSpec(model_path="tiny-random-llama", page_size=16, l1_tokens=256,
                                 l2_ratio=2.0)  # fmt: skip
    with (
        pytest.raises(serverproc.ConfigSkippedError, match="mooncake_master"),
        serverproc.config_server("l1_l2_l3_mooncake", spec),
    ):
        pass
