"""``hicache bench shared-prefix --quick``: on tiny Qwen3-Next the JSON's rounds, exact
hit tokens (whole system prompts) and snapshot resumes per tier, the components' figures,
the PNG; on tiny Gemma 3 the SWA pools (held bytes per token far below nominal) and the
SWA windows' hits per tier."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hicache.bench.shared_prefix import (
    QUICK,
    SharedPrefixWorkload,
    main,
    swa_ratio,
    tier_sizes,
)

MODEL = "tiny-random-qwen3-next"
GEMMA = "tiny-random-gemma3"


def test_quick_run_hits_whole_system_prompts_from_round_two(tmp_path: Path) -> None:
    out = tmp_path / "sp"
    assert main(["--quick", "--model", MODEL, "--configs", "l1,l1_l2", "--out", str(out)]) == 0
    doc = json.loads((out / "shared_prefix.json").read_text())
    assert (out / "shared_prefix.png").stat().st_size > 0
    w = QUICK
    n = w.groups * w.requests_per_group
    sizes = tier_sizes(w, None, None)
    assert doc["l1_tokens"] == sizes.l1_tokens < w.working_set_tokens  # L1 cannot hold them
    assert doc["mamba_track_interval"] == w.system_tokens
    per = doc["models"][MODEL]
    assert set(per) == {"l1", "l1_l2"}
    for rounds in per.values():
        assert [r["round"] for r in rounds] == [1, 2, 3]
        assert all(r["requests"] == n and r["errors"] == 0 for r in rounds)
        assert all(r["prompt_tokens"] == n * (w.system_tokens + w.suffix_tokens) for r in rounds)
    # L1 + L2: every request of rounds 2 and 3 resumes at the end of its system prompt
    # (the interval snapshot), from L2 or L1: exactly the system prompt's whole pages
    for r in per["l1_l2"][1:]:
        assert sum(r["hit_tokens"].values()) == n * w.system_tokens
        assert r["hit_tokens"]["storage"] == 0
        assert r["resumed_requests"] == n
        assert r["hit_rate"] == pytest.approx(w.system_tokens / (w.system_tokens + w.suffix_tokens))
    # round 1: the first request of each group is cold, later ones hit the whole prompt
    first = per["l1_l2"][0]
    hit = sum(first["hit_tokens"].values())
    assert hit % w.system_tokens == 0
    assert hit <= (n - w.groups) * w.system_tokens
    # the working set exceeds L1: round-robin groups thrash it under LRU (nothing hits)
    assert all(sum(r["hit_tokens"].values()) == 0 for r in per["l1"])
    assert all(r["counters"]["device_evicted_tokens_total"] > 0 for r in per["l1"])
    # components: full KV and recurrent snapshots, with pools and bytes per token
    last = {c["component"]: c for c in per["l1_l2"][-1]["components"]}
    assert set(last) == {"full", "mamba", "logprob"}  # scoring entries: none asked here
    full = last["full"]
    assert full["bytes_per_token"] == full["nominal_bytes_per_token"] > 0
    assert full["held_ratio"] == 1.0
    mamba = last["mamba"]
    assert mamba["l1"]["used"] >= 1 and mamba["l2"]["used"] >= w.groups
    assert mamba["nominal_bytes_per_token"] > 0 and mamba["bytes_per_token"] > 0
    assert last["logprob"]["l1"]["used"] == last["logprob"]["l2"]["used"] == 0
    l1_only = {c["component"]: c for c in per["l1"][-1]["components"]}
    assert l1_only["mamba"]["l2"] is None  # no L2 without the hierarchy
    # snapshot resumes per tier: one per resumed admission (no preemption here)
    for r in per["l1_l2"]:
        hits = component_hits(r, "mamba")
        assert hits["l1"] + hits["l2"] == r["resumed_requests"]
    assert component_hits(per["l1_l2"][1], "mamba")["l2"] > 0  # round 2 resumes from L2


def test_quick_gemma3_swa_pools_hold_only_the_window(tmp_path: Path) -> None:
    out = tmp_path / "sp"
    assert main(["--quick", "--model", GEMMA, "--configs", "l1_l2", "--out", str(out)]) == 0
    doc = json.loads((out / "shared_prefix.json").read_text())
    w = QUICK
    rounds = doc["models"][GEMMA]["l1_l2"]
    for r in rounds[1:]:
        assert sum(r["hit_tokens"].values()) == w.groups * w.requests_per_group * w.system_tokens
    last = {c["component"]: c for c in rounds[-1]["components"]}
    assert set(last) == {"full", "swa", "logprob"}  # scoring entries: none asked here
    swa = last["swa"]
    assert swa["l1"]["unit"] == "pages" and swa["l2"]["total"] > 0
    # the sliding layers hold far less than every token's K/V (window 6): the decoded
    # positions are tombstones
    assert swa["nominal_bytes_per_token"] > last["full"]["nominal_bytes_per_token"]
    assert 0 < swa["held_ratio"] < 0.5
    assert swa["bytes_per_token"] == pytest.approx(
        swa["held_ratio"] * swa["nominal_bytes_per_token"]
    )
    assert last["logprob"]["l1"]["used"] == last["logprob"]["l2"]["used"] == 0
    for r in rounds:
        hits = component_hits(r, "swa")
        assert hits["l1"] + hits["l2"] == r["resumed_requests"]
    assert component_hits(rounds[1], "swa")["l2"] > 0  # windows loaded back from L2


def test_gemma3_reuses_system_prompts_followed_by_a_page_or_more(tmp_path: Path) -> None:
    """Each prefill chunk commits its SWA pages and a backup copies every SWA page of the
    span, so the window before a system prompt's end survives the request moving on, in
    L1 and in L2, and the group's next request (another suffix) ends its hit there."""
    out = tmp_path / "sp"
    args = ["--model", GEMMA, "--configs", "l1_l2", "--groups", "3", "--requests-per-group",
            "2", "--system-tokens", "128", "--suffix-tokens", "24", "--output-tokens", "2",
            "--max-parallel", "2", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    rounds = json.loads((out / "shared_prefix.json").read_text())["models"][GEMMA]["l1_l2"]
    assert all(r["hit_rate"] > 0.8 for r in rounds[1:])


def test_swa_ratio_raised_only_where_the_default_cannot_run_max_parallel() -> None:
    assert swa_ratio(QUICK, tier_sizes(QUICK, None, None), None) == 0.8  # no SWA layers
    assert swa_ratio(QUICK, tier_sizes(QUICK, None, None), 6) > 0.8  # 19-page L1
    default = tier_sizes(SharedPrefixWorkload(), None, None)
    assert swa_ratio(SharedPrefixWorkload(), default, 6) == 0.8


def test_quick_run_at_tp_1_and_2(tmp_path: Path) -> None:
    """``--tp-size 1,2`` on the tiny Llama (the hybrids do not split): each config runs at
    both sizes, every request succeeds, TP 2's rounds report an agreement overhead per
    step and TP 1's none, and both hit the same share of the prompts from round two (the
    whole system prompts: L1 or L2 hold them at either size)."""
    out = tmp_path / "sp"
    argv = ["--quick", "--model", "tiny-random-llama", "--configs", "l1_l2", "--tp-size", "1,2",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    per = json.loads((out / "shared_prefix.json").read_text())["models"]["tiny-random-llama"]
    assert set(per) == {"l1_l2@tp1", "l1_l2@tp2"}
    one, two = per["l1_l2@tp1"], per["l1_l2@tp2"]
    assert all(r["tp"] == 1 and r["agreement_us_per_step"] is None for r in one)
    assert all(r["tp"] == 2 and r["agreement_us_per_step"] > 0 for r in two)
    assert all(r["errors"] == 0 for r in one + two)
    assert [r["hit_rate"] for r in one[1:]] == [r["hit_rate"] for r in two[1:]]
    assert one[1]["hit_rate"] > 0


def component_hits(round_: dict[str, Any], name: str) -> dict[str, Any]:
    """The round's resume counts of component ``name``."""
    (hits,) = [h for h in round_["component_hits"] if h["component"] == name]
    return hits
