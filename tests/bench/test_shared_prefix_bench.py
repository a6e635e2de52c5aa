"""``hicache bench shared-prefix --quick`` on tiny Qwen3-Next: the JSON's rounds, exact
hit tokens (whole system prompts) and snapshot resumes, the components' figures, the PNG."""

from __future__ import annotations

import json
from pathlib import Path

from hicache.bench.shared_prefix import QUICK, main, tier_sizes

MODEL = "tiny-random-qwen3-next"


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
        assert r["hit_rate"] > 0.9
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
    assert set(last) == {"full_kv", "mamba"}
    assert last["full_kv"]["bytes_per_token"] == last["full_kv"]["ideal_bytes_per_token"] > 0
    mamba = last["mamba"]
    assert mamba["l1"]["used"] >= 1 and mamba["l2"]["used"] >= w.groups
    assert mamba["ideal_bytes_per_token"] > 0 and mamba["bytes_per_token"] > 0
    assert per["l1"][-1]["components"][1]["l2"] is None  # no L2 without the hierarchy
