"""``hicache bench fairness`` runs end to end on a small workload and writes its figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.bench import fairness


def test_fairness_bench_writes_every_config_and_the_group_rule_shows(tmp_path: Path) -> None:
    out = tmp_path / "fairness.json"
    argv = ["--wide-n", "6", "--wide-tokens", "16", "--wide-prompt", "8", "--num-small", "3"]
    argv += ["--small-interval", "0", "--max-running-requests", "4", "--repeats", "2"]
    argv += ["--configs", "off,on,strict"]
    assert fairness.main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    runs = doc["runs"]
    assert [(r["config"], r["repeat"]) for r in runs] == [
        ("off", 0), ("on", 0), ("strict", 0), ("strict", 1), ("on", 1), ("off", 1)
    ]  # fmt: skip
    for r in runs:
        assert len(r["small_ttft_s"]) == len(r["small_wait_steps"]) == 3
        assert r["wide_tokens"] == 6 * 16 and r["wall_s"] > 0  # every copy ran to its end
        if r["config"] != "off":  # 2 of 4 slots for the wide request, 2 for the small ones
            assert max(r["small_wait_steps"]) <= 4, r
        else:  # every slot taken: each small one waits until a wide copy has finished
            for wait, at in zip(r["small_wait_steps"], r["small_arrival_steps"], strict=True):
                assert at + wait >= 15, r  # (the first copy's first token came at step 1)
        if r["config"] != "on":  # only a lending cap gives slots back (how many under
            assert r["reclaimed"] == 0, r  # "on" depends on when the small ones arrive)
        if r["config"] == "strict":  # 96 tokens, at most 2 copies a step
            assert r["wide_steps"] >= 48, r
        else:  # idle slots lent: 4 copies a step once the small ones are done
            assert r["wide_steps"] < 48, r
    assert set(doc["pairs"]["on"]) == {"ttft_p50_s", "ttft_p99_s", "wide_tok_s"}
    assert doc["pairs"]["on"]["ttft_p50_s"]["n"] == 2


def test_fairness_bench_refuses_unknown_configs() -> None:
    with pytest.raises(SystemExit) as exc:
        fairness.main(["--configs", "off,fastest"])
    assert exc.value.code == 2
    with pytest.raises(ValueError, match="'fastest' is unknown"):
        fairness.scheduler_fields("fastest")


def test_multiturn_accepts_the_scheduler_configs() -> None:
    from hicache.bench.serverproc import SCHEDULER_CONFIGS, parse_configs

    got = parse_configs("l1_no_group_rule,l1,l1_lpm")
    assert got == ["l1_no_group_rule", "l1", "l1_lpm"]
    assert SCHEDULER_CONFIGS["l1_no_group_rule"][-2:] == ("--max-running-requests-per-group", "0")
    with pytest.raises(ValueError, match="l1_no_group_rule,l1_lpm"):
        parse_configs("l1_fair")
