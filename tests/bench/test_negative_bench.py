"""``hicache bench negative`` runs end to end on a small workload, alternating off and on,
and its lookup counts are exact."""

from __future__ import annotations

import json
from pathlib import Path

from hicache.bench import negative


def test_negative_bench_counts_the_lookups_the_cache_saves(tmp_path: Path) -> None:
    argv = ["--requests", "8", "--groups", "4", "--system-tokens", "64", "--suffix-tokens", "16"]
    argv += ["--repeats", "2", "--write-policies", "write_back", "--out", str(tmp_path)]
    assert negative.main(argv) == 0
    doc = json.loads((tmp_path / "negative.json").read_text())
    runs = doc["runs"]
    assert [r["ttl_s"] for r in runs] == [0.0, 2.0, 2.0, 0.0]  # off on, on off
    for r in runs:
        # each of the 4 system prompts stays in L1 alone (write_back): every request looks
        # it up from its first page (its 4 pages; the suffix's page holds the last token,
        # which is computed, so it is never looked up)
        if r["ttl_s"] == 0:
            assert (r["lookups_per_request"], r["keys_per_request"], r["lookups_saved"]) == (
                1.0, 4.0, 0
            )  # fmt: skip
        else:  # the second request of each group asks nothing
            assert (r["lookups_per_request"], r["keys_per_request"], r["lookups_saved"]) == (
                0.5, 2.0, 4
            )  # fmt: skip
        assert r["ttft_mean_ms"] > 0 and r["wall_s"] > 0
    assert (tmp_path / "negative.png").stat().st_size > 0
