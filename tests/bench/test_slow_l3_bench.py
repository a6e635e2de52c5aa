"""``hicache bench slow-l3`` at its smallest: every turn answered, the JSON written, and
the turns after the first do not wait on the slow store (no L3 tokens, counted as not
waited for): a 0.5 s lookup is far more than recomputing 64 tokens on any machine.
Which way the rates took the fast reads before is the machine's (on the tiny model,
reading 64 tokens and recomputing them cost about the same)."""

from __future__ import annotations

import json
from pathlib import Path

from hicache.bench import slow_l3


def test_slow_l3_bench_smallest_settings(tmp_path: Path) -> None:
    out = tmp_path / "slow.json"
    argv = ["--tokens", "64", "--delay-s", "0.5", "--turns", "2", "--json", str(out)]
    assert slow_l3.main(argv) == 0
    doc = json.loads(out.read_text())
    turns = doc["turns"]
    assert len(turns) == 2
    assert all(t["replay_ttft_s"] > 0 and t["recompute_ttft_s"] > 0 for t in turns)
    assert turns[1]["storage_tokens"] == 0
    assert doc["counters"]["l3_unwaited_prefetches_total"] >= 2  # its replay and its fresh
    assert set(doc["counters"]) >= {"l3_decided_read_tokens_total", "prefetch_timeouts_total"}
