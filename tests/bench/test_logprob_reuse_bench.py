"""``hicache bench logprob-reuse`` runs end to end on the tiny model and writes its figures:
the same numbers in both modes, fewer prompt tokens computed with the cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.bench import logprob_reuse


def test_logprob_reuse_bench_writes_both_modes(tmp_path: Path) -> None:
    out = tmp_path / "reuse.json"
    argv = ["--model-path", "tiny-random-llama", "--device", "cpu", "--dtype", "float32"]
    argv += ["--questions", "2", "--context", "60", "--page-size", "4", "--rounds", "2"]
    assert logprob_reuse.main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    on, off = doc["summary"]["on"], doc["summary"]["off"]
    assert on["prompt_tokens"] == off["prompt_tokens"] == on["computed"] + on["cached"]
    assert off["cached"] == 0 and off["computed"] == off["prompt_tokens"]
    # per question: the first choice computes all, the other three reuse the context
    assert on["cached"] > 0 and doc["saved"]["computed_ratio"] > 1
    # the tolerance of tests/engine/test_logprob_reuse.py, per token and per choice
    assert doc["same"]["same_picks"] and doc["same"]["max_token_logprob_diff"] <= 1e-4
    assert [r["mode"] for r in doc["rounds"]] == ["on", "on", "off", "off"]


def test_echo_reuses_the_context_through_the_scoring_entries(tmp_path: Path) -> None:
    argv = ["--model-path", "tiny-random-llama", "--device", "cpu", "--dtype", "float32"]
    argv += ["--questions", "2", "--context", "60", "--page-size", "4", "--rounds", "1"]
    runs = {}
    for top in ("1", "-1"):
        out = tmp_path / f"echo{top}.json"
        argv_top = [*argv, "--echo", "--prompt-logprobs-top", top, "--json", str(out)]
        assert logprob_reuse.main(argv_top) == 0
        runs[top] = json.loads(out.read_text())
    entries, none = runs["1"]["summary"], runs["-1"]["summary"]
    assert none["on"]["cached"] == 0  # without entries an echo request reuses nothing
    assert entries["on"]["cached"] > 0 and runs["1"]["same"]["same_picks"]
    assert runs["1"]["same"]["max_token_logprob_diff"] <= 1e-4


def test_bad_counts_are_refused() -> None:
    with pytest.raises(SystemExit):
        logprob_reuse.main(["--questions", "0"])
